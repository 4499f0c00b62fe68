"""The AttnRes read-out's backward pass (`k3jax.ops.attnres`, docs/design.md) as one Triton kernel over the tokens.

Per block of token rows, with the read-out's weights `w`, scores' parts `a`, `r` kept from the forward pass:

    dw_n = dhᵀ v_n,   ds_n = w_n (dw_n − Σ_m w_m dw_m),   c_n = ds_n r_n,   k_n = −ds_n a_n r_n³ / D
    dv_n = w_n dh + c_n (q ⊙ g) + k_n v_n,          u += Σ_rows c_n v_n   (one partial sum per block)

The block's values and `dh` are read once, in column slices of a power of two (Triton's loads are), and kept for
two passes over the tiles, the first for the `dw`, the second for the cotangents and `u`. A value is not read in the
rows where its weight is exactly 0 (not valid, or underflowed): it gets a zero cotangent there and adds nothing to
`u`, whatever it holds. XLA fuses the same arithmetic into several passes whose reductions over the tokens are
computed where the coefficients are: this kernel reads each value at most once and writes its cotangent once.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._triton import traced_once, triton_call
from pallas_kernels.attnres.tiles import column_slice, load_value

# Token rows and warps a program. Few rows: a program holds its rows of `dh` and of every value (at small's read-out,
# 8 arrays of 768 columns: 24.6k fp32 at 4 rows, 96 registers a thread at 8 warps); BUILD_NOTES, AttnRes.
BLOCK_ROWS = 4
NUM_WARPS = 8


def readout_backward(dh_RD, buffer_CRD, values, qg_D, w_NR, a_NR, r_NR, *, block_rows: int = BLOCK_ROWS,
                     num_warps: int = NUM_WARPS):
  """(d_buffer `[C, R, D]`, d_values (E × `[R, D]`), u `[D]`), all fp32, of the read-out over R token rows of
  `buffer_CRD` (C may be 0) and the E `values`. R must be a multiple of `block_rows`. One call lowered once per
  program and input types (`traced_once`): the read-outs of every layer, scanned or not, share one compiled copy."""
  _check(dh_RD, buffer_CRD, values, w_NR, a_NR, r_NR, block_rows)
  return _backward_once(dh_RD, buffer_CRD, tuple(values), qg_D, w_NR, a_NR, r_NR, (block_rows, num_warps))


def _check(dh_RD, buffer_CRD, values, w_NR, a_NR, r_NR, block_rows):
  R = dh_RD.shape[0]
  N = buffer_CRD.shape[0] + len(values)
  if R % block_rows or block_rows & (block_rows - 1):
    raise ValueError(f"the read-out kernel needs R={R} a multiple of block_rows={block_rows} (a power of two)")
  if w_NR.shape != (N, R) or a_NR.shape != (N, R) or r_NR.shape != (N, R):
    raise ValueError(f"w, a, r must be [N={N}, R={R}], got {w_NR.shape}, {a_NR.shape}, {r_NR.shape}")


def _backward(dh_RD, buffer_CRD, values, qg_D, w_NR, a_NR, r_NR, launch):
  block_rows, num_warps = launch
  R, D = dh_RD.shape
  C, E = buffer_CRD.shape[0], len(values)
  N = C + E
  G = R // block_rows
  rows = pl.BlockSpec((block_rows, D), lambda i: (i, 0))
  slots = pl.BlockSpec((C, block_rows, D), lambda i: (0, i, 0))
  coefs = pl.BlockSpec((N, block_rows), lambda i: (0, i))
  whole_D = pl.BlockSpec((1, D), lambda i: (0, 0))
  in_specs = [whole_D, rows, coefs, coefs, coefs] + ([slots] if C else []) + [rows] * E
  out_specs = ([slots] if C else []) + [rows] * E + [pl.BlockSpec((1, D), lambda i: (i, 0))]
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = ([f32(C, R, D)] if C else []) + [f32(R, D)] * E + [f32(G, D)]
  kernel = functools.partial(_kernel, C=C, E=E, D=D, cols=column_slice(D))
  outs = triton_call(kernel, grid=(G,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                     name="attnres_readout_bwd", num_warps=num_warps, num_stages=1)(
                         qg_D.reshape(1, D), dh_RD, w_NR, a_NR, r_NR, *([buffer_CRD] if C else []), *values)
  d_buffer = outs[0] if C else jnp.zeros((0, R, D), jnp.float32)
  d_values = tuple(outs[1:-1] if C else outs[:-1])
  return d_buffer, d_values, jnp.sum(outs[-1], axis=0)


_backward_once = traced_once(_backward, static_argnums=(7,))


def _kernel(qg_ref, dh_ref, w_ref, a_ref, r_ref, *refs, C, E, D, cols):
  ins, outs = refs[:(1 if C else 0) + E], refs[(1 if C else 0) + E:]
  buf_ref, val_refs = (ins[0], ins[1:]) if C else (None, ins)
  dbuf_ref, dval_refs, u_ref = (outs[0], outs[1:-1], outs[-1]) if C else (None, outs[:-1], outs[-1])
  N = C + E
  slices = [pl.ds(j * cols, cols) for j in range(D // cols)]
  w = [w_ref[n, :] for n in range(N)]
  live = [w[n] != 0.0 for n in range(N)]   # a value is read only in the rows where its weight is not 0

  def store(n, sl, x):
    if n < C:
      dbuf_ref[n, :, sl] = x
    else:
      dval_refs[n - C][:, sl] = x

  # Every tile is loaded once, up front, and kept for the second pass (in registers at a few rows a program).
  dh = [dh_ref[:, sl] for sl in slices]
  tiles = [[load_value(buf_ref, val_refs, C, n, sl, live[n], cols) for sl in slices] for n in range(N)]
  dw = [sum(jnp.sum(dh[j] * tiles[n][j], axis=1) for j in range(len(slices))) for n in range(N)]
  mean_dw = sum(w[n] * dw[n] for n in range(N))
  c, k = [], []
  for n in range(N):
    ds = w[n] * (dw[n] - mean_dw)
    r = r_ref[n, :]
    c.append((ds * r)[:, None])
    k.append((-ds * a_ref[n, :] * r * r * r / D)[:, None])
  for j, sl in enumerate(slices):
    qg = qg_ref[:, sl]
    u = jnp.zeros_like(qg)
    for n in range(N):
      v = tiles[n][j]
      store(n, sl, jnp.where(live[n][:, None], w[n][:, None] * dh[j] + c[n] * qg + k[n] * v, 0.0))
      u = u + jnp.sum(c[n] * v, axis=0, keepdims=True)   # c is 0 where w is (ds = w · …) and v is 0 there
    u_ref[:, sl] = u
