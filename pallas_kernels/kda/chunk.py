"""Chunked KDA through the Pallas kernels, differentiable with `jax.custom_vjp`.

Forward: pre-pass (the fused entry's gate, L2 norms and β sigmoid; q, k against their tiles' anchors) -> intra pass
(parallel over chunks) -> state pass (sequential, writes o). The intra pass's outputs are the residuals (≈ 0.9 GB at
8×4096×16×128, bf16; recomputing them cost more than they take), and under differentiation also the states
entering each chunk and v_new, which the state pass writes beside o (no second pass in the backward). Backward: a
reverse state pass, the state-gradient products, the intra backward, and for the fused entry the pre-pass's
gradient by XLA.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.ops.kda.common import CHUNK, RESIDUALS_NAME, IntraOutputs, reset_mask
from k3jax.ops.kda.gate import fused_inputs
from pallas_kernels._triton import traced_once
from pallas_kernels.kda import bwd, fwd
from pallas_kernels.kda.options import KDAKernelOptions


def default_block_v(B, H, V, target_programs=128):
  """Columns of the state per program in the sequential passes: the widest giving `target_programs` programs.
  The fastest block on the H200 at every B·H measured, forward and backward (BUILD_NOTES.md, KDA kernels)."""
  bv = V
  while bv > 16 and (V // bv) * B * H < target_programs:
    bv //= 2
  return bv


def default_segments(B, H, N, target_rows=128, min_chunks=16):
  """Segments of the forward's state pass (`fwd.state_forward`): enough (batch, head, segment) rows to fill the GPU
  as B·H = 128 does at 8x4096, each segment at least `min_chunks` chunks, their count dividing the N chunks."""
  s = max(1, min(target_rows // (B * H), N // min_chunks))
  while N % s:
    s -= 1
  return s


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one call fixes, the custom VJP's static argument: the scale, the gate's bound, T before padding (None
  without), whether an initial state was given, the forward's and backward's state-pass column blocks and the
  forward's segments (resolved from `options` for the call's shapes), and the options themselves."""
  scale: float
  lower_bound: float
  valid_len: int | None
  has_state: bool
  block_v_fwd: int
  block_v_bwd: int
  segments: int
  options: KDAKernelOptions


class Residuals(NamedTuple):
  """What the backward reads. `raw`: for the fused entry, (q, k, g_raw, beta_logits, (A_log, dt_bias)) as given,
  None otherwise; q, k: as the kernels used them (normalised by the fused pre-pass); the intra pass's outputs
  (`fwd.intra_forward`) and the tiles' cumulative gates `loc`; h, v_new: the states entering each chunk and the
  new values, written by the state pass."""
  raw: tuple | None
  q: jax.Array
  k: jax.Array
  v: jax.Array
  beta: jax.Array
  reset: jax.Array | None
  loc: jax.Array
  intra: IntraOutputs
  h: jax.Array
  v_new: jax.Array


def chunk_kda_pallas(q, k, v, g, beta, *, scale, initial_state, output_final_state, segment_ids, lower_bound,
                     gate=None, options: KDAKernelOptions | None = None):
  """Inputs as `k3jax.ops.kda.chunk_kda` (already checked there); T is padded to a multiple of 64 here. With `gate`
  = (A_log, dt_bias), g and beta are the layer's raw gate and β projections and q, k are L2-normalised in the kernels
  (`k3jax.ops.kda.fused_kda`); the gradients flow to all of them. `options`: the kernels' variants, blocking and
  launches (`KDAKernelOptions`; None: the defaults)."""
  options = KDAKernelOptions() if options is None else options
  if not isinstance(options, KDAKernelOptions):
    raise TypeError(f"options must be a KDAKernelOptions, got {type(options).__name__}")
  B, T, H, K = q.shape
  V = v.shape[-1]
  pad = -T % CHUNK
  padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
  dt = q.dtype
  q, k, v = (padt(x.astype(dt)) for x in (q, k, v))
  if gate is None:
    g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
  g, beta = padt(g), padt(beta)
  reset = None if segment_ids is None else padt(reset_mask(segment_ids, B, T).astype(jnp.int32))
  S0 = None if initial_state is None else initial_state.astype(jnp.float32)   # None: the kernels start from zeros
  N = q.shape[1] // CHUNK
  segments = options.segments or default_segments(B, H, N)
  if N % segments:
    raise ValueError(f"KDAKernelOptions.segments={segments} must divide the {N} chunks of T={T}")
  plan = Plan(scale=float(scale), lower_bound=float(lower_bound), valid_len=T if pad else None,
              has_state=S0 is not None, block_v_fwd=options.block_v or default_block_v(B * segments, H, V),
              block_v_bwd=options.block_v or default_block_v(B, H, V), segments=segments, options=options)
  o, S = _kda(plan, q, k, v, g, beta, gate, S0, reset)
  return o[:, :T], (S if output_final_state else None)


# The forward and the backward each run as one call lowered once per program (`traced_once`): one compiled copy of
# each kernel, however many layers, passes and recomputations call it.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(plan, q, k, v, g, beta, gate, S0, reset):
  return _forward_once(plan, False, q, k, v, g, beta, gate, S0, reset)[0]


def inverts_diagonal(options, dtype, K, V, *, save):
  """Whether the forward's key tiles invert B's diagonal blocks: only undifferentiated (`save` False: with the
  backward, it reads B as it is), with the Mosaic solve, unless `options.invert_diagonal` is False. Inverted, the
  Mosaic solve's chain is 4 products long, not 10."""
  return options.invert_diagonal and not save and fwd.solve_used(options, dtype, K, V) == "mosaic"


def _forward(plan, q, k, v, g, beta, gate, S0, reset, *, save):
  opts = plan.options
  p = fwd.prepare(q, k, g, beta, gate, reset, lower_bound=plan.lower_bound, valid_len=plan.valid_len, save=save,
                  options=opts)
  invert = inverts_diagonal(opts, q.dtype, q.shape[-1], v.shape[-1], save=save)
  intra = fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, v, p.beta, reset, scale=plan.scale, lower_bound=plan.lower_bound,
                            save=save, invert_diagonal=invert, options=opts)
  o, S, *saved = fwd.state_forward(intra.w, intra.u, intra.qs, intra.kd, intra.aqk, intra.decay, S0,
                                   block_v=plan.block_v_fwd, save=save, segments=plan.segments, options=opts)
  if not save:
    return (o, S), None
  h, v_new = saved
  raw = None if gate is None else (q, k, g, beta, gate)
  return (o, S), Residuals(raw, p.q, p.k, v, p.beta, reset, p.loc, intra, h, v_new)


def _kda_fwd(plan, q, k, v, g, beta, gate, S0, reset):
  out, res = _forward_once(plan, True, q, k, v, g, beta, gate, S0, reset)
  return out, jax.tree.map(lambda x: checkpoint_name(x, RESIDUALS_NAME), res)   # for a remat policy to keep


def _backward(plan, res: Residuals, cotangents):
  opts = plan.options
  do, dS_T = cotangents
  do = do.astype(res.q.dtype)
  intra = res.intra
  dv_new, dh, dS0 = bwd.state_backward(do, intra.aqk, intra.kd, intra.qs, intra.w, intra.decay,
                                       dS_T.astype(jnp.float32), block_v=plan.block_v_bwd, options=opts)
  dw, dqs, dkd, dd = bwd.state_grad_products(res.h, dh, res.v_new, dv_new, do, options=opts)
  dq, dk, dv, dg, dbeta = bwd.intra_backward(
      q=res.q, k=res.k, v=res.v, loc=res.loc, beta=res.beta, reset=res.reset, u=intra.u, w=intra.w, kk=intra.kk,
      minv=intra.minv, v_new=res.v_new, dv_new=dv_new, do=do, dw=dw, dqs=dqs, dkd=dkd, dd=dd, scale=plan.scale,
      lower_bound=plan.lower_bound, options=opts)
  dS0 = dS0 if plan.has_state else None
  if res.raw is None:
    return dq, dk, dv, dg, dbeta, None, dS0, None
  # The fused pre-pass: its gradient by XLA from the raw inputs (elementwise and row norms, recomputed here).
  q_raw, k_raw, g_raw, beta_logits, gate = res.raw
  if plan.valid_len is not None:   # the padding's gate is held at zero, so A_log and dt_bias get nothing from it
    dg = dg.at[:, plan.valid_len:].set(0.0)
  prepass = functools.partial(fused_inputs, lower_bound=plan.lower_bound)
  _, pullback = jax.vjp(prepass, q_raw, k_raw, g_raw, beta_logits, *gate)
  dq, dk, dg, dbeta, dA_log, ddt_bias = pullback((dq.astype(res.q.dtype), dk.astype(res.k.dtype),
                                                   dg.astype(jnp.float32), dbeta.astype(jnp.float32)))
  return dq, dk, dv, dg, dbeta, (dA_log, ddt_bias), dS0, None


def _kda_forward(plan, save, *args):
  return _forward(plan, *args, save=save)


_forward_once = traced_once(_kda_forward, static_argnums=(0, 1))
_backward_once = traced_once(_backward, static_argnums=(0,))
_kda.defvjp(_kda_fwd, _backward_once)
