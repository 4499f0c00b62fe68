"""KDA (Kimi Delta Attention): public entry points, input checks, the gate and the reference recurrence.

Shapes: q, k, g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, states `[B,H,K,V]` (fp32). q and k arrive
L2-normalised; g is the per-channel log-decay (<= 0). The formulas: docs/design.md, KDA.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from k3jax.ops import kda_chunk

Array = jax.Array

# Every 16-token tile may factorise e^{±G} only if |lower_bound|·16 < 88.7 (fp32/bf16 exponent range).
SAFE_LOWER_BOUND = -5.5
BACKENDS = ("auto", "xla", "pallas")

_log = logging.getLogger(__name__)
_auto_fallback_said = False


def kda_gate(g_raw: Array, A_log: Array, dt_bias: Array, *, lower_bound: float | None = -5.0) -> Array:
  """fp32 log-decay from the gate projection: `lower_bound·σ(e^{A_log}(z+dt_bias))`, or softplus if None."""
  _check_rank("g_raw", g_raw, 4, "[B,T,H,K]")
  _, _, H, K = g_raw.shape
  _check_shape("A_log", A_log, (H,))
  _check_shape("dt_bias", dt_bias, (H, K))
  _check_lower_bound(lower_bound)
  z = g_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32)
  a = jnp.exp(A_log.astype(jnp.float32))[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(z)
  # σ(u) below e^{-80} would leave g subnormal (slow on CPUs, flushed on GPUs); e^{g} is 1 either way.
  return lower_bound * jax.nn.sigmoid(jnp.maximum(a * z, -80.0))


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        segment_ids=None):
  """The recurrence (docs/design.md, KDA), one token at a time in fp32: the reference every fast path is held to."""
  B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
  scale = K ** -0.5 if scale is None else float(scale)
  o, S = _recurrence(q, k, v, g, beta, _zero_or(initial_state, B, H, K, V), reset_mask(segment_ids, B, T), scale)
  return o, (S if output_final_state else None)


@functools.partial(jax.jit, static_argnums=(7,))
def _recurrence(q, k, v, g, beta, S0, reset, scale):
  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)

  def step(S_BHKV, xs):
    q_t, k_t, v_t, g_t, b_t, r_t = xs
    S_BHKV = S_BHKV * (1.0 - r_t)[:, None, None, None]
    o_t, S_BHKV = _step(q_t, k_t, v_t, g_t, b_t, S_BHKV, scale)
    return S_BHKV, o_t

  S, o_TBHV = jax.lax.scan(step, S0, (f32(q), f32(k), f32(v), f32(g), f32(beta), f32(reset)))
  return jnp.moveaxis(o_TBHV, 0, 1).astype(q.dtype), S


def kda_decode_step(q, k, v, g, beta, state, *, scale=None):
  """One generated token: q,k,g `[B,H,K]` (or `[B,1,H,K]`), v `[B,H,V]`, beta `[B,H]`; returns (o, new state)."""
  one_token = q.ndim == 4
  if one_token:
    if q.shape[1] != 1:
      raise ValueError(f"kda_decode_step takes one token: q has T={q.shape[1]}; use chunk_kda for a prefill")
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))
  _check_rank("q", q, 3, "[B,H,K]")
  B, H, K = q.shape
  for name, x, shape in (("k", k, (B, H, K)), ("g", g, (B, H, K)), ("beta", beta, (B, H))):
    _check_shape(name, x, shape)
  _check_rank("v", v, 3, "[B,H,V]")
  V = v.shape[-1]
  _check_shape("v", v, (B, H, V))
  _check_shape("state", state, (B, H, K, V))
  scale = K ** -0.5 if scale is None else float(scale)
  f32 = lambda x: x.astype(jnp.float32)
  o, S = jax.jit(_step, static_argnums=6)(f32(q), f32(k), f32(v), f32(g), f32(beta), f32(state), scale)
  o = o.astype(q.dtype)
  return (o[:, None] if one_token else o), S


def _step(q_BHK, k_BHK, v_BHV, g_BHK, b_BH, S_BHKV, scale):
  S_BHKV = jnp.exp(g_BHK)[..., None] * S_BHKV
  err_BHV = v_BHV - jnp.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV, precision="highest")
  S_BHKV = S_BHKV + jnp.einsum("bhk,bhv->bhkv", k_BHK, b_BH[..., None] * err_BHV, precision="highest")
  o_BHV = jnp.einsum("bhk,bhkv->bhv", scale * q_BHK, S_BHKV, precision="highest")
  return o_BHV, S_BHKV


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, segment_ids=None,
              lower_bound: float | None = None, backend: str = "auto"):
  """Chunked KDA, same contract as `naive_recurrent_kda`.

  `lower_bound` is the caller's promise that every g >= lower_bound (the bounded gate passes its γ_min);
  None means unbounded (softplus gate). The Pallas kernels need a bound in [-5.5, 0); "auto" picks them on GPU
  when they apply and the XLA path otherwise.
  """
  B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
  _check_lower_bound(lower_bound)
  backend = _pick_backend(backend, lower_bound, K, V)
  scale = K ** -0.5 if scale is None else float(scale)
  if backend == "pallas":
    from pallas_kernels.kda import chunk_kda_pallas
    return chunk_kda_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, segment_ids=segment_ids,
                            lower_bound=lower_bound)
  bounded = lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND
  o, S = _chunk_xla(q, k, v, g, beta, scale=scale, initial_state=_zero_or(initial_state, B, H, K, V),
                                 reset=reset_mask(segment_ids, B, T), lower_bound=lower_bound if bounded else None)
  return o, (S if output_final_state else None)


_chunk_xla = jax.jit(kda_chunk.chunk_kda_xla, static_argnames=("scale", "lower_bound"))


def fused_kda(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, lower_bound: float | None = -5.0, scale=None,
              initial_state=None, output_final_state=False, segment_ids=None, backend: str = "auto"):
  """KDA from the layer's raw projections: L2-normalises q and k, applies the gate and β = σ(beta_logits), then
  runs `chunk_kda`; on the Pallas backend all of it happens in the kernels' first launch. Differentiable w.r.t.
  everything, A_log and dt_bias included."""
  B, T, H, K, V = check_inputs(q, k, v, g_raw, beta_logits, initial_state, segment_ids)
  _check_shape("A_log", A_log, (H,))
  _check_shape("dt_bias", dt_bias, (H, K))
  _check_lower_bound(lower_bound)
  if _pick_backend(backend, lower_bound, K, V) == "pallas":   # the pre-pass runs inside the kernels' first launch
    from pallas_kernels.kda import chunk_kda_pallas
    return chunk_kda_pallas(q, k, v, g_raw, beta_logits, scale=K ** -0.5 if scale is None else float(scale),
                            initial_state=initial_state, output_final_state=output_final_state,
                            segment_ids=segment_ids, lower_bound=lower_bound, gate=(A_log, dt_bias))
  q, k, g, beta = fused_inputs(q, k, g_raw, beta_logits, A_log, dt_bias, lower_bound=lower_bound)
  return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, segment_ids=segment_ids, lower_bound=lower_bound,
                   backend=backend)


def fused_inputs(q, k, g_raw, beta_logits, A_log, dt_bias, *, lower_bound: float | None = -5.0):
  """`fused_kda`'s pre-pass: (L2-normalised q and k, the fp32 log-decay g, β = σ(beta_logits) in fp32)."""
  g = kda_gate(g_raw, A_log, dt_bias, lower_bound=lower_bound)
  beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))  # kept fp32: rounding β to bf16 costs ~2e-3 in o
  return l2_normalize(q), l2_normalize(k), g, beta


def l2_normalize(x, eps: float = 1e-6):
  """x / sqrt(Σx² + eps) over the last axis, computed in fp32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _pick_backend(backend, lower_bound, K, V):
  global _auto_fallback_said
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  gate_ok = lower_bound is not None and SAFE_LOWER_BOUND <= lower_bound < 0
  dims_ok = all(d in (16, 32, 64, 128, 256) for d in (K, V))
  if backend == "pallas":
    if not gate_ok:
      raise ValueError(
          f"backend='pallas' needs a bounded gate with lower_bound in [{SAFE_LOWER_BOUND}, 0) so every 16-token tile "
          f"factorises safely (docs/design.md, KDA); got lower_bound={lower_bound}. Use backend='xla' for this gate.")
    if not dims_ok:
      raise ValueError(f"backend='pallas' needs head dims K, V in (16, 32, 64, 128, 256); got K={K}, V={V}")
    return "pallas"
  if backend == "auto" and jax.default_backend() == "gpu":
    if gate_ok and dims_ok and _pallas_available():
      return "pallas"
    if not _auto_fallback_said:
      _auto_fallback_said = True
      _log.warning("chunk_kda(backend='auto'): lower_bound=%s, K=%d, V=%d are outside the Pallas kernels' range; "
                   "using the XLA path", lower_bound, K, V)
  return "xla"


def _pallas_available() -> bool:
  try:
    import pallas_kernels.kda  # noqa: F401
    return True
  except ImportError:
    return False


def reset_mask(segment_ids, B: int, T: int) -> Array:
  """`[B,T]` bool: True where a new document starts (the state is zeroed before that token). Position 0 never resets."""
  if segment_ids is None:
    return jnp.zeros((B, T), bool)
  changed = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros((B, 1), bool), changed], axis=1)


def check_inputs(q, k, v, g, beta, initial_state=None, segment_ids=None):
  """Validates shapes and dtypes before any compute; returns (B, T, H, K, V)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating-point array, got {getattr(x, 'dtype', type(x))}")
  _check_rank("q", q, 4, "[B,T,H,K]")
  B, T, H, K = q.shape
  if T == 0:
    raise ValueError("q has T=0 tokens")
  _check_shape("k", k, (B, T, H, K))
  _check_shape("g", g, (B, T, H, K))
  _check_rank("v", v, 4, "[B,T,H,V]")
  V = v.shape[-1]
  _check_shape("v", v, (B, T, H, V))
  _check_shape("beta", beta, (B, T, H))
  if initial_state is not None:
    _check_shape("initial_state", initial_state, (B, H, K, V))
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")
  if segment_ids is not None:
    _check_shape("segment_ids", segment_ids, (B, T))
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer array, got {segment_ids.dtype}")
  return B, T, H, K, V


def _check_rank(name, x, rank, layout):
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def _check_shape(name, x, shape):
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _check_lower_bound(lower_bound):
  if lower_bound is not None and not lower_bound < 0:
    raise ValueError(f"lower_bound must be negative (a log-decay bound) or None for the softplus gate, "
                     f"got {lower_bound}")


def _zero_or(state, B, H, K, V):
  return jnp.zeros((B, H, K, V), jnp.float32) if state is None else state.astype(jnp.float32)
