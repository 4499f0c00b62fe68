"""Per-chunk KDA algebra, traced inside the intra-chunk kernels.

A chunk has C = 64 tokens, in 4 tiles of 16. Exponents are anchored at the start of each tile I (R_I, the
cumulative log-decay before the tile), shifted by the constant c = 8·γ_min: causal (no later token moves an
anchor), and with g >= γ_min >= -5.5 the query factor e^{G_i - R_I - c} and the key factor e^{R_I - G_j + c} of
the diagonal tile both stay within e^{±8|γ_min|} (<= e^{44}), so the diagonal tile is a plain GEMM (docs/design.md, KDA)
and neither factor underflows to a denormal (unshifted, the query side reaches e^{-80}). Off the diagonal the key
factor is below e^{c}. The forward's first kernel writes the products' operands already against their own tile's
anchor, with each tile's total log-decay (`TileAnchors` rescales keys from those), and for the backward each row's
cumulative log-decay from its tile's start (`Prepared.loc`): no later kernel takes a cumulative sum.

Products are 16-row blocks of the chunk against all 64 keys: query tile I (16 x K) times the chunk's keys scaled
for anchor R_I (64 x K). Triton cannot slice register values, so tiles are loaded from refs where needed, and the
chunk's rows are assembled through memory where a kernel needs them (see `pallas_kernels.barrier`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.ops.kda.common import CHUNK, SUB
from pallas_kernels import fp32_products

NT = CHUNK // SUB
F32 = jnp.float32


def tile_totals(loc_ref, cols=slice(None)):
  """[1,K] per tile (or of the columns `cols`): the tile's total log-decay, the last row of its cumulative sums."""
  return [loc_ref[pl.ds(i * SUB + SUB - 1, 1), cols].astype(F32) for i in range(NT)]


def load(ref, i=None, dtype=F32):
  """Tile i (16 rows) of the chunk held by `ref`, or the whole chunk when i is None."""
  if i is None:
    return ref[...].astype(dtype)
  idx = (pl.ds(i * SUB, SUB),) if len(ref.shape) == 1 else (pl.ds(i * SUB, SUB), slice(None))
  return ref[idx].astype(dtype)


def store(ref, i, x):
  """Writes tile i of the chunk held by `ref`, or the whole chunk when i is None."""
  if i is None:
    ref[...] = x.astype(ref.dtype)
    return
  idx = (pl.ds(i * SUB, SUB),) if len(ref.shape) == 1 else (pl.ds(i * SUB, SUB), slice(None))
  ref[idx] = x.astype(ref.dtype)


def _dot(a, b, dims, dtype, exact=True):
  # fp32 operands: exact products (`fp32_products`) unless `exact=False` (tf32, Triton's default for fp32); bf16:
  # tensor cores.
  precision = fp32_products() if dtype == F32 and exact else None
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())), precision=precision,
                             preferred_element_type=F32)


def mm(a, b, dtype, exact=True):
  """a @ b, operands in `dtype`, fp32 accumulation."""
  return _dot(a, b, ((1,), (0,)), dtype, exact)


def mm_t(a, b, dtype):
  """a @ bᵀ."""
  return _dot(a, b, ((1,), (1,)), dtype)


def t_mm(a, b, dtype, exact=True):
  """aᵀ @ b."""
  return _dot(a, b, ((0,), (0,)), dtype, exact)


def masked(x, m):
  return x if m is None else jnp.where(m, x, 0.0)


def iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def tile_of_row():
  """[64, 1]: the tile each row of the chunk belongs to."""
  return iota((CHUNK, 1), 0) // SUB


def per_tile(vectors):
  """[64, K] whose rows in tile J equal vectors[J] ([1, K] each, or None for zero)."""
  t = tile_of_row()
  out = jnp.zeros((CHUNK, vectors[0].shape[-1] if vectors[0] is not None else 1), F32)
  for j, v in enumerate(vectors):
    if v is not None:
      out = jnp.where(t == j, v, out)
  return out


class Gates:
  """The log-decay bookkeeping of a whole chunk (a program per chunk) from the cumulative sums `prepare` wrote:
  what the keys and the chunk's end need. Every sum is over same-sign terms (a difference of cumulative sums would
  be off by ε·|G|, up to 2e-5 in an exponent)."""

  def __init__(self, loc_ref, reset_ref, lower_bound):
    self.c = SUB / 2 * lower_bound
    self.tot = tile_totals(loc_ref)
    zero = jnp.zeros_like(self.tot[0])
    self.later = [sum(self.tot[i + 1:], zero) for i in range(NT)]       # after tile I
    self.G_C = sum(self.tot, zero)
    self.loc = loc_ref[...].astype(F32)                                 # tile start -> i
    self.doc_all = self.last_doc = None
    if reset_ref is not None:
      reset = load(reset_ref, None, jnp.int32)
      self.doc_all = jnp.cumsum(reset, axis=0)                          # resets since chunk start
      self.last_doc = jnp.sum(reset)

  def e_k(self):
    """[64,K]: the key factor e^{c - (G - R)}, each row against its tile's anchor."""
    return jnp.exp(self.c - self.loc)

  def to_end(self, e_k):
    """e^{G_C - G} ([64,K], exclusive of the row), zero unless the row is in the chunk's last document."""
    te = per_tile([jnp.exp(self.later[j] + self.tot[j] - self.c) for j in range(NT)]) * e_k
    return masked(te, None if self.doc_all is None else (self.doc_all == self.last_doc)[:, None])

  def decay(self):
    """[1,K]: e^{G_C}, zero where a document starts inside the chunk."""
    d = jnp.exp(self.G_C)
    return d if self.last_doc is None else jnp.where(self.last_doc == 0, d, 0.0)


class TileDocs:
  """Documents and causal masks of tile i (a traced index: a grid axis) against its chunk, apart from the gates so a
  kernel that walks column blocks builds them once. Without resets the document fields are None (no mask)."""

  def __init__(self, reset_ref, i):
    self.i = i
    self.doc_ok = self.first = self.last = self.one_document = None
    if reset_ref is not None:
      reset = load(reset_ref, None, jnp.int32)
      self.one_document = jnp.sum(reset) == 0                                              # no start in the chunk
      doc_all = jnp.cumsum(reset, axis=0)                                                  # resets up to each row
      doc_i = jnp.sum(jnp.where(iota((CHUNK,), 0) < i * SUB, reset, 0)) + jnp.cumsum(load(reset_ref, i, jnp.int32))
      self.doc_ok = doc_i[:, None] == doc_all[None, :]                                     # [16,64]: tile vs chunk
      self.first, self.last = (doc_i == 0)[:, None], (doc_i == jnp.sum(reset))[:, None]

  def row_mask(self, strict):
    """[16,64]: tile i's queries against the chunk's keys, causal (strictly, for B), within one document."""
    causal = iota((SUB, CHUNK), 1) - iota((SUB, CHUNK), 0) - self.i * SUB                 # key - query position
    m = causal < 0 if strict else causal <= 0
    return m if self.doc_ok is None else m & self.doc_ok


class TileAnchors:
  """Tile i's anchors (`docs.i`, a traced index) from its chunk's tile totals `tot` (four [1,K] log-decays), for
  kernels that run a program per tile; every sum over same-sign terms."""

  def __init__(self, tot, docs, lower_bound):
    i = docs.i
    self.c = SUB / 2 * lower_bound
    zero = jnp.zeros_like(tot[0])
    # Keys of tile J <= i against anchor R_i take e^{R_i - R_J} = e^{Σ_{J<=P<i} tot_P} (<= 1).
    self.key_span = [sum((jnp.where(p < i, tot[p], 0.0) for p in range(j, NT)), zero) for j in range(NT)]
    self.tot, self.i, self.docs = tot, i, docs
    self.prefix = self.key_span[0]                                                           # R_i
    self.rest = sum((jnp.where(p >= i, tot[p], 0.0) for p in range(NT)), zero)             # G_C - R_i

  def keys_scale(self):
    """[64,K]: e^{R_i - R_J} on rows of tiles J <= i, 0 after: keys already against their own anchor
    (`prepare`'s ke), rescaled for anchor i. Exponentials of [1,K] rows only."""
    return per_tile([jnp.where(j <= self.i, jnp.exp(self.key_span[j]), 0.0) for j in range(NT)])

  def from_anchor(self):
    """[1,K] or [16,K]: e^{R_i + c}, zero past a document start inside the chunk: q ⊙ e^{G - R_i - c} times this
    is q ⊙ e^{G}."""
    return masked(jnp.exp(self.prefix + self.c), self.docs.first)

  def to_end_from_anchor(self):
    """[1,K] or [16,K]: e^{G_C - R_i - c}, zero unless the row is in the chunk's last document: k ⊙ e^{c - (G - R_i)}
    times this is k ⊙ e^{G_C - G}."""
    return masked(jnp.exp(self.rest - self.c), self.docs.last)


class TileGates(TileAnchors):
  """What one tile i needs of its chunk's gates, from the cumulative sums `prepare` wrote (the tile's rows of what
  `Gates` gives for the chunk, and more), every sum over same-sign terms. Of the columns `cols` (a `pl.ds`) or all."""

  def __init__(self, loc_ref, docs, lower_bound, cols=slice(None)):
    super().__init__(tile_totals(loc_ref, cols), docs, lower_bound)
    self.loc = loc_ref[pl.ds(docs.i * SUB, SUB), cols].astype(F32)                        # [16,K], tile i

  def e_q(self):
    """[16,K]: the tile's query factor e^{G - R_i - c}."""
    return jnp.exp(self.loc - self.c)

  def e_k(self):
    """[16,K]: the tile's key factor e^{c - (G - R_i)}."""
    return jnp.exp(self.c - self.loc)

  def gamma(self):
    """[16,K]: e^{G}, zero past a document start inside the chunk."""
    return masked(jnp.exp(self.prefix + self.loc), self.docs.first)

  def to_end(self):
    """[16,K]: e^{G_C - G}, zero unless the row is in the chunk's last document."""
    return masked(jnp.exp(self.rest - self.loc), self.docs.last)


def unit_lower_inverse(a, exact):
  """(I + a)⁻¹ of a strictly lower [n,n] a (the chunk's 64 rows, or a tile's 16), from [n,n] products only (no
  substitution, so no row reductions, whose partial sums cross warps). The 4x4 diagonal blocks by
  their Neumann series I − n + n² − n³ (n⁴ = 0; no term above 3·max|n|³, unlike a long series), then doubling steps
  X ← X − X L X, L the blocks of a between the halves of each 8-, 16-, ... row block: the exact block inverse
  [[A⁻¹, 0], [−D⁻¹CA⁻¹, D⁻¹]]. `exact`: fp32 products, else tf32."""
  size = a.shape[0]
  r, c = iota((size, size), 0), iota((size, size), 1)
  eye = jnp.where(r == c, 1.0, 0.0)
  n = jnp.where(r // 4 == c // 4, a, 0.0)
  x = eye - n
  for _ in range(2):
    x = eye - mm(n, x, F32, exact)
  b = 4
  while b < size:
    outside = (r // (2 * b) == c // (2 * b)) & (r // b != c // b)
    x = x - mm(x, mm(jnp.where(outside, a, 0.0), x, F32, exact), F32, exact)
    b *= 2
  return x
