"""pallas_kernels._triton: the one interface to Pallas's GPU lowerings; here `traced_once`, which makes a kernel
op's calls of equal shapes share one traced program."""
import jax
import jax.numpy as jnp

from pallas_kernels import _triton


def test_calls_of_equal_shapes_and_static_arguments_share_one_trace(monkeypatch):
  """Inside one traced program, three calls of equal shapes trace the op once; another shape or static argument,
  or the other interpret mode (kernels read it while tracing), traces it again; the values are the op's own."""
  traces = []

  def op(x, power):
    traces.append((x.shape, power))
    return x ** power
  shared = _triton.traced_once(op, static_argnums=(1,))

  def program(a, b):
    return shared(a, 2) + shared(a + 1, 2) + shared(a * 2, 2), shared(b, 2), shared(a, 3)
  a, b = jnp.arange(4.0), jnp.arange(6.0)
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "1")
  out = jax.jit(program)(a, b)
  assert traces == [((4,), 2), ((6,), 2), ((4,), 3)], traces
  expected = (a ** 2 + (a + 1) ** 2 + (a * 2) ** 2, b ** 2, a ** 3)
  assert all(jnp.array_equal(o, e) for o, e in zip(out, expected))
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0")
  jax.make_jaxpr(lambda x: shared(x, 2))(a)
  assert traces[-1] == ((4,), 2) and len(traces) == 4, traces
