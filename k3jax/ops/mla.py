"""Gated MLA's attention over a latent cache (docs/design.md, gated MLA and generation): a prefill chunk against
the cache so far, and one decoded token against it.

The cache is `ckv_BLR`, the RMS-normed latents c_kv of every position of each row, `[B, L, R]` (R = kv_lora_rank).
Rows have their own lengths: the query of row b at position p attends to positions 0..p of row b.

- `chunk_attention` (prefill) up-projects cached latents to keys and values (k = c W_uk, v = c W_uv, head dims
  Dqk, Dv). The absorbed form would score queries against latents directly, but its products are R wide instead
  of Dqk and Dv (256 or 512 against 128): attention of a 4K–64K chunk against a long cache is bound by those
  products, and up-projecting the keys costs R/Tq of them (Tq the chunk or query tile, ≥ 1024), so up-projecting
  does about half the work at R = 256. Two implementations:
  "xla" (`chunk_attention_blocked`): an online softmax over key blocks, up-projected one block at a time; its
  scores pass through memory, so it runs at a fraction of the GPU's matrix rate.
  "cudnn" (`chunk_attention_split`): fused attentions merged by their log-sum-exps, the chunk over itself (causal)
  and over the cache's positions before the row's start, a block of keys at a time, each cut at the start by a key
  length (cuDNN's work follows the length). cuDNN's causal mask is aligned at the first key, so one call cannot
  hold "the prefix and my own past".
- `causal_attention` (training, a full prompt) is causal attention within documents, `segment_ids` marking them.
  "xla" masks the scores with the `[B,1,T,T]` document mask. "cudnn" gives cuDNN each row's runs of equal segment
  ids as packed sequences (`document_runs`: offsets and lengths, at most `max_documents` a row), so it computes no
  score across documents and reads no mask: the dense mask, which cuDNN takes as an additive bias, doubles the
  attention of one document and is O(T²) memory. A batch with a row of more runs takes `blocked_attention` instead
  (an fp32 online softmax over blocks, O(T) memory, slow; both are in the program and `lax.cond` picks, so XLA
  plans memory for both), and the result never depends on the bound.
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


IMPLS = ("xla", "cudnn")   # of `causal_attention` and `chunk_attention`


def causal_attention(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT=None, *, scale: float, impl: str = "xla",
                     max_documents: int = 16):
  """softmax(scale · q kᵀ) v with query t of a row attending to keys s ≤ t of its document: the same segment id
  (runs of equal ids; padding, id 0, is one more run). q, k `[B, T, H, Dqk]`, v `[B, T, H, Dv]`; returns
  `[B, T, H, Dv]` in q's dtype. `impl` "xla" (a dense mask) or "cudnn" (packed runs, at most `max_documents` a row,
  else `blocked_attention`; bf16 or fp16, a GPU)."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  Dv = v_BTHV.shape[-1]
  D = max(q_BTHD.shape[-1], Dv)
  # The fused attentions want one head dim for q, k and v: zero-pad to the larger (scores and outputs unchanged).
  q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, D - a.shape[-1]))) for a in (q_BTHD, k_BTHD, v_BTHV))

  if impl == "xla" or segment_ids_BT is None:
    mask = None if segment_ids_BT is None else document_mask(segment_ids_BT)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale,
                                        implementation=impl)[..., :Dv]
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  offsets, lengths, runs_B = document_runs(segment_ids_BT, max_documents)

  def packed():
    return cudnn.dot_product_attention(q, k, v, None, None, lengths, lengths, offsets, offsets, scale=scale,
                                       mask_type=cudnn.MaskType.PADDING_CAUSAL)

  def blocked():   # O(T) memory: XLA plans both branches' temporaries, and the fallback must not need T² of them
    return blocked_attention(q, k, v, segment_ids_BT, scale=scale)

  return jax.lax.cond(jnp.max(runs_B) <= max_documents, packed, blocked)[..., :Dv]


def saves_fused_attention(prim, *_, **__) -> bool:
  """A `jax.checkpoint` policy: keep what cuDNN's fused attention forward writes (the output and the softmax
  statistics its backward reads), so that a rematerialised layer does not run the attention forward again."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  return prim is cudnn._dot_product_attention_fwd_p_wrapper


def blocked_attention(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT, *, scale: float, block: int = 256):
  """`causal_attention`'s result by blocks of `block` queries and keys with an online softmax (FlashAttention's),
  in fp32: exact, O(T) memory besides one block pair, every pair at or below the diagonal computed (no document
  skipped). The backward recomputes the blocks from the saved log-sum-exps. Slow; it is the cuDNN path's fallback
  for rows of more documents than slots, where the dense mask would be O(T²) memory.

  It saves for the backward its inputs as given, its output in their dtype and the log-sum-exps, nothing in its
  fp32 `[B, H, T, D]` working layout: under the cuDNN path's `lax.cond` a residual of one branch fills a slot of the
  other branch's residual of the same shape and dtype, and any other is written as zeros whichever branch runs."""
  return _blocked(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT.astype(jnp.int32), float(scale), int(block))


_dot = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)   # the blocked attention's fp32 products


def _block_scores(q_blk, k_blk, seg, i, j, scale, block):
  """Scores of query block i against key block j, and which pairs may attend (causal, same document)."""
  s = _dot("bhqd,bhkd->bhqk", q_blk, k_blk) * scale
  pos = jnp.arange(block)
  ok = (_rows(seg, i, block, axis=1)[:, None, :, None] == _rows(seg, j, block, axis=1)[:, None, None, :]) & (
      (i * block + pos)[:, None] >= (j * block + pos)[None, :])
  return s, ok


def _rows(a, n, block, axis=2):
  """Block `n` of `a` along `axis` (the positions of `[B, H, Tp, ·]`, or of segment ids `[B, Tp]` with axis 1)."""
  return jax.lax.dynamic_slice_in_dim(a, n * block, block, axis=axis)


def _heads(block, seg_BT, *xs_BTHD):
  """The working layout: segment ids `[B, Tp]` and each of `xs` as fp32 `[B, H, Tp, ·]`, Tp = T rounded up to a
  whole block; padding positions are a document of their own (−1): no real query sees them, and each sees itself."""
  T = seg_BT.shape[1]
  Tp = -(-T // block) * block
  seg = jnp.pad(seg_BT, ((0, 0), (0, Tp - T)), constant_values=-1)
  return seg, *(jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3).astype(jnp.float32)
                for x in xs_BTHD)


def _back(x_BHTD, T, dtype):
  """`[B, H, Tp, ·]` back to the caller's `[B, T, H, ·]` and dtype."""
  return x_BHTD.transpose(0, 2, 1, 3)[:, :T].astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked(q_BTHD, k_BTHD, v_BTHV, seg_BT, scale, block):
  return _blocked_fwd(q_BTHD, k_BTHD, v_BTHV, seg_BT, scale, block)[0]


def _blocked_fwd(q_BTHD, k_BTHD, v_BTHV, seg_BT, scale, block):
  seg, q, k, v = _heads(block, seg_BT, q_BTHD, k_BTHD, v_BTHV)
  B, H, Tp, Dv = v.shape

  def query_block(i):
    qi = _rows(q, i, block)

    def key_block(j, carry):
      m, l, acc = carry
      s, ok = _block_scores(qi, _rows(k, j, block), seg, i, j, scale, block)
      m_new = jnp.maximum(m, jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1))
      p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
      correction = jnp.exp(m - m_new)
      acc = acc * correction[..., None] + _dot("bhqk,bhkd->bhqd", p, _rows(v, j, block))
      return m_new, l * correction + p.sum(-1), acc

    start = (jnp.full((B, H, block), -1e30, jnp.float32), jnp.zeros((B, H, block), jnp.float32),
             jnp.zeros((B, H, block, Dv), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, start)   # each query sees itself: l > 0
    return acc / l[..., None], m + jnp.log(l)

  o, lse = jax.lax.map(query_block, jnp.arange(Tp // block))          # [n, B, H, block, ·]
  o = _back(jnp.moveaxis(o, 0, 2).reshape(B, H, Tp, Dv), seg_BT.shape[1], q_BTHD.dtype)
  lse = jnp.moveaxis(lse, 0, 2).reshape(B, H, Tp)
  return o, (q_BTHD, k_BTHD, v_BTHV, seg_BT, o, lse)


def _blocked_bwd(scale, block, res, do_BTHV):
  q_BTHD, k_BTHD, v_BTHV, seg_BT, o_BTHV, lse = res
  seg, q, k, v, o, do = _heads(block, seg_BT, q_BTHD, k_BTHD, v_BTHV, o_BTHV, do_BTHV)
  n = q.shape[2] // block
  delta = jnp.sum(do * o, axis=-1)                                      # [B, H, Tp]

  def pair(i, j):
    """(p, ds) of query block i and key block j."""
    s, ok = _block_scores(_rows(q, i, block), _rows(k, j, block), seg, i, j, scale, block)
    p = jnp.where(ok, jnp.exp(s - _rows(lse[..., None], i, block)), 0.0)
    dp = _dot("bhqd,bhkd->bhqk", _rows(do, i, block), _rows(v, j, block))
    return p, p * (dp - _rows(delta[..., None], i, block))

  def dq_block(i):
    step = lambda j, dq: dq + _dot("bhqk,bhkd->bhqd", pair(i, j)[1], _rows(k, j, block)) * scale
    return jax.lax.fori_loop(0, i + 1, step, jnp.zeros_like(_rows(q, i, block)))

  def dkv_block(j):
    def step(i, carry):
      dk, dv = carry
      p, ds = pair(i, j)
      return (dk + _dot("bhqk,bhqd->bhkd", ds, _rows(q, i, block)) * scale,
              dv + _dot("bhqk,bhqd->bhkd", p, _rows(do, i, block)))
    return jax.lax.fori_loop(j, n, step, (jnp.zeros_like(_rows(k, j, block)), jnp.zeros_like(_rows(v, j, block))))

  T = seg_BT.shape[1]
  merge = lambda blocks, like: _back(
      jnp.moveaxis(blocks, 0, 2).reshape(blocks.shape[1], blocks.shape[2], -1, blocks.shape[-1]), T, like.dtype)
  dq = merge(jax.lax.map(dq_block, jnp.arange(n)), q_BTHD)
  dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
  return dq, merge(dk, k_BTHD), merge(dv, v_BTHV), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def document_mask(segment_ids_BT):
  """`[B, 1, T, T]` bool: query t and key s lie in the same document (equal segment ids)."""
  return (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]


def document_runs(segment_ids_BT, max_runs: int):
  """Each row's runs of equal segment ids in cuDNN's packed layout: (offsets `[B, M+1]`, lengths `[B, M]`, runs
  `[B]`) with M = `max_runs`. Run r of row b starts at position offsets[b, r] and holds lengths[b, r] positions;
  slots past the row's runs hold −1, and so does offsets' extra slot. `runs` counts all of a row's runs; those past
  the M-th are left out of the layout."""
  B, T = segment_ids_BT.shape
  starts_BT = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
  run_BT = jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32) - 1
  slot_BT = jnp.where(starts_BT & (run_BT <= max_runs), run_BT, max_runs + 1)      # max_runs + 1: dropped
  rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  starts = jnp.full((B, max_runs + 1), -1, jnp.int32).at[rows_BT, slot_BT].set(t_BT, mode="drop")  # runs 0..M
  runs_B = run_BT[:, -1] + 1
  r = jnp.arange(max_runs)[None]
  ends = jnp.where(r + 1 < runs_B[:, None], starts[:, 1:], T)                  # where the next run starts
  lengths = jnp.where(r < runs_B[:, None], ends - starts[:, :-1], -1)
  offsets = starts.at[:, max_runs].set(-1)
  return offsets, lengths, runs_B


def chunk_attention(q_BTHD, ckv_BLR, start_B, w_uk_RHD, w_uv_RHV, *, scale: float, impl: str = "xla"):
  """Softmax attention of a chunk of queries over the latent cache, up-projected to keys and values.

  Query t of row b sits at position start_b + t and attends to cached positions 0..start_b + t (its own latent
  must already be in the cache: `write_latents`). q `[B, T, H, Dqk]`, ckv `[B, L, R]`, start `[B]` int32 with
  start_b + T ≤ L for the rows' real tokens (later positions are padding: their outputs are arbitrary). `impl`:
  "xla" (`chunk_attention_blocked`) or "cudnn" (`chunk_attention_split` on cuDNN's fused attention; bf16 or fp16,
  a GPU). Returns o `[B, T, H, Dv]` in q's dtype."""
  if impl == "xla":
    return chunk_attention_blocked(q_BTHD, ckv_BLR, start_B, w_uk_RHD, w_uv_RHV, scale=scale)
  if impl == "cudnn":
    return chunk_attention_split(q_BTHD, ckv_BLR, start_B, w_uk_RHD, w_uv_RHV, scale=scale, attend=cudnn_attend)
  raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


SCORE_BYTES = 1 << 29   # fp32 scores of one (query tile, key block) step, B·H·Tq·Bk·4: 512 MiB


def chunk_attention_blocked(q_BTHD, ckv_BLR, start_B, w_uk_RHD, w_uv_RHV, *, scale: float, query_block: int = 4096,
                            key_block: int | None = None):
  """`chunk_attention` as an online softmax over key blocks, each up-projected as it is read.

  Queries are taken `query_block` at a time; for each,
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


KEY_BLOCK_TOKENS = 1 << 16   # cached keys up-projected per step of the split's prefix loop, all rows together


def chunk_attention_split(q_BTHD, ckv_BLR, start_B, w_uk_RHD, w_uv_RHV, *, scale: float, attend,
                          key_block: int | None = None):
  """`chunk_attention` as fused attentions merged by their log-sum-exps: the chunk over its own positions
  start_b … start_b + T − 1 (causal), then over each block of `key_block` cached positions before the furthest
  row's start (a dynamic count), each block up-projected as it is read and cut at the row's start by a key length.
  `key_block` None: KEY_BLOCK_TOKENS / B (at least 256, at most L).

  `attend(q, k, v, *, scale, kv_lengths_B)` is one attention (`cudnn_attend`): q `[B, T, H, D]`, k and v
  `[B, S, H, ·]`; `kv_lengths_B` int32 `[B]` ≥ 1 attends to each row's first keys, unmasked, and None is causal
  (S = T); it returns (o `[B, T, H, Dv]`, the log-sum-exp of the scaled scores `[B, H, T]` in fp32)."""
  B, T, _, _ = q_BTHD.shape
  L = ckv_BLR.shape[1]
  Bk = min(L, key_block or max(256, KEY_BLOCK_TOKENS // B))
  dtype = q_BTHD.dtype
  w_uk, w_uv = w_uk_RHD.astype(dtype), w_uv_RHV.astype(dtype)
  up = lambda c_BSR: (jnp.einsum("bsr,rhd->bshd", c_BSR, w_uk), jnp.einsum("bsr,rhv->bshv", c_BSR, w_uv))
  start_B = start_B.astype(jnp.int32)
  # The chunk's own latents, read back from the cache; positions past it (padding only) repeat its last one.
  pos_BT = jnp.minimum(start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None], L - 1)
  own_BTR = jnp.take_along_axis(ckv_BLR, pos_BT[..., None], axis=1).astype(dtype)
  o_BTHV, lse_BHT = attend(q_BTHD, *up(own_BTR), scale=scale, kv_lengths_B=None)

  def prefix_block(j, carry):
    pos_K = jnp.minimum(j * Bk + jnp.arange(Bk, dtype=jnp.int32), L - 1)   # past L: beyond every start, cut
    keys_B = jnp.clip(start_B - j * Bk, 0, Bk)
    o_j, lse_j = attend(q_BTHD, *up(jnp.take(ckv_BLR, pos_K, axis=1).astype(dtype)), scale=scale,
                        kv_lengths_B=jnp.maximum(keys_B, 1))
    return _merge(*carry, o_j, jnp.where(keys_B[:, None, None] > 0, lse_j, -jnp.inf))   # no keys: no weight

  num_blocks = -(-jnp.max(start_B) // Bk)
  o_BTHV, _ = jax.lax.fori_loop(0, num_blocks, prefix_block, (o_BTHV.astype(jnp.float32), lse_BHT))
  return o_BTHV.astype(dtype)


def _merge(o_a, lse_a, o_b, lse_b):
  """Two softmax attentions of the same queries over disjoint keys, (o `[B, T, H, V]`, lse `[B, H, T]`), as one;
  `lse_a` finite."""
  m = jnp.maximum(lse_a, lse_b)
  w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  to_o = lambda w_BHT: w_BHT.transpose(0, 2, 1)[..., None]
  o = (to_o(w_a) * o_a + to_o(w_b) * o_b.astype(jnp.float32)) / to_o(w_a + w_b)
  return o, m + jnp.log(w_a + w_b)


def cudnn_attend(q_BTHD, k_BSHD, v_BSHV, *, scale: float, kv_lengths_B):
  """One attention on cuDNN's fused kernel for `chunk_attention_split` (its contract). Head dims are zero-padded
  to the larger of q's and v's (scores and outputs unchanged). Calls JAX's cuDNN entry below `jax.nn`, whose
  public form returns the log-sum-exp in the output's dtype (bf16 would put ~3% errors in the merge)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  B, T, _, Dqk = q_BTHD.shape
  Dv = v_BSHV.shape[-1]
  D = max(Dqk, Dv)
  pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, D - a.shape[-1])))
  if kv_lengths_B is None:
    mask_type, lengths = cudnn.MaskType.CAUSAL, ()
  else:                                           # (bias, mask, query lengths, key lengths)
    mask_type, lengths = cudnn.MaskType.PADDING, (None, None, jnp.full((B,), T, jnp.int32), kv_lengths_B)
  o, lse_BHT = cudnn.dot_product_attention(pad(q_BTHD), pad(k_BSHD), pad(v_BSHV), *lengths, scale=scale,
                                           mask_type=mask_type, return_residual=True)
  return o[..., :Dv], lse_BHT


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
