"""Forward kernels: the parallel intra-chunk pass and the sequential state pass that also writes the output."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import barrier, triton_call
from pallas_kernels.kda.tiles import (CHUNK, F32, NT, SUB, Gates, TileGates, iota, load,
                                      masked, mm, mm_t, store, store_block_diagonal, t_mm, tile_of_row,
                                      unit_lower_inverse_16)


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, lower_bound, has_reset, dtype):
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref, kk_ref, minv_ref = refs
  gates = Gates(g_ref, reset_ref, lower_bound)
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


def _rows_kernel(q_ref, k_ref, g_ref, *refs, scale, lower_bound, has_reset, dtype):
  """v5, first launch, one program per query tile: its rows of A_qk and B against the chunk's keys for its anchor,
  and its rows of the scaled decayed queries and of the keys decayed to the chunk end."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  aqk_ref, kk_ref, qs_ref, kd_ref = refs
  i = pl.program_id(2)
  tg = TileGates(g_ref, reset_ref, i, lower_bound)
  keys = load(k_ref) * tg.keys_factor()
  q_i, k_i = load(q_ref, i), load(k_ref, i)
  e_q = tg.e_q()
  store(aqk_ref, None, jnp.where(tg.row_mask(False), scale * mm_t(q_i * e_q, keys, dtype), 0.0))
  store(kk_ref, None, jnp.where(tg.row_mask(True), mm_t(k_i * e_q, keys, dtype), 0.0))
  store(qs_ref, None, scale * q_i * tg.gamma())
  store(kd_ref, None, k_i * tg.to_end())


def _rows_chunk_kernel(q_ref, k_ref, g_ref, *refs, scale, lower_bound, has_reset, dtype):
  """v6, first launch, one program per chunk: v5's rows for all four query tiles, the gates loaded and summed once.
  Each anchor's product takes all 64 rows (a 64-row GEMM, not a 16-row one) and keeps its own tile's: the other
  rows' factors also stay within e^{±8|γ_min|}, and a row that overflows anyway (unnormalised q, k) is discarded
  whole, as each output element is its own sum."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  aqk_ref, kk_ref, qs_ref, kd_ref = refs
  gates = Gates(g_ref, reset_ref, lower_bound)
  e_k = gates.e_k()
  store(qs_ref, None, scale * load(q_ref) * gates.gamma())     # first: fewer values live through the products
  store(kd_ref, None, load(k_ref) * gates.to_end(e_k))
  e_q = gates.e_q()
  q_e, k_e, kek = (load(q_ref) * e_q).astype(dtype), (load(k_ref) * e_q).astype(dtype), load(k_ref) * e_k
  t = tile_of_row()
  aqk = kk = jnp.zeros((CHUNK, CHUNK), F32)
  for i in range(NT):
    keys = kek * gates.anchor_scale(i)
    aqk = jnp.where(t == i, mm_t(q_e, keys, dtype), aqk)
    kk = jnp.where(t == i, mm_t(k_e, keys, dtype), kk)
  store(aqk_ref, None, jnp.where(gates.chunk_mask(False), scale * aqk, 0.0))
  store(kk_ref, None, jnp.where(gates.chunk_mask(True), kk, 0.0))


def _inverse_kernel(g_ref, beta_ref, kk_ref, *refs, lower_bound, has_reset, exact):
  """v5, second launch, one program per chunk: M = (I + βB)⁻¹ and the chunk's state decay. Exact diagonal blocks by
  substitution, through memory as v3's (a batched 64-row substitution took XLA's Triton pipeline 70 s to compile on
  the H200, BUILD_NOTES KDA run 7); then the off-diagonal blocks by two doubling steps X ← X − X L X, with L the
  blocks of βB between the 16-row halves of each 32-row half, then between the 32-row halves."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  minv_ref, decay_ref = refs
  diag = lambda i: kk_ref[pl.ds(i * SUB, SUB), pl.ds(i * SUB, SUB)].astype(F32)
  store_block_diagonal(minv_ref, [unit_lower_inverse_16(load(beta_ref, i)[:, None] * diag(i)) for i in range(NT)])
  barrier()
  a = load(beta_ref)[:, None] * load(kk_ref)
  tr, tc = tile_of_row(), iota((1, CHUNK), 1) // SUB
  x = load(minv_ref)
  for outside in ((tr // 2 == tc // 2) & (tr != tc), tr // 2 != tc // 2):
    x = x - mm(x, mm(jnp.where(outside, a, 0.0), x, F32, exact), F32, exact)
  store(minv_ref, None, x)
  decay_ref[...] = Gates(g_ref, reset_ref, lower_bound).decay().reshape(decay_ref.shape)


def _apply_kernel(minv_ref, beta_ref, x_ref, *refs, lower_bound, has_gamma, has_reset, exact):
  """v5, third launch (twice), one program per chunk and column block: U = M βV, or W = M βΓK with Γ = e^{G} of
  the block's columns; M unrounded, as v3."""
  refs = list(refs)
  g_ref = refs.pop(0) if has_gamma else None
  reset_ref = refs.pop(0) if has_reset and has_gamma else None
  out_ref, = refs
  x = load(beta_ref)[:, None] * load(x_ref)
  if has_gamma:
    x = x * Gates(g_ref, reset_ref, lower_bound).gamma(scan=True)
  store(out_ref, None, mm(load(minv_ref), x, F32, exact))


def _intra_forward_v5(q, k, v, g, beta, reset, *, scale, lower_bound, num_warps, block_cols=64, chunk_rows=False):
  """Four lighter launches instead of one kernel at the register limit: rows of A_qk / B per query tile (grid
  chunks × heads × 4; with `chunk_rows`, v6, per chunk), the inverse per chunk, then U and W per chunk and block of
  `block_cols` columns."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  N = T // CHUNK
  dt = q.dtype
  row = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda n, bh, *_: (bh // H, n, bh % H, 0))
  tile = lambda d: pl.BlockSpec((None, SUB, None, d), lambda n, bh, i: (bh // H, n * NT + i, bh % H, 0))
  tok = pl.BlockSpec((None, CHUNK, None), lambda n, bh, *_: (bh // H, n, bh % H))
  shape = lambda d, dtype=dt: jax.ShapeDtypeStruct((B, T, H, d), dtype)
  resets = [] if reset is None else [reset]
  reset_specs = [pl.BlockSpec((None, CHUNK), lambda n, bh, *_: (bh // H, n))] * len(resets)
  flags = dict(lower_bound=lower_bound, has_reset=reset is not None)
  exact = dt == F32
  rows_kernel, grid, out_block, name = ((_rows_chunk_kernel, (N, B * H), row, "kda_intra_fwd_v6_rows") if chunk_rows
                                       else (_rows_kernel, (N, B * H, NT), tile, "kda_intra_fwd_v5_rows"))
  aqk, kk, qs, kd = triton_call(
      functools.partial(rows_kernel, scale=scale, dtype=dt, **flags), grid=grid,
      in_specs=[row(K), row(K), row(K)] + reset_specs, out_specs=[out_block(d) for d in (CHUNK, CHUNK, K, K)],
      out_shape=[shape(CHUNK), shape(CHUNK, F32), shape(K), shape(K)], name=name,
      num_warps=num_warps, num_stages=1)(q, k, g, *resets)
  minv, decay = triton_call(
      functools.partial(_inverse_kernel, exact=exact, **flags), grid=(N, B * H),
      in_specs=[row(K), tok, row(CHUNK)] + reset_specs,
      out_specs=[row(CHUNK), pl.BlockSpec((None, None, None, K), lambda n, bh: (bh // H, n, bh % H, 0))],
      out_shape=[shape(CHUNK, F32), jax.ShapeDtypeStruct((B, N, H, K), F32)], name="kda_intra_fwd_v5_inverse",
      num_warps=4, num_stages=1)(g, beta, kk, *resets)

  def apply(x, *gates):
    d = x.shape[-1]
    bc = block_cols if d % block_cols == 0 else d
    cols = pl.BlockSpec((None, CHUNK, None, bc), lambda n, bh, c: (bh // H, n, bh % H, c))
    return triton_call(
        functools.partial(_apply_kernel, has_gamma=bool(gates), exact=exact, **flags),
        grid=(N, B * H, d // bc),
        in_specs=[row(CHUNK), tok, cols] + ([cols] + reset_specs if gates else []), out_specs=cols,
        out_shape=shape(x.shape[-1]), name="kda_intra_fwd_v5_apply", num_warps=4, num_stages=1)(minv, beta, x, *gates)
  return apply(k, g, *resets), apply(v), qs, kd, aqk, decay, kk, minv


def intra_forward(q, k, v, g, beta, reset, *, scale, lower_bound, num_warps=None, variant="v5"):
  """Per chunk: W, U, scaled decayed queries, keys decayed to the chunk end, A_qk, and the chunk's state decay;
  and B = A_kk/β and M = (I + A_kk)⁻¹ (fp32, `[B,T,H,64]`: row i holds row i of its chunk's matrix), which the
  backward reads.

  Shapes: q,k,g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, reset `[B,T]` int32 or None, T a multiple of 64.
  Returns w, u, qs, kd, aqk, decay `[B,N,H,K]` fp32, kk, minv. `variant`: "v5" (four launches,
  `_intra_forward_v5`; checked on the H200 and the fastest, BUILD_NOTES KDA runs 6-7: 3.0 ms at 8×4096), "v6" (v5
  with its first launch per chunk, `_rows_chunk_kernel`; not yet timed on a GPU) or "v3" (one kernel, M through
  memory row by row: the reference the tests hold the others to; 4.4 ms); same outputs. `num_warps`: the variant's
  fastest measured setting when None (v6: a guess).
  """
  if variant not in ("v3", "v5", "v6"):
    raise ValueError(f"intra_forward: variant must be 'v3', 'v5' or 'v6', got {variant!r}")
  num_warps = num_warps or {"v3": 8, "v5": 4, "v6": 8}[variant]
  if variant in ("v5", "v6"):
    return _intra_forward_v5(q, k, v, g, beta, reset, scale=scale, lower_bound=lower_bound, num_warps=num_warps,
                             chunk_rows=variant == "v6")
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
               shape(CHUNK, F32), shape(CHUNK, F32)]
  out_specs = [row(K), row(V), row(K), row(K), row(CHUNK),
               pl.BlockSpec((None, None, None, K), lambda n, bh: (bh // H, n, bh % H, 0)), row(CHUNK), row(CHUNK)]
  kernel = functools.partial(_intra_kernel, scale=scale, lower_bound=lower_bound, has_reset=reset is not None, dtype=dt)
  return triton_call(kernel, grid=(N, B * H), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                     name="kda_intra_fwd", num_warps=num_warps,
                     num_stages=1)(*args)


def _state_kernel(w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref, s0_ref, *out_refs, num_chunks, save, dtype):
  if save:
    sT_ref, h_ref, vn_ref = out_refs
  else:
    o_ref, sT_ref = out_refs

  def body(n, S_KV):
    rows = pl.ds(n * CHUNK, CHUNK)
    S_in = S_KV.astype(dtype)
    v_new = u_ref[rows, :].astype(F32) - mm(w_ref[rows, :], S_in, dtype)
    if save:
      h_ref[pl.ds(n * S_KV.shape[0], S_KV.shape[0]), :] = S_in.astype(h_ref.dtype)
      vn_ref[rows, :] = v_new.astype(vn_ref.dtype)
    else:
      o = mm(qs_ref[rows, :], S_in, dtype) + mm(aqk_ref[rows, :], v_new, dtype)
      o_ref[rows, :] = o.astype(o_ref.dtype)
    decay = decay_ref[pl.ds(n, 1), :].astype(F32).T
    return decay * S_KV + t_mm(kd_ref[rows, :], v_new, dtype)

  sT_ref[...] = jax.lax.fori_loop(0, num_chunks, body, s0_ref[...].astype(F32))


class StateSpecs:
  """Blocks of the sequential passes, grid (V/block_v, B·H): one program per (column block, batch·head) walks every
  chunk, so it sees the whole sequence of its head."""

  def __init__(self, H, T, K, block_v):
    self.whole = lambda d: pl.BlockSpec((None, T, None, d), lambda vb, bh: (bh // H, 0, bh % H, 0))
    self.vcols = pl.BlockSpec((None, T, None, block_v), lambda vb, bh: (bh // H, 0, bh % H, vb))
    self.state = pl.BlockSpec((None, None, K, block_v), lambda vb, bh: (bh // H, bh % H, 0, vb))
    self.per_chunk_state = pl.BlockSpec((None, None, T // CHUNK * K, block_v), lambda vb, bh: (bh // H, bh % H, 0, vb))
    self.decay = pl.BlockSpec((None, T // CHUNK, None, K), lambda vb, bh: (bh // H, 0, bh % H, 0))


def state_forward(w, u, qs, kd, aqk, decay, S0, *, block_v, save=False, num_warps=None):
  """The sequential pass over chunks: v_new = U − W S, o = Qs S + A_qk v_new, S ← decay ⊙ S + Kdᵀ v_new.

  Each program owns `block_v` columns of the state of one (batch, head): columns evolve independently.
  Returns (o, final state); with `save=True` (None, final state, the states entering each chunk `[B,H,N·K,V]`
  in the input dtype, v_new `[B,T,H,V]`) for the backward pass, and no o.
  """
  B, T, H, K = w.shape
  V = u.shape[-1]
  N = T // CHUNK
  dt = w.dtype
  sp = StateSpecs(H, T, K, block_v)
  in_specs = [sp.whole(K), sp.vcols, sp.whole(K), sp.whole(K), sp.whole(CHUNK), sp.decay, sp.state]
  final = jax.ShapeDtypeStruct((B, H, K, V), F32)
  if save:
    out_shape = [final, jax.ShapeDtypeStruct((B, H, N * K, V), dt), jax.ShapeDtypeStruct((B, T, H, V), dt)]
    out_specs = [sp.state, sp.per_chunk_state, sp.vcols]
  else:
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, T, H, V), dt), final], [sp.vcols, sp.state]
  kernel = functools.partial(_state_kernel, num_chunks=N, save=save, dtype=dt)
  num_warps = num_warps or (8 if block_v > 64 else 4)
  outs = triton_call(kernel, grid=(V // block_v, B * H), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, name="kda_state_fwd", num_warps=num_warps, num_stages=2)(
                         w, u, qs, kd, aqk, decay, S0)
  return (None, *outs) if save else tuple(outs)
