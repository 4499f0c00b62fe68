"""Grouped GEMM op: the XLA backend's forward and custom-VJP products against a dense per-row reference, the
Mosaic-GPU kernels in interpret mode and lowered for CUDA (their numerics on the GPU: experiments/bench_moe.py), and
the gated expert with its unit in the kernels' epilogues (`glu_ffn`) against the formula, forward and gradients."""
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.ffn import SiTU
from pallas_kernels.grouped_gemm import (Configs, GroupedGemmOptions, TileConfig, grouped_matmul, mosaic,
                                          mosaic_glu, ops)


def rel(a, b):
  return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.sqrt(jnp.mean(b ** 2)))


def random_groups(key, num_rows, num_groups):
  """Sizes summing to num_rows with some empty groups (the zeros routing produces)."""
  cuts = jnp.sort(jax.random.randint(key, (num_groups - 1,), 0, num_rows + 1))
  sizes = jnp.diff(jnp.concatenate([jnp.array([0]), cuts, jnp.array([num_rows])]))
  return sizes.at[1].set(0).at[0].add(sizes[1])  # force one empty group, keep the total


def dense_reference(x_MK, w_GKN, sizes_G):
  group_M = jnp.repeat(jnp.arange(w_GKN.shape[0]), sizes_G, total_repeat_length=x_MK.shape[0])
  return jnp.einsum("mk,mkn->mn", x_MK, w_GKN[group_M])


def test_xla_backend_matches_dense_reference_forward_and_gradients():
  kx, kw, kg, kc = jax.random.split(jax.random.key(0), 4)
  m, k, n, g = 96, 16, 24, 6
  x = jax.random.normal(kx, (m, k))
  w = jax.random.normal(kw, (g, k, n))
  sizes = random_groups(kg, m, g)
  assert int(jnp.sum(sizes == 0)) >= 1
  cot = jax.random.normal(kc, (m, n))

  def loss(fn, x, w):
    return jnp.sum(fn(x, w) * cot)
  ours = jax.value_and_grad(lambda x, w: loss(lambda a, b: grouped_matmul(a, b, sizes, backend="xla"), x, w),
                            argnums=(0, 1))
  ref = jax.value_and_grad(lambda x, w: loss(lambda a, b: dense_reference(a, b, sizes), x, w), argnums=(0, 1))
  (v, (dx, dw)), (v_ref, (dx_ref, dw_ref)) = jax.jit(ours)(x, w), jax.jit(ref)(x, w)
  chex.assert_trees_all_close(v, v_ref, rtol=1e-5)
  assert rel(grouped_matmul(x, w, sizes, backend="xla"), dense_reference(x, w, sizes)) <= 1e-6
  assert rel(dx, dx_ref) <= 1e-6 and rel(dw, dw_ref) <= 1e-6
  assert float(jnp.abs(dw[1]).max()) == 0.0  # the empty group gets no gradient


def test_auto_backend_on_cpu_is_xla_and_mosaic_is_refused():
  x = jax.random.normal(jax.random.key(1), (8, 64), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (2, 64, 128), jnp.bfloat16)
  sizes = jnp.array([3, 5])
  chex.assert_trees_all_equal(grouped_matmul(x, w, sizes), grouped_matmul(x, w, sizes, backend="xla"))
  with pytest.raises(ValueError, match="backend='mosaic' cannot run here"):
    grouped_matmul(x, w, sizes, backend="mosaic")


@pytest.mark.parametrize("bad, match", [
    (dict(x=np.zeros((4, 3, 2), np.float32)), "expected x"),
    (dict(sizes=np.array([1.0, 3.0])), "group_sizes must be an integer"),
    (dict(sizes=np.array([4])), "group_sizes must be an integer"),
    (dict(w=np.zeros((2, 3, 5), np.float16)), "share one floating dtype"),
    (dict(backend="cuda"), "backend must be one of"),
])
def test_bad_arguments_raise_value_errors(bad, match):
  args = dict(x=np.ones((4, 3), np.float32), w=np.ones((2, 3, 5), np.float32), sizes=np.array([1, 3]),
              backend="xla") | bad
  with pytest.raises(ValueError, match=match):
    grouped_matmul(jnp.asarray(args["x"]), jnp.asarray(args["w"]), jnp.asarray(args["sizes"]),
                   backend=args["backend"])


def test_mosaic_shape_constraints_are_named():
  configs = Configs()
  assert mosaic.shape_reason(1024, 2048, jnp.bfloat16, configs) is None
  assert "dtype float32" in mosaic.shape_reason(1024, 2048, jnp.float32, configs)
  assert "K=100" in mosaic.shape_reason(100, 2048, jnp.bfloat16, configs)
  assert "N=200" in mosaic.shape_reason(1024, 200, jnp.bfloat16, configs)
  two = TileConfig(compute_wgs=2)
  assert "N=384 is not a multiple of fwd's 256" in mosaic.shape_reason(1024, 384, jnp.bfloat16, Configs(fwd=two))


@pytest.mark.parametrize("m, g, wgs", [(1000, 64, 1), (512, 7, 1), (1000, 64, 2)])
def test_mosaic_forward_and_backward_lower_for_cuda(monkeypatch, m, g, wgs):
  """The three kernels trace and lower to CUDA here (shared-memory and shape checks run at lowering)."""
  # transposed_ragged_dot reads the SM count from jax.devices()[0] while tracing; CPU devices have none.
  monkeypatch.setattr(jax, "devices", lambda *a, **kw: [types.SimpleNamespace(core_count=132)])
  k, n = 256, 384 * wgs
  ragged = TileConfig(block_n=64 * wgs, max_concurrent_steps=4 if wgs == 1 else 3, compute_wgs=wgs)
  configs = Configs(fwd=ragged, dx=ragged, dw=TileConfig(block_n=128))

  def loss(x, w, sizes):  # the op below grouped_matmul's device check
    return ops._gmm(x, w, sizes, ops.MosaicProducts(configs)).astype(jnp.float32).sum()
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
          jax.ShapeDtypeStruct((g,), jnp.int32))
  exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"])(*args)
  assert exported.mlir_module().count("mosaic_gpu") >= 3


def test_row_tile_schedule_gives_every_row_to_its_group_exactly_once():
  block_m, rows = 16, 208
  sizes = jnp.array([0, 5, 16, 0, 40, 1, 1, 0, 90, 7, 0], jnp.int32)  # 160 rows: aligned and unaligned ends
  schedule, count = mosaic.row_tile_schedule(sizes, rows, block_m)
  block, group, lo, hi = np.asarray(schedule)
  chex.assert_shape(schedule, (4, rows // block_m + sizes.shape[0] - 1))
  owner = np.full(rows, -1)
  for b, g, a, e in zip(block, group, lo, hi):
    assert 0 <= a <= e <= block_m
    rows_here = np.arange(b * block_m + a, b * block_m + e)
    assert np.all(owner[rows_here] == -1), "a row is covered twice"
    owner[rows_here] = g
  np.testing.assert_array_equal(owner, np.concatenate([np.repeat(np.arange(11), np.asarray(sizes)),
                                                       np.full(rows - 160, -1)]))
  assert int(count[0]) == int(np.sum(hi > lo))


@pytest.mark.parametrize("wgs", [1, 2])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_mosaic_ragged_dot_in_interpret_mode_matches_dense_reference(wgs, transpose_rhs):
  """Our Mosaic-GPU kernel, run by Pallas's GPU interpreter on the CPU: empty groups, groups inside one tile, rows
  past the groups (never written, so not compared)."""
  kx, kw = jax.random.split(jax.random.key(3))
  m, k, n = 256, 128, 128
  sizes = jnp.array([70, 0, 1, 120, 40], jnp.int32)  # 231 of 256 rows
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (5, k, n), jnp.float32).astype(jnp.bfloat16)
  config = TileConfig(64, 64, 64, max_concurrent_steps=2, compute_wgs=wgs)
  got = mosaic.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, sizes, config,
                          transpose_rhs=transpose_rhs, interpret=True)
  want = dense_reference(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
  assert rel(got[:231].astype(jnp.float32), want[:231]) <= 4e-3  # bf16 output rounding


def test_mosaic_ragged_dot_rejects_tiles_that_do_not_divide_the_operands():
  x, w, sizes = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((2, 128, 192), jnp.bfloat16), jnp.array([3, 5])
  with pytest.raises(ValueError, match="N=192 of block_n=128"):
    mosaic.ragged_dot(x, w, sizes, TileConfig(64, 128, 64), interpret=True)
  with pytest.raises(ValueError, match="compute_wgs"):
    mosaic.ragged_dot(x, w, sizes, TileConfig(64, 64, 64, compute_wgs=2), interpret=True)


def test_default_tiles_are_chosen_per_product_two_warpgroups_where_they_fit():
  first, wide = mosaic.DEFAULT_CONFIGS[:2]
  assert mosaic.default_configs(1024, 2048, jnp.bfloat16).fwd == first.fwd
  narrow = mosaic.default_configs(1024, 384, jnp.bfloat16)  # 384 columns: not a multiple of 2 x 128, of 2 x 192
  assert narrow.fwd == wide.fwd and mosaic.shape_reason(1024, 384, jnp.bfloat16, narrow) is None
  assert narrow.dx == first.dx   # dX has 1024 columns: the first default fits it
  up = mosaic.default_configs(384, 1024, jnp.bfloat16)  # `small`'s gate/up: the forward fits, dX's 384 columns not
  assert up.fwd == first.fwd and up.dx == wide.dx
  odd = mosaic.default_configs(1024, 640, jnp.bfloat16)   # 640 columns: only one warpgroup's 128-column tiles
  assert odd.fwd.compute_wgs == 1 and mosaic.shape_reason(1024, 640, jnp.bfloat16, odd) is None


def test_options_try_their_tiles_first_where_they_fit(monkeypatch):
  """A layer's `GroupedGemmOptions.tiles` come before the defaults for each product of each shape, and a tiling that
  does not fit a product is passed over for that product alone (a sweep's best for one GEMM of the MoE, say)."""
  wide = Configs(fwd=TileConfig(128, 256, 64), dx=TileConfig(128, 128, 64, 5), dw=TileConfig(128, 128, 64, 5))
  assert mosaic.default_configs(1024, 2048, jnp.bfloat16, (wide,)) == wide
  narrow = mosaic.default_configs(1024, 384, jnp.bfloat16, (wide,))  # 384 columns: wide's forward does not fit
  assert narrow == Configs(fwd=mosaic.default_configs(1024, 384, jnp.bfloat16).fwd, dx=wide.dx, dw=wide.dw)
  seen = []
  monkeypatch.setattr(ops, "grouped_matmul", lambda x, w, gs, *, backend, configs: seen.append((backend, configs)))
  x, sizes = jnp.ones((8, 1024), jnp.bfloat16), jnp.array([8, 0], jnp.int32)
  options = GroupedGemmOptions("xla", tiles=(wide,))
  options.matmul(x, jnp.ones((2, 1024, 2048), jnp.bfloat16), sizes)
  options.matmul(x, jnp.ones((2, 1024, 384), jnp.bfloat16), sizes)
  assert seen == [("xla", wide), ("xla", narrow)]


@pytest.mark.parametrize("kwargs, says", [(dict(backend="triton"), "backend must be one of"),
                                          (dict(tiles=[Configs()]), "tiles must be a tuple of Configs")])
def test_options_refuse_an_unknown_backend_and_loose_tiles(kwargs, says):
  with pytest.raises(ValueError, match=says):
    GroupedGemmOptions(**kwargs)


def test_layers_of_equal_shapes_trace_the_products_as_often_as_one_layer(monkeypatch):
  """One and three grouped GEMMs of equal shapes in a differentiated program trace the forward and backward products
  equally often: the layers share one traced program (one compiled copy of each kernel, not one per layer)."""
  traced = []
  for name in ("fwd", "dx", "dw"):
    original = getattr(ops.XlaProducts, name)
    monkeypatch.setattr(ops.XlaProducts, name,
                        lambda self, *a, _name=name, _f=original: traced.append(_name) or _f(self, *a))
  kx, kw = jax.random.split(jax.random.key(0))
  sizes = jnp.array([10, 12, 10], jnp.int32)

  def traces(layers):
    traced.clear()
    d = 16 + layers   # each count from shapes of its own: nothing traced before
    x, w = jax.random.normal(kx, (32, d)), jax.random.normal(kw, (d, d))
    def loss(x, w):
      for _ in range(layers):
        x = jnp.tanh(grouped_matmul(x, jnp.stack([w, 2 * w, -w]), sizes, backend="xla"))
      return x.sum()
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    return sorted(traced)
  one = traces(1)
  three = traces(3)
  assert three == one and {"fwd", "dx", "dw"} <= set(one), (one, three)


# The gated unit's kernels at interpret-mode sizes: 64-row tiles, HALF-column gate and up blocks.
GLU_TILES = ops.GluTiles(TileConfig(64, 128, 64, max_concurrent_steps=2, compute_wgs=2),
                         TileConfig(64, 64, 64, max_concurrent_steps=2, compute_wgs=2))
GLU_SIZES = jnp.array([70, 0, 1, 120, 65], jnp.int32)   # 256 rows: an empty group, one inside a tile


def glu_operands(m=256, k=128, h=128, scale=0.2):
  """bf16 x `[M, K]`, w_gate_up `[G, K, 2, H]`, w_down `[G, H, K]`, dy `[M, K]`; larger scales saturate the unit."""
  keys = jax.random.split(jax.random.key(11), 4)
  g = GLU_SIZES.shape[0]
  return tuple(a.astype(jnp.bfloat16) for a in (
      jax.random.normal(keys[0], (m, k)), scale * jax.random.normal(keys[1], (g, k, 2, h)),
      scale * jax.random.normal(keys[2], (g, h, k)), jax.random.normal(keys[3], (m, k))))


def max_rel(got, want):
  return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def test_interleave_alternates_gate_and_up_blocks():
  w = jnp.arange(2 * 3 * 2 * 256).reshape(2, 3, 2, 256)
  got = mosaic_glu.interleave(w)
  half = mosaic_glu.HALF
  for blk in range(256 // half):
    np.testing.assert_array_equal(got[:, :, 2 * blk * half:(2 * blk + 1) * half], w[:, :, 0, blk * half:(blk + 1) * half])
    np.testing.assert_array_equal(got[:, :, (2 * blk + 1) * half:(2 * blk + 2) * half], w[:, :, 1, blk * half:(blk + 1) * half])


@pytest.mark.parametrize("scale", [0.2, 3.0])   # 3.0: most units deep in the tanh's and the sigmoid's saturation
def test_glu_kernels_in_interpret_mode_match_the_formula_forward_and_backward(scale):
  x, w, w_down, dy = glu_operands(scale=scale)
  m, h = x.shape[0], w.shape[-1]
  unit = SiTU()
  ab, hid = mosaic_glu.ragged_dot_glu(x, mosaic_glu.interleave(w), GLU_SIZES, unit, GLU_TILES.fwd, interpret=True)
  ab_want = jax.lax.ragged_dot(x, w.reshape(*w.shape[:2], 2 * h), GLU_SIZES, preferred_element_type=jnp.float32)
  to_blocks = lambda a: mosaic_glu.interleave(a.reshape(m, 1, 2, h)).reshape(m, 2 * h)
  assert max_rel(ab, to_blocks(ab_want)) <= 4e-3                      # bf16 output rounding
  # h from ab's rounded values, as the kernel forms it: then only h's own rounding is left.
  ab_bf16 = ab_want.astype(jnp.bfloat16).astype(jnp.float32)
  assert max_rel(hid, unit(ab_bf16[:, :h], ab_bf16[:, h:])) <= 4e-3
  no_pair, hid_only = mosaic_glu.ragged_dot_glu(x, mosaic_glu.interleave(w), GLU_SIZES, unit, GLU_TILES.fwd,
                                                interpret=True, store_pair=False)
  assert no_pair is None
  np.testing.assert_array_equal(hid_only, hid)                       # h alone: the same bits
  dab = mosaic_glu.ragged_dot_glu_grad(dy, w_down, ab, GLU_SIZES, unit, GLU_TILES.grad, interpret=True)
  dh = jax.lax.ragged_dot(dy, jnp.swapaxes(w_down, 1, 2), GLU_SIZES, preferred_element_type=jnp.float32)
  a, b = (ab.astype(jnp.float32).reshape(m, h // 64, 2, 64)[:, :, i] for i in (0, 1))
  da, db = unit.grads(a, b, dh.reshape(m, h // 64, 64))
  assert max_rel(dab, jnp.stack([da, db], axis=2).reshape(m, 2 * h)) <= 8e-3   # dh in fp32, one rounding


def test_glu_ffn_matches_the_fp32_expert_and_its_gradients_at_least_as_well_as_the_unit_between_products():
  """`glu_ffn` (interpreted kernels, the other products by XLA) against autodiff of the fp32 formula, held to the
  error of today's unfused bf16 expert (the unit in bf16 between the two products) on the same inputs."""
  x, w, w_down, dy = glu_operands(scale=1.0)
  g, k, _, h = w.shape
  kernels = ops.GluKernels(SiTU(), GLU_TILES, interpret=True)
  fused = lambda x, w, wd: ops.glu_ffn(x, w, wd, GLU_SIZES, up=ops.XlaProducts(), down=ops.XlaProducts(),
                                       kernels=kernels)

  def unfused(x, w, wd):
    ab = grouped_matmul(x, w.reshape(g, k, 2 * h), GLU_SIZES, backend="xla")
    return grouped_matmul(SiTU()(ab[:, :h], ab[:, h:]), wd, GLU_SIZES, backend="xla")
  want, want_vjp = jax.vjp(lambda *a: ops.glu_ffn_reference(*a, GLU_SIZES, SiTU()),
                           *(a.astype(jnp.float32) for a in (x, w, w_down)))
  wants = (want, *want_vjp(dy.astype(jnp.float32)))
  errors = {}
  for name, fn in (("fused", fused), ("unfused", unfused)):
    y, vjp = jax.vjp(fn, x, w, w_down)
    got = (y, *vjp(dy))
    assert [a.shape for a in got] == [a.shape for a in wants] and all(a.dtype == jnp.bfloat16 for a in got)
    errors[name] = [max_rel(a, b) for a, b in zip(got, wants)]
  for part, e_fused, e_unfused in zip(("y", "dx", "dw_gate_up", "dw_down"), errors["fused"], errors["unfused"]):
    assert e_fused <= max(1.1 * e_unfused, 4e-3), (part, e_fused, e_unfused)


def test_a_glu_ffn_nothing_differentiates_writes_no_pair_and_gives_the_same_output():
  """Undifferentiated (a scanned layer's first forward under remat, evaluation) the forward kernel writes h alone;
  differentiated it writes the pair its backward reads. The output is the same bits either way."""
  x, w, w_down, _ = glu_operands(scale=1.0)
  kernels = ops.GluKernels(SiTU(), GLU_TILES, interpret=True)
  ffn = lambda x, w, wd: ops.glu_ffn(x, w, wd, GLU_SIZES, up=ops.XlaProducts(), down=ops.XlaProducts(),
                                     kernels=kernels)
  plain = str(jax.make_jaxpr(ffn)(x, w, w_down))
  differentiated = str(jax.make_jaxpr(lambda *a: jax.vjp(ffn, *a)[0])(x, w, w_down))
  assert "grouped_ragged_dot_glu_h" in plain and "grouped_ragged_dot_glu_h" not in differentiated
  assert "grouped_ragged_dot_glu" in differentiated
  np.testing.assert_array_equal(jax.jit(ffn)(x, w, w_down), jax.vjp(ffn, x, w, w_down)[0])


def test_glu_ffn_refuses_mismatched_operands_before_any_compute():
  x, w, w_down, _ = glu_operands()
  kernels = ops.GluKernels(SiTU(), GLU_TILES, interpret=True)
  with pytest.raises(ValueError, match=r"w_gate_up \[G, K, 2, H\]"):
    ops.glu_ffn(x, w.reshape(*w.shape[:2], -1), w_down, GLU_SIZES, up=ops.XlaProducts(), down=ops.XlaProducts(),
                kernels=kernels)
  with pytest.raises(ValueError, match="do not run"):
    GroupedGemmOptions().glu_ffn(x, w, w_down, GLU_SIZES, SiTU())   # the CPU: XLA's products, no kernels
  with pytest.raises(ValueError, match=r"M=250 is not a multiple of fwd.block_m=64"):
    mosaic_glu.ragged_dot_glu(x[:250], mosaic_glu.interleave(w), GLU_SIZES, SiTU(), GLU_TILES.fwd, interpret=True)
  with pytest.raises(ValueError, match=r"grad needs compute_wgs=2 and block_n=64"):
    mosaic_glu.ragged_dot_glu_grad(x, w_down, x, GLU_SIZES, SiTU(), GLU_TILES.fwd, interpret=True)


def test_glu_fusion_applies_only_to_mosaic_products_and_fitting_shapes(monkeypatch):
  assert not GroupedGemmOptions().fuses_glu(384, 512, jnp.bfloat16)   # the CPU runs XLA's products
  monkeypatch.setattr(mosaic, "mosaic_gpu_reason", lambda: None)       # as on a Hopper GPU
  assert GroupedGemmOptions().fuses_glu(384, 512, jnp.bfloat16)
  assert not GroupedGemmOptions(glu_tiles=None).fuses_glu(384, 512, jnp.bfloat16)
  assert not GroupedGemmOptions().fuses_glu(384, 448, jnp.bfloat16)   # H not a multiple of 128
  assert not GroupedGemmOptions().fuses_glu(384, 512, jnp.float32)
  assert "block_n=64" in mosaic_glu.shape_reason(384, 512, GLU_TILES.fwd, GLU_TILES.fwd)


def test_glu_ffn_forward_and_backward_lower_for_cuda(monkeypatch):
  """The gated expert's kernels (two forward, four backward) trace and lower to CUDA here, once each."""
  monkeypatch.setattr(jax, "devices", lambda *a, **kw: [types.SimpleNamespace(core_count=132)])
  k, h = 384, 512
  up, down = (ops.MosaicProducts(mosaic.default_configs(a, b, jnp.bfloat16)) for a, b in ((k, 2 * h), (h, k)))

  def loss(x, w, wd, sizes):
    return ops.glu_ffn(x, w, wd, sizes, up=up, down=down, kernels=ops.GluKernels(SiTU())).astype(jnp.float32).sum()
  args = (jax.ShapeDtypeStruct((1000, k), jnp.bfloat16), jax.ShapeDtypeStruct((64, k, 2, h), jnp.bfloat16),
          jax.ShapeDtypeStruct((64, h, k), jnp.bfloat16), jax.ShapeDtypeStruct((64,), jnp.int32))
  module = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"])(*args).mlir_module()
  assert module.count("func.func private @_glu_forward(") == 1
  assert module.count("func.func private @_glu_gradients(") == 1
  assert module.count("custom_call @mosaic_gpu_v2") == 6
  # Undifferentiated: the forward whose first kernel writes h alone.
  forward = jax.export.export(jax.jit(loss), platforms=["cuda"])(*args).mlir_module()
  assert forward.count("custom_call @mosaic_gpu_v2") == 2 and "grouped_ragged_dot_glu_h" in forward
