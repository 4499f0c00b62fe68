"""Forward kernels: the parallel intra-chunk pass and the sequential state pass that also writes the output."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import barrier, triton_call
from pallas_kernels.kda.tiles import (CHUNK, F32, NT, SUB, Gates, iota, load,
                                      masked, mm, mm_t, store, store_block_diagonal, t_mm,
                                      unit_lower_inverse, unit_lower_inverse_16, write_tile_cumsum)


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, lower_bound, has_reset, dtype):
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref, kk_ref, minv_ref, loc_ref = refs
  gates = Gates(write_tile_cumsum(g_ref, loc_ref), reset_ref, lower_bound)
  kek = load(k_ref) * gates.e_k()                                        # keys, each against its own tile's anchor
  exact = dtype == F32

  # 1. Rows of A_qk and of B = A_kk/β: query tile I against the chunk's keys scaled for anchor I. The diagonal
  #    block of (I + βB) is inverted here; the rest of βB's row is kept for the substitution below.
  M_diag, A_off = [], []
  for i in range(NT):
    e_q = gates.e_q(i)
    q_i, k_i, beta_i = load(q_ref, i), load(k_ref, i), load(beta_ref, i)[:, None]
    keys = kek * gates.anchor_scale(i)
    store(aqk_ref, i, masked(scale * mm_t(q_i * e_q, keys, dtype), gates.row_mask(i, False)))
    b_row = masked(mm_t(k_i * e_q, keys, dtype), gates.row_mask(i, True))
    store(kk_ref, i, b_row)
    b_diag = masked(mm_t(k_i * e_q, k_i / e_q, dtype), gates.diag_mask(i))    # e^{c - loc} = 1 / e_q
    M_diag.append(unit_lower_inverse_16(beta_i * b_diag))
    A_off.append(jnp.where(iota((SUB, CHUNK), 1) < i * SUB, beta_i * b_row, 0.0))
  gamma = gates.gamma()
  store(qs_ref, None, scale * load(q_ref) * gamma)
  store(kd_ref, None, load(k_ref) * gates.to_end(gates.e_k()))
  decay_ref[...] = gates.decay().reshape(decay_ref.shape)

  # 2. M = (I + βB)⁻¹ in memory: diagonal blocks (zeros above), then block rows by forward substitution,
  #    M[I, :I] = −M_II Σ_{P<I} A_IP M[P, :], each row reading the rows finished before it.
  store_block_diagonal(minv_ref, M_diag)
  barrier()
  for i in range(1, NT):
    row = -mm(M_diag[i], mm(A_off[i], load(minv_ref), F32, exact), F32, exact)
    store(minv_ref, i, jnp.where(iota((SUB, CHUNK), 1) < i * SUB, row, load(minv_ref, i)))
    barrier()

  # 3. U = M βV and W = M βΓK, with M unrounded (tf32 on bf16 inputs): rows of M can nearly cancel (keys that
  #    repeat), and bf16 operands then cost ~10x the error.
  M = load(minv_ref)
  beta = load(beta_ref)[:, None]
  store(u_ref, None, mm(M, beta * load(v_ref), F32, exact))
  store(w_ref, None, mm(M, beta * gamma * load(k_ref), F32, exact))


def _rows_by_key_tile_kernel(q_ref, k_ref, g_ref, *refs, scale, lower_bound, has_reset, dtype):
  """v8, first launch, one program per chunk: the gates' cumulative sums per tile (which the later launches and the
  backward read), the rows of A_qk and B, the scaled decayed queries and the keys decayed to the chunk end. Column
  block J of A_qk and B is the chunk's queries (keys), scaled for anchor R_J and zero above tile J, times key tile J
  (a 64x16xK product; v7 took 64x64xK per anchor and kept a quarter, 8% slower, BUILD_NOTES KDA run 8):
  e^{G_i - G_j} = e^{loc_i - c} e^{R_I - R_J} e^{c - loc_j}, the middle factor at most 1 and the outer two within
  e^{±8|γ_min|}."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  aqk_ref, kk_ref, qs_ref, kd_ref, loc_ref = refs
  gates = Gates(write_tile_cumsum(g_ref, loc_ref), reset_ref, lower_bound)
  store(qs_ref, None, scale * load(q_ref) * gates.gamma())
  store(kd_ref, None, load(k_ref) * gates.to_end(gates.e_k()))
  e_q = gates.e_q()
  q_e, k_e = load(q_ref) * e_q, load(k_ref) * e_q
  for j in range(NT):
    key_tile = (load(k_ref, j) * gates.e_k(j)).astype(dtype)
    s = gates.anchor_scale_t(j)
    cols = (slice(None), pl.ds(j * SUB, SUB))
    aqk_ref[cols] = jnp.where(gates.column_mask(j, False), scale * mm_t(q_e * s, key_tile, dtype),
                              0.0).astype(aqk_ref.dtype)
    kk_ref[cols] = jnp.where(gates.column_mask(j, True), mm_t(k_e * s, key_tile, dtype), 0.0).astype(kk_ref.dtype)


def _solve_kernel(loc_ref, beta_ref, kk_ref, k_ref, v_ref, *refs, lower_bound, has_reset, exact, block_cols):
  """Second and last launch, one program per chunk: M = (I + βB)⁻¹ (`unit_lower_inverse`), then U = M βV and
  W = M βΓK from M in registers, `block_cols` columns at a time, M unrounded (tf32 on bf16 inputs, as v3); and the
  chunk's state decay. (v6 split this in three launches, 0.79 ms against 0.72 at 8×4096, BUILD_NOTES KDA run 8.)"""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  minv_ref, decay_ref, w_ref, u_ref = refs
  x = unit_lower_inverse(load(beta_ref)[:, None] * load(kk_ref), exact)
  store(minv_ref, None, x)
  beta = load(beta_ref)[:, None]
  for c in range(v_ref.shape[-1] // block_cols):
    cols = pl.ds(c * block_cols, block_cols)
    u_ref[:, cols] = mm(x, beta * v_ref[:, cols].astype(F32), F32, exact).astype(u_ref.dtype)
  for c in range(k_ref.shape[-1] // block_cols):
    cols = pl.ds(c * block_cols, block_cols)
    gates = Gates(loc_ref, reset_ref, lower_bound, cols)
    w_ref[:, cols] = mm(x, beta * gates.gamma() * k_ref[:, cols].astype(F32), F32, exact).astype(w_ref.dtype)
    decay_ref[cols] = gates.decay().reshape(block_cols)


def _intra_forward_launches(q, k, v, g, beta, reset, *, scale, lower_bound, num_warps, block_cols=64):
  """v8: two launches instead of one kernel at the register limit: the rows (`_rows_by_key_tile_kernel`), then the
  inverse with U and W (`_solve_kernel`)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  N = T // CHUNK
  dt = q.dtype
  row = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda n, bh: (bh // H, n, bh % H, 0))
  tok = pl.BlockSpec((None, CHUNK, None), lambda n, bh: (bh // H, n, bh % H))
  shape = lambda d, dtype=dt: jax.ShapeDtypeStruct((B, T, H, d), dtype)
  resets = [] if reset is None else [reset]
  reset_specs = [pl.BlockSpec((None, CHUNK), lambda n, bh: (bh // H, n))] * len(resets)
  flags = dict(lower_bound=lower_bound, has_reset=reset is not None)
  aqk, kk, qs, kd, loc = triton_call(
      functools.partial(_rows_by_key_tile_kernel, scale=scale, dtype=dt, **flags), grid=(N, B * H),
      in_specs=[row(K), row(K), row(K)] + reset_specs, out_specs=[row(d) for d in (CHUNK, CHUNK, K, K, K)],
      out_shape=[shape(CHUNK), shape(CHUNK, F32), shape(K), shape(K), shape(K, F32)], name="kda_intra_fwd_rows",
      num_warps=num_warps, num_stages=1)(q, k, g, *resets)
  bc = block_cols if K % block_cols == 0 and V % block_cols == 0 else min(K, V)
  minv, decay, w, u = triton_call(
      functools.partial(_solve_kernel, exact=dt == F32, block_cols=bc, **flags), grid=(N, B * H),
      in_specs=[row(K), tok, row(CHUNK), row(K), row(V)] + reset_specs,
      out_specs=[row(CHUNK), pl.BlockSpec((None, None, None, K), lambda n, bh: (bh // H, n, bh % H, 0)), row(K),
                 row(V)],
      out_shape=[shape(CHUNK, F32), jax.ShapeDtypeStruct((B, N, H, K), F32), shape(K), shape(V)],
      name="kda_intra_fwd_solve", num_warps=4, num_stages=1)(loc, beta, kk, k, v, *resets)
  return w, u, qs, kd, aqk, decay, kk, minv, loc


def intra_forward(q, k, v, g, beta, reset, *, scale, lower_bound, num_warps=None, variant="v8"):
  """Per chunk: W, U, scaled decayed queries, keys decayed to the chunk end, A_qk, and the chunk's state decay;
  and for the backward B = A_kk/β, M = (I + A_kk)⁻¹ (fp32, `[B,T,H,64]`: row i holds row i of its chunk's matrix)
  and the gates' cumulative sums per 16-token tile (`loc`, fp32 `[B,T,H,K]`), which every later kernel reads
  instead of g.

  Shapes: q,k,g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, reset `[B,T]` int32 or None, T a multiple of 64.
  Returns w, u, qs, kd, aqk, decay `[B,N,H,K]` fp32, kk, minv, loc. `variant`: "v8" (two launches,
  `_intra_forward_launches`; checked and timed on the H200, BUILD_NOTES KDA run 9) or "v3" (one kernel, M through
  memory row by row: the reference the tests hold v8 to); same outputs. `num_warps` (of the first launch): 8 when
  None, the fastest on the H200 (run 9: 1.58 ms at 8x4096 against 1.95 with 4 and 1.78 with 16).
  """
  if variant not in ("v3", "v8"):
    raise ValueError(f"intra_forward: variant must be 'v3' or 'v8', got {variant!r}")
  num_warps = num_warps or 8
  if variant == "v8":
    return _intra_forward_launches(q, k, v, g, beta, reset, scale=scale, lower_bound=lower_bound,
                                   num_warps=num_warps)
  B, T, H, K = q.shape
  V = v.shape[-1]
  N = T // CHUNK
  dt = q.dtype
  row = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda n, bh: (bh // H, n, bh % H, 0))
  in_specs = [row(K), row(K), row(V), row(K), pl.BlockSpec((None, CHUNK, None), lambda n, bh: (bh // H, n, bh % H))]
  args = [q, k, v, g, beta]
  if reset is not None:
    in_specs.append(pl.BlockSpec((None, CHUNK), lambda n, bh: (bh // H, n)))
    args.append(reset)
  shape = lambda d, dtype=dt: jax.ShapeDtypeStruct((B, T, H, d), dtype)
  out_shape = [shape(K), shape(V), shape(K), shape(K), shape(CHUNK), jax.ShapeDtypeStruct((B, N, H, K), F32),
               shape(CHUNK, F32), shape(CHUNK, F32), shape(K, F32)]
  out_specs = [row(K), row(V), row(K), row(K), row(CHUNK),
               pl.BlockSpec((None, None, None, K), lambda n, bh: (bh // H, n, bh % H, 0)), row(CHUNK), row(CHUNK),
               row(K)]
  kernel = functools.partial(_intra_kernel, scale=scale, lower_bound=lower_bound, has_reset=reset is not None, dtype=dt)
  return triton_call(kernel, grid=(N, B * H), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                     name="kda_intra_fwd", num_warps=num_warps,
                     num_stages=1)(*args)


def _state_step(n, S_KV, w_ref, u_ref, kd_ref, decay_ref, dtype, u_scale=None):
  """One chunk of the recurrence: (the state entering chunk n as the products' operand, v_new, the state after).
  `u_scale` (a traced 0 or 1) multiplies U, for the segment maps' identity columns."""
  rows = pl.ds(n * CHUNK, CHUNK)
  S_in = S_KV.astype(dtype)
  u = u_ref[rows, :].astype(F32)
  v_new = (u if u_scale is None else u_scale * u) - mm(w_ref[rows, :], S_in, dtype)
  decay = decay_ref[pl.ds(n, 1), :].astype(F32).T
  return S_in, v_new, decay * S_KV + t_mm(kd_ref[rows, :], v_new, dtype)


def _state_kernel(w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref, s0_ref, *out_refs, num_chunks, save, dtype):
  o_ref, sT_ref, *saved = out_refs

  def body(n, S_KV):
    rows = pl.ds(n * CHUNK, CHUNK)
    S_in, v_new, S_next = _state_step(n, S_KV, w_ref, u_ref, kd_ref, decay_ref, dtype)
    if save:
      h_ref, vn_ref = saved
      h_ref[pl.ds(n * S_KV.shape[0], S_KV.shape[0]), :] = S_in.astype(h_ref.dtype)
      vn_ref[rows, :] = v_new.astype(vn_ref.dtype)
    o = mm(qs_ref[rows, :], S_in, dtype) + mm(aqk_ref[rows, :], v_new, dtype)
    o_ref[rows, :] = o.astype(o_ref.dtype)
    return S_next

  sT_ref[...] = jax.lax.fori_loop(0, num_chunks, body, s0_ref[...].astype(F32))


def _segment_map_kernel(w_ref, u_ref, kd_ref, decay_ref, ends_ref, *, num_chunks, value_blocks, dtype):
  """The state at a segment's end as an affine map of its start, S -> A S + F: column blocks below `value_blocks`
  run the recurrence on u from zero (F), the others on zero values from the identity's columns (A = the product of
  the chunks' diag(decay) - Kdᵀ W)."""
  K, block_v = ends_ref.shape
  vb = pl.program_id(0)
  keep = (vb < value_blocks).astype(F32)
  # The identity's columns (vb - value_blocks) * block_v onwards; none in the value blocks (negative offsets).
  S0 = jnp.where(iota((K, block_v), 0) == iota((K, block_v), 1) + (vb - value_blocks) * block_v, 1.0, 0.0)

  body = lambda n, S_KV: _state_step(n, S_KV, w_ref, u_ref, kd_ref, decay_ref, dtype, u_scale=keep)[2]
  ends_ref[...] = jax.lax.fori_loop(0, num_chunks, body, S0)


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


def state_forward(w, u, qs, kd, aqk, decay, S0, *, block_v, save=False, num_warps=None, segments=1):
  """The sequential pass over chunks: v_new = U − W S, o = Qs S + A_qk v_new, S ← decay ⊙ S + Kdᵀ v_new.

  Each program owns `block_v` columns of the state of one (batch, head): columns evolve independently. With
  `segments` > 1 the chunks are cut into that many runs, each walked by its own programs from its true starting
  state (`segment_starts`): at long T, B·H·V/block_v programs each walking every chunk leave the GPU mostly idle.
  Returns (o, final state); with `save=True` also the backward's residuals: the states entering each chunk
  `[B,H,N·K,V]` and v_new `[B,T,H,V]`, in the input dtype.
  """
  B, T, H, K = w.shape
  V = u.shape[-1]
  N = T // CHUNK
  if N % segments:
    raise ValueError(f"state_forward: segments={segments} must divide the {N} chunks")
  dt = w.dtype
  starts = (S0[:, :, None] if segments == 1 else
            segment_starts(w, u, kd, decay, S0, segments=segments, block_v=block_v))
  sp = StateSpecs(H, T, K, block_v, segments)
  in_specs = [sp.whole(K), sp.vcols, sp.whole(K), sp.whole(K), sp.whole(CHUNK), sp.decay, sp.segment_state]
  out_shape = [jax.ShapeDtypeStruct((B, T, H, V), dt), jax.ShapeDtypeStruct((B, H, segments, K, V), F32)]
  out_specs = [sp.vcols, sp.segment_state]
  if save:
    out_shape += [jax.ShapeDtypeStruct((B, H, N * K, V), dt), jax.ShapeDtypeStruct((B, T, H, V), dt)]
    out_specs += [sp.per_chunk_state, sp.vcols]
  kernel = functools.partial(_state_kernel, num_chunks=N // segments, save=save, dtype=dt)
  num_warps = num_warps or 4   # 4 beat 8 at every column block on the H200 (run 9)
  o, ends, *saved = triton_call(kernel, grid=(V // block_v, B * H, segments), in_specs=in_specs,
                                out_specs=out_specs, out_shape=out_shape, name="kda_state_fwd", num_warps=num_warps,
                                num_stages=2)(w, u, qs, kd, aqk, decay, starts)
  return (o, ends[:, :, -1], *saved)


def segment_starts(w, u, kd, decay, S0, *, segments, block_v):
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
                     num_warps=4, num_stages=2)(w, u, kd, decay)
  F, A = ends[..., :V], ends[..., V:]
  hi = jax.lax.Precision.HIGHEST

  def compose(first, then):   # S -> A2 (A1 S + F1) + F2
    (A1, F1), (A2, F2) = first, then
    return jnp.matmul(A2, A1, precision=hi), jnp.matmul(A2, F1, precision=hi) + F2

  A_to, F_to = jax.lax.associative_scan(compose, (A, F), axis=2)
  S0 = S0.astype(F32)[:, :, None]
  after = jnp.matmul(A_to[:, :, :-1], S0, precision=hi) + F_to[:, :, :-1]
  return jnp.concatenate([S0, after], axis=2)
