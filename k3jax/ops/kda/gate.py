"""The decay gate and the fused entry's pre-pass (q/k L2 norm, gate, β sigmoid), in plain JAX: what the layer, the
XLA path and the Pallas kernels' backward (the pre-pass's gradient) all use. Imports only `common`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.kda.common import L2_EPS, check_float, check_lower_bound, check_rank, check_shape

Array = jax.Array


def kda_gate(g_raw: Array, A_log: Array, dt_bias: Array, *, lower_bound: float | None = -5.0) -> Array:
  """fp32 log-decay from the gate projection: `lower_bound·σ(e^{A_log}(z+dt_bias))`, or softplus if None."""
  for name, x in (("g_raw", g_raw), ("A_log", A_log), ("dt_bias", dt_bias)):
    check_float(name, x)
  check_rank("g_raw", g_raw, 4, "[B,T,H,K]")
  _, _, H, K = g_raw.shape
  check_shape("A_log", A_log, (H,))
  check_shape("dt_bias", dt_bias, (H, K))
  check_lower_bound(lower_bound)
  z = g_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32)
  a = jnp.exp(A_log.astype(jnp.float32))[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(z)
  # σ(u) below e^{-80} would leave g subnormal (slow on CPUs, flushed on GPUs); e^{g} is 1 either way.
  return lower_bound * jax.nn.sigmoid(jnp.maximum(a * z, -80.0))


def fused_inputs(q, k, g_raw, beta_logits, A_log, dt_bias, *, lower_bound: float | None = -5.0):
  """`fused_kda`'s pre-pass: (L2-normalised q and k, the fp32 log-decay g, β = σ(beta_logits) in fp32)."""
  g = kda_gate(g_raw, A_log, dt_bias, lower_bound=lower_bound)
  beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))  # kept fp32: rounding β to bf16 costs ~2e-3 in o
  return l2_normalize(q), l2_normalize(k), g, beta


def l2_normalize(x, eps: float = L2_EPS):
  """x / sqrt(Σx² + eps) over the last axis, computed in fp32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
