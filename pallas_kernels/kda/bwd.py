"""Backward kernels: the reverse sequential pass for the state gradient and the parallel intra-chunk backward."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_call
from pallas_kernels.kda.tiles import (CHUNK, F32, NT, Gates, key_factor, load, masked, mm, mm_t, pairs, rows, store,
                                      t_mm, unit_lower_inverse, upper_ones)


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


def state_backward(do, aqk, kd, qs, w, decay, dS_T, *, block_v, num_warps=None):
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
  num_warps = num_warps or (8 if block_v > 64 else 4)
  return triton_call(kernel, grid=(V // block_v, B * H), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, name="kda_state_bwd", num_warps=num_warps, num_stages=2)(
                         do, aqk, kd, qs, w, decay, dS_T)


def _state_grad_kernel(h_ref, dh_ref, vn_ref, dvn_ref, do_ref, dw_ref, dqs_ref, dkd_ref, dd_ref, *, dtype):
  S, dS = h_ref[...], dh_ref[...]                                   # [BK, V] rows of the state, and its gradient
  dw_ref[...] = -mm_t(dvn_ref[...], S, dtype)
  dqs_ref[...] = mm_t(do_ref[...], S, dtype)
  dkd_ref[...] = mm_t(vn_ref[...], dS, dtype)
  dd_ref[...] = jnp.sum(S.astype(F32) * dS.astype(F32), axis=1)


def state_grad_products(h, dh, v_new, dv_new, do, *, block_k=64):
  """Gradients through v_new = U − W S, o = Qs S + …, S' = decay ⊙ S + Kdᵀ v_new w.r.t. W, Qs, Kd `[B,T,H,K]` and
  the state decay `[B,N,H,K]` (all fp32), from the states entering each chunk and the gradients leaving it.
  Parallel over chunks and blocks of K."""
  B, T, H, V = do.shape
  K = h.shape[2] // (T // CHUNK)
  block_k = min(block_k, K)
  N, nk = T // CHUNK, K // block_k
  state = pl.BlockSpec((None, None, block_k, V), lambda n, bh, kb: (bh // H, bh % H, n * nk + kb, 0))
  row_v = pl.BlockSpec((None, CHUNK, None, V), lambda n, bh, kb: (bh // H, n, bh % H, 0))
  row_k = pl.BlockSpec((None, CHUNK, None, block_k), lambda n, bh, kb: (bh // H, n, bh % H, kb))
  kdim = jax.ShapeDtypeStruct((B, T, H, K), F32)
  return triton_call(
      functools.partial(_state_grad_kernel, dtype=h.dtype), grid=(N, B * H, nk),
      in_specs=[state, state, row_v, row_v, row_v],
      out_specs=[row_k, row_k, row_k, pl.BlockSpec((None, None, None, block_k), lambda n, bh, kb: (bh // H, n, bh % H, kb))],
      out_shape=[kdim, kdim, kdim, jax.ShapeDtypeStruct((B, N, H, K), F32)], name="kda_state_grads",
      num_warps=4, num_stages=1)(h, dh, v_new, dv_new, do)


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref, vn_ref, dvn_ref, do_ref, dw_ref, dqs_ref,
                      dkd_ref, dd_ref, *refs, scale, lower_bound, has_reset, dtype):
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = refs
  gates = Gates(g_ref, reset_ref, lower_bound)
  beta = [rows(load(beta_ref, i)) for i in range(NT)]

  # Recompute B = A_kk/β and M = (I + βB)⁻¹.
  e_k = [gates.e_k(j) for j in range(NT)]
  B = {}
  for i in range(NT):
    kh = load(k_ref, i) * gates.e_q(i)
    for j in range(i + 1):
      B[i, j] = masked(mm_t(kh, load(k_ref, j) * key_factor(gates, e_k, i, j), dtype), gates.pair_mask(i, j, True))
  M = unit_lower_inverse({p: beta[p[0]] * B[p] for p in pairs()}, dtype)

  # Through [U, W] = M [βV, βΓK]: dX = Mᵀ [dU, dW] with dU = dv_new, and dA_kk = −dX [U, W]ᵀ.
  dB, dbeta, dk, dG = {}, [], [], []
  for i in range(NT):
    dXv = sum(t_mm(M[p, i], load(dvn_ref, p), dtype) for p in range(i, NT))
    dXk = sum(t_mm(M[p, i], load(dw_ref, p), dtype) for p in range(i, NT))
    k_i, gamma = load(k_ref, i), gates.gamma(i, gates.e_q(i))
    db = jnp.sum(dXv * load(v_ref, i), axis=1) + jnp.sum(dXk * gamma * k_i, axis=1)
    for j in range(i + 1):
      dA = masked(-(mm_t(dXv, load(u_ref, j), dtype) + mm_t(dXk, load(w_ref, j), dtype)), gates.pair_mask(i, j, True))
      db += jnp.sum(dA * B[i, j], axis=1)
      dB[i, j] = beta[i] * dA
    store(dv_ref, i, beta[i] * dXv)
    dbeta.append(db)
    dk.append(beta[i] * gamma * dXk)
    dG.append(dk[i] * k_i)

  # Through A_qk = scale·q̂ k̃ᵀ and B = k̂ k̃ᵀ. Each term depends on G_i − G_j only: it adds to dG_i and subtracts
  # from dG_j. Both sides use the operands as rounded for the GEMM, so that a pair's parts cancel exactly in dg
  # where they should (the diagonal e^0 terms would otherwise dominate dg's error).
  rounded = lambda a: a.astype(dtype).astype(F32)
  for i in range(NT):
    e_q = gates.e_q(i)
    q_i, k_i, do_i = load(q_ref, i), load(k_ref, i), load(do_ref, i)
    qh, kh = q_i * e_q, k_i * e_q
    dqh, dkh = jnp.zeros_like(qh), jnp.zeros_like(kh)
    for j in range(i + 1):
      factor = key_factor(gates, e_k, i, j)
      kt = load(k_ref, j) * factor
      dAqk = masked(scale * mm_t(do_i, load(vn_ref, j), dtype), gates.pair_mask(i, j, False))
      dqh += mm(dAqk, kt, dtype)
      dkh += mm(dB[i, j], kt, dtype)
      dkt = t_mm(dAqk, qh, dtype) + t_mm(dB[i, j], kh, dtype)
      dk[j] += dkt * factor
      dG[j] -= dkt * rounded(kt)
    gamma = gates.gamma(i, e_q)
    dqs = load(dqs_ref, i)
    store(dq_ref, i, dqh * e_q + scale * gamma * dqs)
    dk[i] += dkh * e_q
    dG[i] += dqh * rounded(qh) + dkh * rounded(kh) + scale * q_i * gamma * dqs

  # Through Kd = k·e^{G_C − G} and decay = e^{G_C}; then dg_m = Σ_{i>=m} dG_i + dG_C.
  dG_C = gates.decay() * dd_ref[...].reshape(1, -1)
  for i in range(NT):
    te = gates.to_end(i, e_k[i])
    dkd, k_i = load(dkd_ref, i), load(k_ref, i)
    store(dk_ref, i, dk[i] + te * dkd)
    dG[i] -= k_i * te * dkd
    dG_C += jnp.sum(k_i * te * dkd, axis=0, keepdims=True)
  later = dG_C
  for i in reversed(range(NT)):
    store(dg_ref, i, mm(upper_ones(), dG[i], F32) + later)
    later = later + jnp.sum(dG[i], axis=0, keepdims=True)
  for i in range(NT):
    store(dbeta_ref, i, dbeta[i])


def intra_backward(q, k, v, g, beta, reset, u, w, v_new, dv_new, do, dw, dqs, dkd, dd, *, scale, lower_bound,
                   num_warps=4):
  """Per chunk: dq, dk, dv, dg (fp32), dβ (fp32), from the recomputed U, W, the state pass's v_new and its gradient,
  dO, and the state-gradient products (dW, dQs, dKd, d decay)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  N = T // CHUNK
  row = lambda d: pl.BlockSpec((None, CHUNK, None, d), lambda n, bh: (bh // H, n, bh % H, 0))
  tok = pl.BlockSpec((None, CHUNK, None), lambda n, bh: (bh // H, n, bh % H))
  in_specs = [row(K), row(K), row(V), row(K), tok, row(V), row(K), row(V), row(V), row(V), row(K), row(K), row(K),
              pl.BlockSpec((None, None, None, K), lambda n, bh: (bh // H, n, bh % H, 0))]
  args = [q, k, v, g, beta, u, w, v_new, dv_new, do, dw, dqs, dkd, dd]
  if reset is not None:
    in_specs.append(pl.BlockSpec((None, CHUNK), lambda n, bh: (bh // H, n)))
    args.append(reset)
  out_shape = [jax.ShapeDtypeStruct((B, T, H, K), q.dtype), jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
               jax.ShapeDtypeStruct((B, T, H, V), v.dtype), jax.ShapeDtypeStruct((B, T, H, K), F32),
               jax.ShapeDtypeStruct((B, T, H), F32)]
  kernel = functools.partial(_intra_bwd_kernel, scale=scale, lower_bound=lower_bound, has_reset=reset is not None,
                             dtype=q.dtype)
  return triton_call(kernel, grid=(N, B * H), in_specs=in_specs, out_specs=[row(K), row(K), row(V), row(K), tok],
                     out_shape=out_shape, name="kda_intra_bwd", num_warps=num_warps, num_stages=1)(*args)
