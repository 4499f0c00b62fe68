"""The AttnRes read-out's forward kernel: h and the kept w, a, r equal the formulas in XLA on fresh inputs, with a
slot that is not valid holding garbage (not read: weight exactly 0); bad shapes are refused before anything runs; it lowers
through Pallas's Triton lowering at the model's width (D = 768, three column slices), once for two read-outs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import attnres as attnres_ops
from model_testing import normal
from pallas_kernels import attnres as attnres_kernels
from pallas_testing import cuda_module_text


def test_rows_not_a_multiple_of_the_block_and_a_bias_of_the_wrong_shape_are_refused():
  x = jnp.zeros((18, 16))
  with pytest.raises(ValueError, match="multiple of block_rows=4"):
    attnres_kernels.readout_forward(jnp.zeros((1, 18, 16)), (x,), jnp.zeros(16), jnp.zeros((2, 18)), eps=1e-6)
  x = jnp.zeros((32, 16))
  with pytest.raises(ValueError, match=r"bias must be \[N=2, R=32\]"):
    attnres_kernels.readout_forward(jnp.zeros((1, 32, 16)), (x,), jnp.zeros(16), jnp.zeros((3, 32)), eps=1e-6)


@pytest.mark.parametrize("C", [3, 0])   # a buffer partly valid; no buffer (an unrolled layer's stream)
def test_outputs_equal_the_formulas_in_xla_and_a_slot_not_valid_gets_weight_zero(C):
  R, D, eps = 48, 48, 1e-6
  qg = normal(1, (D,))
  buffer = normal(2, (C, R, D))
  if C:
    buffer = buffer.at[2].set(1e4)                      # slot 2: not valid, garbage
  values = (normal(3, (R, D)), 2.0 * normal(4, (R, D)))
  valid_N = jnp.array([True, True, False][:C] + [True, True])
  bias = jnp.broadcast_to(jnp.where(valid_N, 0.0, -jnp.inf)[:, None], (C + 2, R))
  h, w, a, r = attnres_kernels.readout_forward(buffer, values, qg, bias, eps=eps)

  v_N = jnp.concatenate([buffer, jnp.stack(values)])
  want_a = jnp.sum(v_N * qg, -1)
  want_r = jax.lax.rsqrt(jnp.mean(v_N * v_N, -1) + eps)
  want_w = jax.nn.softmax(jnp.where(valid_N[:, None], want_a * want_r, -jnp.inf), axis=0)
  want_h = jnp.sum(want_w[..., None] * v_N, 0)
  for got, want in ((h, want_h), (w, want_w), (a[valid_N], want_a[valid_N]), (r[valid_N], want_r[valid_N])):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert float(jnp.min(w[valid_N])) > 0
  if C:   # the slot not valid is not read: its tile is zeros, whatever the buffer holds there
    assert not np.any(np.asarray(w[2])) and not np.any(np.asarray(a[2]))
    np.testing.assert_allclose(r[2], eps ** -0.5, rtol=1e-6)


def test_the_op_on_the_kernel_equals_the_fused_op_forward_and_backward():
  B, T, D = 2, 24, 48
  buffer = normal(0, (3, B, T, D)).at[2].set(1e4)
  values = (normal(1, (B, T, D)), 3.0 * normal(2, (B, T, D)))
  q, g, dh = normal(3, (D,)), 1.0 + 0.1 * normal(4, (D,)), normal(5, (B, T, D))
  valid_C, valid_E = jnp.array([True, True, False]), jnp.array([True, True])

  def run(forward):
    f = lambda *args: attnres_ops.readout(*args[:3], valid_C, args[3], valid_E, eps=1e-6, forward=forward)
    h, vjp = jax.vjp(f, q, g, buffer, values)
    return h, vjp(dh)
  (h0, d0), (h1, d1) = run("fused"), run("kernel")
  np.testing.assert_allclose(h1, h0, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(d1), jax.tree.leaves(d0), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_lowers_to_triton_for_the_gpu_at_the_model_width_once_for_two_read_outs(monkeypatch):
  B, T, D, C = 2, 64, 768, 3
  shape = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
  args = (jax.ShapeDtypeStruct((D,), jnp.float32), jax.ShapeDtypeStruct((D,), jnp.float32),
          jax.ShapeDtypeStruct((C, B, T, D), jnp.float32), (shape, shape))

  def f(q, g, buffer, values):   # two read-outs of one buffer (two queries): one kernel lowered for both
    read = lambda q: attnres_ops.readout(q, g, buffer, jnp.array([True, True, False]), values,
                                         jnp.array([True, True]), eps=1e-6, forward="kernel")
    return read(q) + read(2.0 * q)
  text = cuda_module_text(monkeypatch, f, *args)
  assert text.count('name = "attnres_readout_fwd"') == 1
