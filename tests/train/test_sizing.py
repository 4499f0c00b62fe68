"""Parameter counts and the memory plan (k3jax/train/sizing.py): counts match the built model, K3 reproduces the
published totals, the FLOPs' matrices are the counted ones, the plan takes the config's own mesh and stages,
and a mesh that does not divide the experts is an error."""
import math

import jax
import pytest
from flax import nnx

from experiments import configs
from k3jax.model import K3Model
from k3jax.train import flops, sizing
from model_testing import MODEL, small_config


def test_counts_match_a_built_model():
  cfg = small_config(**MODEL)
  counts = sizing.count_params(cfg)
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  assert sum(t for t, _ in counts.values()) == sum(math.prod(x.shape) for x in
                                                     jax.tree.leaves(nnx.state(model, nnx.Param)))
  E, k = cfg.moe.num_experts, cfg.moe.top_k
  routed = sum(math.prod(l.ffn.w_gate_up.shape) + math.prod(l.ffn.w_down.shape) for l in model.layers[1:])
  assert counts["moe_routed_experts"] == (routed, routed * k // E)
  for c in ("kda", "mla", "dense_ffn", "moe_shared_experts"):
    assert counts[c][0] == counts[c][1] > 0


def test_flops_count_the_matrices_applied_to_each_token():
  """Matrices: every Param of two or more dims (one layer's, unstacked) but the embedding lookup, the depthwise
  convolutions and the elementwise dt_bias [H, K]; routed experts count top_k / E."""
  cfg = small_config(**MODEL)
  active, total = flops.active_matmul_params(cfg)
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  shapes = [(path[-1], var.get_value().shape) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  matrices = [shape for name, shape in shapes if len(shape) >= 2 and name not in ("embed", "conv", "dt_bias")]
  assert total == sum(math.prod(shape) for shape in matrices)
  routed_total, routed_active = sizing.count_params(cfg)["moe_routed_experts"]
  assert total - active == routed_total - routed_active > 0


def test_k3_full_reproduces_the_published_totals_within_3_percent():
  counts = sizing.count_params(configs.load("k3_full").model)
  total, active = (sum(c[i] for c in counts.values()) for i in (0, 1))
  assert abs(total / 2.78e12 - 1) < 0.03, total
  assert abs(active / 104.2e9 - 1) < 0.03, active


def test_report_prints_counts_breakdown_and_a_memory_plan_per_stage_on_the_config_mesh():
  c = configs.load("small")
  text = sizing.report("small", c)
  first = text.splitlines()[0]
  fields = dict(f.split("=") for f in first.split()[1:])
  assert int(fields["total_params"]) > int(fields["active_params"]) > 0
  for word in ("kda", "mla", "moe_routed_experts", "mesh data:-1,expert:1 (1 devices)", "data:-1 counted as 1",
               "Adam m and v", "saved activations", "fits in 140 GiB", "assumptions:"):
    assert word in text, word
  tokens = next(l for l in text.splitlines() if l.strip().startswith("tokens per device"))
  assert all(f"(T={s['seq_len']})" in tokens for s in c.stages) and "0.00" not in text.split("assumptions")[0]


def test_flags_override_the_mesh_and_length_and_rows_that_do_not_split_are_said():
  c = configs.load("k3_full")
  one = sizing.report("k3_full", c, "data:64,expert:16", seq_len=8192, micro_batch=1)
  assert "(1024 devices)" in one and "8192 (T=8192)" in one and "not runnable" not in one
  staged = sizing.report("k3_full", c, "data:64,expert:16")
  assert "stage 3: 16 rows per micro-batch do not split over the 1024 devices" in staged


@pytest.mark.parametrize("mesh,match", [("data:64,expert", "expected 'data:N,expert:M'"),
                                        ("data:4,model:2", "exactly the axes data and expert"),
                                        ("data:2,expert:3", r"expert axis \(3\) does not divide .*num_experts=8")])
def test_bad_meshes_are_errors(mesh, match):
  with pytest.raises(ValueError, match=match):
    sizing.report("tiny", configs.load("tiny"), mesh)
