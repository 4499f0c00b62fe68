"""Absorbed MLA decode attention as a split-K (flash-decoding) Triton kernel (docs/design.md, gated MLA).

    o_b = softmax(scale · q̃_b ckv_bᵀ) ckv_b   over row b's first n_b latents;  q̃ `[B, H, R]`, ckv `[B, L, R]`

Decoding one token is bound by reading the cache. The latents are both the keys and the values (one shared
head of width R), so each block of the cache is loaded once and used for both products; XLA's einsums read the
cache twice and write the scores between. Each row's own length is cut into `num_splits` equal parts, one program
per (row, head block, part), so every program has work whatever the row's length and no program reads past it. A
program runs the online softmax over its part in blocks of `block_l` latents for `block_h` heads at once (padded to
at least 16 rows for the tensor cores; up to 16 heads in one block, so a small model reads its cache once) and writes
its running max, sum and unnormalised accumulator (fp32); `combine` merges the parts.
Scores, softmax and accumulation in fp32; the probabilities enter the second product in the cache's dtype, as in
the XLA path.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import fp32_products, triton_call

F32 = jnp.float32
MIN_ROWS = 16           # tl.dot's smallest M: a head block is padded to it
PROGRAMS = 528          # about four per SM of an H200 (132 SMs)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Launch parameters; None picks the defaults (`default_config`)."""
  block_l: int | None = None       # latents per inner step
  block_h: int | None = None       # heads per program (a power of two ≥ 16)
  num_splits: int | None = None    # parts of each row's length
  num_warps: int = 4
  num_stages: int = 2


def default_config(B: int, H: int, L: int, R: int, config: DecodeConfig | None = None) -> DecodeConfig:
  """Blocks of 64 KB of bf16 latents (128 rows at R = 256, 64 at R = 512; at most L); head blocks of all heads
  (padded to a power of two) while the fp32 accumulator, block_h × R, stays within 32 KB, never under 16 rows;
  enough parts for ~PROGRAMS programs, but no more than one block per part at the cache's length."""
  config = config or DecodeConfig()
  block_l = config.block_l or max(16, min(128, 32768 // R, 1 << (L.bit_length() - 1)))
  if block_l < 16 or block_l & (block_l - 1) or block_l > L:
    raise ValueError(f"block_l must be a power of two in [16, L={L}], got {block_l}")
  block_h = config.block_h or max(MIN_ROWS, min(_pow2_at_least(H), 8192 // R))
  if block_h < MIN_ROWS or block_h & (block_h - 1):
    raise ValueError(f"block_h must be a power of two >= {MIN_ROWS}, got {block_h}")
  head_blocks = -(-H // block_h)
  num_splits = config.num_splits or max(1, min(-(-PROGRAMS // (B * head_blocks)), -(-L // block_l)))
  return dataclasses.replace(config, block_l=block_l, block_h=block_h, num_splits=num_splits)


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def check_inputs(q_BHR, ckv_BLR, lengths_B):
  if q_BHR.ndim != 3 or ckv_BLR.ndim != 3:
    raise ValueError(f"q must be [B,H,R] and ckv [B,L,R], got {tuple(q_BHR.shape)} and {tuple(ckv_BLR.shape)}")
  B, H, R = q_BHR.shape
  if ckv_BLR.shape[0] != B or ckv_BLR.shape[2] != R:
    raise ValueError(f"ckv must be [B={B}, L, R={R}], got {tuple(ckv_BLR.shape)}")
  if R < 16 or R & (R - 1):
    raise ValueError(f"the kernel needs R (kv_lora_rank) a power of two >= 16, got {R}")
  if ckv_BLR.shape[1] < 16:
    raise ValueError(f"the kernel needs a cache of at least 16 positions, got L={ckv_BLR.shape[1]}")
  if lengths_B.shape != (B,) or not jnp.issubdtype(lengths_B.dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer array [B={B}], got {lengths_B.dtype}{tuple(lengths_B.shape)}")
  for name, x in (("q", q_BHR), ("ckv", ckv_BLR)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got {x.dtype}")


def _split_kernel(len_ref, q_ref, ckv_ref, acc_ref, m_ref, l_ref, *, scale, block_l, num_splits, num_heads):
  L = ckv_ref.shape[0]
  block_h = q_ref.shape[0]
  n = jnp.minimum(len_ref[0], L)
  part = pl.cdiv(pl.cdiv(n, num_splits), block_l) * block_l       # this row's part: whole blocks
  begin = pl.program_id(2) * part
  end = jnp.minimum(begin + part, n)
  q = q_ref[...]
  dtype = ckv_ref.dtype
  # fp32 operands: exact products (`fp32_products`; Triton's default for fp32, tf32, is 1e-3 off); bf16: tensor
  # cores as they are.
  precision = fp32_products() if dtype == F32 else None

  def step(i, carry):
    m, l, acc = carry
    first = begin + i * block_l
    at = jnp.minimum(first, L - block_l)         # a block crossing L is shifted back; rows before `first` masked
    rows = at + jax.lax.broadcasted_iota(jnp.int32, (block_l,), 0)
    valid = (rows >= first) & (rows < end)
    c = pltriton.load(ckv_ref.at[pl.ds(at, block_l), :], mask=valid[:, None], other=0.0)
    sc = jax.lax.dot_general(q, c, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=F32) * scale
    sc = jnp.where(valid[None, :], sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))                  # finite: every block has a valid row
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(sc - m_new[:, None])
    pv = jax.lax.dot_general(p.astype(dtype), c, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=F32)
    return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

  R = q.shape[-1]
  init = (jnp.full((block_h,), -jnp.inf, F32), jnp.zeros((block_h,), F32), jnp.zeros((block_h, R), F32))
  m, l, acc = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - begin, 0), block_l), step, init)
  heads = pl.program_id(1) * block_h + jax.lax.broadcasted_iota(jnp.int32, (block_h,), 0) < num_heads
  pltriton.store(acc_ref, acc, mask=heads[:, None])
  pltriton.store(m_ref, m, mask=heads)
  pltriton.store(l_ref, l, mask=heads)


def split_partials(q_BHR, ckv_BLR, lengths_B, *, scale: float, config: DecodeConfig):
  """The first pass: per (row, part) the running max m and sum l `[B, S, Hp]` and accumulator `[B, S, Hp, R]`
  (fp32, Hp = H padded to whole head blocks; rows ≥ H unwritten; a part past the row's length has m = −inf, l = 0,
  acc = 0)."""
  B, H, R = q_BHR.shape
  L = ckv_BLR.shape[1]
  S, block_l, block_h = config.num_splits, config.block_l, config.block_h
  Hp = -(-H // block_h) * block_h
  q = jnp.pad(q_BHR.astype(ckv_BLR.dtype), ((0, 0), (0, Hp - H), (0, 0)))
  kernel = functools.partial(_split_kernel, scale=scale, block_l=block_l, num_splits=S, num_heads=H)
  return triton_call(
      kernel, grid=(B, Hp // block_h, S),
      in_specs=[pl.BlockSpec((1,), lambda b, h, s: (b,)),
                pl.BlockSpec((None, block_h, R), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((None, L, R), lambda b, h, s: (b, 0, 0))],
      out_specs=[pl.BlockSpec((None, None, block_h, R), lambda b, h, s: (b, s, h, 0)),
                 pl.BlockSpec((None, None, block_h), lambda b, h, s: (b, s, h)),
                 pl.BlockSpec((None, None, block_h), lambda b, h, s: (b, s, h))],
      out_shape=[jax.ShapeDtypeStruct((B, S, Hp, R), F32), jax.ShapeDtypeStruct((B, S, Hp), F32),
                 jax.ShapeDtypeStruct((B, S, Hp), F32)],
      name="mla_decode_split", num_warps=config.num_warps, num_stages=config.num_stages,
  )(lengths_B.astype(jnp.int32), q, ckv_BLR)


def combine(acc_BSHR, m_BSH, l_BSH):
  """The second pass: the parts' softmaxes merged, `Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s` (fp32)."""
  M = jnp.max(m_BSH, axis=1, keepdims=True)                     # finite: part 0 holds the row's first latent
  w = jnp.exp(m_BSH - M)                                        # 0 for empty parts (m = −inf)
  return jnp.einsum("bsh,bshr->bhr", w, acc_BSHR) / jnp.sum(w * l_BSH, axis=1)[..., None]


def mla_decode(q_BHR, ckv_BLR, lengths_B, *, scale: float, config: DecodeConfig | None = None):
  """Absorbed decode attention of q̃ `[B, H, R]` over row b's first `lengths_B[b]` (≥ 1) latents of ckv
  `[B, L, R]`; returns the attention-weighted latent `[B, H, R]` in q̃'s dtype. Lengths above L are taken as L."""
  check_inputs(q_BHR, ckv_BLR, lengths_B)
  B, H, R = q_BHR.shape
  config = default_config(B, H, ckv_BLR.shape[1], R, config)
  acc, m, l = split_partials(q_BHR, ckv_BLR, lengths_B, scale=scale, config=config)
  return combine(acc[:, :, :H], m[:, :, :H], l[:, :, :H]).astype(q_BHR.dtype)
