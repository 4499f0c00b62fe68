"""Backward kernels: the reverse sequential pass for the state gradient, the state-gradient products and the
parallel intra-chunk backward (a row pass, a column pass and dg's suffix sum). Each launch's parameters come from
`KDAKernelOptions`; the tests hold the intra backward to autodiff of `k3jax.ops.kda.naive.naive_chunk_intermediates`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_call
from pallas_kernels.kda import state_mosaic
from pallas_kernels.kda.fwd import DEFAULT, StateSpecs, walk_chunks
from pallas_kernels.kda.options import COLS_FORMS
from pallas_kernels.kda.tiles import (CHUNK, F32, NT, SUB, Gates, TileDocs, TileGates, load, masked, mm, mm_t,
                                      store, t_mm)


def _state_bwd_kernel(do_ref, aqk_ref, kd_ref, qs_ref, w_ref, decay_ref, dsT_ref, dvn_ref, dh_ref, ds0_ref, *,
                      num_chunks, dtype):
  def body(n, dS_KV, decay_row):
    rows = pl.ds(n * CHUNK, CHUNK)
    do = do_ref[rows, :]
    dv_new = t_mm(aqk_ref[rows, :], do, dtype) + mm(kd_ref[rows, :], dS_KV, dtype)
    dh_ref[pl.ds(n * dS_KV.shape[0], dS_KV.shape[0]), :] = dS_KV.astype(dh_ref.dtype)
    dvn_ref[rows, :] = dv_new.astype(dvn_ref.dtype)
    decay = decay_row.astype(F32).T
    return t_mm(qs_ref[rows, :], do, dtype) + decay * dS_KV - t_mm(w_ref[rows, :], dv_new, dtype)

  ds0_ref[...] = walk_chunks(num_chunks, body, dsT_ref[...].astype(F32), decay_ref, reverse=True)


def state_backward(do, aqk, kd, qs, w, decay, dS_T, *, block_v, options=DEFAULT):
  """Reverse pass over chunks. Returns dv_new `[B,T,H,V]` and the gradient w.r.t. the state leaving each chunk
  `[B,H,N·K,V]` in the input dtype (as FLA keeps them: at bf16 the intra backward's reads of these fp32 tensors were
  its largest traffic), and the gradient w.r.t. the initial state `[B,H,K,V]` fp32. `options.state_pass`: the
  Mosaic GPU pass (`state_mosaic.state_backward`) or the Triton one, None: Mosaic GPU's where
  `state_mosaic.available`; `options.state_bwd_launch`: the Triton launch."""
  B, T, H, K = w.shape
  V = do.shape[-1]
  N = T // CHUNK
  dt = w.dtype
  if state_mosaic.chosen(dt, K, V, block_v, options.state_pass, options.state_bwd):
    return state_mosaic.state_backward(do, aqk, kd, qs, w, decay, dS_T)
  sp = StateSpecs(H, T, K, block_v)
  in_specs = [sp.vcols, sp.whole(CHUNK), sp.whole(K), sp.whole(K), sp.whole(K), sp.decay, sp.state]
  out_shape = [jax.ShapeDtypeStruct((B, T, H, V), dt), jax.ShapeDtypeStruct((B, H, N * K, V), dt),
               jax.ShapeDtypeStruct((B, H, K, V), F32)]
  out_specs = [sp.vcols, sp.per_chunk_state, sp.state]
  kernel = functools.partial(_state_bwd_kernel, num_chunks=N, dtype=dt)
  return triton_call(kernel, grid=(V // block_v, B * H), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, name="kda_state_bwd", **options.state_bwd_launch(block_v)._asdict())(
                         do, aqk, kd, qs, w, decay, dS_T)


def _state_grad_kernel(h_ref, dh_ref, vn_ref, dvn_ref, do_ref, dw_ref, dqs_ref, dkd_ref, dd_ref, *, dtype):
  S, dS = h_ref[...], dh_ref[...]                                   # [BK, V] rows of the state, and its gradient
  dw_ref[...] = (-mm_t(dvn_ref[...], S, dtype)).astype(dw_ref.dtype)
  dqs_ref[...] = mm_t(do_ref[...], S, dtype).astype(dqs_ref.dtype)
  dkd_ref[...] = mm_t(vn_ref[...], dS, dtype).astype(dkd_ref.dtype)
  dd_ref[...] = jnp.sum(S.astype(F32) * dS.astype(F32), axis=1)


def state_grad_products(h, dh, v_new, dv_new, do, *, options=DEFAULT):
  """Gradients through v_new = U − W S, o = Qs S + …, S' = decay ⊙ S + Kdᵀ v_new w.r.t. W, Qs, Kd `[B,T,H,K]`
  (input dtype) and the state decay `[B,N,H,K]` (fp32), from the states entering each chunk and the gradients
  leaving it. Parallel over chunks and blocks of `options.state_grads_block_k` columns of K."""
  B, T, H, V = do.shape
  K = h.shape[2] // (T // CHUNK)
  block_k = min(options.state_grads_block_k, K)
  N, nk = T // CHUNK, K // block_k
  state = pl.BlockSpec((None, None, block_k, V), lambda n, bh, kb: (bh // H, bh % H, n * nk + kb, 0))
  row_v = pl.BlockSpec((None, CHUNK, None, V), lambda n, bh, kb: (bh // H, n, bh % H, 0))
  row_k = pl.BlockSpec((None, CHUNK, None, block_k), lambda n, bh, kb: (bh // H, n, bh % H, kb))
  kdim = jax.ShapeDtypeStruct((B, T, H, K), h.dtype)
  return triton_call(
      functools.partial(_state_grad_kernel, dtype=h.dtype), grid=(N, B * H, nk),
      in_specs=[state, state, row_v, row_v, row_v],
      out_specs=[row_k, row_k, row_k,
                 pl.BlockSpec((None, None, None, block_k), lambda n, bh, kb: (bh // H, n, bh % H, kb))],
      out_shape=[kdim, kdim, kdim, jax.ShapeDtypeStruct((B, N, H, K), F32)], name="kda_state_grads",
      **options.launch("state_grads")._asdict())(h, dh, v_new, dv_new, do)


def _intra_bwd_rows_kernel(k_ref, v_ref, loc_ref, beta_ref, u_ref, w_ref, kk_ref, minv_ref, vn_ref, dvn_ref, do_ref,
                           dw_ref, *refs, scale, lower_bound, has_reset, dtype):
  """First pass, one program per query tile i (it carries nothing between tiles): everything that contracts
  over K or V (dv, dβ, dA_qk, dB, and dKw = βΓ ⊙ dX_k for the column pass)."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  dv_ref, dbeta_ref, dAqk_ref, dB_ref, dkw_ref = refs
  i = pl.program_id(2)
  docs = TileDocs(reset_ref, i)
  tg = TileGates(loc_ref, docs, lower_bound)
  exact = dtype == F32
  beta_i = load(beta_ref, i)[:, None]
  gamma = tg.gamma()
  m_cols = minv_ref[:, pl.ds(i * SUB, SUB)]
  dXv, dXk = t_mm(m_cols, load(dvn_ref), F32, exact), t_mm(m_cols, load(dw_ref), F32, exact)
  dA = masked(-(mm_t(dXv, load(u_ref), dtype) + mm_t(dXk, load(w_ref), dtype)), docs.row_mask(True))
  store(dv_ref, None, beta_i * dXv)
  store(dbeta_ref, None, jnp.sum(dXv * load(v_ref, i), axis=1) + jnp.sum(dXk * gamma * load(k_ref, i), axis=1)
        + jnp.sum(dA * load(kk_ref, i), axis=1))
  store(dB_ref, None, beta_i * dA)
  store(dAqk_ref, None, masked(scale * mm_t(load(do_ref, i), load(vn_ref), dtype), docs.row_mask(False)))
  store(dkw_ref, None, beta_i * gamma * dXk)


def _pair_products(q_ref, k_ref, loc_ref, dAqk_ref, dB_ref, tg, j, dtype, form):
  """The column pass's products over pairs of rows in tiles I >= J, every operand rounded against its own tile's
  anchor: each 16x16 block of dA_qk and dB times one tile's rows, the anchor shift e^{R_I - R_J} applied in fp32
  to the block's product by Horner's rule over the tiles (a factor e^{tot} >= e^{16·γ_min} a step, so no shift
  underflows while its pair still counts). `form` (`options.COLS_FORMS`) walks the tiles as its `_PAIR_WALKS` body
  says. Returns dq̂, dk̂ of tile j's rows and dk̃ of its keys."""
  rows_j = pl.ds(j * SUB, SUB)
  rows = lambda t: pl.ds(t * SUB, SUB)
  tile = lambda ref, t: ref[rows(t), :].astype(F32)
  tot = lambda t: loc_ref[pl.ds(t * SUB + SUB - 1, 1), :].astype(F32)     # tile t's total log-decay, [1,K]

  def key_tile(t, acc):                  # dq̂ = Σ_{t<=j} e^{R_j - R_t} dA_qk[j, t] k̃_t, likewise dk̂ from dB
    keys = tile(k_ref, t) * jnp.exp(tg.c - tile(loc_ref, t))
    shift = jnp.where(t <= j, jnp.exp(tot(jnp.maximum(t - 1, 0))), 1.0)  # e^{tot_{t-1}}; the sums are zero at t = 0
    return tuple(a * shift + mm(ref[rows_j, rows(t)], keys, dtype) for a, ref in zip(acc, (dAqk_ref, dB_ref)))

  def query_tile(step, acc):             # dk̃ = Σ_{t>=j} e^{R_t - R_j} (dA_qk[t, j]ᵀ q̂_t + dB[t, j]ᵀ k̂_t), t = 3 .. j
    t = NT - 1 - step
    e = jnp.exp(tile(loc_ref, t) - tg.c)
    products = (t_mm(dAqk_ref[rows(t), rows_j], tile(q_ref, t) * e, dtype)
                + t_mm(dB_ref[rows(t), rows_j], tile(k_ref, t) * e, dtype))
    return acc * jnp.where(t >= j, jnp.exp(tot(t)), 1.0) + products

  return _PAIR_WALKS[form](key_tile, query_tile, j, jnp.zeros((SUB, loc_ref.shape[-1]), F32))


def _walk_nonzero_blocks(key_tile, query_tile, j, zeros):
  """"loop": only the blocks causality leaves nonzero, j + 1 key tiles and 4 - j query tiles."""
  return (*jax.lax.fori_loop(0, j + 1, key_tile, (zeros, zeros)), jax.lax.fori_loop(0, NT - j, query_tile, zeros))


def _walk_all_blocks(key_tile, query_tile, j, zeros):
  """"unrolled": all four tiles of each, unrolled, the zero blocks' steps leaving the sums as they are."""
  acc, dkeys = (zeros, zeros), zeros
  for t in range(NT):
    acc, dkeys = key_tile(t, acc), query_tile(t, dkeys)
  return (*acc, dkeys)


# The column pass's forms (`options.COLS_FORMS`), each a walk over the tiles of `_pair_products`' products.
_PAIR_WALKS = {"loop": _walk_nonzero_blocks, "unrolled": _walk_all_blocks}
assert tuple(_PAIR_WALKS) == COLS_FORMS, (tuple(_PAIR_WALKS), COLS_FORMS)


def _intra_bwd_cols_kernel(q_ref, k_ref, loc_ref, dAqk_ref, dB_ref, dkw_ref, dqs_ref, dkd_ref, *refs, scale,
                           lower_bound, has_reset, dtype, form):
  """Second pass, one program per tile J and block of K: dq and dk of the tile's rows, and dG, each row's own
  term of dg (`_dg_suffix_kernel` sums it over the chunk's later rows). A pair of rows i >= j gives dG a term at i
  and its negative at j, both from the same bf16 operands, each rounded against its own tile's anchor
  (`_pair_products`), so the two cancel in dg where they should (with the operands of other tiles rounded against
  tile J's anchor they did not, and d g_raw was 2.5x less accurate than FLA's in bf16)."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  dq_ref, dk_ref, dG_ref = refs
  j = pl.program_id(3)
  docs = TileDocs(reset_ref, j)
  tg = TileGates(loc_ref, docs, lower_bound)
  dqh, dkh, dkeys = _pair_products(q_ref, k_ref, loc_ref, dAqk_ref, dB_ref, tg, j, dtype, form)
  e_q, e_k = tg.e_q(), tg.e_k()
  rounded = lambda a: a.astype(dtype).astype(F32)
  q_j, k_j = load(q_ref, j), load(k_ref, j)
  gamma = tg.gamma()
  dqs = load(dqs_ref, j)
  store(dq_ref, None, dqh * e_q + scale * gamma * dqs)
  te, dkd = tg.to_end(), load(dkd_ref, j)
  dkw = load(dkw_ref, j)
  store(dk_ref, None, dkh * e_q + dkw + dkeys * e_k + te * dkd)
  store(dG_ref, None, dqh * rounded(q_j * e_q) + dkh * rounded(k_j * e_q) + k_j * dkw + scale * q_j * gamma * dqs
        - dkeys * rounded(k_j * e_k) - k_j * te * dkd)


def _dg_suffix_kernel(k_ref, loc_ref, dkd_ref, dd_ref, dG_ref, *refs, lower_bound, has_reset):
  """Third pass: dg of row r = Σ_{rows r' >= r of the chunk} dG[r'] + what the chunk's state decay and the
  keys decayed to its end contribute to every row."""
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  dg_ref, = refs
  gates = Gates(loc_ref, reset_ref, lower_bound)
  base = gates.decay() * dd_ref[...].reshape(1, -1) + jnp.sum(
      load(k_ref) * gates.to_end(gates.e_k()) * load(dkd_ref), axis=0, keepdims=True)
  dG = load(dG_ref)
  store(dg_ref, None, jnp.sum(dG, axis=0, keepdims=True) - jnp.cumsum(dG, axis=0) + dG + base)


def intra_backward(*, q, k, v, loc, beta, reset, u, w, kk, minv, v_new, dv_new, do, dw, dqs, dkd, dd, scale,
                   lower_bound, options=DEFAULT):
  """Per chunk: dq, dk, dv, dg (fp32), dβ (fp32), from the intra pass's cumulative gates `loc`, U, W, B and M, the
  state pass's v_new and its gradient, dO, and the state-gradient products (dW, dQs, dKd, d decay). Three launches,
  each a program per tile: the row pass (grid chunks × heads × 4), the column pass (grid chunks × heads × K blocks ×
  4) and dg's sum over later rows (grid chunks × heads × K blocks), the K blocks `options.bwd_block_k` wide.
  `options.cols_form`: the column pass's pair products over the nonzero blocks only ("loop") or over all
  ("unrolled"), `_pair_products`; the same gradients to fp32 rounding."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  N = T // CHUNK
  block_k = min(options.bwd_block_k, K)
  if K % block_k or block_k % SUB:
    raise ValueError(f"intra_backward: bwd_block_k={block_k} must be a multiple of {SUB} dividing K={K}")
  row = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda n, bh, *_: (bh // H, n, bh % H, 0))
  tok = pl.BlockSpec((None, CHUNK, None), lambda n, bh, *_: (bh // H, n, bh % H))
  res = [pl.BlockSpec((None, CHUNK), lambda n, bh, *_: (bh // H, n))] if reset is not None else []
  opt = [reset] if reset is not None else []
  flags = dict(scale=scale, lower_bound=lower_bound, has_reset=reset is not None, dtype=q.dtype)
  shape = lambda d, dtype: jax.ShapeDtypeStruct((B, T, H, d), dtype)
  out = lambda d: pl.BlockSpec((None, SUB, None, d), lambda n, bh, i: (bh // H, n * NT + i, bh % H, 0))
  out_tok = pl.BlockSpec((None, SUB, None), lambda n, bh, i: (bh // H, n * NT + i, bh % H))
  dv, dbeta, dAqk, dB, dkw = triton_call(
      functools.partial(_intra_bwd_rows_kernel, **flags), grid=(N, B * H, NT),
      in_specs=[row(K), row(V), row(K), tok, row(V), row(K), row(CHUNK), row(CHUNK), row(V), row(V), row(V), row(K)]
      + res, out_specs=[out(V), out_tok, out(CHUNK), out(CHUNK), out(K)],
      out_shape=[shape(V, v.dtype), jax.ShapeDtypeStruct((B, T, H), F32), shape(CHUNK, q.dtype), shape(CHUNK, q.dtype),
                 shape(K, F32)], name="kda_intra_bwd_rows", **options.launch("intra_bwd_rows")._asdict())(
                     k, v, loc, beta, u, w, kk, minv, v_new, dv_new, do, dw, *opt)
  col = pl.BlockSpec((None, CHUNK, None, block_k), lambda n, bh, kb, *_: (bh // H, n, bh % H, kb))
  full = pl.BlockSpec((None, CHUNK, None, CHUNK), lambda n, bh, *_: (bh // H, n, bh % H, 0))
  dd_spec = pl.BlockSpec((None, None, None, block_k), lambda n, bh, kb: (bh // H, n, bh % H, kb))
  tile_col = pl.BlockSpec((None, SUB, None, block_k), lambda n, bh, kb, j: (bh // H, n * NT + j, bh % H, kb))
  dq, dk, dG = triton_call(
      functools.partial(_intra_bwd_cols_kernel, **flags, form=options.cols_form), grid=(N, B * H, K // block_k, NT),
      in_specs=[col, col, col, full, full, col, col, col] + res, out_specs=[tile_col] * 3,
      out_shape=[shape(K, q.dtype), shape(K, k.dtype), shape(K, F32)], name="kda_intra_bwd_cols",
      **options.launch("intra_bwd_cols")._asdict())(q, k, loc, dAqk, dB, dkw, dqs, dkd, *opt)
  dg = triton_call(
      functools.partial(_dg_suffix_kernel, lower_bound=lower_bound, has_reset=reset is not None),
      grid=(N, B * H, K // block_k), in_specs=[col, col, col, dd_spec, col] + res, out_specs=col,
      out_shape=shape(K, F32), name="kda_intra_bwd_dg", **options.launch("intra_bwd_dg")._asdict())(
          k, loc, dkd, dd, dG, *opt)
  return dq, dk, dv, dg, dbeta
