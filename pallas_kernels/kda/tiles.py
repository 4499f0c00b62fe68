"""Per-chunk KDA algebra on 16-token tiles, traced inside the intra-chunk kernels.

A chunk of C = 64 tokens is 4 tiles of 16. Triton cannot slice values held in registers, so tiles are loaded from
the kernel's refs where they are used (again if needed: reloads hit the cache, registers are the scarce resource)
and every product is a 16-row GEMM.

Exponents are anchored at the start of each tile I, shifted by the constant c = 8·γ_min (causal: no later token
moves an anchor). With g >= γ_min >= -5.5 the two full-tile factors e_q = e^{G_i - R_I - c} and
e_k = e^{c - (G_i - R_I)} both lie in e^{±8|γ_min|} (<= e^{44}), so diagonal tiles are plain GEMMs (SPEC.md §2) and
no factor underflows to a denormal. Every other exponential is a [1,K] vector times one of these two.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

CHUNK = 64
SUB = 16
NT = CHUNK // SUB
F32 = jnp.float32


def load(ref, i, dtype=F32):
  """Tile i (16 rows) of the chunk held by `ref`."""
  idx = (pl.ds(i * SUB, SUB),) if len(ref.shape) == 1 else (pl.ds(i * SUB, SUB), slice(None))
  return ref[idx].astype(dtype)


def store(ref, i, x):
  idx = (pl.ds(i * SUB, SUB),) if len(ref.shape) == 1 else (pl.ds(i * SUB, SUB), slice(None))
  ref[idx] = x.astype(ref.dtype)


def pairs():
  """Tile pairs (I, J) with J <= I, row by row."""
  return [(i, j) for i in range(NT) for j in range(i + 1)]


def _dot(a, b, dims, dtype, exact=True):
  # fp32 operands: exact products unless `exact=False` (Triton's default for fp32 is tf32); bf16: tensor cores.
  precision = jax.lax.Precision.HIGHEST if dtype == F32 and exact else None
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())), precision=precision,
                             preferred_element_type=F32)


def mm(a, b, dtype):
  """a @ b, operands in `dtype`, fp32 accumulation."""
  return _dot(a, b, ((1,), (0,)), dtype)


def mm_t(a, b, dtype):
  """a @ bᵀ."""
  return _dot(a, b, ((1,), (1,)), dtype)


def t_mm(a, b, dtype):
  """aᵀ @ b."""
  return _dot(a, b, ((0,), (0,)), dtype)


def rows(x):
  """[16] -> [16, 1]."""
  return x[:, None]


def _iota_pair():
  return (jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0), jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1))


def causal(strict):
  i, j = _iota_pair()
  return j < i if strict else j <= i


def identity():
  i, j = _iota_pair()
  return jnp.where(i == j, 1.0, 0.0).astype(F32)


def upper_ones():
  """[m, i] = 1 for i >= m: `upper_ones() @ x` is the suffix sum of x's rows."""
  i, j = _iota_pair()
  return jnp.where(j >= i, 1.0, 0.0).astype(F32)


def masked(x, m):
  return x if m is None else jnp.where(m, x, 0.0)


class Gates:
  """Log-decay bookkeeping of one chunk: [1,K] sums per tile kept, full-tile factors recomputed on demand."""

  def __init__(self, g_ref, reset_ref, lower_bound):
    self.g_ref = g_ref
    self.c = SUB / 2 * lower_bound
    zero = jnp.zeros((1, g_ref.shape[-1]), F32)
    self.tot = [jnp.sum(load(g_ref, i), axis=0, keepdims=True) for i in range(NT)]      # [1,K] per tile
    self.prefix = [sum(self.tot[:i], zero) for i in range(NT)]                          # before tile i
    self.later = [sum(self.tot[i + 1:], zero) for i in range(NT)]                       # after tile i
    self.G_C = sum(self.tot, zero)
    self.doc = None
    if reset_ref is not None:
      resets = [load(reset_ref, i, jnp.int32) for i in range(NT)]
      before = [sum((jnp.sum(r) for r in resets[:i]), jnp.int32(0)) for i in range(NT)]
      self.doc = [b + jnp.cumsum(r, axis=0) for b, r in zip(before, resets)]          # resets since chunk start
      self.last_doc = sum((jnp.sum(r) for r in resets), jnp.int32(0))

  def _loc(self, i):
    return jnp.cumsum(load(self.g_ref, i), axis=0)                     # G_i - R_I: tile start -> i, inclusive

  def e_q(self, i):
    """Query-side factor of tile i, e^{G_i - R_I - c}."""
    return jnp.exp(self._loc(i) - self.c)

  def e_k(self, i):
    """Key-side factor of tile i, e^{c - (G_i - R_I)}."""
    return jnp.exp(self.c - self._loc(i))

  def key_scale(self, i, j):
    """[1,K] with e_k[j]·key_scale = e^{R_I - G_j + c}: the rest of tile J and whole tiles strictly between."""
    if i == j:
      return None
    return jnp.exp(self.tot[j] + sum(self.tot[j + 1:i], jnp.zeros_like(self.tot[0])))

  def gamma(self, i, e_q):
    """e^{G_i} (chunk start -> i), zero past a document start inside the chunk."""
    return masked(jnp.exp(self.prefix[i] + self.c) * e_q, self.sees_state(i))

  def to_end(self, i, e_k):
    """e^{G_C - G_i} (i -> chunk end, exclusive), zero unless i is in the chunk's last document."""
    return masked(jnp.exp(self.tot[i] - self.c + self.later[i]) * e_k, self.in_last_doc(i))

  def decay(self):
    d = jnp.exp(self.G_C)
    return d if self.doc is None else jnp.where(self.last_doc == 0, d, 0.0)

  def pair_mask(self, i, j, strict):
    """Mask of tile pair (I, J): causal on the diagonal tile, within one document."""
    m = causal(strict) if i == j else None
    if self.doc is not None:
      same = self.doc[i][:, None] == self.doc[j][None, :]
      m = same if m is None else m & same
    return m

  def sees_state(self, i):
    return None if self.doc is None else (self.doc[i] == 0)[:, None]

  def in_last_doc(self, i):
    return None if self.doc is None else (self.doc[i] == self.last_doc)[:, None]


def key_factor(gates, e_k, i, j):
  """e^{R_I - G_j + c} for the keys of tile J seen from tile I: k̃_IJ = k_j ⊙ key_factor."""
  s = gates.key_scale(i, j)
  return e_k[j] if s is None else e_k[j] * s


def unit_lower_inverse(A, dtype):
  """Blocks of (I + A)⁻¹ for strictly lower A given as 16x16 blocks {(I, J): J <= I}.

  Diagonal blocks: (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸), exact since N¹⁶ = 0; then block forward
  substitution M_IJ = −M_II Σ_{J<=P<I} A_IP M_PJ. Products in fp32 for fp32 inputs, tf32 for bf16 inputs (the
  result is rounded to bf16 for the next GEMM anyway).
  """
  dot = lambda a, b: _dot(a, b, ((1,), (0,)), F32, exact=dtype == F32)
  eye = identity()
  M = {}
  for i in range(NT):
    n = A[i, i]
    inv, p = eye - n, n
    for _ in range(3):
      p = dot(p, p)
      inv = dot(inv, eye + p)
    M[i, i] = inv
  for i in range(NT):
    for j in range(i):
      M[i, j] = -dot(M[i, i], sum(dot(A[i, p], M[p, j]) for p in range(j, i)))
  return M
