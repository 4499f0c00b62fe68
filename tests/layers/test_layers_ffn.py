"""SiTU-GLU: the formula (docs/design.md, LatentMoE), its SwiGLU limit and bound, and the dense FFN built on it."""
import chex
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.ffn import SiTU, SiTUGLU, situ_glu
from model_testing import abstract, normal, random_module


def pair(a, b):
  """The gate and up units stacked as situ_glu takes them, `[..., 2, F]`."""
  return jnp.stack([a, b], axis=-2)


def formula(a, b, beta1=4.0, beta2=25.0):
  return beta1 * jnp.tanh(a / beta1) * jax.nn.sigmoid(a) * beta2 * jnp.tanh(b / beta2)


def test_situ_glu_matches_its_formula():
  a, b = 6.0 * normal(0, (64,)), 40.0 * normal(1, (64,))
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  want = 4.0 * np.tanh(a64 / 4.0) / (1 + np.exp(-a64)) * 25.0 * np.tanh(b64 / 25.0)
  np.testing.assert_allclose(situ_glu(pair(a, b)), want, rtol=1e-5, atol=1e-6)


def test_situ_glu_tends_to_swiglu_and_stays_bounded():
  a, b = normal(2, (64,)), normal(3, (64,))
  np.testing.assert_allclose(situ_glu(pair(a, b), 1e4, 1e4), jax.nn.silu(a) * b, rtol=1e-5, atol=1e-6)
  big = situ_glu(pair(1e3 * normal(4, (256,)), 1e3 * normal(5, (256,))))
  assert float(jnp.max(jnp.abs(big))) <= 4.0 * 25.0


def test_situ_glu_gradient_is_autodiff_of_the_formula_saturated_units_included():
  # Units from the linear range to deep saturation of both tanh and of the sigmoid, either sign.
  a = normal(7, (3, 256)) * jnp.array([1.0, 10.0, 200.0])[:, None]
  b = normal(8, (3, 256)) * jnp.array([1.0, 60.0, 500.0])[:, None]
  dout = normal(9, (3, 256))
  close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))
  got, = jax.vjp(situ_glu, pair(a, b))[1](dout)
  close(got, pair(*jax.vjp(formula, a, b)[1](dout)))
  close(jax.grad(lambda ab: jnp.sum(situ_glu(ab, 7.0, 3.0) * dout))(pair(a, b)),
        pair(*jax.grad(lambda a, b: jnp.sum(formula(a, b, 7.0, 3.0) * dout), (0, 1))(a, b)))


def test_situ_unit_grads_are_autodiff_of_the_unit_saturated_units_included():
  """The hand-written backward the grouped GEMM's epilogue runs (`SiTU.grads`) against autodiff, fp32."""
  a = normal(13, (3, 256)) * jnp.array([1.0, 10.0, 200.0])[:, None]
  b = normal(14, (3, 256)) * jnp.array([1.0, 60.0, 500.0])[:, None]
  dh = normal(15, (3, 256))
  for unit in (SiTU(), SiTU(7.0, 3.0)):
    got, want = unit.grads(a, b, dh), jax.vjp(unit, a, b)[1](dh)
    for g, w in zip(got, want):
      assert float(jnp.max(jnp.abs(w))) > 0.1
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))))


def test_situ_glu_in_bf16_stays_within_bf16_roundoff_of_the_fp32_formula_forward_and_backward():
  ab = pair(3.0 * normal(10, (512,)), 30.0 * normal(11, (512,))).astype(jnp.bfloat16)
  dout = normal(12, (512,)).astype(jnp.bfloat16)
  out, vjp = jax.vjp(situ_glu, ab)
  dab, = vjp(dout)
  chex.assert_type((out, dab), (jnp.bfloat16, jnp.bfloat16))
  want, vjp32 = jax.vjp(lambda x: formula(x[..., 0, :], x[..., 1, :]), ab.astype(jnp.float32))
  dab_want, = vjp32(dout.astype(jnp.float32))
  # A few roundings of bf16 (2^-8 relative each) along the formula; swapped halves would be off by O(1).
  rel = lambda got, want: float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
  assert rel(out, want) < 2e-2
  assert rel(dab, dab_want) < 2e-2


def test_dense_ffn_is_w_down_of_situ_glu():
  ffn = random_module(lambda rngs: SiTUGLU(16, 24, rngs=rngs, dtype=jnp.float32))
  x = normal(6, (2, 5, 16))
  y = jax.jit(lambda x: ffn(x))(x)
  chex.assert_shape(y, (2, 5, 16))
  chex.assert_type(y, jnp.float32)
  w = np.asarray(ffn.w_gate_up[...], np.float64)
  x64 = np.asarray(x, np.float64)
  a, b = x64 @ w[:, 0], x64 @ w[:, 1]
  h = 4.0 * np.tanh(a / 4.0) / (1 + np.exp(-a)) * 25.0 * np.tanh(b / 25.0)
  np.testing.assert_allclose(y, h @ np.asarray(ffn.w_down[...], np.float64), rtol=1e-4, atol=1e-5)
  chex.assert_type(abstract(lambda rngs: SiTUGLU(16, 24, rngs=rngs), lambda f, x: f(x), x), jnp.bfloat16)
