"""The backward pass of the causal depthwise conv + SiLU (`k3jax.ops.short_conv`) as one Triton kernel.

With taps `tap_j[t] = xp[t + j]·keep_j[t]` (xp: the W−1 inputs of the state, then x; keep_j zero across a
document boundary), `pre = Σ_j w_j tap_j` and `dpre = dy · SiLU'(pre)`:

    dx[t] = Σ_j w_j keep_j[t + W−1−j] dpre[t + W−1−j],      dw_j = Σ_t tap_j[t] dpre[t]

A program walks blocks of rows of one batch row and one slice of channels, recomputing `pre` and `dpre` at the W row
shifts each block needs from the inputs (read from L1/L2 again, not from memory), and keeps its share of `dw` in
registers: the inputs and the cotangent are read once, the input's gradient written once, where XLA's fusions
recompute the same values across passes and reduce each tap apart (docs/design.md, KDA).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._triton import traced_once, triton_call

BLOCK_T = 16      # rows a step of a program's loop
BLOCK_C = 128     # channels a program
ROW_SPLITS = 4    # programs along each batch row's T (its blocks walked in turn by each)


def applies(T: int, sizes, *, block_t: int = BLOCK_T, block_c: int = BLOCK_C, splits: int = ROW_SPLITS) -> bool:
  """Whether the kernel takes T rows and channel parts of `sizes` (else the caller's XLA formulas do)."""
  return T % (block_t * splits) == 0 and all(c % block_c == 0 for c in sizes)


def conv_backward(xpp_BPC, dy_parts, w_WC, segp_BP=None, *, block_t: int = BLOCK_T, block_c: int = BLOCK_C,
                  splits: int = ROW_SPLITS):
  """(dx `[B, T, C]` in xpp's dtype, dw `[W, C]` fp32).

  `xpp_BPC` `[B, T + 2(W−1), C]`: the state's W−1 inputs, x, then W−1 rows of zeros. `dy_parts`: the cotangents of
  the output's channel parts, in order, each `[B, T + W−1, C_i]` with W−1 rows of zeros appended. `segp_BP`
  `[B, T + 2(W−1)]` int32: each xpp row's document (the state's rows the first document's; the tail's any), or None
  (one document). `applies` must hold. One call lowered once per program and input types (`traced_once`): every
  KDA layer's conv, scanned or not, shares one compiled copy."""
  W = w_WC.shape[0]
  B, P, C = xpp_BPC.shape
  T = P - 2 * (W - 1)
  sizes = [d.shape[-1] for d in dy_parts]
  if sum(sizes) != C or not applies(T, sizes, block_t=block_t, block_c=block_c, splits=splits):
    raise ValueError(f"conv_backward needs T={T} a multiple of {block_t * splits} and channel parts {sizes} "
                     f"(summing to C={C}) multiples of {block_c}")
  return _backward_once(xpp_BPC, tuple(dy_parts), w_WC, segp_BP, (block_t, block_c, splits))


def _backward(xpp_BPC, dy_parts, w_WC, segp_BP, blocks):
  block_t, block_c, splits = blocks
  W = w_WC.shape[0]
  B, P, C = xpp_BPC.shape
  T = P - 2 * (W - 1)
  sizes = [d.shape[-1] for d in dy_parts]
  starts = [sum(sizes[:i]) // block_c for i in range(len(sizes))]
  part_blocks = [c // block_c for c in sizes]
  grid = (B, splits, C // block_c)
  whole_rows = lambda rows: pl.BlockSpec((None, rows, block_c), lambda b, s, c: (b, 0, c))
  part_rows = [pl.BlockSpec((None, T + W - 1, block_c),
                            functools.partial(lambda b, s, c, i: (b, 0, jnp.clip(c - starts[i], 0,
                                                                                 part_blocks[i] - 1)), i=i))
               for i in range(len(sizes))]
  in_specs = [whole_rows(P), pl.BlockSpec((W, block_c), lambda b, s, c: (0, c))] + part_rows
  args = [xpp_BPC, w_WC.astype(jnp.float32), *dy_parts]
  if segp_BP is not None:
    in_specs.append(pl.BlockSpec((None, P), lambda b, s, c: (b, 0)))
    args.append(segp_BP.astype(jnp.int32))
  # dx's block is a whole batch row: the `splits` programs of a row each store their own rows of it.
  out_specs = [pl.BlockSpec((None, T, block_c), lambda b, s, c: (b, 0, c)),
               pl.BlockSpec((None, None, W, block_c), lambda b, s, c: (b, s, 0, c))]
  out_shape = [jax.ShapeDtypeStruct((B, T, C), xpp_BPC.dtype), jax.ShapeDtypeStruct((B, splits, W, C), jnp.float32)]
  kernel = functools.partial(_kernel, W=W, rows=T // splits, block_t=block_t, block_c=block_c, starts=tuple(starts),
                             parts=len(sizes), has_segments=segp_BP is not None)
  dx, dw_partial = triton_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                               name="short_conv_bwd", num_warps=4, num_stages=1)(*args)
  return dx, jnp.sum(dw_partial, axis=(0, 1))


_backward_once = traced_once(_backward, static_argnums=(4,))


def _kernel(xpp_ref, w_ref, *refs, W, rows, block_t, block_c, starts, parts, has_segments):
  dy_refs = refs[:parts]
  segp_ref = refs[parts] if has_segments else None
  dx_ref, dw_ref = refs[-2:]
  c = pl.program_id(2)
  part = sum((c >= starts[i]).astype(jnp.int32) for i in range(1, parts))
  w = [w_ref[j, :] for j in range(W)]

  def dy_at(r0):
    """The cotangent's rows r0.. of this program's channels, from the part they belong to."""
    def load(i):
      return lambda: dy_refs[i][pl.ds(r0, block_t), :].astype(jnp.float32)
    return load(0)() if parts == 1 else jax.lax.switch(part, [load(i) for i in range(parts)])

  def x_at(r0):
    return xpp_ref[pl.ds(r0, block_t), :].astype(jnp.float32)

  def keep(r0, j):
    """keep_j at rows r0..: tap j of those rows is of their own document."""
    if not has_segments or j == W - 1:
      return None
    return (segp_ref[pl.ds(r0 + j, block_t)] == segp_ref[pl.ds(r0 + W - 1, block_t)])[:, None]

  def masked(x, k):
    return x if k is None else jnp.where(k, x, 0.0)

  def dpre_at(r0):
    """(dpre at rows r0.. (zero past T: the cotangent's appended rows are), the rows' taps, their masks)."""
    keeps = [keep(r0, j) for j in range(W)]
    taps = [masked(x_at(r0 + j), keeps[j]) for j in range(W)]
    pre = sum(w[j] * taps[j] for j in range(W))
    sig = jax.nn.sigmoid(pre)
    return dy_at(r0) * sig * (1.0 + pre * (1.0 - sig)), taps, keeps

  first = pl.program_id(1) * rows   # program ids outside the loop: interpret mode reads them only there

  def step(i, dw):
    t0 = first + i * block_t
    rows_at = [dpre_at(t0 + s) for s in range(W)]   # dpre at the W row shifts dx reads
    d0, taps0, _ = rows_at[0]
    dw = tuple(dw[j] + jnp.sum(taps0[j] * d0, axis=0) for j in range(W))
    dx = 0.0
    for j in range(W):
      d, _, keeps = rows_at[W - 1 - j]
      dx = dx + w[j] * masked(d, keeps[j])
    dx_ref[pl.ds(t0, block_t), :] = dx.astype(dx_ref.dtype)
    return dw

  zero = jnp.zeros((block_c,), jnp.float32)
  dw = jax.lax.fori_loop(0, rows // block_t, step, (zero,) * W)
  for j in range(W):
    dw_ref[j, :] = dw[j]
