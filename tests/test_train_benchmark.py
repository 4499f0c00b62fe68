"""Throughput and scaling benchmarks of the train step: an expert-parallel mesh reproduces the one-device loss
curve (fp32); variants measured in turn from their own processes; curve comparison and variant errors."""
import copy
import functools

import chex
import numpy as np
import pytest

from experiments.configs import tiny
from k3jax.train import benchmark


def small_tiny():
  c = tiny.get_config()
  c.model.num_layers = 2  # layer 0: KDA + dense FFN, layer 1: MLA + LatentMoE
  c.model.dtype = "float32"
  c.seq_len, c.batch_size, c.steps = 32, 8, 10
  return c


def test_expert_parallel_mesh_reproduces_the_one_device_curve():
  configs = [benchmark.variant(small_tiny(), mesh=m) for m in ("data:1,expert:1", "data:2,expert:2")]
  runs = [benchmark.compile_run(c) for c in configs]
  curves = [benchmark.loss_curve(r, steps=6, warmup=2) for r in runs]
  chex.assert_trees_all_close(curves[0]["losses"], curves[1]["losses"], rtol=1e-5)
  assert curves[0]["losses"][-1] < curves[0]["losses"][0]  # the curve is a training curve, not a constant
  gap = benchmark.compare_curves(curves[0], curves[1], tail=3)
  assert gap["devices"] == 4 and gap["max_rel_gap"] < 1e-5
  assert gap["scaling"] > 0 and all(r.compile_s > 0 for r in runs)


def test_time_train_step_reports_finite_throughput():
  run = benchmark.compile_run(benchmark.variant(small_tiny(), pattern="mla", seq_len=16, tokens_per_step=128))
  row = benchmark.time_train_step(run, steps=2, warmup=1)
  assert (row["seq_len"], row["batch_size"]) == (16, 8)
  assert row["finite"] and row["tokens_per_s"] > 0 and row["mfu"] is None  # no peak FLOP/s known for a CPU


def test_measure_in_turn_returns_rows_in_config_order_and_reports_a_failing_config():
  good = benchmark.variant(small_tiny(), pattern="mla", seq_len=16, tokens_per_step=128)
  bad = copy.deepcopy(good)
  bad.log_every = 0  # rejected when its Run is built, inside its process
  measure = functools.partial(benchmark.time_train_step, steps=1, warmup=1)
  rows = list(benchmark.measure_in_turn([bad, good], measure, timeout_s=600))
  assert "log_every" in rows[0]["error"]
  assert rows[1]["finite"] and (rows[1]["seq_len"], rows[1]["batch_size"]) == (16, 8), rows[1]


def test_compare_curves_measures_gaps_and_scaling():
  ref = {"mesh": "a", "devices": 1, "losses": [2.0, 1.0, 1.0], "tokens_per_s": 100.0}
  other = {"mesh": "b", "devices": 2, "losses": [2.0, 1.1, 0.95], "tokens_per_s": 160.0}
  gap = benchmark.compare_curves(ref, other, tail=2)
  np.testing.assert_allclose([gap["max_rel_gap"], gap["tail_mean_rel_gap"], gap["tail_mean_gap"], gap["scaling"]],
                             [0.1, 0.075, 0.025, 0.8])
  with pytest.raises(ValueError, match="steps"):
    benchmark.compare_curves(ref, {**other, "losses": [1.0]})


def test_variant_rejects_unknown_patterns_and_uneven_batches():
  with pytest.raises(ValueError, match="pattern"):
    benchmark.variant(small_tiny(), pattern="rnn")
  with pytest.raises(ValueError, match="multiple"):
    benchmark.variant(small_tiny(), seq_len=48, tokens_per_step=100)
