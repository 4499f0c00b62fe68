"""The intra pass's key-tile products as a Mosaic GPU kernel (wgmma, TMA), one warpgroup per chunk: the same
outputs as `fwd._key_tile_kernel` (A_qk, B = A_kk/β, Qs, Kd, βΓK), which ncu found issue-bound on Triton's layout
round trips through shared memory (BUILD_NOTES KDA run 10). Here every [64,K] tile stays in the wgmma register
layout, where each warp holds one 16-token tile's rows, and the products read shared memory directly.

A's rows of tile I take the anchor R_I: queries q ⊙ e^{G - R_I - c} (each row against its own tile) times keys
k ⊙ e^{c - (G - R_J)} ⊙ e^{R_I - R_J} (tiles J <= I), one [64,K] x [K,64] product per anchor I whose rows of tile
I are kept (SPEC.md §2's bound keeps both factors within e^{±8|γ_min|}, as in `tiles`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret_mode
from pallas_kernels.kda.tiles import CHUNK, NT, SUB

BF16, F32 = jnp.bfloat16, jnp.float32
WGMMA = plgpu.Layout.WGMMA


def check_supported(dtype, K):
  """Raises unless this kernel takes these inputs: bf16, K a multiple of 64 up to 256."""
  if jnp.dtype(dtype) != BF16 or K % 64 or K > 256:
    raise ValueError(f"the Mosaic GPU key tiles take bf16 with K in (64, 128, 192, 256); got "
                     f"{jnp.dtype(dtype).name}, K={K}")


def chunk_docs(reset_BT):
  """[B,2,T] int32 from the resets: per row, the documents begun in its chunk up to it (0: the chunk's first
  document) and those still to begin after it (0: the chunk's last document)."""
  B, T = reset_BT.shape
  r = reset_BT.reshape(B, T // CHUNK, CHUNK).astype(jnp.int32)
  doc = jnp.cumsum(r, axis=-1)
  return jnp.stack([doc, doc[..., -1:] - doc], axis=1).reshape(B, 2, T)


def key_tiles(q, k, loc, beta_BHT, docs_B2T, *, scale, lower_bound):
  """A_qk (bf16), B = A_kk/β (fp32) `[B,T,H,64]` (row i: row i of its chunk's matrix), Qs, Kd and βΓK (bf16
  `[B,T,H,K]`), as `fwd.intra_forward`'s key-tile launch. q, k bf16 `[B,T,H,K]` (normalised), loc fp32 from
  `fwd.prepare`, β fp32 `[B,H,T]`, documents from `chunk_docs` or None."""
  B, T, H, K = q.shape
  check_supported(q.dtype, K)
  out = [jax.ShapeDtypeStruct((B, T, H, CHUNK), BF16), jax.ShapeDtypeStruct((B, T, H, CHUNK), F32)]
  out += [jax.ShapeDtypeStruct((B, T, H, K), BF16)] * 3
  docs = () if docs_B2T is None else (docs_B2T,)
  kernel = functools.partial(_chunk, H=H, scale=scale, c=SUB / 2 * lower_bound, has_docs=docs_B2T is not None)
  return plgpu.kernel(
      kernel, out_type=out, grid=(T // CHUNK, B * H), grid_names=("n", "bh"),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      kernel_name="kda_intra_fwd_key_tiles_mosaic", interpret=plgpu.InterpretGPUParams() if interpret_mode() else None,
  )(q, k, loc, beta_BHT, *docs)


def _swizzled(dtype):
  return plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128)


def _chunk(q_gmem, k_gmem, loc_gmem, beta_gmem, *refs, H, scale, c, has_docs):
  docs_gmem, (aqk_gmem, kk_gmem, qs_gmem, kd_gmem, kgb_gmem) = (refs[0], refs[1:]) if has_docs else (None, refs)
  n, bh = lax.axis_index("n"), lax.axis_index("bh")
  b, h, rows = bh // H, bh % H, pl.ds(n * CHUNK, CHUNK)
  K = q_gmem.shape[-1]
  wide = lambda dtype=BF16: plgpu.SMEM((CHUNK, K), dtype, transforms=_swizzled(dtype))
  square = lambda dtype: plgpu.SMEM((CHUNK, CHUNK), dtype, transforms=_swizzled(dtype))
  per_col = lambda v, cols: lax.broadcast_in_dim(v, (CHUNK, cols), [1])
  per_row = lambda v, cols: lax.broadcast_in_dim(v, (CHUNK, cols), [0])

  def scoped(q_s, k_s, kop_s, tot_s, beta_s, docs_s, loaded):
    # Everything but the products is done before them, so only the keys' factors and A stay live across the
    # anchors (holding q, k and the gates too spilled 2.7 KB at 255 registers, BUILD_NOTES run 11). Shared memory:
    # 48 KB here, then 32 KB scoped (the gates, then Qs and Kd, then A), at K = 128: two programs per SM.
    copies = [(q_gmem.at[b, rows, h], q_s), (k_gmem.at[b, rows, h], k_s), (beta_gmem.at[b, h, rows], beta_s)]
    copies += [(loc_gmem.at[b, n * CHUNK + j * SUB + SUB - 1, h], tot_s.at[j]) for j in range(NT)]
    copies += [(docs_gmem.at[b, j, rows], docs_s.at[j]) for j in range(2)] if has_docs else []
    for i, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])

    def load_loc(loc_s, loc_loaded):
      plgpu.copy_gmem_to_smem(loc_gmem.at[b, rows, h], loc_s, loc_loaded)
      for i in range(len(copies)):
        plgpu.barrier_wait(loaded.at[i])
      plgpu.barrier_wait(loc_loaded)
      return plgpu.load(loc_s, layout=WGMMA)

    loc = pl.run_scoped(load_loc, wide(F32), plgpu.Barrier())
    tile_row = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=WGMMA.reduce(1)) // SUB
    tot = [plgpu.load(tot_s.at[j], layout=WGMMA.reduce(0)) for j in range(NT)]   # [K]: tile J's log-decay
    # Sums over same-sign terms only (a difference of prefix sums is off by ε·|G|).
    span = lambda lo, hi: sum(tot[lo:hi], jnp.zeros_like(tot[0]))

    def by_tile(vectors, cols=K):
      """[64,cols]: rows of tile J hold vectors[J] ([cols]; zero past the list)."""
      out = jnp.zeros((CHUNK, cols), F32)
      for j, v in enumerate(vectors):
        out = jnp.where(per_row(tile_row, cols) == j, per_col(v, cols), out)
      return out

    same_doc = first = last = None
    if has_docs:
      doc_r = plgpu.load(docs_s.at[0], layout=WGMMA.reduce(1))
      same_doc = per_row(doc_r, CHUNK) == per_col(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(0)), CHUNK)
      first = per_row(doc_r, K) == 0
      last = per_row(plgpu.load(docs_s.at[1], layout=WGMMA.reduce(1)), K) == 0
    mask = lambda m, x: x if m is None else jnp.where(m, x, 0.0)
    both = lambda m1, m2: m1 if m2 is None else m1 & m2

    q = plgpu.load(q_s, layout=WGMMA).astype(F32)
    k = plgpu.load(k_s, layout=WGMMA).astype(F32)
    gamma = mask(first, jnp.exp(by_tile([span(0, j) for j in range(NT)]) + loc))     # e^{G}, G from chunk start
    beta = per_row(plgpu.load(beta_s, layout=WGMMA.reduce(1)), K)
    kop_s[...] = (beta * gamma * k).astype(BF16)
    e_q = jnp.exp(loc - c)
    kek = k * jnp.exp(c - loc)

    def tile_outputs(qs_s, kd_s):
      qs_s[...] = (scale * q * gamma).astype(BF16)
      kd_s[...] = mask(last, k * jnp.exp(by_tile([span(j, NT) for j in range(NT)]) - loc)).astype(BF16)
      q_s[...] = (q * e_q).astype(BF16)             # each thread rewrites the elements it loaded
      k_s[...] = (k * e_q).astype(BF16)
      plgpu.commit_smem()
      for src, dst in ((qs_s, qs_gmem), (kd_s, kd_gmem), (kop_s, kgb_gmem)):
        plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(tile_outputs, wide(), wide())

    rr = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=WGMMA)
    a_qk = a_kk = jnp.zeros((CHUNK, CHUNK), F32)
    for i in range(NT):
      # Keys for anchor R_i: tile J <= i scaled by e^{R_i - R_J}, later tiles zero.
      kop_s[...] = (kek * by_tile([jnp.exp(span(j, i)) for j in range(i + 1)])).astype(BF16)
      plgpu.commit_smem()

      def products(acc_qk, acc_kk):
        plgpu.wgmma(acc_qk, q_s, kop_s.transpose((1, 0)))
        plgpu.wgmma(acc_kk, k_s, kop_s.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_qk[...], acc_kk[...]

      p_qk, p_kk = pl.run_scoped(products, plgpu.ACC((CHUNK, CHUNK), F32), plgpu.ACC((CHUNK, CHUNK), F32))
      a_qk = jnp.where(rr // SUB == i, p_qk, a_qk)
      a_kk = jnp.where(rr // SUB == i, p_kk, a_kk)

    def write(aqk_s, kk_s):
      cc = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=WGMMA)
      aqk_s[...] = mask(both(cc <= rr, same_doc), scale * a_qk).astype(BF16)
      kk_s[...] = mask(both(cc < rr, same_doc), a_kk)
      plgpu.commit_smem()
      for src, dst in ((aqk_s, aqk_gmem), (kk_s, kk_gmem)):
        plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, square(BF16), square(F32))

  n_copies = 3 + NT + 2 * has_docs
  pl.run_scoped(scoped, wide(), wide(), wide(), plgpu.SMEM((NT, K), F32), plgpu.SMEM((CHUNK,), F32),
                plgpu.SMEM((2, CHUNK), jnp.int32), plgpu.Barrier(num_barriers=n_copies))
