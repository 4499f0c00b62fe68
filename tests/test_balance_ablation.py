"""experiments/balance_ablation.py on a cut-down tiny model (2 MLA layers, one MoE layer): two methods for a few steps
write the JSON table and the plot, every method starts from the same model and batches; a rerun reuses finished
runs and refuses another config; the skewed data is a pure function of the seed."""
import json

import chex
import numpy as np
import pytest

from experiments import balance_ablation

pytestmark = pytest.mark.xdist_group("balance_ablation")  # one worker builds the module fixture (--dist loadgroup)
STEPS = 4
METHODS = ["quantile", "none"]
SUMMARY = {"mean_max_vio_last_half", "final_max_vio", "final_loss", "mean_loss_last_half", "heldout_loss"}


def small_config():
  c = balance_ablation.ablation_config()
  c.model.num_layers, c.model.layer_pattern = 2, ("mla",)  # MLA + dense FFN, MLA + LatentMoE: compiles fastest
  c.mesh = "data:1,expert:1"
  c.seq_len, c.batch_size = 32, 8
  c.eval.batches = 1
  return c


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
  """(work directory, returned table) of a two-method ablation."""
  workdir = tmp_path_factory.mktemp("ablation")
  return workdir, balance_ablation.run_ablation(small_config(), workdir, METHODS, steps=STEPS, seed=3)


def test_two_methods_write_the_table_and_plot_from_the_same_start(ablation):
  workdir, table = ablation
  saved = json.loads((workdir / "balance_ablation.json").read_text())
  assert saved == json.loads(json.dumps(table))
  assert (workdir / "balance_ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert saved["moe_layers"] == [1] and saved["max_vio_bound"] == 3.0 and saved["optimal_loss"] < np.log(8)
  assert list(saved["methods"]) == METHODS
  for r in saved["methods"].values():
    assert r["step"] == list(range(1, STEPS + 1))
    chex.assert_shape(np.array(r["max_vio_per_layer"]), (STEPS, 1))
    np.testing.assert_array_equal(r["max_vio"], np.max(r["max_vio_per_layer"], axis=1))
    assert set(r["summary"]) == SUMMARY and all(np.isfinite(v) for v in r["summary"].values())
    assert r["summary"]["final_loss"] == r["loss"][-1]
    assert all(0.0 <= v <= 3.0 for v in r["max_vio"])
  quantile, none = saved["methods"]["quantile"], saved["methods"]["none"]
  # Step 1 runs before any balancer update: the same model, batch and routing for both methods.
  assert quantile["loss"][0] == none["loss"][0] and quantile["max_vio"][0] == none["max_vio"][0]
  assert "quantile" in balance_ablation.format_table(table)


def test_rerun_reuses_finished_runs_and_refuses_another_config(ablation):
  workdir, table = ablation
  again = balance_ablation.run_ablation(small_config(), workdir, METHODS, steps=STEPS, seed=3)
  for name in METHODS:
    assert {k: v for k, v in again["methods"][name].items() if k != "wall_s"} == \
        {k: v for k, v in table["methods"][name].items() if k != "wall_s"}
  with pytest.raises(ValueError, match="another config"):
    balance_ablation.run_ablation(small_config(), workdir, METHODS, steps=STEPS + 1, seed=3)
  with pytest.raises(ValueError, match="another config"):
    balance_ablation.run_ablation(small_config(), workdir, METHODS, steps=STEPS, seed=4)
  with pytest.raises(ValueError, match="distinct balancers"):
    balance_ablation.run_ablation(small_config(), workdir, ["none", "none"], steps=STEPS, seed=3)
  with pytest.raises(ValueError, match="distinct balancers"):
    balance_ablation.run_ablation(small_config(), workdir, ["switch"], steps=STEPS, seed=3)


def test_skewed_data_is_a_pure_function_of_the_seed():
  train, heldout, optimal = balance_ablation.markov_tokens(5)
  again = balance_ablation.markov_tokens(5)
  np.testing.assert_array_equal(train, again[0])
  np.testing.assert_array_equal(heldout, again[1])
  assert optimal == again[2]
  assert not np.array_equal(train, balance_ablation.markov_tokens(6)[0])
  assert set(np.unique(train)) == set(balance_ablation.ALPHABET)
  assert 0.0 < optimal < np.log(len(balance_ablation.ALPHABET))
