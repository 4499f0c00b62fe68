"""Backward kernels: the reverse sequential pass for the state gradient and the parallel intra-chunk backward."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_call
from pallas_kernels.kda.tiles import (CHUNK, F32, NT, SUB, Gates, Intra, masked, mm, mm_t, pairs, store_tiles, t_mm,
                                      tiles)


def _state_bwd_kernel(do_ref, aqk_ref, kd_ref, qs_ref, w_ref, decay_ref, dsT_ref, dvn_ref, dh_ref, ds0_ref, *,
                      num_chunks, dtype):
  def body(i, dS_KV):
    n = num_chunks - 1 - i
    rows = pl.ds(n * CHUNK, CHUNK)
    do = do_ref[rows, :]
    dv_new = t_mm(aqk_ref[rows, :], do, dtype) + mm(kd_ref[rows, :], dS_KV, dtype)
    dh_ref[pl.ds(n * dS_KV.shape[0], dS_KV.shape[0]), :] = dS_KV.astype(dh_ref.dtype)
    dvn_ref[rows, :] = dv_new.astype(dvn_ref.dtype)
    decay = decay_ref[pl.ds(n, 1), :].astype(F32).T
    return t_mm(qs_ref[rows, :], do, dtype) + decay * dS_KV - t_mm(w_ref[rows, :], dv_new, dtype)

  ds0_ref[...] = jax.lax.fori_loop(0, num_chunks, body, dsT_ref[...].astype(F32))


def state_backward(do, aqk, kd, qs, w, decay, dS_T, *, block_v):
  """Reverse pass over chunks. Returns dv_new `[B,T,H,V]` fp32, the gradient w.r.t. the state leaving each chunk
  `[B,H,N·K,V]` (input dtype) and the gradient w.r.t. the initial state `[B,H,K,V]` fp32."""
  B, T, H, K = w.shape
  V = do.shape[-1]
  N = T // CHUNK
  dt = w.dtype
  whole = lambda d: pl.BlockSpec((None, T, None, d), lambda vb, bh: (bh // H, 0, bh % H, 0))
  vcols = pl.BlockSpec((None, T, None, block_v), lambda vb, bh: (bh // H, 0, bh % H, vb))
  state = pl.BlockSpec((None, None, K, block_v), lambda vb, bh: (bh // H, bh % H, 0, vb))
  in_specs = [vcols, whole(CHUNK), whole(K), whole(K), whole(K),
              pl.BlockSpec((None, N, None, K), lambda vb, bh: (bh // H, 0, bh % H, 0)), state]
  out_shape = [jax.ShapeDtypeStruct((B, T, H, V), F32), jax.ShapeDtypeStruct((B, H, N * K, V), dt),
               jax.ShapeDtypeStruct((B, H, K, V), F32)]
  out_specs = [vcols, pl.BlockSpec((None, None, N * K, block_v), lambda vb, bh: (bh // H, bh % H, 0, vb)), state]
  kernel = functools.partial(_state_bwd_kernel, num_chunks=N, dtype=dt)
  return triton_call(kernel, grid=(V // block_v, B * H), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, name="kda_state_bwd", num_warps=4, num_stages=2)(
                         do, aqk, kd, qs, w, decay, dS_T)


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h_ref, dh_ref, vn_ref, dvn_ref, do_ref, *refs,
                      scale, lower_bound, has_reset, dtype):
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = refs
  gt = Gates(tiles(g_ref), tiles(reset_ref, jnp.int32) if has_reset else None, lower_bound)
  x = Intra(tiles(q_ref), tiles(k_ref), tiles(v_ref), tiles(beta_ref), gt, scale=scale, dtype=dtype)
  S, dS = h_ref[...].astype(F32), dh_ref[...].astype(F32)      # state entering / gradient leaving the chunk
  vn, dvn, do = tiles(vn_ref), tiles(dvn_ref), tiles(do_ref)

  # Through the state pass: v_new = U − W S, o = Qs S + A_qk v_new, S' = decay ⊙ S + Kdᵀ v_new.
  dW = [-mm_t(d, S, dtype) for d in dvn]
  dQs = [mm_t(d, S, dtype) for d in do]
  dKd = [mm_t(v, dS, dtype) for v in vn]
  dAqk = {(i, j): masked(mm_t(do[i], vn[j], dtype), gt.pair_mask(i, j, False)) for i, j in pairs()}

  # Through [U, W] = M [βV, βΓK] with M = (I + A_kk)⁻¹: dX = Mᵀ dY, dA_kk = −dX [U, W]ᵀ.
  dXv = [sum(t_mm(x.M[p, i], dvn[p], dtype) for p in range(i, NT)) for i in range(NT)]
  dXk = [sum(t_mm(x.M[p, i], dW[p], dtype) for p in range(i, NT)) for i in range(NT)]
  dAkk = {(i, j): masked(-(mm_t(dXv[i], x.U[j], dtype) + mm_t(dXk[i], x.W[j], dtype)), gt.pair_mask(i, j, True))
          for i, j in pairs()}
  dv = [b * d for b, d in zip(x.beta, dXv)]
  dbeta = [jnp.sum(dXv[i] * x.v[i], axis=1) + jnp.sum(dXk[i] * x.gamma[i] * x.k[i], axis=1)
           + sum(jnp.sum(dAkk[i, j] * x.B[i, j], axis=1) for j in range(i + 1)) for i in range(NT)]
  dk = [b * gm * d for b, gm, d in zip(x.beta, x.gamma, dXk)]
  dG = [a * d for a, d in zip(x.bgk, dXk)]

  # Through the anchored products A_qk = scale·q̂ k̃ᵀ and A_kk/β = k̂ k̃ᵀ; each term depends on G_i − G_j only, so it
  # adds to dG_i and subtracts from dG_j. Both sides use the operands as rounded for the GEMM, so that a pair's
  # two parts cancel exactly in dg where they should (the diagonal terms, e^0, dominate otherwise).
  rounded = lambda a: a.astype(dtype).astype(F32)
  dqh = [jnp.zeros_like(a) for a in x.qh]
  dkh = [jnp.zeros_like(a) for a in x.kh]
  for i, j in pairs():
    dB = x.beta[i] * dAkk[i, j]
    dqh[i] += scale * mm(dAqk[i, j], x.kt[i, j], dtype)
    dkh[i] += mm(dB, x.kt[i, j], dtype)
    dkt = scale * t_mm(dAqk[i, j], x.qh[i], dtype) + t_mm(dB, x.kh[i], dtype)
    dk[j] += dkt * x.anchor_k[i, j]
    dG[j] -= dkt * rounded(x.kt[i, j])
  dq = [d * a for d, a in zip(dqh, x.anchor_q)]
  for i in range(NT):
    dk[i] += dkh[i] * x.anchor_q[i]
    dG[i] += dqh[i] * rounded(x.qh[i]) + dkh[i] * rounded(x.kh[i])

  # Through Qs = scale·q·Γ, Kd = k·e^{G_C − G}, decay = e^{G_C}.
  kd = x.k_to_end()
  dG_C = gt.state_decay() * jnp.sum(S * dS, axis=1)[None, :]
  for i in range(NT):
    dq[i] += scale * x.gamma[i] * dQs[i]
    dG[i] += scale * x.q[i] * x.gamma[i] * dQs[i]
    dk[i] += masked(jnp.exp(gt.to_end[i]), gt.in_last_doc(i)) * dKd[i]
    dG[i] -= kd[i] * dKd[i]
    dG_C += jnp.sum(kd[i] * dKd[i], axis=0, keepdims=True)

  # G_i = Σ_{m<=i} g_m and G_C = Σ_m g_m: dg_m = Σ_{i>=m} dG_i + dG_C (suffix sums as a triangular product).
  r = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  c = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  upper = jnp.where(c >= r, 1.0, 0.0).astype(F32)
  dg, later = [None] * NT, dG_C
  for i in reversed(range(NT)):
    dg[i] = mm(upper, dG[i], F32) + later
    later = later + jnp.sum(dG[i], axis=0, keepdims=True)

  store_tiles(dq_ref, dq)
  store_tiles(dk_ref, dk)
  store_tiles(dv_ref, dv)
  store_tiles(dg_ref, dg)
  for i in range(NT):
    dbeta_ref[pl.ds(i * SUB, SUB)] = dbeta[i].astype(dbeta_ref.dtype)


def intra_backward(q, k, v, g, beta, reset, h, dh, v_new, dv_new, do, *, scale, lower_bound):
  """Per chunk, from the states and state gradients of the two sequential passes: dq, dk, dv, dg (fp32), dβ (fp32)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  N = T // CHUNK
  row = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda n, bh: (bh // H, n, bh % H, 0))
  per_chunk = pl.BlockSpec((None, None, K, V), lambda n, bh: (bh // H, bh % H, n, 0))
  in_specs = [row(K), row(K), row(V), row(K), pl.BlockSpec((None, CHUNK, None), lambda n, bh: (bh // H, n, bh % H)),
              per_chunk, per_chunk, row(V), row(V), row(V)]
  args = [q, k, v, g, beta, h, dh, v_new, dv_new, do]
  if reset is not None:
    in_specs.append(pl.BlockSpec((None, CHUNK), lambda n, bh: (bh // H, n)))
    args.append(reset)
  out_shape = [jax.ShapeDtypeStruct((B, T, H, K), q.dtype), jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
               jax.ShapeDtypeStruct((B, T, H, V), v.dtype), jax.ShapeDtypeStruct((B, T, H, K), F32),
               jax.ShapeDtypeStruct((B, T, H), F32)]
  out_specs = [row(K), row(K), row(V), row(K), pl.BlockSpec((None, CHUNK, None), lambda n, bh: (bh // H, n, bh % H))]
  kernel = functools.partial(_intra_bwd_kernel, scale=scale, lower_bound=lower_bound, has_reset=reset is not None,
                             dtype=q.dtype)
  return triton_call(kernel, grid=(N, B * H), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                     name="kda_intra_bwd", num_warps=4, num_stages=1)(*args)
