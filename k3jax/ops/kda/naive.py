"""References in plain JAX, written from the definitions (docs/design.md, KDA): the recurrence one token at a time,
which every fast path is held to, and the per-chunk quantities of the Pallas intra pass from pairwise decays and a
dense solve, which its launches (and, by autodiff, its backward) are held to."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.kda.common import CHUNK, SUB, IntraOutputs, check_inputs, reset_mask, zero_or

_HI = jax.lax.Precision.HIGHEST


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        segment_ids=None):
  """The recurrence (docs/design.md, KDA), one token at a time in fp32: the reference every fast path is held to."""
  B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
  scale = K ** -0.5 if scale is None else float(scale)
  o, S = _recurrence(q, k, v, g, beta, zero_or(initial_state, B, H, K, V), reset_mask(segment_ids, B, T), scale)
  return o, (S if output_final_state else None)


@functools.partial(jax.jit, static_argnums=(7,))
def _recurrence(q, k, v, g, beta, S0, reset, scale):
  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)

  def step(S_BHKV, xs):
    q_t, k_t, v_t, g_t, b_t, r_t = xs
    S_BHKV = S_BHKV * (1.0 - r_t)[:, None, None, None]
    o_t, S_BHKV = recurrent_step(q_t, k_t, v_t, g_t, b_t, S_BHKV, scale)
    return S_BHKV, o_t

  S, o_TBHV = jax.lax.scan(step, S0, (f32(q), f32(k), f32(v), f32(g), f32(beta), f32(reset)))
  return jnp.moveaxis(o_TBHV, 0, 1).astype(q.dtype), S


def recurrent_step(q_BHK, k_BHK, v_BHV, g_BHK, b_BH, S_BHKV, scale):
  """One token: S' = e^{g} ⊙ S, S = S' + k (β (v − S'ᵀk))ᵀ, o = scale·Sᵀq. Returns (o, S)."""
  S_BHKV = jnp.exp(g_BHK)[..., None] * S_BHKV
  err_BHV = v_BHV - jnp.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV, precision=_HI)
  S_BHKV = S_BHKV + jnp.einsum("bhk,bhv->bhkv", k_BHK, b_BH[..., None] * err_BHV, precision=_HI)
  o_BHV = jnp.einsum("bhk,bhkv->bhv", scale * q_BHK, S_BHKV, precision=_HI)
  return o_BHV, S_BHKV


def naive_chunk_intermediates(q, k, v, g, beta, reset=None, *, scale):
  """Per 64-token chunk, what the Pallas intra pass writes, from the definitions in the inputs' dtype (float64 under
  `jax.enable_x64` for a reference): pairwise decays e^{G_i − G_j} with G the cumulative log-decay from the chunk's
  start, masks by document, and a dense solve. T a multiple of 64; `reset` `[B,T]` (nonzero where a document starts)
  or None. Returns (`IntraOutputs`, loc) in the kernels' layout:
    w, u `[B,T,H,K|V]`: W = M βΓK and U = M βV, M = (I + A_kk)⁻¹, A_kk[i, j] = β_i B[i, j];
    qs, kd `[B,T,H,K]`: scale·q ⊙ Γ and k ⊙ e^{G_C − G}, Γ = e^{G} before the chunk's first document start (else 0),
      kd zero outside the chunk's last document;
    aqk `[B,T,H,64]`: scale Σ_c q_ic k_jc e^{G_ic − G_jc} for j <= i in one document (row i of its chunk's matrix);
    decay `[B,N,H,K]`: e^{G_C}, zero where a document starts inside the chunk;
    kk `[B,T,H,64]`: B[i, j] = Σ_c k_ic k_jc e^{G_ic − G_jc} for j < i in one document;
    minv `[B,T,H,64]`: M;
  and loc `[B,T,H,K]`: the cumulative sums of g within each 16-token tile."""
  B, T, H, K = q.shape
  N = T // CHUNK
  chunks = lambda x: jnp.moveaxis(x.reshape(B, N, CHUNK, H, *x.shape[3:]), 3, 1)     # [B,H,N,C,...]
  unchunk = lambda x: jnp.moveaxis(x, 1, 3).reshape(B, T, H, *x.shape[4:])
  q_c, k_c, v_c, g_c, b_c = (chunks(x) for x in (q, k, v, g, beta))
  r = jnp.zeros((B, T), jnp.int32) if reset is None else reset.astype(jnp.int32)
  doc = jnp.cumsum(r.reshape(B, N, CHUNK), axis=-1)[:, None]                         # [B,1,N,C]
  G = jnp.cumsum(g_c, axis=-2)
  i, j = jnp.arange(CHUNK)[:, None], jnp.arange(CHUNK)[None, :]
  same = doc[..., :, None] == doc[..., None, :]
  decays = jnp.exp(jnp.where((j <= i)[..., None], G[..., :, None, :] - G[..., None, :, :], -jnp.inf))  # [...,i,j,K]
  pair = lambda a, b_: jnp.einsum("...ic,...jc,...ijc->...ij", a, b_, decays, precision=_HI)
  aqk = scale * pair(q_c, k_c) * ((j <= i) & same)
  kk = pair(k_c, k_c) * ((j < i) & same)
  minv = jnp.linalg.inv(jnp.eye(CHUNK, dtype=q.dtype) + b_c[..., None] * kk)
  gamma = jnp.exp(G) * (doc == 0)[..., None]
  mm = lambda a, b_: jnp.einsum("...ij,...jd->...id", a, b_, precision=_HI)
  u, w = mm(minv, b_c[..., None] * v_c), mm(minv, b_c[..., None] * gamma * k_c)
  last = doc[..., -1:] == doc
  kd = k_c * jnp.exp(G[..., -1:, :] - G) * last[..., None]
  decay = jnp.exp(G[..., -1, :]) * (doc[..., -1:] == 0)                            # [B,H,N,K]
  loc = jnp.cumsum(g_c.reshape(*g_c.shape[:3], CHUNK // SUB, SUB, K), axis=-2).reshape(g_c.shape)
  intra = IntraOutputs(w=unchunk(w), u=unchunk(u), qs=unchunk(scale * q_c * gamma), kd=unchunk(kd), aqk=unchunk(aqk),
                       decay=jnp.moveaxis(decay, 1, 2), kk=unchunk(kk), minv=unchunk(minv))
  return intra, unchunk(loc)
