"""The three grouped-GEMM products on Hopper GPUs, through JAX's Pallas Mosaic-GPU kernels.

`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (rows of the lhs ragged over groups, one rhs matrix
per group) gives the forward `Y = X W[g]` and `dX = dY W[g]ᵀ` (`transpose_rhs=True`);
`transposed_ragged_dot_mgpu.transposed_ragged_dot` (ragged contraction) gives `dW[g] = X_gᵀ dY_g`.
Both take arbitrary group sizes, zeros included, with no per-group row alignment. Rows at or past
`sum(group_sizes)` are never written by the forward kernels: their values are unspecified. The kernels accumulate
in fp32 and return the input dtype. There is no CPU or interpreter mode; `supports` says where they apply.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tiling of one kernel (the keyword arguments of both JAX kernels)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1


@dataclasses.dataclass(frozen=True)
class Configs:
  """One tiling per product: forward, dX, dW."""
  fwd: TileConfig = TileConfig()
  dx: TileConfig = TileConfig()
  dw: TileConfig = TileConfig()


def row_multiple(configs: Configs) -> int:
  """Row counts are padded to a multiple of this, so no kernel tile reads past the end of its operands."""
  return math.lcm(configs.fwd.block_m, configs.dx.block_m, configs.dw.block_k)


def unsupported_reason(k: int, n: int, dtype, configs: Configs) -> str | None:
  """Why the kernels cannot run `[M,k] x [G,k,n]` here (None when they can; any M: rows are padded)."""
  if jax.default_backend() != "gpu":
    return f"the default backend is {jax.default_backend()!r}, not 'gpu'"
  capability = getattr(jax.devices()[0], "compute_capability", "")
  if not str(capability).startswith("9."):
    return f"the kernels use Hopper wgmma (compute capability 9.x); this GPU has {capability!r}"
  return shape_reason(k, n, dtype, configs)


def shape_reason(k: int, n: int, dtype, configs: Configs) -> str | None:
  """The shape and dtype constraints of the three kernels under `configs` (None when all hold)."""
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
  checks = (
      (k % configs.fwd.block_k, f"K={k} is not a multiple of fwd.block_k={configs.fwd.block_k}"),
      (n % configs.fwd.block_n, f"N={n} is not a multiple of fwd.block_n={configs.fwd.block_n}"),
      (n % configs.dx.block_k, f"N={n} is not a multiple of dx.block_k={configs.dx.block_k}"),
      (k % configs.dx.block_n, f"K={k} is not a multiple of dx.block_n={configs.dx.block_n}"),
      (k % configs.dw.block_m, f"K={k} is not a multiple of dw.block_m={configs.dw.block_m}"),
      (n % configs.dw.block_n, f"N={n} is not a multiple of dw.block_n={configs.dw.block_n}"),
  )
  return next((msg for bad, msg in checks if bad), None)


def ragged_dot(x_MK, w_GKN, group_sizes_G, config: TileConfig, *, transpose_rhs: bool = False):
  """`Y[m] = X[m] @ W[g(m)]` (or `@ W[g(m)]ᵀ` with `transpose_rhs`, W then `[G, N, K]`); `[M, N]` in x's dtype."""
  return ragged_dot_mgpu.ragged_dot(
      x_MK, w_GKN, group_sizes=group_sizes_G.astype(jnp.int32), transpose_rhs=transpose_rhs,
      **dataclasses.asdict(config))


def transposed_ragged_dot(x_MK, dy_MN, group_sizes_G, config: TileConfig):
  """`dW[g] = X_gᵀ dY_g` over each group's rows; `[G, K, N]` in x's dtype, zeros for empty groups."""
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      x_MK, dy_MN, group_sizes=group_sizes_G.astype(jnp.int32), **dataclasses.asdict(config))
