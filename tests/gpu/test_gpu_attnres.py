"""The AttnRes read-out's passes as Pallas kernels (`forward="kernel"`, `backward="kernel"`) on the GPU, at small's
width: h and every gradient against the formula in full fp32 (`readout_reference`, HIGHEST, and its autodiff), held
to the error of the op's fused XLA passes on the same inputs (the anchor), with a buffer partly valid and garbage
past it. With
K3JAX_GPU_TESTS=cpu the kernel runs interpreted on smaller shapes, to check the test itself."""
import functools

import jax
import jax.numpy as jnp
import pytest

from k3jax.ops import attnres as attnres_ops

pytestmark = pytest.mark.gpu

EPS = 1e-6
# small's width on the GPU; off it, three column slices of 16 and three blocks of rows for the interpreter.
B, T, D, C = (4, 1024, 768, 5) if jax.default_backend() == "gpu" else (2, 24, 48, 5)


def _max_rel_err(got, want):
  return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True) if b.size)


def _inputs(query_scale):
  ks = jax.random.split(jax.random.PRNGKey(int(query_scale)), 6)
  q = query_scale * jax.random.normal(ks[0], (D,)) / D ** 0.5
  g = 1.0 + 0.1 * jax.random.normal(ks[1], (D,))
  valid_C = jnp.arange(C) < 3
  buffer = jnp.where(valid_C[:, None, None, None], jax.random.normal(ks[2], (C, B, T, D)), 1e4)
  values = (jax.random.normal(ks[3], (B, T, D)), 2.0 * jax.random.normal(ks[4], (B, T, D)))
  return q, g, buffer, valid_C, values, jnp.array([False, True]), jax.random.normal(ks[5], (B, T, D))


@pytest.mark.parametrize("query_scale", [1.0, 30.0])   # ordinary and saturated weights
def test_kernel_forward_is_held_to_the_fused_forward_s_error(query_scale):
  q, g, buffer, valid_C, values, valid_E, _ = _inputs(query_scale)
  run = lambda readout: jax.jit(lambda *a: readout(*a, eps=EPS))(q, g, buffer, valid_C, values, valid_E)
  want = run(attnres_ops.readout_reference)
  kernel = run(functools.partial(attnres_ops.readout, forward="kernel"))
  fused = run(functools.partial(attnres_ops.readout, forward="fused"))
  assert _max_rel_err(kernel, want) <= max(2 * _max_rel_err(fused, want), 1e-6)


@pytest.mark.parametrize("query_scale", [1.0, 30.0])   # ordinary and saturated weights
def test_kernel_gradients_are_held_to_the_fused_backward_s_error(query_scale):
  q, g, buffer, valid_C, values, valid_E, dh = _inputs(query_scale)

  def grads(readout):
    f = lambda q, g, buffer, values: jnp.sum(readout(q, g, buffer, valid_C, values, valid_E, eps=EPS) * dh)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, g, buffer, values)
  want = grads(attnres_ops.readout_reference)
  kernel = grads(functools.partial(attnres_ops.readout, backward="kernel"))
  fused = grads(functools.partial(attnres_ops.readout, backward="fused"))
  assert _max_rel_err(kernel, want) <= max(2 * _max_rel_err(fused, want), 1e-5)
  assert not jnp.any(kernel[2][3:]) and not jnp.any(kernel[3][0])   # nothing for what is not valid
