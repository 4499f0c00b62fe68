"""Per-chunk KDA algebra on 16-token tiles, traced inside the forward and backward intra-chunk kernels.

A chunk of C = 64 tokens is 4 tiles of 16. Triton cannot slice values held in registers, so every quantity is a
Python list of per-tile arrays (or a dict over tile pairs (I, J), J <= I) and every product is a 16-row GEMM.

Exponents are anchored at the start of each tile I shifted by the constant c = 8·γ_min (causal: no later token
moves an anchor). With g >= γ_min >= -5.5, the query-side factor e^{G_i - R_I - c} and the key-side factor
e^{R_I - G_j + c} both stay within e^{±8|γ_min|} on the diagonal tile and below e^{c} off it, so diagonal tiles
are plain GEMMs (SPEC.md §2) and neither factor underflows to a denormal.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

CHUNK = 64
SUB = 16
NT = CHUNK // SUB
F32 = jnp.float32


def tiles(ref, dtype=F32):
  """The chunk held by `ref` (leading axis C) as NT tiles of 16 rows."""
  if len(ref.shape) == 1:
    return [ref[pl.ds(i * SUB, SUB)].astype(dtype) for i in range(NT)]
  return [ref[pl.ds(i * SUB, SUB), :].astype(dtype) for i in range(NT)]


def store_tiles(ref, values):
  for i, x in enumerate(values):
    ref[pl.ds(i * SUB, SUB), :] = x.astype(ref.dtype)


def pairs():
  return [(i, j) for i in range(NT) for j in range(i + 1)]


def mm(a, b, dtype):
  """a @ b with operands in `dtype` (tensor cores for bf16), fp32 accumulation."""
  return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=F32)


def mm_t(a, b, dtype):
  """a @ bᵀ."""
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())), preferred_element_type=F32)


def t_mm(a, b, dtype):
  """aᵀ @ b."""
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())), preferred_element_type=F32)


def _causal(strict):
  i = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  return j < i if strict else j <= i


class Gates:
  """Log-decay bookkeeping of one chunk, every sum taken over same-sign terms (no cancellation)."""

  def __init__(self, g_tiles, reset_tiles, lower_bound):
    self.shift = SUB / 2 * lower_bound
    self.loc = [jnp.cumsum(g, axis=0) for g in g_tiles]               # tile start -> i, inclusive
    self.tot = [jnp.sum(g, axis=0, keepdims=True) for g in g_tiles]   # [1,K] per tile
    self.prefix = [sum(self.tot[:i], jnp.zeros_like(self.tot[0])) for i in range(NT)]
    self.G = [p + l for p, l in zip(self.prefix, self.loc)]            # chunk start -> i
    self.G_C = sum(self.tot, jnp.zeros_like(self.tot[0]))
    rest = [t - l for t, l in zip(self.tot, self.loc)]                 # i -> tile end, exclusive
    self.to_end = [rest[i] + sum(self.tot[i + 1:], jnp.zeros_like(self.tot[0])) for i in range(NT)]
    self.E = {(i, j): -self.loc[i] if i == j else rest[j] + sum(self.tot[j + 1:i], jnp.zeros_like(self.tot[0]))
              for i, j in pairs()}                                     # R_I - G_j
    if reset_tiles is None:
      self.doc = None
      return
    counts = [jnp.cumsum(r.astype(jnp.int32), axis=0) for r in reset_tiles]
    before = [sum((jnp.sum(c.astype(jnp.int32)) for c in reset_tiles[:i]), jnp.int32(0)) for i in range(NT)]
    self.doc = [b + c for b, c in zip(before, counts)]                   # resets seen since chunk start
    self.last_doc = sum((jnp.sum(r.astype(jnp.int32)) for r in reset_tiles), jnp.int32(0))

  def pair_mask(self, i, j, strict):
    """Causal mask of tile pair (I, J) (only the diagonal tile needs one), within one document."""
    m = _causal(strict) if i == j else None
    if self.doc is not None:
      same = self.doc[i][:, None] == self.doc[j][None, :]
      m = same if m is None else m & same
    return m

  def sees_state(self, i):
    """[16,1]: the state entering the chunk reaches token i (no document start in between)."""
    return None if self.doc is None else (self.doc[i] == 0)[:, None]

  def in_last_doc(self, i):
    return None if self.doc is None else (self.doc[i] == self.last_doc)[:, None]

  def state_decay(self):
    d = jnp.exp(self.G_C)
    return d if self.doc is None else jnp.where(self.last_doc == 0, d, 0.0)


def masked(x, m):
  return x if m is None else jnp.where(m, x, 0.0)


class Intra:
  """The intra-chunk matrices of one chunk: A_qk, A_kk, M = (I + A_kk)⁻¹ (as 16x16 blocks) and U, W."""

  def __init__(self, q, k, v, beta, gates: Gates, *, scale, dtype):
    self.gt, self.dtype, self.scale = gates, dtype, scale
    c = gates.shift
    self.q, self.k, self.v, self.beta = q, k, v, [b[:, None] for b in beta]
    self.anchor_q = [jnp.exp(l - c) for l in gates.loc]                  # e^{G_i - R_I - c}
    self.anchor_k = {p: jnp.exp(gates.E[p] + c) for p in pairs()}        # e^{R_I - G_j + c}
    self.qh = [x * a for x, a in zip(q, self.anchor_q)]
    self.kh = [x * a for x, a in zip(k, self.anchor_q)]
    self.kt = {(i, j): k[j] * self.anchor_k[i, j] for i, j in pairs()}
    self.A_qk = {(i, j): masked(scale * mm_t(self.qh[i], self.kt[i, j], dtype), gates.pair_mask(i, j, False))
                 for i, j in pairs()}
    self.B = {(i, j): masked(mm_t(self.kh[i], self.kt[i, j], dtype), gates.pair_mask(i, j, True))
              for i, j in pairs()}                                     # A_kk without β
    A_kk = {p: self.beta[p[0]] * self.B[p] for p in pairs()}
    self.M = _unit_lower_inverse(A_kk)
    self.gamma = [masked(jnp.exp(G), gates.sees_state(i)) for i, G in enumerate(gates.G)]
    self.bv = [b * x for b, x in zip(self.beta, v)]
    self.bgk = [b * gm * x for b, gm, x in zip(self.beta, self.gamma, k)]
    self.U = [sum(mm(self.M[i, j], self.bv[j], dtype) for j in range(i + 1)) for i in range(NT)]
    self.W = [sum(mm(self.M[i, j], self.bgk[j], dtype) for j in range(i + 1)) for i in range(NT)]

  def q_state(self):
    return [self.scale * x * gm for x, gm in zip(self.q, self.gamma)]

  def k_to_end(self):
    return [masked(x * jnp.exp(e), self.gt.in_last_doc(i)) for i, (x, e) in enumerate(zip(self.k, self.gt.to_end))]


def _unit_lower_inverse(A):
  """Blocks of (I + A)⁻¹ for strictly lower A given as 16x16 blocks {(I, J): J <= I}, in fp32.

  Diagonal blocks: (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸), exact since N¹⁶ = 0; then block forward
  substitution M_IJ = −M_II Σ_{J<=P<I} A_IP M_PJ.
  """
  eye = jnp.where(_causal(False) & ~_causal(True), 1.0, 0.0).astype(F32)
  M = {}
  for i in range(NT):
    n = A[i, i]
    inv = eye - n
    p = n
    for _ in range(3):
      p = mm(p, p, F32)
      inv = mm(inv, eye + p, F32)
    M[i, i] = inv
  for i in range(NT):
    for j in range(i):
      acc = sum(mm(A[i, p], M[p, j], F32) for p in range(j, i))
      M[i, j] = -mm(M[i, i], acc, F32)
  return M
