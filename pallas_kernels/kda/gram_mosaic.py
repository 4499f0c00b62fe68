"""The intra pass's key-tile products as a Mosaic GPU kernel (wgmma, TMA), one warpgroup per chunk: the same
outputs as `fwd._key_tile_kernel` (A_qk, B = A_kk/β, Qs, Kd, βΓK), which ncu found issue-bound on Triton's layout
round trips through shared memory (BUILD_NOTES KDA run 10). Opt-in (`fwd.intra_forward(..., key_tiles="mosaic")`),
written in session 9 after the device time ran out: checked in interpret mode and lowered, not yet timed.

A's rows of tile I take the anchor R_I: queries q ⊙ e^{G - R_I - c} (each row against its own tile) times keys
k ⊙ e^{c - (G - R_J)} ⊙ e^{R_I - R_J} (tiles J <= I); SPEC.md §2's bound keeps both factors within e^{±8|γ_min|}, as
in `tiles`. One pair of accumulators takes every anchor: anchor I's queries are zero outside tile I, so its
product lands on tile I's rows only. K is walked in 64-column passes, so a gate or key tile is 32 registers per
thread, not 64: the first version held [64,K] tiles and spilled at 255 registers (BUILD_NOTES run 11, commit
900cafb).
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
  P = q_gmem.shape[-1] // 64
  cols = [pl.ds(p * 64, 64) for p in range(P)]
  square = lambda dtype: plgpu.SMEM((CHUNK, 64), dtype, transforms=_swizzled(dtype))
  per_col = lambda v: lax.broadcast_in_dim(v, (CHUNK, 64), [1])
  per_row = lambda v: lax.broadcast_in_dim(v, (CHUNK, 64), [0])

  def scoped(q_s, k_s, kgb_s, qa_s, ka_s, kop_s, tot_s, beta_s, docs_s, loaded):
    # Shared memory at K = 128: q, k, βΓK 48 KB, the operands 24 KB, then 32 KB scoped (the gates, then A): two
    # programs per SM. Each pass overwrites its q and k columns with Qs and Kd once read.
    copies = [(q_gmem.at[b, rows, h, cols[p]], q_s[p]) for p in range(P)]
    copies += [(k_gmem.at[b, rows, h, cols[p]], k_s[p]) for p in range(P)]
    copies += [(beta_gmem.at[b, h, rows], beta_s)]
    copies += [(loc_gmem.at[b, n * CHUNK + j * SUB + SUB - 1, h], tot_s.at[j]) for j in range(NT)]
    copies += [(docs_gmem.at[b, j, rows], docs_s.at[j]) for j in range(2)] if has_docs else []
    for i, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])

    tile_row = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=WGMMA.reduce(1)) // SUB
    in_tile = [per_row(tile_row) == j for j in range(NT)]

    def by_tile(vectors):
      """[64,64]: rows of tile J hold vectors[J] ([64]; zero past the list)."""
      out = jnp.zeros((CHUNK, 64), F32)
      for j, v in enumerate(vectors):
        out = jnp.where(in_tile[j], per_col(v), out)
      return out

    first = last = None
    mask = lambda m, x: x if m is None else jnp.where(m, x, 0.0)

    def passes(loc_s, loc_loaded):
      for p in range(P):
        plgpu.copy_gmem_to_smem(loc_gmem.at[b, rows, h, cols[p]], loc_s[p], loc_loaded.at[p])
      for i in range(len(copies)):
        plgpu.barrier_wait(loaded.at[i])
      if has_docs:
        nonlocal first, last
        first = per_row(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(1))) == 0
        last = per_row(plgpu.load(docs_s.at[1], layout=WGMMA.reduce(1))) == 0
      beta = per_row(plgpu.load(beta_s, layout=WGMMA.reduce(1)))

      def accumulate(acc_qk, acc_kk):
        for p in range(P):
          plgpu.barrier_wait(loc_loaded.at[p])
          tot = [plgpu.load(tot_s.at[j, cols[p]], layout=WGMMA.reduce(0)) for j in range(NT)]
          span = lambda lo, hi: sum(tot[lo:hi], jnp.zeros_like(tot[0]))   # same-sign terms only
          loc = plgpu.load(loc_s[p], layout=WGMMA)
          q = plgpu.load(q_s[p], layout=WGMMA).astype(F32)
          k = plgpu.load(k_s[p], layout=WGMMA).astype(F32)
          gamma = mask(first, jnp.exp(by_tile([span(0, j) for j in range(NT)]) + loc))   # e^{G}
          q_s[p][...] = (scale * q * gamma).astype(BF16)          # each thread rewrites the elements it loaded
          kgb_s[p][...] = (beta * gamma * k).astype(BF16)
          k_s[p][...] = mask(last, k * jnp.exp(by_tile([span(j, NT) for j in range(NT)]) - loc)).astype(BF16)
          plgpu.commit_smem()
          for src, dst in ((q_s[p], qs_gmem), (k_s[p], kd_gmem), (kgb_s[p], kgb_gmem)):
            plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h, cols[p]])
          e_q = jnp.exp(loc - c)
          qe, kqe = (q * e_q).astype(BF16), (k * e_q).astype(BF16)
          kek = k * jnp.exp(c - loc)
          for i in range(NT):
            # Keys for anchor R_i: tile J <= i scaled by e^{R_i - R_J}, later tiles zero.
            qa_s[...] = jnp.where(in_tile[i], qe, jnp.zeros_like(qe))
            ka_s[...] = jnp.where(in_tile[i], kqe, jnp.zeros_like(kqe))
            kop_s[...] = (kek * by_tile([jnp.exp(span(j, i)) for j in range(i + 1)])).astype(BF16)
            plgpu.commit_smem()
            plgpu.wgmma(acc_qk, qa_s, kop_s.transpose((1, 0)))
            plgpu.wgmma(acc_kk, ka_s, kop_s.transpose((1, 0)))
            plgpu.wgmma_wait(0)                                  # before the operands are overwritten
        return acc_qk[...], acc_kk[...]

      return pl.run_scoped(accumulate, plgpu.ACC((CHUNK, CHUNK), F32), plgpu.ACC((CHUNK, CHUNK), F32))

    a_qk, a_kk = pl.run_scoped(passes, [square(F32)] * P, plgpu.Barrier(num_barriers=P))

    def write(aqk_s, kk_s):
      rr = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=WGMMA)
      cc = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=WGMMA)
      same_doc = None
      if has_docs:
        same_doc = (lax.broadcast_in_dim(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(1)), (CHUNK, CHUNK), [0])
                    == lax.broadcast_in_dim(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(0)), (CHUNK, CHUNK), [1]))
      both = lambda m: m if same_doc is None else m & same_doc
      aqk_s[...] = mask(both(cc <= rr), scale * a_qk).astype(BF16)
      kk_s[...] = mask(both(cc < rr), a_kk)
      plgpu.commit_smem()
      for src, dst in ((aqk_s, aqk_gmem), (kk_s, kk_gmem)):
        plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, square(BF16), square(F32))

  K = q_gmem.shape[-1]
  n_copies = 2 * P + 1 + NT + 2 * has_docs
  pl.run_scoped(scoped, [square(BF16)] * P, [square(BF16)] * P, [square(BF16)] * P, square(BF16), square(BF16),
                square(BF16), plgpu.SMEM((NT, K), F32), plgpu.SMEM((CHUNK,), F32), plgpu.SMEM((2, CHUNK), jnp.int32),
                plgpu.Barrier(num_barriers=n_copies))
