"""Forward kernels: the pre-pass (gate, L2 norms, the products' operands against their tiles' anchors), the parallel
intra-chunk pass, the sequential state pass that also writes the output. Each launch's parameters come from
`KDAKernelOptions`; the tests hold the launches' outputs to `k3jax.ops.kda.naive.naive_chunk_intermediates`."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.ops.kda.common import L2_EPS, IntraOutputs
from pallas_kernels import barrier, triton_call
from pallas_kernels.kda import solve_mosaic, state_mosaic
from pallas_kernels.kda.options import KDAKernelOptions
from pallas_kernels.kda.tiles import (CHUNK, F32, NT, SUB, TileAnchors, TileDocs, iota, load, masked, mm, mm_t, store,
                                      t_mm, unit_lower_inverse)

DEFAULT = KDAKernelOptions()

class Prepared(NamedTuple):
  """`prepare`'s outputs. q, k: normalised (the fused entry) or as given; with loc, the backward's (None unless
  saved). qe = q ⊙ e^{G - R - c}, kq = k ⊙ e^{G - R - c}, ke = k ⊙ e^{c - (G - R)} (input dtype `[B,T,H,K]`, R
  each row's tile anchor, `tiles`); tot fp32 `[B,T/16,H,K]`, each tile's total log-decay; β fp32 `[B,T,H]`; loc
  fp32 `[B,T,H,K]`, the cumulative sums within each tile."""
  q: jax.Array | None
  k: jax.Array | None
  qe: jax.Array
  kq: jax.Array
  ke: jax.Array
  tot: jax.Array
  beta: jax.Array
  loc: jax.Array | None


def _prepare_kernel(*refs, fused, lower_bound, valid_len, save):
  """The forward's first launch, one program per 16-token tile: the key-tile products' operands, each row against
  the tile's anchor, and the tile's total; with `fused`, from the gate projection (`k3jax.ops.kda.kda_gate`) and
  L2-normalising q, k, with β = σ(logits). The exponentials are taken here, once, not per anchor in the key tiles."""
  n_in = 6 if fused else 3
  ins, outs = refs[:n_in], list(refs[n_in:])
  q_ref, k_ref, g_ref = ins[:3]
  qn_ref, kn_ref = (outs.pop(0), outs.pop(0)) if fused and save else (None, None)
  g = load(g_ref)
  if fused:
    _, _, _, b_ref, a_ref, dt_ref = ins
    a = jnp.exp(load(a_ref))[None, :]                                               # [1,1]: the head's e^{A_log}
    z = jnp.maximum(a * (g + load(dt_ref)[None, :]), -80.0)                         # as kda_gate: no subnormal g
    g = lower_bound / (1.0 + jnp.exp(-z))
    store(outs.pop(0), None, 1.0 / (1.0 + jnp.exp(-load(b_ref))))
  if valid_len is not None:   # padding rows decay nothing (a zero gate projection would)
    g = jnp.where(pl.program_id(1) * SUB + iota((SUB, 1), 0) < valid_len, g, 0.0)
  qe_ref, kq_ref, ke_ref, tot_ref, *loc_ref = outs
  loc = jnp.cumsum(g, axis=0)
  if save:
    store(loc_ref[0], None, loc)
  tot_ref[...] = jnp.sum(g, axis=0, keepdims=True).astype(tot_ref.dtype)

  def normalised(x_ref, xn_ref):
    x = load(x_ref)
    if fused:
      x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)
    if xn_ref is not None:
      store(xn_ref, None, x)
    return x

  # q, then k, each loaded where used, and a tile per program: holding q, k, g and the sums at once, or a chunk per
  # program, was slower.
  c = SUB / 2 * lower_bound
  e_q = jnp.exp(loc - c)
  store(qe_ref, None, normalised(q_ref, qn_ref) * e_q)
  k = normalised(k_ref, kn_ref)
  store(kq_ref, None, k * e_q)
  store(ke_ref, None, k * jnp.exp(c - loc))


def prepare(q, k, g, beta, gate, reset, *, lower_bound, valid_len=None, save=True, options=DEFAULT):
  """The forward's first launch (`_prepare_kernel`), returning `Prepared`. `gate` None: g is the log-decay and q,
  k, β are taken as they are. `gate` = (A_log [H], dt_bias [H,K]): g and β are the raw projections (`fused_kda`), q
  and k are L2-normalised and β is σ(β). Rows from `valid_len` on (T's padding) get g = 0. `save`: also write what
  the backward reads (normalised q, k and loc). `options.prepare`: the launch."""
  B, T, H, K = g.shape
  fused = gate is not None
  row = lambda d: pl.BlockSpec((None, SUB, None, d), lambda bh, n: (bh // H, n, bh % H, 0))
  tok = pl.BlockSpec((None, SUB, None), lambda bh, n: (bh // H, n, bh % H))
  head = pl.BlockSpec((None, K), lambda bh, n: (bh % H, 0))
  args, in_specs = [q, k, g], [row(K)] * 3
  out_shape, out_specs = [], []
  if fused:
    A_log, dt_bias = gate
    a_spec = pl.BlockSpec((None, 1), lambda bh, n: (bh % H, 0))
    args = args + [beta, A_log.astype(F32).reshape(H, 1), dt_bias.astype(F32)]
    in_specs = in_specs + [tok, a_spec, head]
    if save:
      out_shape, out_specs = [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 2, [row(K)] * 2
    out_shape, out_specs = out_shape + [jax.ShapeDtypeStruct((B, T, H), F32)], out_specs + [tok]
  out_shape += [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3 + [jax.ShapeDtypeStruct((B, T // SUB, H, K), F32)]
  out_specs += [row(K)] * 3 + [pl.BlockSpec((None, 1, None, K), lambda bh, n: (bh // H, n, bh % H, 0))]
  if save:
    out_shape, out_specs = out_shape + [jax.ShapeDtypeStruct((B, T, H, K), F32)], out_specs + [row(K)]
  kernel = functools.partial(_prepare_kernel, fused=fused, lower_bound=lower_bound, valid_len=valid_len, save=save)
  # Heads first in every intra launch: programs launched together read a token's neighbouring heads.
  outs = list(triton_call(kernel, grid=(B * H, T // SUB), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          name="kda_prepare", **options.launch("prepare")._asdict())(*args))
  q_n, k_n = (outs.pop(0), outs.pop(0)) if fused and save else ((None, None) if fused else (q, k))
  beta = outs.pop(0) if fused else beta.astype(F32)
  qe, kq, ke, tot, *loc = outs
  return Prepared(q_n, k_n, qe, kq, ke, tot, beta, loc[0] if save else None)


def _key_tile_kernel(qe_ref, kq_ref, ke_ref, tot_ref, beta_ref, *refs, scale, lower_bound, has_reset, dtype,
                     block_k, invert_diagonal, beta_by_head):
  """The forward's second launch, one program per (query tile I, chunk): row block I of A_qk and B, tile I's
  queries (`prepare`'s qe, kq: against their own anchor R_I) times the chunk's keys ke rescaled for R_I, and tile
  I's rows of Qs, Kd and βΓK, `block_k` columns of K at a time; the chunk's state decay from tile 0's program; with
  `beta_by_head`, tile I's β again, heads before time (for the Mosaic solve's TMA). No exponential of a [64,K]
  tile: `prepare` took them once (here they would be taken for every anchor, four times the chunk's). With
  `invert_diagonal`, B's diagonal block I holds (I + βB_II)⁻¹ − I instead (for the Mosaic solve's
  `diagonal_inverted`)."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  aqk_ref, kk_ref, qs_ref, kd_ref, kgb_ref, decay_ref, *beta_t_ref = refs
  docs = TileDocs(reset_ref, pl.program_id(0))
  rows = pl.ds(docs.i * SUB, SUB)
  beta_i = beta_ref[...].astype(F32)[:, None]
  if beta_by_head:
    beta_t_ref[0][...] = beta_ref[...].astype(F32)

  def columns(cb, acc):
    cols = pl.ds(cb * block_k, block_k)
    an = TileAnchors([tot_ref[pl.ds(p, 1), cols].astype(F32) for p in range(NT)], docs, lower_bound)
    keys = (ke_ref[:, cols].astype(F32) * an.keys_scale()).astype(dtype)
    qe_i, kq_i = qe_ref[:, cols].astype(F32), kq_ref[:, cols].astype(F32)
    acc_qk = acc[0] + mm_t(qe_i, keys, dtype)
    acc_kk = acc[1] + mm_t(kq_i, keys, dtype)
    start = an.from_anchor()
    qs_ref[:, cols] = (scale * qe_i * start).astype(qs_ref.dtype)
    kgb_ref[:, cols] = (beta_i * kq_i * start).astype(kgb_ref.dtype)
    kd_ref[:, cols] = (ke_ref[rows, cols].astype(F32) * an.to_end_from_anchor()).astype(kd_ref.dtype)

    @pl.when(docs.i == 0)
    def _():   # e^{G_C}, zero where a document starts inside the chunk (the state entering it reaches no row after)
      decay = jnp.exp(an.rest)[0]
      decay_ref[cols] = decay if docs.one_document is None else jnp.where(docs.one_document, decay, 0.0)
    return acc_qk, acc_kk

  zeros = jnp.zeros((SUB, CHUNK), F32)
  acc_qk, acc_kk = jax.lax.fori_loop(0, qe_ref.shape[-1] // block_k, columns, (zeros, zeros))
  aqk_ref[...] = masked(scale * acc_qk, docs.row_mask(False)).astype(aqk_ref.dtype)
  kk_ref[...] = masked(acc_kk, docs.row_mask(True)).astype(kk_ref.dtype)
  if invert_diagonal:   # the diagonal block, masked, read back (registers cannot be sliced) and replaced
    diag = pl.ds(docs.i * SUB, SUB)
    barrier()
    m = unit_lower_inverse(beta_i * kk_ref[:, diag], True)   # by products: faster than substitution
    barrier()
    kk_ref[:, diag] = m - jnp.where(iota((SUB, SUB), 0) == iota((SUB, SUB), 1), 1.0, 0.0)


def _solve_kernel(beta_ref, kk_ref, kgb_ref, v_ref, *refs, exact, block_cols, save):
  """The intra pass's last launch, one program per chunk: M = (I + βB)⁻¹, U = M βV and W = M (βΓK), M unrounded
  (tf32 on bf16 inputs); M itself is written only for the backward (`save`). No gates: the key tiles wrote βΓK."""
  w_ref, u_ref, *minv_ref = refs
  beta = load(beta_ref)[:, None]
  x = unit_lower_inverse(beta * load(kk_ref), exact)
  if save:
    store(minv_ref[0], None, x)
  for c in range(v_ref.shape[-1] // block_cols):
    cols = pl.ds(c * block_cols, block_cols)
    u_ref[:, cols] = mm(x, beta * v_ref[:, cols].astype(F32), F32, exact).astype(u_ref.dtype)
  for c in range(kgb_ref.shape[-1] // block_cols):
    cols = pl.ds(c * block_cols, block_cols)
    w_ref[:, cols] = mm(x, kgb_ref[:, cols].astype(F32), F32, exact).astype(w_ref.dtype)


def intra_forward(qe, kq, ke, tot, v, beta, reset, *, scale, lower_bound, save=True, invert_diagonal=False,
                  options=DEFAULT):
  """The intra pass on `prepare`'s outputs: the key-tile launch (`_key_tile_kernel`),
  then the solve (Mosaic GPU's on Hopper for bf16, else `_solve_kernel`). qe, kq, ke `[B,T,H,K]`, tot, β from
  `prepare`, v `[B,T,H,V]`, reset `[B,T]` int32 or None, T a multiple of 64. Returns the `IntraOutputs`: W, U, the
  scaled decayed queries Qs, the keys decayed to the chunk end Kd (input dtype), A_qk (input dtype), the chunks'
  state decay (fp32 `[B,N,H,K]`: e^{G_C}, zero where a document starts inside the chunk), B = A_kk/β (fp32) and,
  with `save` (for the backward), M = (I + A_kk)⁻¹ (fp32 `[B,T,H,64]`, row i holds row i of its chunk's matrix;
  None otherwise). `options.solve`: "triton" (`_solve_kernel`), "mosaic" (`solve_mosaic.solve`, bf16 on Hopper) or None
  (the Mosaic solve where `solve_mosaic.available`); `options.key_tiles_block_k`, `solve_block_cols` and the two
  launches as there. `invert_diagonal` (the Mosaic solve without `save` only): the key tiles invert B's 16x16
  diagonal blocks and the solve starts from them (two doubling steps instead of six steps); the B returned then
  holds those inverses on its diagonal blocks."""
  B, T, H, K = qe.shape
  V = v.shape[-1]
  solve = solve_used(options, qe.dtype, K, V)
  if invert_diagonal and (save or solve != "mosaic"):
    raise ValueError("intra_forward: invert_diagonal needs the Mosaic solve and save=False")
  N = T // CHUNK
  dt = qe.dtype
  block_k = options.key_tiles_block_k or min(K, 32)
  if K % block_k or block_k % SUB:
    raise ValueError(f"intra_forward: key_tiles_block_k={block_k} must be a multiple of {SUB} dividing K={K}")
  row = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda i, bh, n: (bh // H, n, bh % H, 0))
  tile = lambda d: pl.BlockSpec((None, SUB, None, d), lambda i, bh, n: (bh // H, n * NT + i, bh % H, 0))
  shape = lambda d, dtype=dt: jax.ShapeDtypeStruct((B, T, H, d), dtype)
  resets = [] if reset is None else [reset]
  outs = [shape(CHUNK), shape(CHUNK, F32)] + [shape(K)] * 3 + [jax.ShapeDtypeStruct((B, N, H, K), F32)]
  out_specs = [tile(CHUNK), tile(CHUNK)] + [tile(K)] * 3 + [
      pl.BlockSpec((None, None, None, K), lambda i, bh, n: (bh // H, n, bh % H, 0))]
  mosaic = solve == "mosaic"
  if mosaic:
    outs.append(jax.ShapeDtypeStruct((B, H, T), F32))
    out_specs.append(pl.BlockSpec((None, None, SUB), lambda i, bh, n: (bh // H, bh % H, n * NT + i)))
  aqk, kk, qs, kd, kgb, decay, *beta_t = triton_call(
      functools.partial(_key_tile_kernel, scale=scale, lower_bound=lower_bound, has_reset=reset is not None,
                        dtype=dt, block_k=block_k, invert_diagonal=invert_diagonal, beta_by_head=mosaic),
      grid=(NT, B * H, N),
      in_specs=[tile(K), tile(K), row(K), pl.BlockSpec((None, NT, None, K), lambda i, bh, n: (bh // H, n, bh % H, 0)),
                pl.BlockSpec((None, SUB, None), lambda i, bh, n: (bh // H, n * NT + i, bh % H))]
      + [pl.BlockSpec((None, CHUNK), lambda i, bh, n: (bh // H, n))] * len(resets),
      out_specs=out_specs, out_shape=outs, name="kda_intra_fwd_key_tiles",
      **options.launch("intra_fwd_key_tiles")._asdict())(qe, kq, ke, tot, beta, *resets)
  if mosaic:
    w, u, minv = solve_mosaic.solve(beta_t[0], kk, kgb, v, save=save, diagonal_inverted=invert_diagonal)
    return IntraOutputs(w, u, qs, kd, aqk, decay, kk, minv)
  bc = options.solve_block_cols
  bc = bc if K % bc == 0 and V % bc == 0 else min(K, V)
  row2 = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda bh, n: (bh // H, n, bh % H, 0))
  out_shape, out_specs = [shape(K), shape(V)], [row2(K), row2(V)]
  if save:
    out_shape, out_specs = out_shape + [shape(CHUNK, F32)], out_specs + [row2(CHUNK)]
  w, u, *minv = triton_call(
      functools.partial(_solve_kernel, exact=dt == F32, block_cols=bc, save=save), grid=(B * H, N),
      in_specs=[pl.BlockSpec((None, CHUNK, None), lambda bh, n: (bh // H, n, bh % H)), row2(CHUNK), row2(K),
                row2(V)],
      out_specs=out_specs, out_shape=out_shape, name="kda_intra_fwd_solve",
      **options.launch("intra_fwd_solve")._asdict())(beta, kk, kgb, v)
  return IntraOutputs(w, u, qs, kd, aqk, decay, kk, minv[0] if save else None)


def solve_used(options, dtype, K, V):
  """The solve `intra_forward` runs under `options`: "mosaic" or "triton"; asked for Mosaic GPU's with inputs it
  cannot take, or given the Triton solve's launch with Mosaic GPU's, it raises before any compute."""
  solve = options.solve or ("mosaic" if solve_mosaic.available(dtype, K, V) else "triton")
  if solve == "mosaic":
    solve_mosaic.check_supported(dtype, K, V)
    if options.intra_fwd_solve is not None:
      raise ValueError("KDAKernelOptions.intra_fwd_solve is the Triton solve's launch; the Mosaic GPU solve runs here")
  return solve


def walk_chunks(num_chunks, step, S, decay_ref, reverse=False):
  """S <- step(n, S, decay_row) over the chunks n (last to first with `reverse`), decay_row chunk n's state decay
  ([1,K], as loaded) read first in the chunk: Triton pipelines only loads that feed products, and this one, issued
  where used, was waited for in every chunk (loaded a chunk ahead, it was slower still)."""
  chunk = (lambda i: num_chunks - 1 - i) if reverse else (lambda i: i)
  return jax.lax.fori_loop(0, num_chunks, lambda i, S: step(chunk(i), S, decay_ref[pl.ds(chunk(i), 1), :]), S)


def _state_step(n, S_KV, decay_row, w_ref, u_ref, kd_ref, dtype, u_scale=None):
  """One chunk of the recurrence: (the state entering chunk n as the products' operand, v_new, the state after).
  `u_scale` (a traced 0 or 1) multiplies U, for the segment maps' identity columns."""
  rows = pl.ds(n * CHUNK, CHUNK)
  S_in = S_KV.astype(dtype)
  u = u_ref[rows, :].astype(F32)
  v_new = (u if u_scale is None else u_scale * u) - mm(w_ref[rows, :], S_in, dtype)
  return S_in, v_new, decay_row.astype(F32).T * S_KV + t_mm(kd_ref[rows, :], v_new, dtype)


def _state_kernel(w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref, *refs, num_chunks, save, dtype, has_start):
  s0_ref, (o_ref, sT_ref, *saved) = (refs[0], refs[1:]) if has_start else (None, refs)

  def body(n, S_KV, decay_row):
    rows = pl.ds(n * CHUNK, CHUNK)
    S_in, v_new, S_next = _state_step(n, S_KV, decay_row, w_ref, u_ref, kd_ref, dtype)
    if save:
      h_ref, vn_ref = saved
      h_ref[pl.ds(n * S_KV.shape[0], S_KV.shape[0]), :] = S_in.astype(h_ref.dtype)
      vn_ref[rows, :] = v_new.astype(vn_ref.dtype)
    o = mm(qs_ref[rows, :], S_in, dtype) + mm(aqk_ref[rows, :], v_new, dtype)
    o_ref[rows, :] = o.astype(o_ref.dtype)
    return S_next

  S = s0_ref[...].astype(F32) if has_start else jnp.zeros(sT_ref.shape, F32)
  sT_ref[...] = walk_chunks(num_chunks, body, S, decay_ref)


def _segment_map_kernel(w_ref, u_ref, kd_ref, decay_ref, ends_ref, *, num_chunks, value_blocks, dtype):
  """The state at a segment's end as an affine map of its start, S -> A S + F: column blocks below `value_blocks`
  run the recurrence on u from zero (F), the others on zero values from the identity's columns (A = the product of
  the chunks' diag(decay) - Kdᵀ W)."""
  K, block_v = ends_ref.shape
  vb = pl.program_id(0)
  keep = (vb < value_blocks).astype(F32)
  # The identity's columns (vb - value_blocks) * block_v onwards; none in the value blocks (negative offsets).
  S0 = jnp.where(iota((K, block_v), 0) == iota((K, block_v), 1) + (vb - value_blocks) * block_v, 1.0, 0.0)

  step = lambda n, S_KV, decay_row: _state_step(n, S_KV, decay_row, w_ref, u_ref, kd_ref, dtype, u_scale=keep)[2]
  ends_ref[...] = walk_chunks(num_chunks, step, S0, decay_ref)


class StateSpecs:
  """Blocks of the sequential passes, grid (V/block_v, B·H) or (V/block_v, B·H, segments): one program per (column
  block, batch·head, segment) walks every chunk of its segment (of the whole sequence with one segment)."""

  def __init__(self, H, T, K, block_v, segments=1):
    Ts = T // segments
    self.whole = lambda d: pl.BlockSpec((None, Ts, None, d), lambda vb, bh, s=0: (bh // H, s, bh % H, 0))
    self.vcols = pl.BlockSpec((None, Ts, None, block_v), lambda vb, bh, s=0: (bh // H, s, bh % H, vb))
    self.state = pl.BlockSpec((None, None, K, block_v), lambda vb, bh: (bh // H, bh % H, 0, vb))
    self.segment_state = pl.BlockSpec((None, None, None, K, block_v),
                                      lambda vb, bh, s: (bh // H, bh % H, s, 0, vb))
    self.per_chunk_state = pl.BlockSpec((None, None, Ts // CHUNK * K, block_v),
                                        lambda vb, bh, s=0: (bh // H, bh % H, s, vb))
    self.decay = pl.BlockSpec((None, Ts // CHUNK, None, K), lambda vb, bh, s=0: (bh // H, s, bh % H, 0))


def state_forward(w, u, qs, kd, aqk, decay, S0, *, block_v, save=False, segments=1, options=DEFAULT):
  """The sequential pass over chunks: v_new = U − W S, o = Qs S + A_qk v_new, S ← decay ⊙ S + Kdᵀ v_new.

  Each program owns `block_v` columns of the state of one (batch, head): columns evolve independently. With
  `segments` > 1 the chunks are cut into that many runs, each walked by its own programs from its true starting
  state (`segment_starts`): at long T, B·H·V/block_v programs each walking every chunk leave the GPU mostly idle.
  Returns (o, final state); with `save=True` also the backward's residuals: the states entering each chunk
  `[B,H,N·K,V]` and v_new `[B,T,H,V]`, in the input dtype. S0 None: zeros. `options.state_pass`: the Mosaic GPU pass
  (`state_mosaic`, wgmma) or the Triton one, None: Mosaic GPU's where `state_mosaic.available`; `options.state_fwd`
  and `state_segment_maps`: the Triton launches.
  """
  B, T, H, K = w.shape
  V = u.shape[-1]
  N = T // CHUNK
  if N % segments:
    raise ValueError(f"state_forward: segments={segments} must divide the {N} chunks")
  dt = w.dtype
  if segments > 1:   # XLA's scan gives each segment its start
    S0 = segment_starts(w, u, kd, decay, jnp.zeros((B, H, K, V), F32) if S0 is None else S0, segments=segments,
                        block_v=block_v, options=options)
  elif S0 is not None:
    S0 = S0[:, :, None]
  starts = [] if S0 is None else [S0.astype(F32)]
  if state_mosaic.chosen(dt, K, V, block_v, options.state_pass, options.state_fwd):
    o, ends, *saved = state_mosaic.state_forward(w, u, qs, kd, aqk, decay, starts[0] if starts else None, save=save,
                                                 segments=segments)
    return (o, ends[:, :, -1], *saved)
  sp = StateSpecs(H, T, K, block_v, segments)
  in_specs = [sp.whole(K), sp.vcols, sp.whole(K), sp.whole(K), sp.whole(CHUNK), sp.decay]
  in_specs += [sp.segment_state] * len(starts)
  out_shape = [jax.ShapeDtypeStruct((B, T, H, V), dt), jax.ShapeDtypeStruct((B, H, segments, K, V), F32)]
  out_specs = [sp.vcols, sp.segment_state]
  if save:
    out_shape += [jax.ShapeDtypeStruct((B, H, N * K, V), dt), jax.ShapeDtypeStruct((B, T, H, V), dt)]
    out_specs += [sp.per_chunk_state, sp.vcols]
  kernel = functools.partial(_state_kernel, num_chunks=N // segments, save=save, dtype=dt, has_start=bool(starts))
  o, ends, *saved = triton_call(kernel, grid=(V // block_v, B * H, segments), in_specs=in_specs,
                                out_specs=out_specs, out_shape=out_shape, name="kda_state_fwd",
                                **options.launch("state_fwd")._asdict())(w, u, qs, kd, aqk, decay, *starts)
  return (o, ends[:, :, -1], *saved)


def segment_starts(w, u, kd, decay, S0, *, segments, block_v, options=DEFAULT):
  """[B,H,segments,K,V] fp32: the state entering each segment. One parallel pass gives each segment's map
  S -> A S + F (`_segment_map_kernel`); an associative scan over segments then composes them (log2(segments)
  rounds of batched K x K products, fp32)."""
  B, T, H, K = w.shape
  V = u.shape[-1]
  sp = StateSpecs(H, T, K, block_v, segments)
  value_blocks = V // block_v
  u_spec = pl.BlockSpec((None, T // segments, None, block_v),
                        lambda vb, bh, s: (bh // H, s, bh % H, jnp.minimum(vb, value_blocks - 1)))
  kernel = functools.partial(_segment_map_kernel, num_chunks=T // CHUNK // segments, value_blocks=value_blocks,
                             dtype=w.dtype)
  ends = triton_call(kernel, grid=((V + K) // block_v, B * H, segments),
                     in_specs=[sp.whole(K), u_spec, sp.whole(K), sp.decay], out_specs=sp.segment_state,
                     out_shape=jax.ShapeDtypeStruct((B, H, segments, K, V + K), F32), name="kda_state_segment_maps",
                     **options.launch("state_segment_maps")._asdict())(w, u, kd, decay)
  F, A = ends[..., :V], ends[..., V:]
  hi = jax.lax.Precision.HIGHEST

  def compose(first, then):   # S -> A2 (A1 S + F1) + F2
    (A1, F1), (A2, F2) = first, then
    return jnp.matmul(A2, A1, precision=hi), jnp.matmul(A2, F1, precision=hi) + F2

  A_to, F_to = jax.lax.associative_scan(compose, (A, F), axis=2)
  S0 = S0.astype(F32)[:, :, None]
  after = jnp.matmul(A_to[:, :, :-1], S0, precision=hi) + F_to[:, :, :-1]
  return jnp.concatenate([S0, after], axis=2)
