"""What every KDA path shares (the XLA path, the reference, the Pallas kernels): the chunk sizes, the L2 norm's epsilon,
the bound under which the gate factorises, and the input checks. Imports nothing else of the op, so the kernels
(`pallas_kernels/kda/`) can use it without importing the entry points.

Layout: q, k, g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, states `[B,H,K,V]` (fp32), segment ids `[B,T]`.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

CHUNK = 64   # tokens per chunk of the chunked paths
SUB = 16     # tokens per tile: exponents are anchored per tile (docs/design.md, KDA)
L2_EPS = 1e-6   # x / sqrt(Σx² + L2_EPS): the q/k normalisation of the fused entry and of the kernels' pre-pass
# Every 16-token tile may factorise e^{±G} only if |lower_bound|·16 < 88.7 (fp32/bf16 exponent range).
SAFE_LOWER_BOUND = -5.5
# The name (`jax.ad_checkpoint.checkpoint_name`) the Pallas path gives what its forward keeps for its backward: a
# remat policy that saves it keeps the kernels' residuals instead of running the KDA forward again.
RESIDUALS_NAME = "kda_residuals"


class IntraOutputs(NamedTuple):
  """The chunked form's per-chunk quantities, in the kernels' layout: what `pallas_kernels.kda.fwd.intra_forward`
  writes and `naive.naive_chunk_intermediates` defines (docs/design.md, KDA: the chunked form)."""
  w: Array        # [B,T,H,K]  W = M βΓK, M = (I + A_kk)⁻¹
  u: Array        # [B,T,H,V]  U = M βV
  qs: Array       # [B,T,H,K]  scale·q ⊙ Γ
  kd: Array       # [B,T,H,K]  k ⊙ e^{G_C − G}
  aqk: Array      # [B,T,H,64] A_qk, row i of its chunk's matrix
  decay: Array    # [B,N,H,K]  the chunk's state decay e^{G_C}
  kk: Array       # [B,T,H,64] B = A_kk / β
  minv: Array | None   # [B,T,H,64] M (None where the kernels were not asked to keep it)


def check_inputs(q, k, v, g, beta, initial_state=None, segment_ids=None):
  """Validates shapes and dtypes before any compute; returns (B, T, H, K, V). Warns when T < H on concrete inputs
  (the axes are time before heads: `[B,H,T,K]` inputs would be read with the two swapped)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    check_float(name, x)
  check_rank("q", q, 4, "[B,T,H,K]")
  B, T, H, K = q.shape
  if T == 0:
    raise ValueError("q has T=0 tokens")
  check_shape("k", k, (B, T, H, K))
  check_shape("g", g, (B, T, H, K))
  check_rank("v", v, 4, "[B,T,H,V]")
  V = v.shape[-1]
  check_shape("v", v, (B, T, H, V))
  check_shape("beta", beta, (B, T, H))
  if initial_state is not None:
    check_shape("initial_state", initial_state, (B, H, K, V))
    check_float("initial_state", initial_state)
  if segment_ids is not None:
    check_shape("segment_ids", segment_ids, (B, T))
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer array, got {segment_ids.dtype}")
  if T < H and is_concrete(q):
    warnings.warn(f"q has shape {tuple(q.shape)}: T={T} tokens, fewer than H={H} heads. KDA's inputs are [B,T,H,K] "
                  "(time before heads); inputs laid out [B,H,T,K] are read with the two axes swapped.", stacklevel=3)
  return B, T, H, K, V


def check_gate_values(g, lower_bound=None, name="g"):
  """On a concrete g (not under `jax.jit`, where values are unknown until run), raises unless every entry is a finite
  log-decay: <= 0, and >= `lower_bound` when one is declared. One fused min/max pass over g."""
  if not is_concrete(g):
    return
  lo, hi = (float(x) for x in _min_max(g))
  if not hi <= 0.0:   # NaN fails too
    raise ValueError(f"{name} must be a log-decay (finite, <= 0), got a maximum of {hi:g}: pass the gate's output "
                     "(kda_gate(g_raw, A_log, dt_bias)), or the raw projection to fused_kda")
  if not lo >= (-float("inf") if lower_bound is None else lower_bound):
    raise ValueError(f"{name} has entries down to {lo:g}, below the declared lower_bound={lower_bound}: the bounded "
                     "paths factorise e^{±G} only above it (docs/design.md, KDA)")


@jax.jit
def _min_max(x):
  x = x.astype(jnp.float32)
  return jnp.min(x), jnp.max(x)


def is_concrete(x) -> bool:
  """Whether x holds values now (an array outside any trace), so checks on its values or its shape's intent apply."""
  return not isinstance(x, jax.core.Tracer)


def check_float(name, x):
  if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating-point array, got {getattr(x, 'dtype', type(x))}")


def check_rank(name, x, rank, layout):
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_shape(name, x, shape):
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_lower_bound(lower_bound):
  if lower_bound is not None and not lower_bound < 0:
    raise ValueError(f"lower_bound must be negative (a log-decay bound) or None for the softplus gate, "
                     f"got {lower_bound}")


def reset_mask(segment_ids, B: int, T: int) -> Array:
  """`[B,T]` bool: True where a new document starts (the state is zeroed before that token). Position 0 never resets."""
  if segment_ids is None:
    return jnp.zeros((B, T), bool)
  changed = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros((B, 1), bool), changed], axis=1)


def zero_or(state, B, H, K, V):
  """The fp32 state to start from: `state`, or zeros when None."""
  return jnp.zeros((B, H, K, V), jnp.float32) if state is None else state.astype(jnp.float32)
