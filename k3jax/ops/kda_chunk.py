"""Chunked KDA in plain JAX (the XLA path): parallel intra-chunk algebra, then a scan over chunks for the state.

Within a chunk of C tokens, exponents are anchored per 16-token sub-chunk I at R_I, the cumulative log-decay just
before I (causal: nothing after a token moves its anchor). Query-side factors e^{G_i - R_I} are <= 1 and key-side
factors e^{R_I - G_j} are <= 1 for every j before I, for any gate. Inside the diagonal tile e^{R_I - G_j} reaches
e^{16·|γ_min|}; with the bounded gate that is finite (SPEC.md §2) and the tile is one matrix product
(`factorise_diagonal=True`); otherwise the diagonal tiles use pairwise e^{G_i - G_j}.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64
SUB = 16
_HI = jax.lax.Precision.HIGHEST


def chunk_kda_xla(q, k, v, g, beta, *, scale, initial_state, reset, factorise_diagonal):
  """q,k,g `[B,T,H,K]`, v `[B,T,H,V]`, beta `[B,T,H]`, reset `[B,T]` bool, initial_state `[B,H,K,V]` fp32."""
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

  G = jnp.cumsum(g_c, axis=-2)                                          # [B,H,N,C,K]
  A_qk, A_kk = _intra_chunk_matrices(q_c * scale, k_c, G, doc, factorise_diagonal)
  A_kk = A_kk * b_c[..., None]

  sees_state = (doc == 0)[..., None]                                    # no reset between chunk start and token
  gamma = jnp.exp(G) * sees_state
  rhs = b_c[..., None] * jnp.concatenate([v_c, gamma * k_c], axis=-1)
  eye = jnp.eye(CHUNK, dtype=jnp.float32)
  UW = jax.scipy.linalg.solve_triangular(eye + A_kk, rhs, lower=True, unit_diagonal=True)
  U, W = UW[..., :v_c.shape[-1]], UW[..., v_c.shape[-1]:]

  G_last = G[..., -1:, :]
  last_doc = doc[..., -1:]
  k_to_end = k_c * jnp.exp(G_last - G) * (doc == last_doc)[..., None]   # e^{G_C - G_j} <= 1
  state_decay = jnp.exp(G_last[..., 0, :]) * (last_doc == 0)            # [B,H,N,K]
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


def _intra_chunk_matrices(q, k, G, doc, factorise_diagonal):
  """A_qk (j <= i) and A_kk without β (j < i), both masked to the same document: [B,H,N,C,C]."""
  *lead, C, K = q.shape
  S = C // SUB
  sub_of = jnp.arange(C) // SUB
  # R_I: cumulative log-decay just before sub-chunk I (0 for the first).
  R = jnp.concatenate([jnp.zeros((*lead, 1, K), G.dtype), G[..., SUB - 1:C - 1:SUB, :]], axis=-2)  # [...,S,K]
  R_tok = R[..., sub_of, :]                                                         # [...,C,K]
  q_hat = q * jnp.exp(G - R_tok)                                                    # <= |q|
  k_hat = k * jnp.exp(G - R_tok)
  # key-side factors per anchor I: e^{R_I - G_j}, kept only for j before the end of I (else the exponent is masked).
  before_end = jnp.arange(C)[None, :] < (jnp.arange(S)[:, None] + 1) * SUB          # [S,C]
  if not factorise_diagonal:
    before_end = jnp.arange(C)[None, :] < jnp.arange(S)[:, None] * SUB             # strictly earlier tiles only
  expo = jnp.where(before_end[..., None], R[..., :, None, :] - G[..., None, :, :], -jnp.inf)
  k_key = k[..., None, :, :] * jnp.exp(expo)                                        # [...,S,C,K]

  def scores(a):  # a: [...,C,K] query side -> [...,C,C]
    a = a.reshape(*lead, S, SUB, K)
    return _mm("...Iik,...Ijk->...Iij", a, k_key).reshape(*lead, C, C)

  A_qk, A_kk = scores(q_hat), scores(k_hat)
  if not factorise_diagonal:
    A_qk = A_qk + _diagonal_tiles_pairwise(q, k, G)
    A_kk = A_kk + _diagonal_tiles_pairwise(k, k, G)
  i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
  same_doc = doc[..., :, None] == doc[..., None, :]
  return A_qk * ((j <= i) & same_doc), A_kk * ((j < i) & same_doc)


def _diagonal_tiles_pairwise(a, k, G):
  """Σ_c a_ic k_jc e^{G_ic - G_jc} on the 16x16 diagonal tiles (j <= i), zero elsewhere: safe for any gate."""
  *lead, C, K = a.shape
  S = C // SUB
  tile = lambda x: x.reshape(*lead, S, SUB, K)
  a_t, k_t, G_t = tile(a), tile(k), tile(G)
  causal = (jnp.arange(SUB)[:, None] >= jnp.arange(SUB)[None, :])[..., None]
  expo = jnp.where(causal, G_t[..., :, None, :] - G_t[..., None, :, :], -jnp.inf)  # [...,S,i,j,K]
  d = jnp.einsum("...ik,...jk,...ijk->...ij", a_t, k_t, jnp.exp(expo), precision=_HI)
  eye_S = jnp.eye(S, dtype=d.dtype)
  return jnp.einsum("...Iij,IJ->...IiJj", d, eye_S).reshape(*lead, C, C)


def _mm(spec, a, b):
  return jnp.einsum(spec, a, b, precision=_HI)
