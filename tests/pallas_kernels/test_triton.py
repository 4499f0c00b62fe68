"""pallas_kernels._triton: the one interface to Pallas's GPU lowerings; here `traced_once`, which makes a kernel
op's calls of equal shapes one function of the lowered program, however JAX's transformations copy them."""
import re

import jax
import jax.numpy as jnp

from pallas_kernels import _triton


def _functions_and_calls(lowered_text):
  return re.findall(r'func.func private @"?([^"(\s]+)', lowered_text), len(re.findall(r"call @", lowered_text))


def test_equal_calls_are_one_function_of_the_lowered_program(monkeypatch):
  """Inside one program, calls of equal shapes and static arguments, also under a remat, a scan and a gradient's
  recomputation, trace the op once and lower to one function; another shape, static argument or interpret mode
  (kernels read it while tracing) is another; the values are the op's own."""
  traces = []

  def op(x, power):
    traces.append((x.shape, power))
    return x ** power
  shared = _triton.traced_once(op, static_argnums=(1,))

  def program(a, b):
    scanned = jax.lax.scan(lambda c, _: (shared(c, 2) * 0.5, None), a, length=3)[0]
    rematted = jax.checkpoint(lambda z: shared(z, 2))(a * 2)
    return shared(a, 2) + shared(a + 1, 2) + rematted + scanned, shared(b, 2), shared(a, 3)
  a, b = jnp.arange(4.0), jnp.arange(6.0)
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "1")
  functions, calls = _functions_and_calls(jax.jit(program).lower(a, b).as_text())
  assert traces == [((4,), 2), ((6,), 2), ((4,), 3)], traces
  assert functions == ["op", "op_0", "op_1"] and calls == 6, (functions, calls)
  out = jax.jit(program)(a, b)
  scanned = a
  for _ in range(3):
    scanned = scanned ** 2 * 0.5
  expected = (a ** 2 + (a + 1) ** 2 + (a * 2) ** 2 + scanned, b ** 2, a ** 3)
  assert all(jnp.allclose(o, e) for o, e in zip(out, expected))
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0")
  jax.make_jaxpr(lambda x: shared(x, 2))(a)
  assert traces[-1] == ((4,), 2) and len(traces) == 4, traces


def test_a_custom_vjps_calls_are_one_function_each_through_scan_remat_and_gradient():
  """The kernels' use: the calls sit inside a custom VJP's forward and backward, and the VJP is called by layers
  unrolled, scanned and rematerialised under a gradient. The lowered step holds one function per call (a jit around
  the calls held one per transformation path); the gradient is the op's; `jax.vmap` maps the call."""
  def square_op(x):
    return x * x, x

  def twice_op(x, dy):
    return 2 * x * dy
  square = _triton.traced_once(square_op, static_argnums=())
  twice = _triton.traced_once(twice_op, static_argnums=())

  @jax.custom_vjp
  def f(x):
    return square(x)[0]

  f.defvjp(lambda x: square(x), lambda x, dy: (twice(x, dy),))
  layer = jax.checkpoint(lambda x: 0.5 * f(x) + 1.0)

  def loss(x):
    x = layer(layer(x))                                               # unrolled
    x = jax.lax.scan(lambda c, _: (layer(c), None), x, length=2)[0]   # scanned
    return jnp.sum(x)

  x = jnp.linspace(-1.0, 1.0, 5)
  functions, _ = _functions_and_calls(jax.jit(jax.grad(loss)).lower(x).as_text())
  ours = sorted(f for f in functions if not f.startswith("dynamic_"))   # not the scan's own helpers
  assert ours == ["square_op", "twice_op"], functions
  assert jnp.allclose(jax.grad(loss)(x), _chain(x, 4))
  assert jnp.allclose(jax.vmap(f)(jnp.stack([x, 2 * x])), jnp.stack([x * x, 4 * x * x]))


def _chain(x, n):
  """d/dx of n applications of y -> y²/2 + 1, summed."""
  grad = jnp.ones_like(x)
  for _ in range(n):
    grad, x = grad * x, 0.5 * x * x + 1.0
  return grad
