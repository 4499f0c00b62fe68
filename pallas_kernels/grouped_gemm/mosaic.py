"""The three grouped-GEMM products on Hopper GPUs, as Pallas Mosaic-GPU kernels (wgmma, TMA).

`ragged_dot` (ours) gives the forward `Y = X W[g]` and `dX = dY W[g]ᵀ` (`transpose_rhs=True`): rows of X ragged
over groups, one rhs matrix per group, with a precomputed schedule of (row block, group) work items.
JAX's `transposed_ragged_dot_mgpu.transposed_ragged_dot` (ragged contraction) gives `dW[g] = X_gᵀ dY_g`.
All take arbitrary group sizes, zeros included, with no per-group row alignment. Rows at or past
`sum(group_sizes)` are never written by the forward kernels: their values are unspecified. The kernels accumulate
in fp32 and return the input dtype. On the CPU they run in Mosaic-GPU interpret mode (`interpret=True`: tests only).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

from pallas_kernels import mosaic_gpu_reason

DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tiling of one kernel: ours (`ragged_dot`) or JAX's (`transposed_ragged_dot`, which ignores compute_wgs)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1
  compute_wgs: int = 1  # `ragged_dot` only: 2 runs two consumer warpgroups (block_n columns each) and a TMA producer


@dataclasses.dataclass(frozen=True)
class Configs:
  """One tiling per product: forward, dX, dW."""
  fwd: TileConfig = TileConfig()
  dx: TileConfig = TileConfig()
  dw: TileConfig = TileConfig()


# What `grouped_matmul` uses when given no tiles, chosen per product: the first whose shape constraints hold for that
# product. The first is the best of bench_moe's sweep on the H200 (its numbers: BUILD_NOTES.md, LatentMoE and grouped
# GEMM); the second takes outputs of a multiple of 384 columns (a latent of 384, as `small`'s), which the first's
# 256-column tiles do not divide, in tiles of 384 (two warpgroups of 192); the last fits any N and K that are
# multiples of 128.
DEFAULT_CONFIGS = (
    Configs(fwd=TileConfig(128, 128, 64, max_concurrent_steps=3, grid_block_n=4, compute_wgs=2),
            dx=TileConfig(128, 128, 64, max_concurrent_steps=3, grid_block_n=8, compute_wgs=2),
            dw=TileConfig(128, 128, 64, max_concurrent_steps=4, grid_block_n=8)),
    Configs(fwd=TileConfig(128, 192, 64, max_concurrent_steps=2, compute_wgs=2),
            dx=TileConfig(128, 192, 64, max_concurrent_steps=2, compute_wgs=2)),
    Configs())

PRODUCTS = ("fwd", "dx", "dw")


def default_configs(k: int, n: int, dtype, preferred: tuple[Configs, ...] = ()) -> Configs:
  """For each product of `[M, k] x [G, k, n]`, the first tiling of `preferred`, then of `DEFAULT_CONFIGS`, that
  fits it (the last default's when none does)."""
  candidates = tuple(preferred) + DEFAULT_CONFIGS

  def pick(product):
    fits = (getattr(c, product) for c in candidates if _product_reason(product, k, n, getattr(c, product)) is None)
    return next(fits, getattr(DEFAULT_CONFIGS[-1], product))
  return Configs(**{product: pick(product) for product in PRODUCTS})


def row_multiple(configs: Configs) -> int:
  """Row counts are padded to a multiple of this, so no kernel tile reads past the end of its operands."""
  return math.lcm(configs.fwd.block_m, configs.dx.block_m, configs.dw.block_k)


def unsupported_reason(k: int, n: int, dtype, configs: Configs) -> str | None:
  """Why the kernels cannot run `[M,k] x [G,k,n]` here (None when they can; any M: rows are padded)."""
  return mosaic_gpu_reason() or shape_reason(k, n, dtype, configs)


def shape_reason(k: int, n: int, dtype, configs: Configs) -> str | None:
  """The shape and dtype constraints of the three kernels under `configs` (None when all hold)."""
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
  reasons = (_product_reason(product, k, n, getattr(configs, product)) for product in PRODUCTS)
  return next((r for r in reasons if r), None)


def _product_reason(product: str, k: int, n: int, config: TileConfig) -> str | None:
  """Why `product` ("fwd": `[M,k] x [k,n]`, "dx": `[M,n] x [n,k]`, "dw": `[k,M] x [M,n]`) cannot run under `config`."""
  if product == "dw":
    checks = ((k % config.block_m, f"K={k} is not a multiple of dw.block_m={config.block_m}"),
              (n % config.block_n, f"N={n} is not a multiple of dw.block_n={config.block_n}"))
  else:
    (inner, contracted), (outer, out) = (("K", k), ("N", n)) if product == "fwd" else (("N", n), ("K", k))
    checks = ((contracted % config.block_k, f"{inner}={contracted} is not a multiple of {product}.block_k="
                                            f"{config.block_k}"),
              (out % _cta_n(config), f"{outer}={out} is not a multiple of {product}'s {_cta_n(config)} columns "
                                     "per tile"))
  return next((msg for bad, msg in checks if bad), None)


def _cta_n(config: TileConfig) -> int:
  return config.compute_wgs * config.block_n


def row_tile_schedule(group_sizes_G, rows: int, block_m: int):
  """The work items of `ragged_dot`: one per (row block, group) pair that shares rows, in row order.

  Returns the items `[4, rows // block_m + G - 1]` int32 (the most there can be: row block, group, and the group's
  first and end row within the block; items past the last real one have no rows) and their count `[1]`. Built once
  outside the kernel, so a tile reads its item instead of scanning all G group sizes (JAX's `ragged_dot_mgpu`
  scans per tile: 0.33 of a dense GEMM at G = 256, 0.50 at G = 64).
  """
  num_groups = group_sizes_G.shape[0]
  ends = jnp.cumsum(group_sizes_G)
  starts = ends - group_sizes_G
  first, last = starts // block_m, (ends - 1) // block_m
  count = jnp.where(group_sizes_G > 0, last - first + 1, 0)
  item_ends = jnp.cumsum(count)
  item = jnp.arange(rows // block_m + num_groups - 1)
  # compare_all: one fusion over [items, G]; the default binary search lowers to a while loop of small kernels.
  group = jnp.minimum(jnp.searchsorted(item_ends, item, side="right", method="compare_all"), num_groups - 1)
  block = first[group] + item - (item_ends - count)[group]
  lo = jnp.clip(starts[group] - block * block_m, 0, block_m)
  hi = jnp.where(item < item_ends[-1], jnp.clip(ends[group] - block * block_m, 0, block_m), lo)
  return jnp.stack([block, group, lo, hi]).astype(jnp.int32), item_ends[-1:].astype(jnp.int32)


def ragged_dot(x_MK, w_GKN, group_sizes_G, config: TileConfig, *, transpose_rhs: bool = False,
               interpret: bool = False):
  """`Y[m] = X[m] @ W[g(m)]` (or `@ W[g(m)]ᵀ` with `transpose_rhs`, W then `[G, N, K]`); `[M, N]` in x's dtype.

  M must be a multiple of `config.block_m` (pad the rows); K of `block_k`, N of `block_n`.
  """
  (m, k), (num_groups, *w_dims) = x_MK.shape, w_GKN.shape
  n = w_dims[0] if transpose_rhs else w_dims[1]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  if m % bm or k % bk or n % bn or bm & (bm - 1) or config.max_concurrent_steps < 2:
    raise ValueError(f"ragged_dot needs M={m} a multiple of block_m={bm} (a power of two), K={k} of block_k={bk},"
                     f" N={n} of block_n={bn}, and max_concurrent_steps >= 2; got {config}")
  if config.compute_wgs not in (1, 2) or n % _cta_n(config):
    raise ValueError(f"compute_wgs must be 1 or 2, with N={n} a multiple of compute_wgs * block_n; got {config}")
  schedule, num_items = row_tile_schedule(group_sizes_G.astype(jnp.int32), m, bm)

  body = _one_warpgroup if config.compute_wgs == 1 else _two_warpgroups
  kernel = plgpu.kernel(
      functools.partial(body, k=k, grid_n=n // _cta_n(config), config=config, transpose_rhs=transpose_rhs),
      out_type=jax.ShapeDtypeStruct((m, n), x_MK.dtype),
      **launch("grouped_ragged_dot", interpret, two_warpgroups=config.compute_wgs == 2))
  return kernel(schedule, num_items, x_MK, w_GKN)


def launch(name: str, interpret: bool, *, two_warpgroups: bool) -> dict:
  """`plgpu.kernel`'s launch arguments for a persistent grouped-GEMM kernel: one CTA per SM, warpgroup semantics,
  with `two_warpgroups` a TMA warpgroup and two consumers (threads named "wg")."""
  threads = dict(num_threads=3, thread_name="wg") if two_warpgroups else {}
  return dict(grid=(_num_sms(interpret),), grid_names=("sm",), kernel_name=name,
              compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
              interpret=plgpu.InterpretGPUParams() if interpret else None, **threads)


def _one_warpgroup(schedule_gmem, num_items_gmem, x_gmem, w_gmem, y_gmem, *, k, grid_n, config, transpose_rhs):
  """One warpgroup per SM: a TMA pipeline over K feeding wgmma, then the item's rows stored."""
  bm, bn, bk = config.block_m, config.block_n, config.block_k

  @functools.partial(for_each_tile, schedule_gmem, num_items_gmem, grid_n, config)
  def _tile(block, group, lo, hi, ni):
    def product(acc_ref):
      rhs_spec = (plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=1) if transpose_rhs else
                  plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1))
      plgpu.emit_pipeline(
          lambda _, x_smem, w_smem: plgpu.wgmma(
              acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_rhs else w_smem),
          grid=(k // bk,),
          in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (block, kk), delay_release=1), rhs_spec],
          max_concurrent_steps=config.max_concurrent_steps,
      )(x_gmem, w_gmem.at[group])
      return acc_ref[...]

    acc = pl.run_scoped(product, plgpu.ACC((bm, bn)))

    def store(y_smem):
      y_smem[...] = acc.astype(y_smem.dtype)
      plgpu.commit_smem()
      store_rows(y_smem, y_gmem, block * bm, lo, hi - lo, pl.ds(ni * bn, bn))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(store, out_tile((bm, bn), y_gmem.dtype))


def _two_warpgroups(schedule_gmem, num_items_gmem, x_gmem, w_gmem, y_gmem, *, k, grid_n, config, transpose_rhs):
  """Two consumer warpgroups share each x tile (block_n columns each) while a third issues the TMA loads."""
  bm, bn = config.block_m, config.block_n
  cta_n = 2 * bn

  def mma(_, x_smem, w_smem, acc_ref):
    wg_cols = pl.ds(lax.axis_index("wg") * bn, bn)
    rhs = w_smem.at[wg_cols].transpose((1, 0)) if transpose_rhs else w_smem.at[:, wg_cols]
    plgpu.wgmma(acc_ref, x_smem, rhs)
    plgpu.wgmma_wait(0)
    return acc_ref

  pipeline = two_warpgroup_pipeline(config, k, cta_n, x_gmem.dtype, transpose_rhs)

  @functools.partial(pl.run_scoped, allocations=pipeline_allocations(pipeline, x_gmem, w_gmem),
                     y_smem=out_tile((2, bm, bn), y_gmem.dtype), collective_axes="wg")
  def _scope(allocations, y_smem):
    @functools.partial(for_each_tile, schedule_gmem, num_items_gmem, grid_n, config)
    def _tile(block, group, lo, hi, ni):
      def context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
        def _acc(acc_ref):
          run(acc_ref)
          wg = lax.axis_index("wg")
          y = acc_ref[...].astype(y_smem.dtype)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's stores have read y_smem
          y_smem[wg] = y
          plgpu.commit_smem()
          store_rows(y_smem.at[wg], y_gmem, block * bm, lo, hi - lo, pl.ds(ni * cta_n + wg * bn, bn))

      w_cols = pl.ds(ni * cta_n, cta_n)
      pipeline(mma, context)(
          x_gmem.at[pl.ds(block * bm, bm)],
          w_gmem.at[group, w_cols] if transpose_rhs else w_gmem.at[group, :, w_cols],
          allocations=allocations)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def for_each_tile(schedule_gmem, num_items_gmem, grid_n: int, config: TileConfig, body):
  """Runs `body(block, group, lo, hi, ni)` for this CTA's share of the (work item, column tile) pairs: the item's
  row block and group, its rows `[lo, hi)` in the block (`row_tile_schedule`), the column tile ni < grid_n."""
  items = num_items_gmem[0]

  @plgpu.nd_loop((items * grid_n,), collective_axes="sm")
  def _item_loop(loop):
    item, ni = plgpu.planar_snake(loop.index[0], (items, grid_n), 1, config.grid_block_n)
    body(*(schedule_gmem[j, item] for j in range(4)), ni)


def two_warpgroup_pipeline(config: TileConfig, k: int, cta_n: int, dtype, transpose_rhs: bool):
  """`pipeline(body, context)`: the K loop of one tile, a TMA warpgroup feeding two consumer warpgroups the x tile
  `(block_m, block_k)` and the rhs tile of `cta_n` columns (`(cta_n, block_k)` with `transpose_rhs`)."""
  bm, bk = config.block_m, config.block_k
  tiled = _swizzled(bk, dtype, tile_rows=8)
  rhs_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k // bk,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=config.max_concurrent_steps, compute_context=context,
        in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=tiled, memory_space=plgpu.SMEM),
                  plgpu.BlockSpec(rhs_block, (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                                  transforms=tiled, memory_space=plgpu.SMEM)])
  return pipeline


def pipeline_allocations(pipeline, x_gmem, w_gmem):
  """The shared-memory buffers and barriers of `pipeline` (`two_warpgroup_pipeline`'s), allocated once for every
  tile a CTA runs."""
  ignore = lambda *_, **__: None
  return pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0])


def _swizzled(cols: int, dtype, *, tile_rows: int):
  """The shared-memory transforms of tiles `cols` wide: the widest swizzle their rows take, in tiles of `tile_rows`
  rows by one swizzle's columns."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  return plgpu.TilingTransform((tile_rows, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def out_tile(shape, dtype):
  """A shared-memory tile that a warpgroup's accumulators are written to and TMA stores read, swizzled so the
  accumulators' rows land in distinct banks, and tiled by single rows so that `store_rows` can store any row range
  of it."""
  return plgpu.SMEM(shape, dtype, transforms=_swizzled(shape[-1], dtype, tile_rows=1))


def store_rows(src_smem, dst_gmem, row0, start, size, cols):
  """Stores rows `[start, start + size)` of the tile: TMA copies have static shapes, so `size` goes out as its
  binary digits, one copy per set bit, largest first (a full tile is one copy)."""
  piece = src_smem.shape[0]
  while piece:
    @pl.when(size & piece != 0)
    def _(start=start, piece=piece):
      plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(start, piece)], dst_gmem.at[pl.ds(row0 + start, piece), cols])
    start = start + (size & piece)
    piece //= 2


def _num_sms(interpret: bool) -> int:
  """One persistent CTA per SM (two when interpreting; an H100/H200's 132 when lowering for CUDA from a CPU)."""
  return 2 if interpret else getattr(jax.devices()[0], "core_count", 132)


def transposed_ragged_dot(x_MK, dy_MN, group_sizes_G, config: TileConfig):
  """`dW[g] = X_gᵀ dY_g` over each group's rows; `[G, K, N]` in x's dtype, zeros for empty groups."""
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      x_MK, dy_MN, group_sizes=group_sizes_G.astype(jnp.int32), block_m=config.block_m, block_n=config.block_n,
      block_k=config.block_k, max_concurrent_steps=config.max_concurrent_steps, grid_block_n=config.grid_block_n)
