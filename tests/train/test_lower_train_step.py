"""k3jax/train/lowering.py: the train step lowers from abstract inputs, and with scanned layer groups its
program does not grow with the number of groups."""
from experiments import configs
from k3jax.train.lowering import lower_train_step


def _lowered(num_layers: int) -> dict:
  c = configs.load("tiny")
  c.model.num_layers = num_layers   # layer 0 dense, then groups of (KDA, KDA, KDA, MLA) from layer 4
  return lower_train_step(c, seq_len=32, batch=2, micro_batches=1, mesh_spec="data:1,expert:1")


def test_the_scanned_train_step_does_not_grow_with_depth():
  two, four = _lowered(12), _lowered(20)          # 2 and 4 groups; unrolled, 8 more layers of program
  assert {"trace_s", "lower_s", "trace_lower_cpu_s", "jaxpr_eqns"} <= set(two)
  # What grows is per MoE layer and small: its load metrics and the balancer's stats (unrolled: by two thirds).
  assert four["jaxpr_eqns"] < 1.05 * two["jaxpr_eqns"], (two, four)
  assert four["stablehlo_mb"] < 1.05 * two["stablehlo_mb"], (two, four)
