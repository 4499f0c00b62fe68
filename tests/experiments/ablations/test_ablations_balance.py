"""experiments.ablations.balance on a cut-down tiny model (2 MLA layers, one MoE layer): two methods for a few steps give
the table, every method starts from the same model and batches; a rerun reuses finished runs and refuses another
config; the skewed data is a pure function of the seed; the script writes the JSON and the plot."""
import json
import pathlib
import subprocess
import sys

import chex
import numpy as np
import pytest

from experiments.configs import tiny
from experiments.ablations import balance
from k3jax.train import workdir as workdir_lib

pytestmark = pytest.mark.xdist_group("balance_ablation")  # one worker builds the module fixture (--dist loadgroup)
ROOT = pathlib.Path(__file__).resolve().parents[3]
STEPS = 4
METHODS = ["cutoff_histogram", "none"]


def small_config():
  c = balance.ablation_config(tiny.get_config())
  c.model.num_layers, c.model.layer_pattern = 2, ("mla",)  # MLA + dense FFN, MLA + LatentMoE: compiles fastest
  c.mesh = "data:1,expert:1"
  c.seq_len, c.batch_size = 32, 8
  c.eval.batches = 1
  return c


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
  """(work directory, returned table) of a two-method ablation."""
  workdir = tmp_path_factory.mktemp("ablation")
  return workdir, balance.run_ablation(small_config(), workdir, METHODS, steps=STEPS, seeds=[3], data_seed=3)


def test_two_methods_give_the_table_from_the_same_start(ablation):
  workdir, table = ablation
  assert table["moe_layers"] == [1] and table["max_vio_bound"] == 3.0 and table["optimal_loss"] < np.log(8)
  assert list(table["methods"]) == METHODS and table["seeds"] == [3]
  for name, m in table["methods"].items():
    (r,) = m["runs"]
    assert r["seed"] == 3 and r["step"] == list(range(1, STEPS + 1))
    chex.assert_shape(np.array(r["max_vio_per_layer"]), (STEPS, 1))
    np.testing.assert_array_equal(r["max_vio"], np.max(r["max_vio_per_layer"], axis=1))
    assert set(r["summary"]) == set(balance.SUMMARY) and all(np.isfinite(v) for v in r["summary"].values())
    assert r["summary"]["final_loss"] == r["loss"][-1]
    assert all(0.0 <= v <= 3.0 for v in r["max_vio"])
    assert m["summary"]["final_loss"]["mean"] == r["loss"][-1] and m["summary"]["final_loss"]["std"] is None
    saved = json.loads((workdir / name / "seed_3" / "config.json").read_text())
    assert saved["model"]["moe"]["balancer"] == balance.METHODS[name]["model.moe.balancer"]
  assert json.loads((workdir / "cutoff_histogram" / "seed_3" / "config.json").read_text()
                    )["model"]["moe"]["balancer_method"] == "histogram"
  cutoff, none = (table["methods"][m]["runs"][0] for m in METHODS)
  # Step 1 runs before any balancer update: the same model, batch and routing for both methods.
  assert cutoff["loss"][0] == none["loss"][0] and cutoff["max_vio"][0] == none["max_vio"][0]
  # The bias spread: the balancer moved the experts apart; without one the bias stays zero.
  assert cutoff["summary"]["final_bias_range"] > 0.0 and none["summary"]["final_bias_range"] == 0.0
  text = balance.format_table(table)
  assert "cutoff_histogram" in text and "none" in text


def test_rerun_reuses_finished_runs_and_refuses_another_config(ablation):
  workdir, table = ablation
  again = balance.run_ablation(small_config(), workdir, METHODS, steps=STEPS, seeds=[3], data_seed=3)
  for name in METHODS:
    strip = lambda m: [{k: v for k, v in r.items() if k != "wall_s"} for r in m["runs"]]
    assert strip(again["methods"][name]) == strip(table["methods"][name])
  with pytest.raises(workdir_lib.ConfigChanged, match="steps"):
    balance.run_ablation(small_config(), workdir, METHODS, steps=STEPS + 1, seeds=[3], data_seed=3)
  with pytest.raises(workdir_lib.ConfigChanged, match="data.shards"):   # other data: other shard files
    balance.run_ablation(small_config(), workdir, METHODS, steps=STEPS, seeds=[3], data_seed=4)
  with pytest.raises(ValueError, match="distinct names"):
    balance.run_ablation(small_config(), workdir, ["none", "none"], steps=STEPS, seeds=[3])
  with pytest.raises(ValueError, match="distinct names"):
    balance.run_ablation(small_config(), workdir, ["switch"], steps=STEPS, seeds=[3])


def test_script_writes_the_json_and_the_plot_of_the_ablation(ablation):
  workdir, table = ablation
  # The flags give the fixture's config, so the script reuses its finished runs (a pure read of the table).
  flags = ["--config.model.num_layers=2", "--config.model.layer_pattern=('mla',)", "--config.mesh=data:1,expert:1",
           "--config.seq_len=32", "--config.batch_size=8", "--config.eval.batches=1"]
  subprocess.run([sys.executable, "-m", "experiments.balance_ablation", f"--workdir={workdir}", f"--steps={STEPS}",
                  f"--methods={','.join(METHODS)}", "--seeds=3", "--data_seed=3", *flags],
                 cwd=ROOT, check=True, capture_output=True, text=True)
  saved = json.loads((workdir / "balance_ablation.json").read_text())
  assert list(saved["methods"]) == METHODS
  assert saved["methods"]["none"]["runs"][0]["loss"] == table["methods"]["none"]["runs"][0]["loss"]
  assert (workdir / "balance_ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_config_needs_moe_and_keeps_only_the_skewed_shards():
  c = balance.ablation_config(tiny.get_config())
  assert c.data.mix["shards"] == 1.0 and sum(c.data.mix.values()) == 1.0 and c.eval.examples == 0
  dense = tiny.get_config()
  dense.model.moe.enabled = False
  with pytest.raises(ValueError, match="moe.enabled"):
    balance.ablation_config(dense)


def test_skewed_data_is_a_pure_function_of_the_seed():
  train, heldout, optimal = balance.markov_tokens(5)
  again = balance.markov_tokens(5)
  np.testing.assert_array_equal(train, again[0])
  np.testing.assert_array_equal(heldout, again[1])
  assert optimal == again[2]
  assert not np.array_equal(train, balance.markov_tokens(6)[0])
  assert set(np.unique(train)) == set(balance.ALPHABET)
  assert 0.0 < optimal < np.log(len(balance.ALPHABET))


def test_markov_shards_are_written_once_and_hold_the_chains_tokens(tmp_path):
  train_path, heldout_path = balance.markov_shards(5, tmp_path / "d")
  assert (train_path, heldout_path) == balance.markov_paths(5, tmp_path / "d")
  train, heldout, _ = balance.markov_tokens(5)
  np.testing.assert_array_equal(np.load(train_path), train)
  np.testing.assert_array_equal(np.load(heldout_path), heldout)
  before = pathlib.Path(train_path).stat().st_mtime_ns
  assert balance.markov_shards(5, tmp_path / "d") == (train_path, heldout_path)
  assert pathlib.Path(train_path).stat().st_mtime_ns == before     # not rewritten
  assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["markov_5_heldout.npy", "markov_5_train.npy"]


def test_train_methods_refuses_unequal_or_too_few_steps_before_training(tmp_path):
  configs = balance.method_configs(small_config(), METHODS, 4)
  configs["none"].steps = 5
  for bad in (configs, {}, balance.method_configs(small_config(), METHODS, 1)):
    with pytest.raises(ValueError, match="equal steps"):
      balance.train_methods(bad, tmp_path)
  assert not list(tmp_path.iterdir())
