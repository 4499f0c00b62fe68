"""The AttnRes read-out's forward pass (`k3jax.ops.attnres`, docs/design.md) as one Triton kernel over the tokens.

Per block of token rows, over the values v_n (the buffer's C slots, then the E single values):

    a_n = (q ⊙ g)ᵀ v_n,   r_n = (mean_d v_n² + ε)^-½,   w = softmax_n(a_n r_n + bias_n),   h = Σ_n w_n v_n

The block's values are read once, in column slices of a power of two (Triton's loads are), and kept: a first pass
over the tiles forms `a` and `r`, a second the weighted sum. `bias_n` is 0 for a valid value and −inf for one that
is not: that one is not read (its tile is zeros, so its `a` is 0 and its `r` ε^-½) and has weight exactly 0. It
writes `h` and the `w`, `a`, `r` the backward pass keeps.

XLA computes the same sum as one fusion over the values; the kernel is an opaque call to XLA's fusion passes, whose
priority fusion spends seconds of every compile on the read-outs' sums (BUILD_NOTES, AttnRes).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._triton import traced_once, triton_call
from pallas_kernels.attnres.tiles import column_slice, load_value

# Token rows and warps a program. Few rows: a program holds its rows of every value (at small's read-out, 7 values
# of 768 columns: 21.5k fp32 at 4 rows, 84 registers a thread at 8 warps); BUILD_NOTES, AttnRes, has the sweep.
BLOCK_ROWS = 4
NUM_WARPS = 8


def readout_forward(buffer_CRD, values, qg_D, bias_NR, *, eps: float, block_rows: int = BLOCK_ROWS,
                    num_warps: int = NUM_WARPS):
  """(h `[R, D]`, w `[N, R]`, a `[N, R]`, r `[N, R]`), all fp32, of the read-out over R token rows of `buffer_CRD`
  (C may be 0) and the E `values` (N = C + E); `bias_NR` is 0 where a value is valid and −inf where it is not (at
  least one valid per row, else w is NaN). R must be a multiple of `block_rows`. Lowered once per program and input
  types (`traced_once`)."""
  R, D = values[0].shape if values else buffer_CRD.shape[1:]
  N = buffer_CRD.shape[0] + len(values)
  if R % block_rows or block_rows & (block_rows - 1):
    raise ValueError(f"the read-out kernel needs R={R} a multiple of block_rows={block_rows} (a power of two)")
  if bias_NR.shape != (N, R) or qg_D.shape != (D,):
    raise ValueError(f"bias must be [N={N}, R={R}] and qg [D={D}], got {bias_NR.shape} and {qg_D.shape}")
  return _forward_once(buffer_CRD, tuple(values), qg_D, bias_NR, (float(eps), block_rows, num_warps))


def _forward(buffer_CRD, values, qg_D, bias_NR, static):
  eps, block_rows, num_warps = static
  R, D = bias_NR.shape[1], qg_D.shape[0]
  C, E = buffer_CRD.shape[0], len(values)
  N = C + E
  rows = pl.BlockSpec((block_rows, D), lambda i: (i, 0))
  slots = pl.BlockSpec((C, block_rows, D), lambda i: (0, i, 0))
  coefs = pl.BlockSpec((N, block_rows), lambda i: (0, i))
  in_specs = [pl.BlockSpec((1, D), lambda i: (0, 0)), coefs] + ([slots] if C else []) + [rows] * E
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  kernel = functools.partial(_kernel, C=C, E=E, D=D, cols=column_slice(D), eps=eps)
  return triton_call(kernel, grid=(R // block_rows,), in_specs=in_specs, out_specs=[rows, coefs, coefs, coefs],
                     out_shape=[f32(R, D), f32(N, R), f32(N, R), f32(N, R)], name="attnres_readout_fwd",
                     num_warps=num_warps, num_stages=1)(
                         qg_D.reshape(1, D), bias_NR, *([buffer_CRD] if C else []), *values)


_forward_once = traced_once(_forward, static_argnums=(4,))


def _kernel(qg_ref, bias_ref, *refs, C, E, D, cols, eps):
  ins, (h_ref, w_ref, a_ref, r_ref) = refs[:-4], refs[-4:]
  buf_ref, val_refs = (ins[0], ins[1:]) if C else (None, ins)
  N = C + E
  slices = [pl.ds(j * cols, cols) for j in range(D // cols)]
  bias = [bias_ref[n, :] for n in range(N)]
  # A value is read only where it is valid (bias 0): the buffer's empty slots cost no traffic, and what they hold
  # (zeros here) never meets the weight 0 they get.
  value = lambda n, sl: load_value(buf_ref, val_refs, C, n, sl, bias[n] == 0.0, cols)

  # Every value's tile is loaded once, up front, and kept for the weighted sum (in registers at a few rows a
  # program): one read of the values, all loads in flight together.
  tiles = [[value(n, sl) for sl in slices] for n in range(N)]
  a, sq = [0.0] * N, [0.0] * N
  for j, sl in enumerate(slices):
    qg = qg_ref[:, sl]
    for n in range(N):
      v = tiles[n][j]
      a[n] = a[n] + jnp.sum(v * qg, axis=1)
      sq[n] = sq[n] + jnp.sum(v * v, axis=1)
  r = [jax.lax.rsqrt(sq[n] / D + eps) for n in range(N)]
  s = [a[n] * r[n] + bias[n] for n in range(N)]
  top = functools.reduce(jnp.maximum, s)
  e = [jnp.exp(s[n] - top) for n in range(N)]
  total = sum(e)
  w = [e[n] / total for n in range(N)]
  for n in range(N):
    w_ref[n, :], a_ref[n, :], r_ref[n, :] = w[n], a[n], r[n]
  for j, sl in enumerate(slices):
    h_ref[:, sl] = sum(w[n][:, None] * tiles[n][j] for n in range(N))
