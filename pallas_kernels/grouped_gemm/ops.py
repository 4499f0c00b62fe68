"""Grouped GEMM `Y[m] = X[m] @ W[g(m)]` for MoE experts, with its two backward products, behind `jax.custom_vjp`.

Rows of X are sorted by group: the first `group_sizes[0]` rows belong to group 0, and so on. Backends:
- "mosaic": Pallas Mosaic-GPU kernels (`mosaic.py`) for the forward, dX and dW (Hopper GPUs, bf16/fp16);
- "xla": `jax.lax.ragged_dot` / `ragged_dot_general` (any device; on GPU it runs at about 2% of a dense GEMM);
- "auto": "mosaic" where `mosaic.unsupported_reason` is None, else "xla".
Output rows at or past `sum(group_sizes)` are zeros with "xla" and unspecified with "mosaic": callers must not
use them (the MoE layer masks them), and such input rows must be finite. Inside `jax.shard_map`, use
`check_vma=False`: the Mosaic kernels type their outputs as replicated over the mesh axes.

`glu_ffn` is a whole gated expert, `unit(x W_a, x W_b) W_down`, with the unit in the products' epilogues
(`mosaic_glu`) where the Mosaic kernels run (`GroupedGemmOptions.fuses_glu`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels._triton import traced_once
from pallas_kernels.grouped_gemm import mosaic, mosaic_glu

BACKENDS = ("auto", "mosaic", "xla")
_DW_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class GluTiles:
  """The tilings of the gated unit's two kernels (`mosaic_glu`): the first product with the unit after it, and the
  down projection's dX with the unit's backward after it."""
  fwd: mosaic.TileConfig = mosaic.TileConfig(128, 128, 64, max_concurrent_steps=3, grid_block_n=4, compute_wgs=2)
  grad: mosaic.TileConfig = mosaic.TileConfig(128, 64, 64, max_concurrent_steps=3, grid_block_n=8, compute_wgs=2)


@dataclasses.dataclass(frozen=True)
class GroupedGemmOptions:
  """How a layer's grouped GEMMs run: the backend (BACKENDS), the Mosaic tilings to try first for each product's
  shape (`tiles`, in order; then `mosaic.DEFAULT_CONFIGS`), and those of a gated unit in the products' epilogues
  (`glu_tiles`; None: the unit runs between the products, by XLA)."""
  backend: str = "auto"
  tiles: tuple[mosaic.Configs, ...] = ()
  glu_tiles: GluTiles | None = GluTiles()

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
    if not isinstance(self.tiles, tuple) or not all(isinstance(c, mosaic.Configs) for c in self.tiles):
      raise ValueError(f"tiles must be a tuple of Configs, got {self.tiles!r}")

  def matmul(self, x_MK, w_GKN, group_sizes_G):
    """`grouped_matmul` under these options, the tiles chosen for this product's shape."""
    configs = mosaic.default_configs(x_MK.shape[1], w_GKN.shape[2], x_MK.dtype, self.tiles)
    return grouped_matmul(x_MK, w_GKN, group_sizes_G, backend=self.backend, configs=configs)

  def _products(self, k: int, n: int, dtype):
    return products(self.backend, k, n, dtype, mosaic.default_configs(k, n, dtype, self.tiles))

  def fuses_glu(self, k: int, h: int, dtype) -> bool:
    """Whether `glu_ffn` runs a `[M, k]` expert of h units in the Mosaic kernels' epilogues here."""
    return (self.glu_tiles is not None and isinstance(self._products(k, 2 * h, dtype), MosaicProducts)
            and isinstance(self._products(h, k, dtype), MosaicProducts)
            and mosaic_glu.shape_reason(k, h, self.glu_tiles.fwd, self.glu_tiles.grad) is None)

  def glu_ffn(self, x_MK, w_gate_up_GK2H, w_down_GHK, group_sizes_G, unit):
    """`glu_ffn` under these options; `fuses_glu` must hold."""
    k, h, dtype = x_MK.shape[1], w_down_GHK.shape[1], x_MK.dtype
    if not self.fuses_glu(k, h, dtype):
      raise ValueError(f"the gated unit's kernels do not run [M, {k}] -> {h} units in {jnp.dtype(dtype).name} here")
    return glu_ffn(x_MK, w_gate_up_GK2H, w_down_GHK, group_sizes_G, up=self._products(k, 2 * h, dtype),
                   down=self._products(h, k, dtype), kernels=GluKernels(unit, self.glu_tiles))


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
    return _pad_rows(a_MX, mosaic.row_multiple(self.configs))

  def fwd(self, x, w, gs):
    return mosaic.ragged_dot(self._pad(x), w, gs, self.configs.fwd)[:x.shape[0]]

  def dx(self, dy, w, gs):
    return mosaic.ragged_dot(self._pad(dy), w, gs, self.configs.dx, transpose_rhs=True)[:dy.shape[0]]

  def dw(self, x, dy, gs):
    return mosaic.transposed_ragged_dot(self._pad(x), self._pad(dy), gs, self.configs.dw)


@dataclasses.dataclass(frozen=True)
class GluKernels:
  """The gated unit `unit` in the epilogues of the kernels `mosaic_glu` (tiled as `tiles`), rows padded to their
  tile multiple; `interpret` runs them in Mosaic GPU's interpret mode (tests on the CPU)."""
  unit: object
  tiles: GluTiles = GluTiles()
  interpret: bool = False

  def _pad(self, a_MX):
    return _pad_rows(a_MX, math.lcm(self.tiles.fwd.block_m, self.tiles.grad.block_m))

  def forward(self, x, w, gs, store_pair: bool = True):
    """(ab, h) of x's rows; ab None without `store_pair` (not written)."""
    ab, h = mosaic_glu.ragged_dot_glu(self._pad(x), w, gs, self.unit, self.tiles.fwd, interpret=self.interpret,
                                      store_pair=store_pair)
    return (None if ab is None else ab[:x.shape[0]]), h[:x.shape[0]]

  def backward(self, dy, w_down, ab, gs):
    return mosaic_glu.ragged_dot_glu_grad(self._pad(dy), w_down, self._pad(ab), gs, self.unit, self.tiles.grad,
                                          interpret=self.interpret)[:dy.shape[0]]


def glu_ffn(x_MK, w_gate_up_GK2H, w_down_GHK, group_sizes_G, *, up, down, kernels: GluKernels):
  """`y = unit(a, b) W_down[g]` with `[a, b] = x W_gate_up[g]`, `[M, K] -> [M, K]` in x's dtype; differentiable in
  x and both weights. `w_gate_up_GK2H` is `[G, K, 2, H]` (the gate units, then the up units), `w_down_GHK`
  `[G, H, K]`. The unit's forward and backward run in the epilogues of `kernels`; `up` and `down` (`products`'
  implementations for the two shapes) run the other four products. Every row must be in a group
  (`sum(group_sizes) == M`): the kernels write no other row, and the products would read them."""
  if x_MK.ndim != 2 or w_gate_up_GK2H.ndim != 4 or w_gate_up_GK2H.shape[1:3] != (x_MK.shape[1], 2) or \
      w_down_GHK.shape != (w_gate_up_GK2H.shape[0], w_gate_up_GK2H.shape[3], x_MK.shape[1]):
    raise ValueError(f"expected x [M, K], w_gate_up [G, K, 2, H] and w_down [G, H, K], got {x_MK.shape}, "
                     f"{w_gate_up_GK2H.shape} and {w_down_GHK.shape}")
  w_ab = mosaic_glu.interleave(w_gate_up_GK2H)   # its VJP gives the gradient back in [G, K, 2, H]
  return _glu(x_MK, w_ab, w_down_GHK, group_sizes_G.astype(jnp.int32), up, down, kernels)


def glu_ffn_reference(x_MK, w_gate_up_GK2H, w_down_GHK, group_sizes_G, unit):
  """`glu_ffn`'s formula in fp32 (XLA's ragged dots at full precision, the unit between them): the tests' and the
  benchmark's reference."""
  f32 = lambda a: a.astype(jnp.float32)
  g, k, _, h = w_gate_up_GK2H.shape
  full = jax.lax.Precision.HIGHEST
  ab = jax.lax.ragged_dot(f32(x_MK), f32(w_gate_up_GK2H).reshape(g, k, 2 * h), group_sizes_G, precision=full)
  return jax.lax.ragged_dot(unit(ab[:, :h], ab[:, h:]), f32(w_down_GHK), group_sizes_G, precision=full)


def _pad_rows(a_MX, multiple: int):
  """a with zero rows appended up to a multiple of `multiple` rows (itself when it has one)."""
  pad = -a_MX.shape[0] % multiple
  return jnp.pad(a_MX, ((0, pad), (0, 0))) if pad else a_MX


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


# The gated expert: its forward (two kernels) and backward (four) each one call lowered once per program. A forward
# that nothing differentiates (a scanned layer's first forward under remat, evaluation) does not write the pair
# (a, b), which only the backward's kernel reads.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _glu(x, w_ab, w_down, gs, up, down, kernels):
  return _glu_forward_once(x, w_ab, w_down, gs, up, down, kernels, False)[0]


def _glu_fwd(x, w_ab, w_down, gs, up, down, kernels):
  y, ab, h = _glu_forward_once(x, w_ab, w_down, gs, up, down, kernels, True)
  return y, (x, w_ab, w_down, gs, ab, h)


def _glu_bwd(up, down, kernels, res, dy):
  x, w_ab, w_down, gs, ab, h = res
  return (*_glu_gradients_once(x, w_ab, w_down, gs, ab, h, dy, up, down, kernels), None)


@jax.named_scope(SCOPE)
def _glu_forward(x, w_ab, w_down, gs, up, down, kernels, store_pair):
  ab, h = kernels.forward(x, w_ab, gs, store_pair)
  return down.fwd(h, w_down, gs), ab, h


@jax.named_scope(SCOPE)
def _glu_gradients(x, w_ab, w_down, gs, ab, h, dy, up, down, kernels):
  dy = dy.astype(x.dtype)
  dab = kernels.backward(dy, w_down, ab, gs)
  return up.dx(dab, w_ab, gs), up.dw(x, dab, gs).astype(w_ab.dtype), down.dw(h, dy, gs).astype(w_down.dtype)


_glu_forward_once = traced_once(_glu_forward, static_argnums=(4, 5, 6, 7))
_glu_gradients_once = traced_once(_glu_gradients, static_argnums=(7, 8, 9))
_glu.defvjp(_glu_fwd, _glu_bwd)
