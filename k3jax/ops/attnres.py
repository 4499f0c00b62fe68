"""The AttnRes read-out (docs/design.md, AttnRes) as one op with a hand-written backward pass.

    s_n = qᵀ RMSNorm_g(v_n) = a_n · r_n,     a_n = (q ⊙ g)ᵀ v_n,   r_n = (mean_d v_n² + ε)^-½
    w   = softmax of s over the valid n,     h = Σ_n w_n v_n

The values are a stacked buffer `[C,B,T,D]` (valid where `valid_C`) and single arrays `[B,T,D]` (valid where
`valid_E`), fp32 or bf16 (the stored sources, `k3jax.layers.attnres`), read into fp32: every product and sum is
fp32, and each value's cotangent is rounded to its own dtype once, at the end. What is not valid has weight exactly 0
and a zero cotangent.

The backward pass, from `w`, `a` and `r` kept per value and token (`[N,B,T]`, small beside the values):

    dw_n = dhᵀ v_n,   ds_n = w_n (dw_n − Σ_m w_m dw_m)
    dv_n = w_n dh + ds_n r_n (q ⊙ g) − ds_n a_n r_n³ / D · v_n
    dq = g ⊙ u,   dg = q ⊙ u,   u = Σ_{n, tokens} ds_n r_n v_n

Each line is one elementwise-and-reduce pass over the values, which XLA fuses (the buffer's cotangent with the sum
it is added to). Autodiff of the same formula goes through the normalised keys and the softmax's own VJP and reads
and writes the values several more times (`experiments/bench_attnres.py` times the two).

Inside a scanned group of layers every read-out sees the same buffer and its queries are parameters, so the
buffer's part of all J read-outs of the group can be computed in one pass over it (`summarize_buffer`), as the
softmax over the buffer's slots alone, as a weighted mean and a log-sum-exp:

    π_jn = softmax_n(s_jn),   P̄_j = Σ_n π_jn v_n,   ℓ_j = log Σ_n exp(s_jn)

and each read-out then merges its part with its single values (`readout_from_summary`): a softmax over (ℓ_j, s_e)
weighting (P̄_j, v_e), which is `readout`'s h. The backward pass then meets the buffer once per group, through the
means' cotangents, where the per-read-out op reads it and rewrites its cotangent at every read-out. Both are left to
autodiff: every product is elementwise or an fp32 `HIGHEST` dot, and both weightings are `jax.nn.softmax`, whose
VJP subtracts Σ w·dw from the same rounded dw (un-normalised partial sums would leave a saturated read-out's
gradient to cancel two dots rounded apart, far less accurate: docs/design.md, AttnRes).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config import RESIDUAL_BACKWARDS as BACKWARDS


def readout(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, *, eps: float, backward: str = "fused"):
  """h `[B,T,D]` fp32. `query_D`, `scale_D`: the pseudo-query and the key RMSNorm's weight; `buffer_CBTD` fp32 or
  bf16 (C may be 0) with `valid_C` bool `[C]`; `values` a tuple of E fp32 or bf16 `[B,T,D]` with `valid_E` bool
  `[E]`. At least one value must be valid (else the weights are NaN).

  `backward` (BACKWARDS), how the backward pass runs; the same arithmetic, which is faster is measured: "fused", as
  XLA fuses it; "barrier", its reductions over the tokens (`u`) reading their coefficients and values through an
  optimization barrier, so that XLA writes the coefficients once and reduces them in a pass of their own."""
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  return _readout(query_D, scale_D, buffer_CBTD, valid_C, tuple(values), valid_E, eps, backward)


def weights(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, *, eps: float):
  """The read-out's softmax weights `[C+E,B,T]`: the buffer's slots, then `values` in order."""
  return _forward(query_D, scale_D, buffer_CBTD, valid_C, tuple(values), valid_E, eps)[1]


def readout_reference(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, *, eps: float,
                      precision=jax.lax.Precision.HIGHEST):
  """`readout` as the formula reads, left to autodiff: every value stacked, RMS-normalised and scored (the test
  reference; at `precision=DEFAULT`, which may be TF32 on a GPU, what the model ran before the op, timed by
  `experiments/bench_attnres.py`)."""
  v_NBTD = jnp.concatenate([buffer_CBTD, *(v[None] for v in values)]).astype(jnp.float32)
  valid_N = jnp.concatenate([valid_C, valid_E])
  keys_NBTD = v_NBTD * jax.lax.rsqrt(jnp.mean(v_NBTD * v_NBTD, axis=-1, keepdims=True) + eps) * scale_D
  s_NBT = jnp.einsum("d,nbtd->nbt", query_D, keys_NBTD, precision=precision)
  w_NBT = jax.nn.softmax(jnp.where(valid_N[:, None, None], s_NBT, -jnp.inf), axis=0)
  return jnp.einsum("nbt,nbtd->btd", w_NBT, jnp.where(valid_N[:, None, None, None], v_NBTD, 0.0), precision=precision)


def _forward(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps):
  """(h, w_N, a_N, r_N): the read-out and what its backward pass keeps."""
  buffer_CBTD, values = _in_fp32(buffer_CBTD, values)
  qg = query_D * scale_D
  stats = lambda v: (jnp.sum(v * qg, axis=-1), jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps))
  a_C, r_C = stats(buffer_CBTD)
  a_E, r_E = zip(*map(stats, values)) if values else ((), ())
  a_N = jnp.concatenate([a_C, *(a[None] for a in a_E)])
  r_N = jnp.concatenate([r_C, *(r[None] for r in r_E)])
  valid_N = jnp.concatenate([valid_C, valid_E])
  s_N = jnp.where(valid_N[:, None, None], a_N * r_N, -jnp.inf)
  w_N = jax.nn.softmax(s_N, axis=0)
  # Summed value by value in order (one fusion; no matrix unit, whose fp32 may be TF32): a `Stream` and the `Carry`
  # holding the same sources give the same sum, since a slot that is not valid adds an exact 0. (One reduction over
  # the buffer's slot axis compiles faster, through XLA's priority fusion, but runs slower on the GPU.)
  all_values = [buffer_CBTD[i] for i in range(buffer_CBTD.shape[0])] + list(values)
  h = sum(w_N[i][..., None] * v for i, v in enumerate(all_values))
  return h, w_N, a_N, r_N


def _in_fp32(buffer_CBTD, values):
  """The buffer and values read as fp32 (a convert XLA fuses into the pass that reads them)."""
  return buffer_CBTD.astype(jnp.float32), tuple(v.astype(jnp.float32) for v in values)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _readout(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps, backward):
  del backward
  return _forward(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps)[0]


def _readout_fwd(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps, backward):
  del backward
  h, w_N, a_N, r_N = _forward(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps)
  return h, (query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, w_N, a_N, r_N)


def _readout_bwd(eps, backward, residuals, dh):
  del eps
  query_D, scale_D, buffer_in, valid_C, values_in, valid_E, w_N, a_N, r_N = residuals
  buffer_CBTD, values = _in_fp32(buffer_in, values_in)
  c, d = buffer_CBTD.shape[0], query_D.shape[0]
  dw_C = jnp.sum(dh * buffer_CBTD, axis=-1)
  dw_N = jnp.concatenate([dw_C, *(jnp.sum(dh * v, axis=-1)[None] for v in values)])
  ds_N = w_N * (dw_N - jnp.sum(w_N * dw_N, axis=0))    # 0 where not valid (w = 0)
  c_N = ds_N * r_N                                            # coefficient of q ⊙ g
  k_N = -ds_N * a_N * r_N ** 3 / d                            # coefficient of v itself
  qg = query_D * scale_D

  def dv(i, v):
    return w_N[i][..., None] * dh + c_N[i][..., None] * qg + k_N[i][..., None] * v

  d_buffer = jnp.where(valid_C[:, None, None, None], dv(slice(0, c), buffer_CBTD), 0.0).astype(buffer_in.dtype)
  d_values = tuple(jnp.where(valid_E[i], dv(c + i, v), 0.0).astype(v_in.dtype)
                   for i, (v, v_in) in enumerate(zip(values, values_in)))
  if backward == "barrier":
    c_N, buffer_CBTD, values = jax.lax.optimization_barrier((c_N, buffer_CBTD, values))
  u = jnp.sum(c_N[:c, ..., None] * buffer_CBTD, axis=(0, 1, 2))
  u = u + sum(jnp.sum(c_N[c + i][..., None] * v, axis=(0, 1)) for i, v in enumerate(values))
  return scale_D * u, query_D * u, d_buffer, None, d_values, None


_readout.defvjp(_readout_fwd, _readout_bwd)



class BufferSummary(NamedTuple):
  """The buffer's part of J read-outs (`summarize_buffer`), per token; `part(j)` is read-out j's."""
  mean_BTJD: jax.Array   # P̄_j = Σ_n π_jn v_n, π_j the softmax of s_j over the valid slots (0 when none is valid)
  lse_BTJ: jax.Array     # ℓ_j = log Σ_n exp(s_jn) over the valid slots, −inf when none is valid

  def part(self, j: int) -> tuple[jax.Array, jax.Array]:
    """(P̄ `[B,T,D]`, ℓ `[B,T]`) of read-out j."""
    return self.mean_BTJD[:, :, j], self.lse_BTJ[..., j]


def summarize_buffer(queries_JD, scales_JD, buffer_CBTD, valid_C, *, eps: float) -> BufferSummary:
  """The buffer's part of the read-outs of J (query, key-norm weight) pairs, in one pass over the buffer (the module
  docstring). The tokens' axes lead P̄ so that the J means of one token lie side by side (one read of each slot's
  row serves all J)."""
  buffer_CBTD = buffer_CBTD.astype(jnp.float32)
  qg_JD = queries_JD * scales_JD
  a_BTJC = jnp.einsum("cbtd,jd->btjc", buffer_CBTD, qg_JD, precision=jax.lax.Precision.HIGHEST)
  r_BTC = jnp.moveaxis(jax.lax.rsqrt(jnp.mean(buffer_CBTD * buffer_CBTD, axis=-1) + eps), 0, -1)
  any_valid = jnp.any(valid_C)
  # With no valid slot the scores are 0 (finite weights, a finite mean) and ℓ = −inf gives the mean no weight.
  s_BTJC = jnp.where(valid_C, a_BTJC * r_BTC[:, :, None, :], jnp.where(any_valid, -jnp.inf, 0.0))
  pi_BTJC = jax.nn.softmax(s_BTJC, axis=-1)
  lse_BTJ = jnp.where(any_valid, jax.nn.logsumexp(s_BTJC, axis=-1), -jnp.inf)
  # Slot by slot (one fusion, no matrix unit: its fp32 may be TF32), as `readout` sums h.
  zero = jnp.zeros((*s_BTJC.shape[:3], buffer_CBTD.shape[-1]), jnp.float32)
  mean_BTJD = sum((pi_BTJC[..., n, None] * buffer_CBTD[n][:, :, None, :] for n in range(buffer_CBTD.shape[0])),
                  zero)
  return BufferSummary(mean_BTJD, lse_BTJ)


def readout_from_summary(query_D, scale_D, part, values, valid_E, *, eps: float):
  """h `[B,T,D]` fp32: `readout` of a buffer whose part `part` = `BufferSummary.part(j)` is (with `query_D`,
  `scale_D` read-out j's own) and of the single `values` (valid where `valid_E`)."""
  mean_BTD, lse_BT = part
  values = tuple(v.astype(jnp.float32) for v in values)
  qg = query_D * scale_D
  score = lambda v: jnp.sum(v * qg, axis=-1) * jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)
  s_NBT = jnp.stack([lse_BT, *(jnp.where(valid_E[i], score(v), -jnp.inf) for i, v in enumerate(values))])
  w_NBT = jax.nn.softmax(s_NBT, axis=0)
  return sum(w_NBT[i][..., None] * v for i, v in enumerate((mean_BTD, *values)))
