"""A gated unit `h = unit(a, b)` (a GLU) in the epilogues of the grouped GEMMs around it, on Hopper GPUs.

An expert `y = unit(x W_a, x W_b) W_down` runs as two kernels each way instead of two products and an elementwise
pass between them:
- `ragged_dot_glu`: `ab = x W_ab[g]` and `h = unit(a, b)` from one tile's accumulators, both written (h alone for
  a forward nothing differentiates);
- `ragged_dot_glu_grad`: `dh = dy W_down[g]ᵀ`, then `(da, db) = unit.grads(a, b, dh)` with a and b read back from
  the forward's `ab`: the pair's cotangent is written by the product, dh never is.
The gate and up units are interleaved in blocks of `HALF` columns (`interleave`), so that one warpgroup's tile holds
both halves of its units. Rows of x are sorted by group as for `mosaic.ragged_dot`, whose schedule, pipeline and
row stores these kernels share; rows at or past `sum(group_sizes)` are never written. `unit` is a static object:
`unit(a, b)` and `unit.grads(a, b, dh)` of fp32 arrays, written with ops Mosaic GPU lowers (exp, tanh, arithmetic).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_gemm.mosaic import (TileConfig, for_each_tile, launch, out_tile, pipeline_allocations,
                                                row_tile_schedule, store_rows, two_warpgroup_pipeline)

HALF = 64  # gate and up columns alternate in blocks of this many: one 128-byte swizzle row of bf16


def interleave(w_GK2H):
  """`[G, K, 2, H]` (the gate units, then the up units) -> `[G, K, 2H]`: HALF gate columns, HALF up columns, ...
  The gradient of this reshuffle undoes it, so a caller differentiating through it gets `[G, K, 2, H]` back."""
  g, k, _, h = w_GK2H.shape
  return w_GK2H.reshape(g, k, 2, h // HALF, HALF).transpose(0, 1, 3, 2, 4).reshape(g, k, 2 * h)


def shape_reason(k: int, h: int, fwd: TileConfig, grad: TileConfig) -> str | None:
  """Why the two kernels cannot run `[M, k] -> 2h units -> [M, k]` under these tilings (None when they can)."""
  return _reason("fwd", k, h, fwd, 2 * HALF) or _reason("grad", k, h, grad, HALF)


def _reason(name: str, k: int, h: int, config: TileConfig, block_n: int, m: int | None = None) -> str | None:
  checks = (
      (config.compute_wgs != 2 or config.block_n != block_n, f"{name} needs compute_wgs=2 and block_n={block_n}"),
      (h % (2 * HALF), f"H={h} is not a multiple of {2 * HALF}"),
      (k % config.block_k, f"K={k} is not a multiple of {name}.block_k={config.block_k}"),
      (m is not None and m % config.block_m, f"M={m} is not a multiple of {name}.block_m={config.block_m}"),
  )
  return next((msg for bad, msg in checks if bad), None)


def _check(name: str, m: int, k: int, h: int, config: TileConfig, block_n: int) -> None:
  reason = _reason(name, k, h, config, block_n, m)
  if reason:
    raise ValueError(f"the gated unit's kernels cannot run [M={m}, K={k}] with {h} units: {reason}")


def ragged_dot_glu(x_MK, w_GKN, group_sizes_G, unit, config: TileConfig, *, interpret: bool = False,
                   store_pair: bool = True):
  """(ab `[M, N]`, h `[M, N/2]`) in x's dtype: `ab = x W[g]` with W's columns interleaved (`interleave`) and
  `h = unit(a, b)` of ab's rounded values, in fp32, rounded once. M a multiple of `config.block_m`. Without
  `store_pair` (a forward nothing differentiates: the backward's kernel is what reads ab) ab is not written and
  None is returned in its place; h is the same."""
  (m, k), (_, _, n) = x_MK.shape, w_GKN.shape
  _check("fwd", m, k, n // 2, config, 2 * HALF)
  schedule, num_items = row_tile_schedule(group_sizes_G.astype(jnp.int32), m, config.block_m)
  h_type = jax.ShapeDtypeStruct((m, n // 2), x_MK.dtype)
  kernel = plgpu.kernel(
      functools.partial(_glu_kernel, k=k, grid_n=n // (2 * config.block_n), config=config, unit=unit,
                        store_pair=store_pair),
      out_type=(jax.ShapeDtypeStruct((m, n), x_MK.dtype), h_type) if store_pair else h_type,
      **launch("grouped_ragged_dot_glu" if store_pair else "grouped_ragged_dot_glu_h", interpret,
               two_warpgroups=True))
  out = kernel(schedule, num_items, x_MK, w_GKN)
  return out if store_pair else (None, out)


def ragged_dot_glu_grad(dy_MK, w_GHK, ab_MN, group_sizes_G, unit, config: TileConfig, *, interpret: bool = False):
  """dab `[M, 2H]` in dy's dtype, interleaved as ab: `unit.grads(a, b, dh)` with `dh = dy W[g]ᵀ` in fp32
  (W `[G, H, K]`, the down projection's weights), a and b read from `ab`."""
  (m, k), (_, h, _) = dy_MK.shape, w_GHK.shape
  _check("grad", m, k, h, config, HALF)
  schedule, num_items = row_tile_schedule(group_sizes_G.astype(jnp.int32), m, config.block_m)
  kernel = plgpu.kernel(
      functools.partial(_glu_grad_kernel, k=k, grid_n=h // (2 * config.block_n), config=config, unit=unit),
      out_type=jax.ShapeDtypeStruct((m, 2 * h), dy_MK.dtype),
      **launch("grouped_ragged_dot_glu_grad", interpret, two_warpgroups=True))
  return kernel(schedule, num_items, dy_MK, w_GHK, ab_MN)


def _glu_kernel(schedule_gmem, num_items_gmem, x_gmem, w_gmem, *outs, k, grid_n, config, unit, store_pair):
  """Each consumer warpgroup accumulates HALF gate and HALF up columns; its epilogue stores both (`store_pair`),
  then their unit."""
  ab_gmem, h_gmem = outs if store_pair else (None, *outs)
  bm, bn = config.block_m, config.block_n
  cta_n, dtype = 2 * bn, x_gmem.dtype

  def mma(_, x_smem, w_smem, accs):
    col = lax.axis_index("wg") * bn
    for acc, offset in zip(accs, (0, HALF)):
      plgpu.wgmma(acc, x_smem, w_smem.at[:, pl.ds(col + offset, HALF)])
    plgpu.wgmma_wait(0)
    return accs

  pipeline = two_warpgroup_pipeline(config, k, cta_n, dtype, transpose_rhs=False)

  @functools.partial(pl.run_scoped, allocations=pipeline_allocations(pipeline, x_gmem, w_gmem),
                     out_smem=out_tile((2, 2, bm, HALF), dtype), collective_axes="wg")
  def _scope(allocations, out_smem):
    @functools.partial(for_each_tile, schedule_gmem, num_items_gmem, grid_n, config)
    def _tile(block, group, lo, hi, ni):
      def context(run):
        @functools.partial(pl.run_scoped, acc_a=plgpu.ACC((bm, HALF), jnp.float32),
                           acc_b=plgpu.ACC((bm, HALF), jnp.float32))
        def _acc(acc_a, acc_b):
          run((acc_a, acc_b))
          wg = lax.axis_index("wg")
          col = pl.multiple_of(ni * cta_n + wg * bn, 2 * HALF)
          a, b = acc_a[...].astype(dtype), acc_b[...].astype(dtype)
          if store_pair:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's h store has read out_smem
            out_smem[wg, 0] = a
            out_smem[wg, 1] = b
            plgpu.commit_smem()
            for half in range(2):
              store_rows(out_smem.at[wg, half], ab_gmem, block * bm, lo, hi - lo, pl.ds(col + half * HALF, HALF))
          h = unit(a.astype(jnp.float32), b.astype(jnp.float32)).astype(dtype)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the ab (or previous h) stores have read the tile
          out_smem[wg, 0] = h
          plgpu.commit_smem()
          h_cols = pl.ds(pl.multiple_of(col // 2, HALF), HALF)
          store_rows(out_smem.at[wg, 0], h_gmem, block * bm, lo, hi - lo, h_cols)

      pipeline(mma, context)(x_gmem.at[pl.ds(block * bm, bm)], w_gmem.at[group, :, pl.ds(ni * cta_n, cta_n)],
                             allocations=allocations)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _glu_grad_kernel(schedule_gmem, num_items_gmem, x_gmem, w_gmem, ab_gmem, dab_gmem, *, k, grid_n, config, unit):
  """Each consumer warpgroup accumulates dh for HALF units while its a and b tiles load; its epilogue writes their
  cotangents over those tiles in shared memory, then stores them."""
  bm, bn = config.block_m, config.block_n
  cta_n, dtype = 2 * bn, x_gmem.dtype

  def mma(_, x_smem, w_smem, acc_ref):
    plgpu.wgmma(acc_ref, x_smem, w_smem.at[pl.ds(lax.axis_index("wg") * bn, bn)].transpose((1, 0)))
    plgpu.wgmma_wait(0)
    return acc_ref

  pipeline = two_warpgroup_pipeline(config, k, cta_n, dtype, transpose_rhs=True)

  @functools.partial(pl.run_scoped, allocations=pipeline_allocations(pipeline, x_gmem, w_gmem),
                     ab_smem=out_tile((2, 2, bm, HALF), dtype),
                     loaded=plgpu.Barrier(num_arrivals=1, num_barriers=4), collective_axes="wg")
  def _scope(allocations, ab_smem, loaded):
    @functools.partial(for_each_tile, schedule_gmem, num_items_gmem, grid_n, config)
    def _tile(block, group, lo, hi, ni):
      def context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
        def _acc(acc_ref):
          wg = lax.axis_index("wg")
          # ab's columns of this warpgroup's units: HALF gate, then HALF up
          col = pl.multiple_of(2 * (ni * cta_n + wg * bn), 2 * HALF)
          for half in range(2):   # loaded while the product runs
            plgpu.copy_gmem_to_smem(ab_gmem.at[pl.ds(block * bm, bm), pl.ds(col + half * HALF, HALF)],
                                    ab_smem.at[wg, half], loaded.at[2 * wg + half])
          run(acc_ref)
          plgpu.barrier_wait(loaded.at[2 * wg])
          plgpu.barrier_wait(loaded.at[2 * wg + 1])
          da, db = unit.grads(ab_smem[wg, 0].astype(jnp.float32), ab_smem[wg, 1].astype(jnp.float32), acc_ref[...])
          plgpu.commit_smem()   # every thread has read the tiles before any overwrites them
          ab_smem[wg, 0] = da.astype(dtype)
          ab_smem[wg, 1] = db.astype(dtype)
          plgpu.commit_smem()
          for half in range(2):
            store_rows(ab_smem.at[wg, half], dab_gmem, block * bm, lo, hi - lo, pl.ds(col + half * HALF, HALF))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      pipeline(mma, context)(x_gmem.at[pl.ds(block * bm, bm)], w_gmem.at[group, pl.ds(ni * cta_n, cta_n)],
                             allocations=allocations)
