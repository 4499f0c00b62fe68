"""The intra pass's key-tile products as a Mosaic GPU kernel (wgmma, TMA), one warpgroup per chunk: the same
outputs as `fwd._key_tile_kernel` (A_qk, B = A_kk/β, Qs, Kd, βΓK), which ncu found issue-bound on Triton's layout
round trips through shared memory (BUILD_NOTES KDA run 10); and `intra`, the same launch going on to the solve, so
neither B nor βΓK goes through memory. Opt-in (`fwd.intra_forward(..., key_tiles="mosaic")` and `solve="fused"`),
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

from pallas_kernels.kda import solve_mosaic
from pallas_kernels.kda.solve_mosaic import BF16, WGMMA, per_chunk, swizzled
from pallas_kernels.kda.tiles import CHUNK, F32, NT, SUB


def check_supported(dtype, K, V=None):
  """Raises unless this kernel takes these inputs: bf16, K a multiple of 64 up to 256 (and with the solve fused, V
  a multiple of 64 up to 192: V's blocks go through the three operand buffers)."""
  if jnp.dtype(dtype) != BF16 or K % 64 or K > 256 or (V is not None and (V % 64 or V > 192)):
    raise ValueError(f"the Mosaic GPU key tiles take bf16 with K in (64, 128, 192, 256) and, with the solve fused, V "
                     f"in (64, 128, 192); got {jnp.dtype(dtype).name}, K={K}, V={V}")


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
  return _launch(out, (q, k, loc, beta_BHT), docs_B2T, H=H, scale=scale, lower_bound=lower_bound, fused=False,
                 save=True, name="kda_intra_fwd_key_tiles_mosaic")


def intra(q, k, v, loc, beta_BHT, docs_B2T, *, scale, lower_bound, save):
  """The whole intra pass in one launch: the key tiles, then the solve (`solve_mosaic.unit_lower_inverse`) on B
  still in registers, U = M βV and W = M (βΓK) with βΓK still in shared memory, so neither B nor βΓK goes through
  memory. Returns W, U, Qs, Kd, A_qk (bf16), and with `save` B and M (fp32 `[B,T,H,64]`; None otherwise), as
  `fwd.intra_forward`."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  check_supported(q.dtype, K, V)
  shape = lambda d, dtype=BF16: jax.ShapeDtypeStruct((B, T, H, d), dtype)
  out = [shape(K), shape(V), shape(K), shape(K), shape(CHUNK)] + ([shape(CHUNK, F32)] * 2 if save else [])
  w, u, qs, kd, aqk, *saved = _launch(out, (q, k, loc, beta_BHT, v), docs_B2T, H=H, scale=scale,
                                      lower_bound=lower_bound, fused=True, save=save, name="kda_intra_fwd_mosaic")
  kk, minv = saved if save else (None, None)
  return w, u, qs, kd, aqk, kk, minv


def _launch(out, args, docs_B2T, *, H, scale, lower_bound, fused, save, name):
  docs = () if docs_B2T is None else (docs_B2T,)
  B, T = args[0].shape[:2]
  kernel = functools.partial(_chunk, H=H, scale=scale, c=SUB / 2 * lower_bound, has_docs=docs_B2T is not None,
                             fused=fused, save=save)
  return per_chunk(kernel, out, B, T, H, name)(*args, *docs)


def _chunk(q_gmem, k_gmem, loc_gmem, beta_gmem, *refs, H, scale, c, has_docs, fused, save):
  refs = list(refs)
  v_gmem = refs.pop(0) if fused else None
  docs_gmem = refs.pop(0) if has_docs else None
  if fused:
    w_gmem, u_gmem, qs_gmem, kd_gmem, aqk_gmem, *saved = refs
    kk_gmem, m_gmem = saved if save else (None, None)
    kgb_gmem = None
  else:
    aqk_gmem, kk_gmem, qs_gmem, kd_gmem, kgb_gmem = refs
  n, bh = lax.axis_index("n"), lax.axis_index("bh")
  b, h, rows = bh // H, bh % H, pl.ds(n * CHUNK, CHUNK)
  P = q_gmem.shape[-1] // 64
  PV = v_gmem.shape[-1] // 64 if fused else 0
  cols = [pl.ds(p * 64, 64) for p in range(max(P, PV))]
  square = lambda dtype: plgpu.SMEM((CHUNK, 64), dtype, transforms=swizzled(dtype))
  per_col = lambda v: lax.broadcast_in_dim(v, (CHUNK, 64), [1])
  per_row = lambda v: lax.broadcast_in_dim(v, (CHUNK, 64), [0])

  def scoped(q_s, k_s, kgb_s, qa_s, ka_s, kop_s, spare_s, tot_s, beta_s, docs_s, loaded):
    # Shared memory at K = 128: q, k, βΓK 48 KB, the operands 24 KB, then 32 KB scoped (the gates, then A, then M):
    # two programs per SM. Each pass overwrites its q and k columns with Qs and Kd once read; with the solve fused,
    # V's blocks load into the operand buffers after the last product, the solve's bf16 halves go through q's and
    # k's buffers once Qs and Kd are stored, U overwrites V and W overwrites βΓK.
    copies = [(q_gmem.at[b, rows, h, cols[p]], q_s[p]) for p in range(P)]
    copies += [(k_gmem.at[b, rows, h, cols[p]], k_s[p]) for p in range(P)]
    copies += [(beta_gmem.at[b, h, rows], beta_s)]
    copies += [(loc_gmem.at[b, n * CHUNK + j * SUB + SUB - 1, h], tot_s.at[j]) for j in range(NT)]
    copies += [(docs_gmem.at[b, j, rows], docs_s.at[j]) for j in range(2)] if has_docs else []
    for i, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])

    tile_row = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=WGMMA.reduce(1)) // SUB
    in_tile = lambda j: per_row(tile_row) == j

    def by_tile(vectors):
      """[64,64]: rows of tile J hold vectors[J] ([64]; zero past the list)."""
      out = jnp.zeros((CHUNK, 64), F32)
      for j, v in enumerate(vectors):
        out = jnp.where(in_tile(j), per_col(v), out)
      return out

    mask = lambda m, x: x if m is None else jnp.where(m, x, 0.0)
    beta_row = lambda: plgpu.load(beta_s, layout=WGMMA.reduce(1))

    def passes(loc_s, loc_loaded):
      for p in range(P):
        plgpu.copy_gmem_to_smem(loc_gmem.at[b, rows, h, cols[p]], loc_s[p], loc_loaded.at[p])
      for i in range(len(copies)):
        plgpu.barrier_wait(loaded.at[i])
      first = last = None                     # rows in the chunk's first / last document
      if has_docs:
        first = per_row(plgpu.load(docs_s.at[0], layout=WGMMA.reduce(1))) == 0
        last = per_row(plgpu.load(docs_s.at[1], layout=WGMMA.reduce(1))) == 0
      beta = per_row(beta_row())

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
          stores = ((q_s[p], qs_gmem), (k_s[p], kd_gmem)) + (() if fused else ((kgb_s[p], kgb_gmem),))
          for src, dst in stores:
            plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h, cols[p]])
          e_q = jnp.exp(loc - c)
          qe, kqe = (q * e_q).astype(BF16), (k * e_q).astype(BF16)
          kek = k * jnp.exp(c - loc)
          for i in range(NT):
            # Keys for anchor R_i: tile J <= i scaled by e^{R_i - R_J}, later tiles zero.
            qa_s[...] = jnp.where(in_tile(i), qe, jnp.zeros_like(qe))
            ka_s[...] = jnp.where(in_tile(i), kqe, jnp.zeros_like(kqe))
            kop_s[...] = (kek * by_tile([jnp.exp(span(j, i)) for j in range(i + 1)])).astype(BF16)
            plgpu.commit_smem()
            plgpu.wgmma(acc_qk, qa_s, kop_s.transpose((1, 0)))
            plgpu.wgmma(acc_kk, ka_s, kop_s.transpose((1, 0)))
            plgpu.wgmma_wait(0)                                  # before the operands are overwritten
        return acc_qk[...], acc_kk[...]

      return pl.run_scoped(accumulate, plgpu.ACC((CHUNK, CHUNK), F32), plgpu.ACC((CHUNK, CHUNK), F32))

    a_qk, a_kk = pl.run_scoped(passes, [square(F32)] * P, plgpu.Barrier(num_barriers=P))
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
      for src, dst in ((aqk_s, aqk_gmem),) + (((kk_s, kk_gmem),) if kk_gmem is not None else ()):
        plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)          # the scope's memory is reused after it

    pl.run_scoped(write, square(BF16), square(F32))
    if not fused:
      plgpu.wait_smem_to_gmem(0)
      return

    # The solve: q's and k's buffers (Qs and Kd stored: the write scope waited) take the products' bf16 halves.
    a_hi, a_lo, b_hi, b_lo = (list(q_s) + list(k_s) + list(spare_s))[:4]
    x = solve_mosaic.unit_lower_inverse(a_kk * lax.broadcast_in_dim(beta_row(), (CHUNK, CHUNK), [0]),
                                        (a_hi, a_lo, b_hi, b_lo))

    def outputs(m_s):
      if save:
        m_s[...] = x
      # U = (M diag β) V and W = M (βΓK): V and βΓK are exact in bf16, so two products each.
      beta_col = lax.broadcast_in_dim(plgpu.load(beta_s, layout=WGMMA.reduce(0)), (CHUNK, CHUNK), [1])
      (a_hi[...], a_lo[...]), (b_hi[...], b_lo[...]) = solve_mosaic.halves(x * beta_col), solve_mosaic.halves(x)
      plgpu.commit_smem()
      for j in range(PV):
        plgpu.barrier_wait(loaded.at[len(copies) + j])
        v_s[j][...] = solve_mosaic.product((CHUNK, 64), (a_hi, v_s[j]), (a_lo, v_s[j])).astype(BF16)
      for p in range(P):
        kgb_s[p][...] = solve_mosaic.product((CHUNK, 64), (b_hi, kgb_s[p]), (b_lo, kgb_s[p])).astype(BF16)
      plgpu.commit_smem()
      stores = [(v_s[j], u_gmem, cols[j]) for j in range(PV)] + [(kgb_s[p], w_gmem, cols[p]) for p in range(P)]
      stores += [(m_s, m_gmem, slice(None))] if save else []
      for src, dst, cs in stores:
        plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h, cs])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(outputs, square(F32))

  K = q_gmem.shape[-1]
  n_barriers = 2 * P + 1 + NT + 2 * has_docs + PV
  spares = max(0, 4 - 2 * P) if fused else 0
  pl.run_scoped(scoped, [square(BF16)] * P, [square(BF16)] * P, [square(BF16)] * P, square(BF16), square(BF16),
                square(BF16), [square(BF16)] * spares, plgpu.SMEM((NT, K), F32), plgpu.SMEM((CHUNK,), F32),
                plgpu.SMEM((2, CHUNK), jnp.int32), plgpu.Barrier(num_barriers=n_barriers))
