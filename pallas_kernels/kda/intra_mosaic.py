"""The whole intra pass in one Mosaic GPU launch (wgmma, TMA), one warpgroup per chunk, on `fwd.prepare`'s anchored
operands: the key-tile products, then the solve on B still in registers, so neither B nor βΓK goes through memory
and one launch's latency goes. Opt-in (`fwd.intra_forward(..., solve="fused")`), written in session 10 after the
device time ran out: checked in interpret mode and lowered, not yet timed (BUILD_NOTES KDA run 12).

Session 9's fused launch computed the gates' exponentials for every anchor and spilled at 255 registers (2.89 ms,
run 12, commit 7e6c17e). Here the operands arrive against their own tile's anchor, so anchor I's keys are ke times
a per-tile row e^{R_I - R_J} (J <= I): exponentials of [64] vectors only. One pair of accumulators takes every
(pass, anchor) product: anchor I's queries are zero outside tile I, so its product lands on tile I's rows only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import solve_mosaic
from pallas_kernels.kda.solve_mosaic import BF16, WGMMA, per_chunk, swizzled
from pallas_kernels.kda.tiles import CHUNK, F32, NT, SUB


def check_supported(dtype, K, V):
  """Raises unless this kernel takes these inputs: bf16, K a multiple of 64 up to 256, V a multiple of 64 up to 192
  (V's blocks go through the three operand buffers)."""
  if jnp.dtype(dtype) != BF16 or K % 64 or K > 256 or V % 64 or V > 192:
    raise ValueError(f"the fused Mosaic GPU intra pass takes bf16 with K in (64, 128, 192, 256) and V in (64, 128, "
                     f"192); got {jnp.dtype(dtype).name}, K={K}, V={V}")


def chunk_docs(reset_BT):
  """[B,2,T] int32 from the resets: per row, the documents begun in its chunk up to it (0: the chunk's first
  document) and those still to begin after it (0: the chunk's last document)."""
  B, T = reset_BT.shape
  doc = jnp.cumsum(reset_BT.reshape(B, T // CHUNK, CHUNK).astype(jnp.int32), axis=-1)
  return jnp.stack([doc, doc[..., -1:] - doc], axis=1).reshape(B, 2, T)


def intra(qe, kq, ke, tot, v, beta_BHT, reset, *, scale, lower_bound, save):
  """As `fwd.intra_forward`: W, U, Qs, Kd, A_qk (bf16) and with `save` B and M (fp32 `[B,T,H,64]`; None otherwise).
  qe, kq, ke bf16 `[B,T,H,K]` and tot fp32 `[B,T/16,H,K]` from `fwd.prepare`, v bf16 `[B,T,H,V]`, β fp32 `[B,H,T]`
  (a chunk's β contiguous for TMA), reset `[B,T]` int32 or None."""
  B, T, H, K = qe.shape
  V = v.shape[-1]
  check_supported(qe.dtype, K, V)
  shape = lambda d, dtype=BF16: jax.ShapeDtypeStruct((B, T, H, d), dtype)
  out = [shape(K), shape(V), shape(K), shape(K), shape(CHUNK)] + ([shape(CHUNK, F32)] * 2 if save else [])
  docs = () if reset is None else (chunk_docs(reset),)
  kernel = functools.partial(_chunk, H=H, scale=scale, c=SUB / 2 * lower_bound, has_docs=reset is not None,
                             save=save)
  w, u, qs, kd, aqk, *saved = per_chunk(kernel, out, B, T, H, "kda_intra_fwd_mosaic")(qe, kq, ke, tot, beta_BHT, v,
                                                                                       *docs)
  kk, minv = saved if save else (None, None)
  return w, u, qs, kd, aqk, kk, minv


def _chunk(qe_gmem, kq_gmem, ke_gmem, tot_gmem, beta_gmem, v_gmem, *refs, H, scale, c, has_docs, save):
  refs = list(refs)
  docs_gmem = refs.pop(0) if has_docs else None
  w_gmem, u_gmem, qs_gmem, kd_gmem, aqk_gmem, *saved = refs
  kk_gmem, m_gmem = saved if save else (None, None)
  n, bh = lax.axis_index("n"), lax.axis_index("bh")
  b, h, rows = bh // H, bh % H, pl.ds(n * CHUNK, CHUNK)
  P, PV = qe_gmem.shape[-1] // 64, v_gmem.shape[-1] // 64
  cols = [pl.ds(p * 64, 64) for p in range(max(P, PV))]
  square = lambda dtype: plgpu.SMEM((CHUNK, 64), dtype, transforms=swizzled(dtype))
  per_col = lambda x: lax.broadcast_in_dim(x, (CHUNK, 64), [1])
  per_row = lambda x: lax.broadcast_in_dim(x, (CHUNK, 64), [0])
  mask = lambda m, x: x if m is None else jnp.where(m, x, 0.0)

  def scoped(qe_s, kq_s, ke_s, qa_s, ka_s, kop_s, spare_s, tot_s, beta_s, docs_s, loaded):
    # Shared memory at K = 128: qe, kq, ke 48 KB, the operands 24 KB, then 24 KB scoped (A_qk, B): two programs per
    # SM. After the products each pass overwrites qe, kq, ke with Qs, βΓK, Kd; V's blocks load into the operand
    # buffers, the solve's bf16 halves go through qe's and ke's buffers once Qs and Kd are stored, U overwrites V and
    # W overwrites βΓK.
    copies = [(g.at[b, rows, h, cols[p]], s[p]) for g, s in ((qe_gmem, qe_s), (kq_gmem, kq_s), (ke_gmem, ke_s))
              for p in range(P)]
    copies += [(beta_gmem.at[b, h, rows], beta_s), (tot_gmem.at[b, pl.ds(n * NT, NT), h], tot_s)]
    copies += [(docs_gmem.at[b, j, rows], docs_s.at[j]) for j in range(2)] if has_docs else []
    for i, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    for i in range(len(copies)):
      plgpu.barrier_wait(loaded.at[i])

    tile_row = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=WGMMA.reduce(1)) // SUB
    in_tile = lambda j: per_row(tile_row) == j

    def by_tile(vectors):
      """[64,64]: rows of tile J hold vectors[J] ([64]; zero past the list)."""
      out = jnp.zeros((CHUNK, 64), F32)
      for j, x in enumerate(vectors):
        out = jnp.where(in_tile(j), per_col(x), out)
      return out

    first = last = None                     # rows in the chunk's first / last document
    if has_docs:
      first = per_row(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(1))) == 0
      last = per_row(plgpu.load(docs_s.at[1], layout=WGMMA.reduce(1))) == 0
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)

    def accumulate(acc_qk, acc_kk):
      for p in range(P):
        tot = [plgpu.load(tot_s.at[j, cols[p]], layout=WGMMA.reduce(0)) for j in range(NT)]
        span = lambda lo, hi: sum(tot[lo:hi], jnp.zeros_like(tot[0]))   # same-sign terms only
        for i in range(NT):
          # Anchor R_i: queries of tile i (against their own anchor already), keys of tiles J <= i times e^{R_i-R_J}.
          for src, dst in ((qe_s[p], qa_s), (kq_s[p], ka_s)):
            x = plgpu.load(src, layout=WGMMA)                    # bf16: no conversion, half the registers
            dst[...] = jnp.where(in_tile(i), x, jnp.zeros_like(x))
          kop_s[...] = (load(ke_s[p]) * by_tile([jnp.exp(span(j, i)) for j in range(i + 1)])).astype(BF16)
          plgpu.commit_smem()
          plgpu.wgmma(acc_qk, qa_s, kop_s.transpose((1, 0)))
          plgpu.wgmma(acc_kk, ka_s, kop_s.transpose((1, 0)))
          plgpu.wgmma_wait(0)                                    # before the operands are overwritten
        # Qs = scale·qe·e^{R+c}, βΓK = β·kq·e^{R+c} (zero past a document start), Kd = ke·e^{G_C-R-c} (zero before
        # the chunk's last document), each thread rewriting the elements it loaded.
        start = mask(first, by_tile([jnp.exp(span(0, j) + c) for j in range(NT)]))
        qe_s[p][...] = (scale * load(qe_s[p]) * start).astype(BF16)
        kq_s[p][...] = (per_row(plgpu.load(beta_s, layout=WGMMA.reduce(1))) * load(kq_s[p]) * start).astype(BF16)
        ke_s[p][...] = mask(last, load(ke_s[p]) * by_tile([jnp.exp(span(j, NT) - c) for j in range(NT)])).astype(BF16)
        plgpu.commit_smem()
        for src, dst in ((qe_s[p], qs_gmem), (ke_s[p], kd_gmem)):
          plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h, cols[p]])
      return acc_qk[...], acc_kk[...]

    a_qk, a_kk = pl.run_scoped(accumulate, plgpu.ACC((CHUNK, CHUNK), F32), plgpu.ACC((CHUNK, CHUNK), F32))
    v_s = [qa_s, ka_s, kop_s][:PV]
    for j in range(PV):
      plgpu.copy_gmem_to_smem(v_gmem.at[b, rows, h, cols[j]], v_s[j], loaded.at[len(copies) + j])

    rr = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=WGMMA)
    cc = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=WGMMA)
    same_doc = None
    if has_docs:
      same_doc = (lax.broadcast_in_dim(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(1)), (CHUNK, CHUNK), [0])
                  == lax.broadcast_in_dim(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(0)), (CHUNK, CHUNK), [1]))
    both = lambda m: m if same_doc is None else m & same_doc
    a_kk = mask(both(cc < rr), a_kk)

    def write(aqk_s, kk_s):
      aqk_s[...] = mask(both(cc <= rr), scale * a_qk).astype(BF16)
      kk_s[...] = a_kk
      plgpu.commit_smem()
      for src, dst in ((aqk_s, aqk_gmem),) + (((kk_s, kk_gmem),) if save else ()):
        plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)          # the scope's memory is reused after it

    pl.run_scoped(write, square(BF16), square(F32))

    # The solve: qe's and ke's buffers (Qs and Kd stored: the write scope waited) take the products' bf16 halves.
    for j in range(PV):
      plgpu.barrier_wait(loaded.at[len(copies) + j])
    squares = (list(qe_s) + list(ke_s) + list(spare_s))[:4]

    def outputs(m_s):
      solve_mosaic.solve_in_place(a_kk, beta_s, squares, v_s, kq_s, m_s if save else None)
      plgpu.commit_smem()
      stores = [(v_s[j], u_gmem, cols[j]) for j in range(PV)] + [(kq_s[p], w_gmem, cols[p]) for p in range(P)]
      stores += [(m_s, m_gmem, slice(None))] if save else []
      for src, dst, cs in stores:
        plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h, cs])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(outputs, square(F32))

  K = qe_gmem.shape[-1]
  n_barriers = 3 * P + 2 + 2 * has_docs + PV
  spares = max(0, 4 - 2 * P)
  pl.run_scoped(scoped, [square(BF16)] * P, [square(BF16)] * P, [square(BF16)] * P, square(BF16), square(BF16),
                square(BF16), [square(BF16)] * spares, plgpu.SMEM((NT, K), F32), plgpu.SMEM((CHUNK,), F32),
                plgpu.SMEM((2, CHUNK), jnp.int32), plgpu.Barrier(num_barriers=n_barriers))
