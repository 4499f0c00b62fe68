"""Chunked KDA in plain JAX (the XLA path): parallel intra-chunk algebra, then a scan over chunks for the state.

Within a chunk of C tokens, exponents are anchored per 16-token sub-chunk I at R_I, the cumulative log-decay just
before I (causal: nothing after a token moves its anchor). Query-side factors e^{G_i - R_I} are <= 1 and key-side
factors e^{R_I - G_j} are <= 1 for every j before I, for any gate. Inside the diagonal tile e^{R_I - G_j} reaches
e^{16·|γ_min|}; with the bounded gate that is finite (docs/design.md, KDA) and the tile is one matrix product. The
anchor is then shifted by the constant 8·γ_min, still causal, so each factor stays within e^{±8|γ_min|} (<= e^{44}):
unshifted, the query side would reach e^{-80} and its small components would underflow to denormals and flush
to zero. With the softplus gate (`lower_bound=None`) the diagonal tiles use pairwise e^{G_i - G_j}.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.kda.common import CHUNK, SUB

_HI = jax.lax.Precision.HIGHEST


def chunk_kda_xla(q, k, v, g, beta, *, scale, initial_state, reset, lower_bound):
  """q,k,g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, reset `[B,T]` bool, initial_state `[B,H,K,V]` fp32.

  `lower_bound`: g >= lower_bound >= -5.5 (the bounded gate) factorises the diagonal tiles; None does not.
  """
  B, T, H, K = q.shape
  N = -(-T // CHUNK)
  pad = N * CHUNK - T

  def to_chunks(x):
    # [B,T,H,...] -> [B,H,N,C,...] in fp32; padded tokens have k=v=q=beta=0 and g=0: they leave the state alone.
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, N, CHUNK, *x.shape[2:]), 3, 1)

  q_c, k_c, v_c, g_c = (to_chunks(x) for x in (q, k, v, g))           # [B,H,N,C,K|V]
  b_c = to_chunks(beta)                                                 # [B,H,N,C]
  r = jnp.pad(reset, [(0, 0), (0, pad)]).reshape(B, N, CHUNK)
  doc_BNC = jnp.cumsum(r.astype(jnp.int32), axis=-1)                   # resets seen so far inside the chunk
  doc = doc_BNC[:, None]                                                # [B,1,N,C], broadcasts over H

  A_qk, A_kk = _intra_chunk_matrices(q_c * scale, k_c, g_c, doc, lower_bound)
  A_kk = A_kk * b_c[..., None]

  # Log-decays as sums of same-sign terms, never as differences of cumulative sums (those lose ~eps·|G|).
  G = jnp.cumsum(g_c, axis=-2)                                          # chunk start -> i (inclusive)
  to_end = _suffix_sum(g_c, axis=-2)                                    # j (exclusive) -> chunk end
  sees_state = (doc == 0)[..., None]                                    # no reset between chunk start and token
  gamma = jnp.exp(G) * sees_state
  rhs = b_c[..., None] * jnp.concatenate([v_c, gamma * k_c], axis=-1)
  UW = _mm("...ij,...jd->...id", _unit_lower_inverse(A_kk), rhs)
  U, W = UW[..., :v_c.shape[-1]], UW[..., v_c.shape[-1]:]

  last_doc = doc[..., -1:]
  k_to_end = k_c * jnp.exp(to_end) * (doc == last_doc)[..., None]
  state_decay = jnp.exp(G[..., -1, :]) * (last_doc == 0)                # [B,H,N,K]
  q_state = q_c * scale * gamma

  def step(S_BHKV, xs):
    U_n, W_n, A_n, qs_n, kd_n, dec_n = xs
    v_new = U_n - _mm("bhck,bhkv->bhcv", W_n, S_BHKV)
    o_n = _mm("bhck,bhkv->bhcv", qs_n, S_BHKV) + _mm("bhcd,bhdv->bhcv", A_n, v_new)
    S_BHKV = dec_n[..., None] * S_BHKV + _mm("bhck,bhcv->bhkv", kd_n, v_new)
    return S_BHKV, o_n

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (U, W, A_qk, q_state, k_to_end, state_decay))
  S, o = jax.lax.scan(step, initial_state, xs)                          # o: [N,B,H,C,V]
  o = jnp.moveaxis(o, 0, 2).reshape(B, H, N * CHUNK, -1)[:, :, :T]
  return jnp.moveaxis(o, 1, 2).astype(q.dtype), S


def _intra_chunk_matrices(q, k, g, doc, lower_bound):
  """A_qk (j <= i) and A_kk without β (j < i), both masked to the same document: [B,H,N,C,C]."""
  *lead, C, K = q.shape
  S = C // SUB
  tiles = lambda x: x.reshape(*lead, S, SUB, K)
  g_t = tiles(g)
  shift = 0.0 if lower_bound is None else SUB / 2 * lower_bound
  local = jnp.cumsum(g_t, axis=-2)                                      # G_i - R_I: tile start -> i
  q_hat = tiles(q) * jnp.exp(local - shift)
  k_hat = tiles(k) * jnp.exp(local - shift)
  # R_I - G_j for j in an earlier tile J: the rest of J after j, plus whole tiles strictly between J and I.
  between = (jnp.arange(S)[None, :, None] < jnp.arange(S)[None, None, :]) & (
      jnp.arange(S)[None, None, :] < jnp.arange(S)[:, None, None])        # [I,J,P]: J < P < I
  gap_IJ = jnp.einsum("IJP,...PK->...IJK", between.astype(g.dtype), local[..., -1, :], precision=_HI)
  expo = gap_IJ[..., :, :, None, :] + _suffix_sum(g_t, axis=-2)[..., None, :, :, :]  # [...,I,J,j,K]
  earlier = (jnp.arange(S)[None, :] < jnp.arange(S)[:, None])[:, :, None, None]
  if lower_bound is not None:  # inside tile I: R_I - G_j = -local_j, at most 16·|γ_min|
    expo = jnp.where(jnp.eye(S, dtype=bool)[:, :, None, None], -local[..., None, :, :, :], expo)
    earlier = earlier | jnp.eye(S, dtype=bool)[:, :, None, None]
  k_key = tiles(k)[..., None, :, :, :] * jnp.exp(jnp.where(earlier, expo + shift, -jnp.inf))   # [...,I,J,j,K]

  def scores(a_hat):  # [...,I,i,K] -> [...,C,C]
    return _mm("...Iik,...IJjk->...IiJj", a_hat, k_key).reshape(*lead, C, C)

  A_qk, A_kk = scores(q_hat), scores(k_hat)
  if lower_bound is None:
    A_qk = A_qk + _diagonal_tiles_pairwise(q, k, g)
    A_kk = A_kk + _diagonal_tiles_pairwise(k, k, g)
  i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
  same_doc = doc[..., :, None] == doc[..., None, :]
  return A_qk * ((j <= i) & same_doc), A_kk * ((j < i) & same_doc)


def _diagonal_tiles_pairwise(a, k, g):
  """Σ_c a_ic k_jc e^{G_ic - G_jc} on the 16x16 diagonal tiles (j <= i), zero elsewhere: safe for any gate."""
  *lead, C, K = a.shape
  S = C // SUB
  tiles = lambda x: x.reshape(*lead, S, SUB, K)
  r = jnp.arange(SUB)
  span = ((r[None, :, None] < r[None, None, :]) & (r[None, None, :] <= r[:, None, None])).astype(g.dtype)  # [i,j,m]
  expo = jnp.einsum("ijm,...mk->...ijk", span, tiles(g), precision=_HI)            # Σ_{j<m<=i} g_m
  expo = jnp.where((r[:, None] >= r[None, :])[..., None], expo, -jnp.inf)
  d = jnp.einsum("...ik,...jk,...ijk->...ij", tiles(a), tiles(k), jnp.exp(expo), precision=_HI)
  return jnp.einsum("...Iij,IJ->...IiJj", d, jnp.eye(S, dtype=d.dtype)).reshape(*lead, C, C)


def _unit_lower_inverse(A):
  """(I + A)⁻¹ for strictly lower A `[..., C, C]`, as the kernels compute it: 16x16 diagonal blocks by forward
  substitution, then block rows M[I, :I] = −M_II · A[I, :I] · M[:I, :I]. (XLA's batched triangular solve runs
  ~40x slower than this on a CPU.)"""
  *lead, C, _ = A.shape
  S = C // SUB
  eye = jnp.broadcast_to(jnp.eye(SUB, dtype=A.dtype), (*lead, S, SUB, SUB))
  diag = jnp.stack([A[..., i * SUB:(i + 1) * SUB, i * SUB:(i + 1) * SUB] for i in range(S)], axis=-3)

  def substitute(r, M):  # row r of M = e_r − Σ_{j<r} N[r, j] M[j]; rows below r are still those of I
    n_r = jax.lax.dynamic_index_in_dim(diag, r, axis=-2, keepdims=False)                 # [..., S, 16]
    return M + jnp.where(jnp.arange(SUB)[:, None] == r, -_mm("...j,...jc->...c", n_r, M)[..., None, :], 0.0)

  M_diag = jax.lax.fori_loop(1, SUB, substitute, eye)
  M = jnp.zeros_like(A)
  for i in range(S):
    rows = slice(i * SUB, (i + 1) * SUB)
    block = jnp.zeros((*lead, SUB, C), A.dtype).at[..., i * SUB:(i + 1) * SUB].set(M_diag[..., i, :, :])
    if i:
      block = block - _mm("...ab,...bc->...ac", M_diag[..., i, :, :],
                          _mm("...ab,...bc->...ac", A[..., rows, :i * SUB], M[..., :i * SUB, :]))
    M = M.at[..., rows, :].set(block)
  return M


def _suffix_sum(x, axis):
  """Σ_{m>j} x_m along `axis`, computed as a running sum from the end (no cancellation)."""
  incl = jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis=axis), axis)
  zero = jnp.zeros_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis))
  return jnp.concatenate([jax.lax.slice_in_dim(incl, 1, None, axis=axis), zero], axis=axis)


def _mm(spec, a, b):
  return jnp.einsum(spec, a, b, precision=_HI)
