"""The MoE benchmark's library (experiments/benchmarks/moe.py): the activated FLOPs it compares the dense FFN with
are the layer's own matrices, the sweep's pick, the product check's guard against rows outside every group, and the
summary table's cells. The whole benchmark runs end to end in tests/test_benchmarks.py."""
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.benchmarks import moe as moe_benchmark
from k3jax.layers.moe import LatentMoE
from pallas_kernels.grouped_gemm import Configs, TileConfig, ops

SHAPES = dataclasses.replace(moe_benchmark.SMALL, top_k=3, num_shared=2, d_model=48, latent_dim=24, expert_hidden=40)


def test_activated_flops_per_token_are_twice_the_weights_a_token_meets():
  """2 · Σ the layer's matrices (router, latent down/up, shared experts), routed experts at top_k / E."""
  E = 16
  layer = nnx.eval_shape(lambda: LatentMoE(SHAPES.d_model, moe_benchmark.moe_config(SHAPES, E), rngs=nnx.Rngs(0)))
  weights = 0
  for path, param in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    shape = param.get_value().shape
    if len(shape) >= 2:
      routed = path in (("w_gate_up",), ("w_down",))   # the shared experts use the same names one level down
      weights += math.prod(shape) * SHAPES.top_k // E if routed else math.prod(shape)
  assert moe_benchmark.activated_flops_per_token(SHAPES, E) == 2 * weights


def test_best_configs_sums_both_gemms_and_passes_over_configs_that_failed_on_either():
  a, b, c = TileConfig(128, 128, 64, 3, 8, 2), TileConfig(128, 64, 64, 6, 8, 2), TileConfig(64, 64, 64, 2, 4, 1)
  row = lambda gemm, config, seconds=None: {"gemm": gemm, "config": dataclasses.asdict(config),
                                            **({"error": "no"} if seconds is None else {"seconds": seconds})}
  sweep = {"fwd": [row("gate_up", a, 1.0), row("down", a), row("gate_up", b, 2.0), row("down", b, 2.0)],
           "dx": [row("gate_up", a, 1.0), row("down", a, 3.0), row("gate_up", b, 2.5), row("down", b, 1.0)],
           "dw": [row("gate_up", a), row("down", b)]}
  default = Configs(c, c, c)
  best = moe_benchmark.best_configs(sweep, default)
  assert best == Configs(fwd=b, dx=b, dw=c)   # fwd: a failed on down; dx: 3.5 s against 4.0 s; dw: none ran


def test_check_products_catches_junk_from_rows_outside_every_group_in_dw():
  class Leaky(ops.XlaProducts):
    def dw(self, x, dy, sizes):   # also sums the rows past the groups into the last group
      dw = super().dw(x, dy, sizes)
      return dw.at[-1].add((x[-100:].T.astype(jnp.float32) @ dy[-100:].astype(jnp.float32)).astype(dw.dtype))

  errs = moe_benchmark.check_products(Leaky(), 300, 32, 16, 8, jax.random.key(0))
  assert errs["fwd"] < moe_benchmark.MAX_REL_ERR and errs["dx"] < moe_benchmark.MAX_REL_ERR and errs["finite"]
  assert errs["dw"] > 1.0


def test_summary_cells_are_tflops_with_the_dense_ratio_and_dashes_where_a_section_failed():
  shapes = dataclasses.replace(moe_benchmark.SMALL, experts=(8, 16))
  flop = {name: 2 * shapes.tokens * shapes.top_k * k * n for name, (k, n) in moe_benchmark.gemm_shapes(shapes).items()}
  times = lambda name: {p: flop[name] / 4e12 for p in ("fwd", "dx", "dw")} | {
      f"dense_{p}": flop[name] / 2e12 for p in ("fwd", "dx", "dw")}       # 4 TFLOP/s, half the dense GEMM's time
  d = {run: {impl: {"fwd": 1e-3, "fwd_bwd": 3e-3} for impl in ("custom_vjp", "autodiff")}
       for run in ("experts", "movement")}
  results = {"E8": {"gate_up": {"times": times("gate_up"), "vs_ragged_dot": {"rows": 256, "ragged_dot_fwd": 3.0,
                                                                             "grouped_fwd": 1.0}},
                    "layer": {"moe": 2e-3, "dense": 1e-3}, "dispatch": d},
             "E16": {}}
  lines = moe_benchmark.summary(results, shapes).splitlines()
  assert lines[2] == "| 8 | gate_up 32->64 | 4 (2.00) | 4 (2.00) | 4 (2.00) | 3.0x at 256 rows | 2.00 / 1.00 = 2.00x |"
  assert lines[3] == "| 8 | down 32->32 | - | - | - | - | 2.00 / 1.00 = 2.00x |"
  assert lines[4] == "| 16 | gate_up 32->64 | - | - | - | - | - |"
  assert lines[-6:-4] == ["| 8 | experts | 1.000 / 1.000 | 3.000 / 3.000 |",
                          "| 8 | movement | 1.000 / 1.000 | 3.000 / 3.000 |"]
  assert lines[-1] == "| 8 | - / - |"   # no glu section ran
  no_dispatch = moe_benchmark.summary({"E8": {}}, dataclasses.replace(shapes, sections=("dispatch",)))
  assert no_dispatch.splitlines()[-1] == "| 8 | movement | failed | failed |"

