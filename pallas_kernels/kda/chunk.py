"""Chunked KDA through the Pallas kernels, differentiable with `jax.custom_vjp`.

Forward: pre-pass (the fused entry's gate, L2 norms and β sigmoid; q, k against their tiles' anchors) -> intra pass
(parallel over chunks) -> state pass (sequential, writes o). The intra pass's outputs are the residuals (≈ 0.9 GB at
8×4096×16×128, bf16; recomputing them cost more than they take), and under differentiation also the states
entering each chunk and v_new, which the state pass writes beside o (no second pass in the backward). Backward: a
reverse state pass, the state-gradient products, the intra backward, and for the fused entry the pre-pass's
gradient by XLA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import bwd, fwd, solve_mosaic
from pallas_kernels.kda.tiles import CHUNK


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


def chunk_kda_pallas(q, k, v, g, beta, *, scale, initial_state, output_final_state, segment_ids, lower_bound,
                     block_v=None, gate=None, cols_form="loop"):
  """Inputs as `k3jax.ops.kda.chunk_kda` (already checked there); T is padded to a multiple of 64 here. With `gate`
  = (A_log, dt_bias), g and beta are the layer's raw gate and β projections and q, k are L2-normalised in the kernels
  (`k3jax.ops.kda.fused_kda`); the gradients flow to all of them. `cols_form`: the backward column pass's form
  (`bwd.intra_backward`), for timing the two against each other."""
  if cols_form not in bwd.COLS_FORMS:
    raise ValueError(f"chunk_kda_pallas: cols_form must be one of {bwd.COLS_FORMS}, got {cols_form!r}")
  B, T, H, K = q.shape
  V = v.shape[-1]
  pad = -T % CHUNK
  padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
  dt = q.dtype
  q, k, v = (padt(x.astype(dt)) for x in (q, k, v))
  if gate is None:
    g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
  g, beta = padt(g), padt(beta)
  reset = None
  if segment_ids is not None:
    from k3jax.ops.kda import reset_mask
    reset = padt(reset_mask(segment_ids, B, T).astype(jnp.int32))
  S0 = None if initial_state is None else initial_state.astype(jnp.float32)   # None: the kernels start from zeros
  segments = default_segments(B, H, q.shape[1] // CHUNK)
  block_fwd, block_bwd = ((block_v, block_v) if block_v else
                          (default_block_v(B * segments, H, V), default_block_v(B, H, V)))
  cfg = (float(scale), float(lower_bound), block_fwd, block_bwd, segments, T if pad else None, S0 is not None,
         cols_form)
  o, S = _kda(cfg, q, k, v, g, beta, gate, S0, reset)
  return o[:, :T], (S if output_final_state else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(cfg, q, k, v, g, beta, gate, S0, reset):
  return _forward(cfg, q, k, v, g, beta, gate, S0, reset, save=False)[0]


def _forward(cfg, q, k, v, g, beta, gate, S0, reset, *, save):
  scale, lower_bound, block_v, _, segments, valid_len, _, _ = cfg
  p = fwd.prepare(q, k, g, beta, gate, reset, lower_bound=lower_bound, valid_len=valid_len, save=save)
  # Without the backward, the key tiles invert B's diagonal blocks: the Mosaic solve's chain is then 4 products long,
  # not 10; the backward reads B as it is.
  invert = not save and solve_mosaic.available(q.dtype, q.shape[-1], v.shape[-1])
  w, u, qs, kd, aqk, decay, kk, minv = fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, v, p.beta, reset, scale=scale,
                                                         lower_bound=lower_bound, save=save, invert_diagonal=invert)
  o, S, *saved = fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=block_v, save=save, segments=segments)
  intra = (p.q, p.k, p.beta, w, u, qs, kd, aqk, decay, kk, minv, p.loc)
  return (o, S), (None if gate is None else (q, k, g, beta, gate), v, reset, intra, saved)


def _kda_fwd(cfg, q, k, v, g, beta, gate, S0, reset):
  return _forward(cfg, q, k, v, g, beta, gate, S0, reset, save=True)


def _kda_bwd(cfg, res, cotangents):
  scale, lower_bound, _, block_v_bwd, _, valid_len, has_state, cols_form = cfg
  raw, v, reset, (q, k, beta, w, u, qs, kd, aqk, decay, kk, minv, loc), (h, v_new) = res
  do, dS_T = cotangents
  do = do.astype(q.dtype)
  dv_new, dh, dS0 = bwd.state_backward(do, aqk, kd, qs, w, decay, dS_T.astype(jnp.float32), block_v=block_v_bwd)
  dw, dqs, dkd, dd = bwd.state_grad_products(h, dh, v_new, dv_new, do)
  dq, dk, dv, dg, dbeta = bwd.intra_backward(q, k, v, loc, beta, reset, u, w, kk, minv, v_new, dv_new, do, dw, dqs,
                                             dkd, dd, scale=scale, lower_bound=lower_bound,
                                             cols_form=cols_form)
  if raw is None:
    return dq, dk, dv, dg, dbeta, None, dS0 if has_state else None, None
  # The fused pre-pass: its gradient by XLA from the raw inputs (elementwise and row norms, recomputed here).
  from k3jax.ops.kda import fused_inputs
  q_raw, k_raw, g_raw, beta_logits, gate = raw
  if valid_len is not None:   # the padding's gate is held at zero, so A_log and dt_bias get nothing from it
    dg = dg.at[:, valid_len:].set(0.0)
  prepass = functools.partial(fused_inputs, lower_bound=lower_bound)
  _, pullback = jax.vjp(prepass, q_raw, k_raw, g_raw, beta_logits, *gate)
  dq, dk, dg, dbeta, dA_log, ddt_bias = pullback((dq.astype(q.dtype), dk.astype(k.dtype), dg.astype(jnp.float32),
                                                   dbeta.astype(jnp.float32)))
  return dq, dk, dv, dg, dbeta, (dA_log, ddt_bias), dS0 if has_state else None, None


_kda.defvjp(_kda_fwd, _kda_bwd)
