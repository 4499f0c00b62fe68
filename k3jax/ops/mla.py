"""Gated MLA's attention over a latent cache (docs/design.md, gated MLA and generation): a prefill chunk against
the cache so far, and one decoded token against it.

The cache is `ckv_BLR`, the RMS-normed latents c_kv of every position of each row, `[B, L, R]` (R = kv_lora_rank).
Rows have their own lengths: the query of row b at position p attends to positions 0..p of row b.

- `chunk_attention` (prefill) up-projects cached latents to keys and values (k = c W_uk, v = c W_uv, head dims
  Dqk, Dv) one key block at a time and runs an online softmax over the blocks. The absorbed form would score
  queries against latents directly, but its products are R wide instead of Dqk and Dv (256 or 512 against 128):
  attention of a 4K–64K chunk against a long cache is bound by those products, and re-projecting a key block
  costs R/Tq of them (Tq the query tile, ≥ 1024), so up-projecting does about half the work at R = 256.
- `decode_attention` (one token) is absorbed: q̃_h = W_uk,h q_h scores the latents (multi-query attention with
  one shared key/value head of width R) and the result is the attention-weighted latent; decoding is bound by
  reading the cache, which this reads once per step (the Pallas kernel) instead of materialising keys and values.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.config import MLA_DECODE_IMPLS as DECODE_IMPLS


def write_latents(ckv_BLR, c_BTR, start_B, lengths_B):
  """The cache with row b's first `lengths_B[b]` latents of `c_BTR` written at positions start_b, start_b + 1, …
  (the rest of the chunk, padding, writes nothing). Positions ≥ L are dropped: callers size the cache."""
  B, T, _ = c_BTR.shape
  L = ckv_BLR.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)[None]
  pos_BT = jnp.where(t < lengths_B[:, None], start_B[:, None] + t, L)            # L: out of range, dropped
  rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  return ckv_BLR.at[rows_BT, pos_BT].set(c_BTR.astype(ckv_BLR.dtype), mode="drop")


SCORE_BYTES = 1 << 29   # fp32 scores of one (query tile, key block) step, B·H·Tq·Bk·4: 512 MiB


def chunk_attention(q_BTHD, ckv_BLR, start_B, w_uk_RHD, w_uv_RHV, *, scale: float, query_block: int = 4096,
                    key_block: int | None = None):
  """Softmax attention of a chunk of queries over the latent cache, up-projected block by block.

  Query t of row b sits at position start_b + t and attends to cached positions 0..start_b + t (its own
  latent must already be in the cache: `write_latents`). Queries are taken `query_block` at a time; for each,
  key blocks of `key_block` positions up to the last one any row needs (a dynamic count: the cost follows the rows'
  positions, not L). `key_block` None: the largest power of two in [256, 4096] whose scores fit SCORE_BYTES (each
  step of the loop costs a launch and a host round trip, so blocks are long). Scores and the softmax in fp32,
  products in the inputs' dtype. Returns o `[B, T, H, Dv]`.
  """
  B, T, H, D = q_BTHD.shape
  L, R = ckv_BLR.shape[1:]
  Dv = w_uv_RHV.shape[-1]
  dtype = q_BTHD.dtype
  Tq = min(query_block, T)
  if key_block is None:
    key_block = 4096
    while key_block > 256 and B * H * Tq * key_block * 4 > SCORE_BYTES:
      key_block //= 2
  Bk = min(key_block, L)
  nq = -(-T // Tq)
  q = jnp.pad(q_BTHD, ((0, 0), (0, nq * Tq - T), (0, 0), (0, 0)))
  q_NBHTD = q.reshape(B, nq, Tq, H, D).transpose(1, 0, 3, 2, 4)
  w_uk, w_uv = w_uk_RHD.astype(dtype), w_uv_RHV.astype(dtype)
  first_B = start_B.astype(jnp.int32)

  def query_tile(args):
    i, q_BHTD = args
    qpos_BT = first_B[:, None] + i * Tq + jnp.arange(Tq, dtype=jnp.int32)[None]
    num_blocks = jnp.minimum(-(-(jnp.max(qpos_BT) + 1) // Bk), -(-L // Bk))

    def key_block_step(j, carry):
      m_BHT, l_BHT, acc_BHTV = carry
      nominal = j * Bk
      begin = jnp.minimum(nominal, L - Bk)             # the last block is shifted back to fit; its overlap masked
      c_BKR = jax.lax.dynamic_slice(ckv_BLR, (0, begin, 0), (B, Bk, R)).astype(dtype)
      k_BHKD = jnp.einsum("bkr,rhd->bhkd", c_BKR, w_uk)
      v_BHKV = jnp.einsum("bkr,rhv->bhkv", c_BKR, w_uv)
      s = jnp.einsum("bhtd,bhkd->bhtk", q_BHTD, k_BHKD, preferred_element_type=jnp.float32) * scale
      kpos_K = begin + jnp.arange(Bk, dtype=jnp.int32)
      allowed_BTK = (kpos_K[None, None] >= nominal) & (kpos_K[None, None] <= qpos_BT[:, :, None])
      s = jnp.where(allowed_BTK[:, None], s, -jnp.inf)
      m_new = jnp.maximum(m_BHT, jnp.max(s, axis=-1))
      alpha = jnp.exp(m_BHT - m_new)                   # 0 on the first block (m = −inf, m_new finite)
      p = jnp.exp(s - m_new[..., None])
      pv = jnp.einsum("bhtk,bhkv->bhtv", p.astype(dtype), v_BHKV, preferred_element_type=jnp.float32)
      return m_new, alpha * l_BHT + jnp.sum(p, axis=-1), alpha[..., None] * acc_BHTV + pv

    # Every query attends to position 0, so after block 0 every row of m is finite.
    init = (jnp.full((B, H, Tq), -jnp.inf, jnp.float32), jnp.zeros((B, H, Tq), jnp.float32),
            jnp.zeros((B, H, Tq, Dv), jnp.float32))
    _, l_BHT, acc_BHTV = jax.lax.fori_loop(0, num_blocks, key_block_step, init)
    return (acc_BHTV / l_BHT[..., None]).astype(dtype)

  o_NBHTV = jax.lax.map(query_tile, (jnp.arange(nq, dtype=jnp.int32), q_NBHTD))
  return o_NBHTV.transpose(1, 0, 3, 2, 4).reshape(B, nq * Tq, H, Dv)[:, :T]


def decode_attention(q_BHR, ckv_BLR, lengths_B, *, scale: float, impl: str = "auto"):
  """Absorbed decode attention: softmax(scale · q̃ ckvᵀ) ckv over each row's first `lengths_B[b]` cached latents
  (≥ 1). q̃ `[B, H, R]`; returns the attention-weighted latent `[B, H, R]` in q̃'s dtype. `impl`: "xla" (einsums
  over the whole cache, masked), "pallas" (the split-K kernel, `pallas_kernels.mla_decode`, which reads only each
  row's own length), "auto" (the kernel on a GPU when it applies, else XLA)."""
  if impl not in DECODE_IMPLS:
    raise ValueError(f"impl must be one of {DECODE_IMPLS}, got {impl!r}")
  if pick_decode_impl(impl, q_BHR.shape[-1], ckv_BLR.shape[1]) == "pallas":
    from pallas_kernels.mla_decode import mla_decode
    return mla_decode(q_BHR, ckv_BLR, lengths_B, scale=scale)
  return decode_attention_xla(q_BHR, ckv_BLR, lengths_B, scale=scale)


def decode_attention_xla(q_BHR, ckv_BLR, lengths_B, *, scale: float):
  """`decode_attention` as XLA einsums over the whole cache (positions ≥ the row's length masked)."""
  L = ckv_BLR.shape[1]
  s = jnp.einsum("bhr,blr->bhl", q_BHR, ckv_BLR, preferred_element_type=jnp.float32) * scale
  s = jnp.where(jnp.arange(L)[None, None] < lengths_B[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(q_BHR.dtype)
  return jnp.einsum("bhl,blr->bhr", p, ckv_BLR.astype(q_BHR.dtype))


def pick_decode_impl(impl: str, R: int, L: int) -> str:
  """"xla" or "pallas" for `impl`: "auto" takes the kernel on a GPU where it applies (R a power of two ≥ 16, a cache
  of ≥ 16 positions); "pallas" refuses the rest (the kernel's own checks, before any compute)."""
  fits = R >= 16 and not R & (R - 1) and L >= 16
  if impl == "pallas":
    if not fits:
      raise ValueError(f"the Pallas MLA decode kernel needs kv_lora_rank a power of two >= 16 and a cache of >= 16 "
                       f"positions, got R={R}, L={L}; use mla.decode_impl='xla'")
    return "pallas"
  if impl == "auto" and jax.default_backend() == "gpu" and fits and _kernel_available():
    return "pallas"
  return "xla"


@functools.cache
def _kernel_available() -> bool:
  try:
    import pallas_kernels.mla_decode  # noqa: F401
    return True
  except ImportError:
    return False
