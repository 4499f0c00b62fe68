"""The decay gate and the fused entry's pre-pass: the formulas, and bad inputs refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda


def test_gate_formulas():
  g_raw = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 2, 4))
  A_log, dt_bias = jnp.array([0.3, -0.2]), jax.random.normal(jax.random.PRNGKey(1), (2, 4))
  z = np.asarray(g_raw, np.float64) + np.asarray(dt_bias, np.float64)
  a = np.exp(np.asarray(A_log, np.float64))[:, None]
  np.testing.assert_allclose(kda.kda_gate(g_raw, A_log, dt_bias), -5.0 / (1 + np.exp(-a * z)), rtol=1e-5)
  np.testing.assert_allclose(kda.kda_gate(g_raw, A_log, dt_bias, lower_bound=None), -a * np.log1p(np.exp(z)),
                             rtol=1e-5)


def test_pre_pass_normalises_q_and_k_and_takes_the_sigmoid():
  ks = jax.random.split(jax.random.PRNGKey(2), 4)
  q, k = (3 * jax.random.normal(key, (1, 5, 2, 8)) for key in ks[:2])
  logits = jax.random.normal(ks[2], (1, 5, 2))
  qn, kn, g, beta = kda.fused_inputs(q, k, jax.random.normal(ks[3], (1, 5, 2, 8)), logits, jnp.zeros(2),
                                     jnp.zeros((2, 8)))
  np.testing.assert_allclose(jnp.linalg.norm(qn, axis=-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(kn * jnp.linalg.norm(k, axis=-1, keepdims=True), k, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(beta, 1 / (1 + np.exp(-np.asarray(logits, np.float64))), rtol=1e-6)
  assert g.dtype == beta.dtype == jnp.float32


def test_bad_gate_inputs_raise():
  with pytest.raises(ValueError, match="dt_bias must have shape"):
    kda.kda_gate(jnp.zeros((1, 2, 3, 4)), jnp.zeros(3), jnp.zeros((3, 5)))
  with pytest.raises(ValueError, match="A_log must have shape"):
    kda.kda_gate(jnp.zeros((1, 2, 3, 4)), jnp.zeros(2), jnp.zeros((3, 4)))
  with pytest.raises(ValueError, match="g_raw must be a floating-point"):
    kda.kda_gate(jnp.zeros((1, 2, 3, 4), jnp.int32), jnp.zeros(3), jnp.zeros((3, 4)))
