"""Forward kernels: the parallel intra-chunk pass and the sequential state pass that also writes the output."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_call
from pallas_kernels.kda.tiles import (CHUNK, F32, NT, SUB, Gates, key_factor, load, masked, mm, mm_t, pairs, rows, store,
                                      t_mm, unit_lower_inverse)


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, lower_bound, has_reset, dtype):
  reset_ref, refs = (refs[0], refs[1:]) if has_reset else (None, refs)
  w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref = refs
  gates = Gates(g_ref, reset_ref, lower_bound)
  e_k = [gates.e_k(j) for j in range(NT)]

  # A_qk (written as it is made), B = A_kk/β, and the decayed queries.
  B, zero = {}, jnp.zeros((SUB, SUB), aqk_ref.dtype)
  for i in range(NT):
    e_q = gates.e_q(i)
    q_i = load(q_ref, i)
    qh, kh = q_i * e_q, load(k_ref, i) * e_q
    for j in range(NT):
      cols = (pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB))
      if j > i:
        aqk_ref[cols] = zero
        continue
      kt = load(k_ref, j) * key_factor(gates, e_k, i, j)
      aqk_ref[cols] = masked(scale * mm_t(qh, kt, dtype), gates.pair_mask(i, j, False)).astype(aqk_ref.dtype)
      B[i, j] = masked(mm_t(kh, kt, dtype), gates.pair_mask(i, j, True))
    store(qs_ref, i, scale * q_i * gates.gamma(i, e_q))
  for i in range(NT):
    store(kd_ref, i, load(k_ref, i) * gates.to_end(i, e_k[i]))
  decay_ref[...] = gates.decay().reshape(decay_ref.shape)

  # U = M βV and W = M βΓK with M = (I + βB)⁻¹.
  beta = [rows(load(beta_ref, i)) for i in range(NT)]
  M = unit_lower_inverse({p: beta[p[0]] * B[p] for p in pairs()}, dtype)
  bv = [(b * load(v_ref, j)).astype(dtype) for j, b in enumerate(beta)]
  bgk = [(b * gates.gamma(j, gates.e_q(j)) * load(k_ref, j)).astype(dtype) for j, b in enumerate(beta)]
  for i in range(NT):
    store(u_ref, i, sum(mm(M[i, j], bv[j], dtype) for j in range(i + 1)))
    store(w_ref, i, sum(mm(M[i, j], bgk[j], dtype) for j in range(i + 1)))


def intra_forward(q, k, v, g, beta, reset, *, scale, lower_bound, num_warps=8):
  """Per chunk: W, U, scaled decayed queries, keys decayed to the chunk end, A_qk, and the chunk's state decay.

  Shapes: q,k,g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, reset `[B,T]` int32 or None, T a multiple of 64.
  Returns w, qs, kd `[B,T,H,K]`, u `[B,T,H,V]`, aqk `[B,T,H,64]` (row i: A_qk[i, :] of its chunk), decay
  `[B,N,H,K]` fp32.
  """
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
  out_shape = [jax.ShapeDtypeStruct((B, T, H, K), dt), jax.ShapeDtypeStruct((B, T, H, V), dt),
               jax.ShapeDtypeStruct((B, T, H, K), dt), jax.ShapeDtypeStruct((B, T, H, K), dt),
               jax.ShapeDtypeStruct((B, T, H, CHUNK), dt), jax.ShapeDtypeStruct((B, N, H, K), F32)]
  out_specs = [row(K), row(V), row(K), row(K), row(CHUNK),
               pl.BlockSpec((None, None, None, K), lambda n, bh: (bh // H, n, bh % H, 0))]
  kernel = functools.partial(_intra_kernel, scale=scale, lower_bound=lower_bound, has_reset=reset is not None,
                             dtype=dt)
  return triton_call(kernel, grid=(N, B * H), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                     name="kda_intra_fwd", num_warps=num_warps, num_stages=1)(*args)


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
  whole = lambda d: pl.BlockSpec((None, T, None, d), lambda vb, bh: (bh // H, 0, bh % H, 0))
  vcols = pl.BlockSpec((None, T, None, block_v), lambda vb, bh: (bh // H, 0, bh % H, vb))
  state = pl.BlockSpec((None, None, K, block_v), lambda vb, bh: (bh // H, bh % H, 0, vb))
  in_specs = [whole(K), vcols, whole(K), whole(K), whole(CHUNK),
              pl.BlockSpec((None, N, None, K), lambda vb, bh: (bh // H, 0, bh % H, 0)), state]
  final = jax.ShapeDtypeStruct((B, H, K, V), F32)
  if save:
    out_shape = [final, jax.ShapeDtypeStruct((B, H, N * K, V), dt), jax.ShapeDtypeStruct((B, T, H, V), dt)]
    out_specs = [state, pl.BlockSpec((None, None, N * K, block_v), lambda vb, bh: (bh // H, bh % H, 0, vb)), vcols]
  else:
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, T, H, V), dt), final], [vcols, state]
  kernel = functools.partial(_state_kernel, num_chunks=N, save=save, dtype=dt)
  num_warps = num_warps or (8 if block_v > 64 else 4)
  outs = triton_call(kernel, grid=(V // block_v, B * H), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, name="kda_state_fwd", num_warps=num_warps, num_stages=2)(
                         w, u, qs, kd, aqk, decay, S0)
  return (None, *outs) if save else tuple(outs)
