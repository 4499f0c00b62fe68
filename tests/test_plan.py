"""experiments/plan.py: counts match the built model, K3 reproduces the published totals, the report's format."""
import math

import jax
import pytest
from flax import nnx

from experiments import plan
from k3jax.model import K3Model
from model_testing import MODEL, small_config


def test_counts_match_a_built_model():
  cfg = small_config(**MODEL)
  counts = plan.count_params(cfg)
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  assert sum(t for t, _ in counts.values()) == sum(math.prod(x.shape) for x in
                                                     jax.tree.leaves(nnx.state(model, nnx.Param)))
  E, k = cfg.moe.num_experts, cfg.moe.top_k
  routed = sum(math.prod(l.ffn.w_gate_up.shape) + math.prod(l.ffn.w_down.shape) for l in model.layers[1:])
  assert counts["moe_routed_experts"] == (routed, routed * k // E)
  for c in ("kda", "mla", "dense_ffn", "moe_shared_experts"):
    assert counts[c][0] == counts[c][1] > 0


def test_k3_full_reproduces_the_published_totals_within_3_percent():
  counts = plan.count_params(plan.load_config("k3_full").model)
  total, active = (sum(c[i] for c in counts.values()) for i in (0, 1))
  assert abs(total / 2.78e12 - 1) < 0.03, total
  assert abs(active / 104.2e9 - 1) < 0.03, active


def test_report_prints_counts_breakdown_and_memory_plan():
  text = plan.report("tiny", plan.load_config("tiny").model, "data:4,expert:2", 512, 2, 140.0)
  first = text.splitlines()[0]
  fields = dict(f.split("=") for f in first.split()[1:])
  assert int(fields["total_params"]) > int(fields["active_params"]) > 0
  for word in ("kda", "mla", "moe_routed_experts", "(8 devices)", "Adam m and v", "saved activations",
               "fits in 140 GiB", "assumptions:"):
    assert word in text, word


def test_mesh_must_be_axis_sizes():
  with pytest.raises(ValueError, match="expected 'axis:N"):
    plan.parse_mesh("data:64,expert")
