"""SiTU-GLU: the formula (docs/design.md, LatentMoE), its SwiGLU limit and bound, and the dense FFN built on it."""
import chex
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.ffn import SiTUGLU, situ_glu
from model_testing import abstract, normal, random_module


def test_situ_glu_matches_its_formula():
  a, b = 6.0 * normal(0, (64,)), 40.0 * normal(1, (64,))
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  want = 4.0 * np.tanh(a64 / 4.0) / (1 + np.exp(-a64)) * 25.0 * np.tanh(b64 / 25.0)
  np.testing.assert_allclose(situ_glu(a, b), want, rtol=1e-5, atol=1e-6)


def test_situ_glu_tends_to_swiglu_and_stays_bounded():
  a, b = normal(2, (64,)), normal(3, (64,))
  np.testing.assert_allclose(situ_glu(a, b, 1e4, 1e4), jax.nn.silu(a) * b, rtol=1e-5, atol=1e-6)
  big = situ_glu(1e3 * normal(4, (256,)), 1e3 * normal(5, (256,)))
  assert float(jnp.max(jnp.abs(big))) <= 4.0 * 25.0


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
