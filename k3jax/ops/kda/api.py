"""KDA's entry points: `chunk_kda` (normalised q, k and the log-decay g), `fused_kda` (the layer's raw projections)
and `kda_decode_step` (one generated token); each checks its inputs before any compute and picks the XLA path or the
Pallas kernels (`pallas_kernels/kda/`, imported only when they run).

Shapes: q, k, g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, states `[B,H,K,V]` (fp32). q and k arrive
L2-normalised; g is the per-channel log-decay (<= 0). The formulas: docs/design.md, KDA.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from k3jax.ops.kda import chunk as chunk_xla
from k3jax.ops.kda.common import (SAFE_LOWER_BOUND, check_float, check_gate_values, check_inputs, check_lower_bound,
                                  check_rank, check_shape, reset_mask, zero_or)
from k3jax.ops.kda.gate import fused_inputs
from k3jax.ops.kda.naive import recurrent_step

if TYPE_CHECKING:
  from pallas_kernels.kda import KDAKernelOptions

BACKENDS = ("auto", "xla", "pallas")
FUSED_INPUTS = ("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias")   # `fused_kda`'s arrays, in its order

_log = logging.getLogger(__name__)
_auto_fallback_said = False


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, segment_ids=None,
              lower_bound: float | None = None, backend: str = "auto", kernel_options: KDAKernelOptions | None = None):
  """Chunked KDA, same contract as `naive_recurrent_kda`.

  `lower_bound` is the caller's promise that every g >= lower_bound (the bounded gate passes its γ_min);
  None means unbounded (softplus gate). On concrete inputs it is checked, with g <= 0 (`common.check_gate_values`).
  The Pallas kernels need a bound in [-5.5, 0); "auto" picks them on GPU when they apply and the XLA path otherwise.
  `kernel_options` (`pallas_kernels.kda.KDAKernelOptions`): the kernels' variants, blocking and launch parameters;
  None: the defaults. Given for a call that runs the XLA path, it is an error.
  """
  B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
  check_lower_bound(lower_bound)
  backend = _pick_backend(backend, lower_bound, K, V, kernel_options)
  check_gate_values(g, lower_bound)
  scale = K ** -0.5 if scale is None else float(scale)
  if backend == "pallas":
    from pallas_kernels.kda import chunk_kda_pallas
    return chunk_kda_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, segment_ids=segment_ids,
                            lower_bound=lower_bound, options=kernel_options)
  return _xla(q, k, v, g, beta, scale, initial_state, output_final_state, segment_ids, lower_bound)


def _xla(q, k, v, g, beta, scale, initial_state, output_final_state, segment_ids, lower_bound):
  """The XLA path on checked inputs."""
  B, T, H, K = q.shape
  bounded = lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND
  o, S = _chunk_xla(q, k, v, g, beta, scale=scale, initial_state=zero_or(initial_state, B, H, K, v.shape[-1]),
                    reset=reset_mask(segment_ids, B, T), lower_bound=lower_bound if bounded else None)
  return o, (S if output_final_state else None)


_chunk_xla = jax.jit(chunk_xla.chunk_kda_xla, static_argnames=("scale", "lower_bound"))


def fused_kda(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, lower_bound: float | None = -5.0, scale=None,
              initial_state=None, output_final_state=False, segment_ids=None, backend: str = "auto",
              kernel_options: KDAKernelOptions | None = None):
  """KDA from the layer's raw projections: L2-normalises q and k, applies the gate and β = σ(beta_logits), then
  runs `chunk_kda`; on the Pallas backend all of it happens in the kernels' first launch. Differentiable w.r.t.
  everything, A_log and dt_bias included. `kernel_options` as in `chunk_kda`."""
  B, T, H, K, V = check_inputs(q, k, v, g_raw, beta_logits, initial_state, segment_ids)
  check_float("A_log", A_log)
  check_float("dt_bias", dt_bias)
  check_shape("A_log", A_log, (H,))
  check_shape("dt_bias", dt_bias, (H, K))
  check_lower_bound(lower_bound)
  scale = K ** -0.5 if scale is None else float(scale)
  if _pick_backend(backend, lower_bound, K, V, kernel_options) == "pallas":   # the pre-pass runs in the first launch
    from pallas_kernels.kda import chunk_kda_pallas
    return chunk_kda_pallas(q, k, v, g_raw, beta_logits, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, segment_ids=segment_ids, lower_bound=lower_bound,
                            gate=(A_log, dt_bias), options=kernel_options)
  q, k, g, beta = fused_inputs(q, k, g_raw, beta_logits, A_log, dt_bias, lower_bound=lower_bound)
  return _xla(q, k, v, g, beta, scale, initial_state, output_final_state, segment_ids, lower_bound)


def kda_decode_step(q, k, v, g, beta, state, *, scale=None):
  """One generated token: q,k,g `[B,H,K]` (or `[B,1,H,K]`), v `[B,H,V]`, beta `[B,H]`, the state `[B,H,K,V]` (fp32
  from a prefill, or zeros to start); returns (o, new state)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    check_float(name, x)
  if state is None:
    raise ValueError("kda_decode_step needs the state [B,H,K,V] the prefill returned (chunk_kda(..., "
                     "output_final_state=True)); to start from nothing pass zeros, jnp.zeros((B, H, K, V), jnp.float32)")
  check_float("state", state)
  one_token = q.ndim == 4
  if one_token:
    if q.shape[1] != 1:
      raise ValueError(f"kda_decode_step takes one token: q has T={q.shape[1]}; use chunk_kda for a prefill")
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))
  check_rank("q", q, 3, "[B,H,K]")
  B, H, K = q.shape
  for name, x, shape in (("k", k, (B, H, K)), ("g", g, (B, H, K)), ("beta", beta, (B, H))):
    check_shape(name, x, shape)
  check_rank("v", v, 3, "[B,H,V]")
  V = v.shape[-1]
  check_shape("v", v, (B, H, V))
  check_shape("state", state, (B, H, K, V))
  check_gate_values(g)
  scale = K ** -0.5 if scale is None else float(scale)
  f32 = lambda x: x.astype(jnp.float32)
  o, S = jax.jit(recurrent_step, static_argnums=6)(f32(q), f32(k), f32(v), f32(g), f32(beta), f32(state), scale)
  o = o.astype(q.dtype)
  return (o[:, None] if one_token else o), S


def _pick_backend(backend, lower_bound, K, V, kernel_options=None):
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
  picked = "xla"
  if backend == "auto" and jax.default_backend() == "gpu":
    if gate_ok and dims_ok and _pallas_available():
      picked = "pallas"
    elif not _auto_fallback_said:
      _auto_fallback_said = True
      _log.warning("chunk_kda(backend='auto'): lower_bound=%s, K=%d, V=%d are outside the Pallas kernels' range; "
                   "using the XLA path", lower_bound, K, V)
  if kernel_options is not None and picked != "pallas":
    raise ValueError(f"kernel_options set the Pallas kernels, but this call runs the XLA path (backend={backend!r} "
                     f"on {jax.default_backend()}, lower_bound={lower_bound}, K={K}, V={V})")
  return picked


def _pallas_available() -> bool:
  try:
    import pallas_kernels.kda  # noqa: F401
    return True
  except ImportError:
    return False
