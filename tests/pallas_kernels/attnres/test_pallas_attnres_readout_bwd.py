"""The AttnRes read-out's backward kernel: its outputs equal the same formulas in XLA (`k3jax.ops.attnres`'s
"fused" backward) on fresh inputs with a slot of zero weight holding garbage, and it lowers through Pallas's Triton
lowering at the model's width (D = 768, three column slices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import attnres as attnres_ops
from model_testing import normal
from pallas_kernels import attnres as attnres_kernels
from pallas_testing import cuda_module_text


def test_rows_not_a_multiple_of_the_block_are_refused_before_anything_runs():
  x = jnp.zeros((18, 16))
  with pytest.raises(ValueError, match="multiple of block_rows=4"):
    attnres_kernels.readout_backward(x, jnp.zeros((1, 18, 16)), (x,), jnp.zeros(16), *[jnp.zeros((2, 18))] * 3)


def test_outputs_equal_the_formulas_in_xla_and_a_weightless_slot_gets_zero():
  R, D, C = 48, 48, 3
  dh, qg = normal(0, (R, D)), normal(1, (D,))
  buffer = normal(2, (C, R, D)).at[2].set(1e4)          # slot 2: not valid, garbage
  values = (normal(3, (R, D)), 2.0 * normal(4, (R, D)))
  logits = normal(5, (C + 2, R)).at[2].set(-jnp.inf)
  w = jax.nn.softmax(logits, axis=0)
  a, r = normal(6, (C + 2, R)), 1.0 + jnp.abs(normal(7, (C + 2, R)))
  d_buffer, d_values, u = attnres_kernels.readout_backward(dh, buffer, values, qg, w, a, r)

  dw = jnp.stack([jnp.sum(dh * v, -1) for v in (*buffer, *values)])
  ds = w * (dw - jnp.sum(w * dw, 0))
  c, k = ds * r, -ds * a * r ** 3 / D
  want = [jnp.where(w[n][:, None] != 0, w[n][:, None] * dh + c[n][:, None] * qg + k[n][:, None] * v, 0.0)
          for n, v in enumerate((*buffer, *values))]
  want_u = sum(jnp.sum(c[n][:, None] * v, 0) for n, v in enumerate((*buffer, *values)) if n != 2)
  np.testing.assert_allclose(d_buffer, jnp.stack(want[:C]), rtol=1e-5, atol=1e-5)
  for got, ref in zip(d_values, want[C:], strict=True):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(u, want_u, rtol=1e-4, atol=1e-4)
  assert not np.any(np.asarray(d_buffer[2])) and float(jnp.max(jnp.abs(u))) > 1.0


def test_lowers_to_triton_for_the_gpu_at_the_model_width_once_for_two_read_outs(monkeypatch):
  B, T, D, C = 2, 64, 768, 3
  shape = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
  args = (jax.ShapeDtypeStruct((D,), jnp.float32), jax.ShapeDtypeStruct((D,), jnp.float32),
          jax.ShapeDtypeStruct((C, B, T, D), jnp.float32), (shape, shape))

  def grads(q, g, buffer, values):
    def f(q, g, buffer, values):   # two read-outs of one buffer (two queries): one kernel lowered for both
      read = lambda q: attnres_ops.readout(q, g, buffer, jnp.array([True, True, False]), values,
                                           jnp.array([True, True]), eps=1e-6, backward="kernel")
      return jnp.sum(read(q) * read(2.0 * q))
    return jax.grad(f, argnums=(0, 1, 2, 3))(q, g, buffer, values)
  text = cuda_module_text(monkeypatch, grads, *args)
  assert text.count('name = "attnres_readout_bwd"') == 1
