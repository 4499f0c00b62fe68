"""Grouped GEMM `Y[m] = X[m] @ W[g(m)]` for MoE experts, with its two backward products, behind `jax.custom_vjp`.

Rows of X are sorted by group: the first `group_sizes[0]` rows belong to group 0, and so on. Backends:
- "mosaic": Pallas Mosaic-GPU kernels (`mosaic.py`) for the forward, dX and dW (Hopper GPUs, bf16/fp16);
- "xla": `jax.lax.ragged_dot` / `ragged_dot_general` (any device; on GPU it runs at about 2% of a dense GEMM);
- "auto": "mosaic" where `mosaic.unsupported_reason` is None, else "xla".
Output rows at or past `sum(group_sizes)` are zeros with "xla" and unspecified with "mosaic": callers must not
use them (the MoE layer masks them), and such input rows must be finite. Inside `jax.shard_map`, use
`check_vma=False`: the Mosaic kernels type their outputs as replicated over the mesh axes.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels._triton import traced_once
from pallas_kernels.grouped_gemm import mosaic

BACKENDS = ("auto", "mosaic", "xla")
_DW_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class GroupedGemmOptions:
  """How a layer's grouped GEMMs run: the backend (BACKENDS) and the Mosaic tilings to try first for each product's
  shape (`tiles`, in order; then `mosaic.DEFAULT_CONFIGS`)."""
  backend: str = "auto"
  tiles: tuple[mosaic.Configs, ...] = ()

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
    if not isinstance(self.tiles, tuple) or not all(isinstance(c, mosaic.Configs) for c in self.tiles):
      raise ValueError(f"tiles must be a tuple of Configs, got {self.tiles!r}")

  def matmul(self, x_MK, w_GKN, group_sizes_G):
    """`grouped_matmul` under these options, the tiles chosen for this product's shape."""
    configs = mosaic.default_configs(x_MK.shape[1], w_GKN.shape[2], x_MK.dtype, self.tiles)
    return grouped_matmul(x_MK, w_GKN, group_sizes_G, backend=self.backend, configs=configs)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, backend: str = "auto", configs: mosaic.Configs | None = None):
  """`[M, K] x [G, K, N] -> [M, N]` in x's dtype (fp32 accumulation); differentiable in x and w."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if x_MK.ndim != 2 or w_GKN.ndim != 3 or x_MK.shape[1] != w_GKN.shape[1]:
    raise ValueError(f"expected x [M, K] and w [G, K, N] with equal K, got x {x_MK.shape} and w {w_GKN.shape}")
  if group_sizes_G.shape != (w_GKN.shape[0],) or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer [G={w_GKN.shape[0]}] array, got {group_sizes_G.dtype}"
                     f"{list(group_sizes_G.shape)}")
  if x_MK.dtype != w_GKN.dtype or not jnp.issubdtype(x_MK.dtype, jnp.floating):
    raise ValueError(f"x and w must share one floating dtype, got {x_MK.dtype} and {w_GKN.dtype}")
  impl = products(backend, x_MK.shape[1], w_GKN.shape[2], x_MK.dtype, configs)
  return _gmm(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), impl)


def products(backend: str, k: int, n: int, dtype, configs: mosaic.Configs | None = None):
  """The implementation of the three products that `backend` means for `[M, k] x [G, k, n]` in `dtype` here."""
  configs = configs or mosaic.default_configs(k, n, dtype)
  reason = mosaic.unsupported_reason(k, n, dtype, configs)
  if backend == "mosaic" and reason is not None:
    raise ValueError(f"backend='mosaic' cannot run here: {reason}")
  if backend == "auto" and reason is not None and jax.default_backend() == "gpu":
    warnings.warn(f"grouped_matmul falls back to jax.lax.ragged_dot (about 2% of a dense GEMM here): {reason}")
  if backend == "xla" or (backend == "auto" and reason is not None):
    return XlaProducts()
  return MosaicProducts(configs)


@dataclasses.dataclass(frozen=True)
class XlaProducts:
  """`fwd(x, w, gs)`, `dx(dy, w, gs)`, `dw(x, dy, gs)` through XLA's ragged dots."""

  def fwd(self, x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)

  def dx(self, dy, w, gs):
    return jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), gs, preferred_element_type=jnp.float32).astype(dy.dtype)

  def dw(self, x, dy, gs):
    return jax.lax.ragged_dot_general(x, dy, gs, _DW_DIMS, preferred_element_type=jnp.float32).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class MosaicProducts:
  """The three products through the Mosaic-GPU kernels, rows padded to the kernels' tile multiple."""
  configs: mosaic.Configs

  def _pad(self, a_MX):
    pad = -a_MX.shape[0] % mosaic.row_multiple(self.configs)
    return jnp.pad(a_MX, ((0, pad), (0, 0))) if pad else a_MX

  def fwd(self, x, w, gs):
    return mosaic.ragged_dot(self._pad(x), w, gs, self.configs.fwd)[:x.shape[0]]

  def dx(self, dy, w, gs):
    return mosaic.ragged_dot(self._pad(dy), w, gs, self.configs.dx, transpose_rhs=True)[:dy.shape[0]]

  def dw(self, x, dy, gs):
    return mosaic.transposed_ragged_dot(self._pad(x), self._pad(dy), gs, self.configs.dw)


SCOPE = "grouped_gemm"  # the named scope of the three products (profiles find the kernels by it)


# The product and its two gradients each run as one call lowered once per program (`traced_once`): one compiled
# copy of each kernel, however many layers, passes and recomputations call it.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(x, w, gs, impl):
  return _product_once(x, w, gs, impl)


def _gmm_fwd(x, w, gs, impl):
  return _product_once(x, w, gs, impl), (x, w, gs)


def _gmm_bwd(impl, res, dy):
  x, w, gs = res
  return (*_gradients_once(x, w, gs, dy, impl), None)


@jax.named_scope(SCOPE)
def _product(x, w, gs, impl):
  return impl.fwd(x, w, gs)


@jax.named_scope(SCOPE)
def _gradients(x, w, gs, dy, impl):
  dy = dy.astype(x.dtype)
  return impl.dx(dy, w, gs), impl.dw(x, dy, gs).astype(w.dtype)


_product_once = traced_once(_product, static_argnums=(3,))
_gradients_once = traced_once(_gradients, static_argnums=(4,))
_gmm.defvjp(_gmm_fwd, _gmm_bwd)
