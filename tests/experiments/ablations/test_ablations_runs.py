"""experiments.ablations.runs, residual and throughput on two tiny dense variants trained a few steps: histories as
logged, reuse of finished runs and refusal of another config, the trained model as checkpointed, the AttnRes depth
weights, forward throughput; the Study's configs and the summaries."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.configs import tiny
from experiments.ablations import residual, runs, throughput
from k3jax.data import pipeline
from k3jax.layers import attnres
from k3jax.model import K3Model, scanned_layout
from k3jax.train import step as step_lib
from k3jax.train import trainer, workdir as workdir_lib
from model_testing import compiled_programs

ROOT = pathlib.Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.xdist_group("ablations_runs")  # one worker builds the module fixture (--dist loadgroup)
STEPS = 3


def small_config():
  c = tiny.get_config()
  c.model.num_layers, c.model.layer_pattern, c.model.last_layer = 2, ("mla",), None
  c.model.moe.enabled = False
  c.mesh = "data:1,expert:1"
  c.seq_len, c.batch_size, c.steps = 32, 4, STEPS
  c.log_every, c.checkpoint_every, c.keep_checkpoints = 1, 10 ** 9, 1
  c.eval.batches, c.eval.batch_size, c.eval.examples = 1, 4, 0
  c.optimizer.lr = 3e-2      # moves the zero-initialised pseudo-queries visibly in three steps
  return c


def study():
  return runs.Study("t", "cpu", small_config(), {"block": {"model.residual.mode": "block"},
                                                  "full": {"model.residual.mode": "full"}}, (0,))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("variants")
  return workdir, runs.train_variants(study().configs(), workdir, seeds=[0])


def test_each_variant_trains_in_its_own_directory_and_its_history_is_what_it_logged(trained):
  workdir, histories = trained
  assert list(histories) == ["block", "full"]
  for name, (h,) in histories.items():
    directory = runs.run_dir(workdir, name, 0)
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert h["metrics"]["step"] == [1, 2, 3] and h["metrics"]["loss"] == [r["loss"] for r in records]
    assert h["metrics"]["tokens_per_s"][0] is None and h["metrics"]["tokens_per_s"][-1] > 0
    assert len(h["evals"]) == 1 and np.isfinite(h["evals"][0]["heldout_loss"]) and h["wall_s"] > 0
    assert json.loads((directory / "config.json").read_text())["model"]["residual"]["mode"] == name
  # Same seed, same batches, same initial parameters: the first losses agree (AttnRes starts uniform either way
  # and the first sub-layers see the same sources) to fp32 roundoff (the two modes sum in other orders: 1.4e-6 seen).
  assert histories["block"][0]["metrics"]["loss"][0] == pytest.approx(histories["full"][0]["metrics"]["loss"][0],
                                                                      rel=1e-5)


def test_a_second_call_reuses_finished_runs_and_refuses_a_directory_of_another_config(trained):
  workdir, histories = trained
  again = runs.train_variants(study().configs(), workdir, seeds=[0])
  for name in histories:
    assert again[name][0]["metrics"] == histories[name][0]["metrics"]
  other = study().configs()
  other["full"].optimizer.lr = 1e-3
  before = (runs.run_dir(workdir, "block", 0) / "metrics.jsonl").read_text()
  with pytest.raises(workdir_lib.ConfigChanged, match="optimizer.lr"):
    runs.train_variants(other, workdir, seeds=[0])
  assert (runs.run_dir(workdir, "block", 0) / "metrics.jsonl").read_text() == before  # checked before training
  for bad in ({"a b": small_config()}, {}):
    with pytest.raises(ValueError):
      runs.train_variants(bad, workdir)
  with pytest.raises(ValueError, match="seeds"):
    runs.train_variants(study().configs(), workdir, seeds=[0, 0])


def test_a_run_stopped_between_its_last_checkpoint_and_its_evaluation_is_evaluated_on_the_next_call(trained,
                                                                                                  tmp_path):
  workdir, histories = trained
  shutil.copytree(runs.run_dir(workdir, "block", 0), runs.run_dir(tmp_path, "block", 0))
  (runs.run_dir(tmp_path, "block", 0) / "eval.jsonl").unlink()
  (h,) = runs.train_variants({"block": study().configs()["block"]}, tmp_path)["block"]
  assert h["metrics"] == histories["block"][0]["metrics"]
  assert h["evals"][0]["step"] == STEPS
  assert h["evals"][0]["heldout_loss"] == pytest.approx(histories["block"][0]["evals"][0]["heldout_loss"], rel=1e-6)


def test_records_let_another_machine_skip_finished_runs_and_keep_what_measure_took(trained, tmp_path, monkeypatch):
  """A copy of the finished run's directory stands for its training (the fixture trained it); `measure` reads its
  checkpoint. The second call has a new, empty work directory, as a fresh GPU machine would."""
  workdir, histories = trained
  config = study().configs()["block"]
  shutil.copytree(runs.run_dir(workdir, "block", 0), runs.run_dir(tmp_path / "a", "block", 0))
  seen = []

  def measure(name, seed, directory):
    seen.append((name, seed))
    _, model = runs.trained_model(directory)
    return {"depth_weights": residual.depth_weights(model, np.arange(32)[None] % 7),
            "final_norm": np.asarray(model.final_norm.weight[...])}   # an array: records hold it as a list

  records = tmp_path / "records"
  (h,) = runs.train_variants({"block": config}, tmp_path / "a", records=records, measure=measure)["block"]
  assert seen == [("block", 0)] and h["measured"]["depth_weights"][0]["name"]
  record = json.loads((records / "block" / "seed_0.json").read_text())
  assert record["result"] == h and record["config"]["seed"] == 0
  assert isinstance(h["measured"]["final_norm"], list) and len(h["measured"]["final_norm"]) == config.model.d_model
  assert h["metrics"] == histories["block"][0]["metrics"]

  def no_training(*args, **kwargs):
    raise AssertionError("a recorded run trained again")
  monkeypatch.setattr(runs.trainer, "Run", no_training)
  moved = study().configs()["block"]
  moved.data.cache_dir = str(tmp_path / "elsewhere")           # where files live may differ
  (again,) = runs.train_variants({"block": moved}, tmp_path / "b", records=records, measure=measure)["block"]
  assert again == record["result"] and seen == [("block", 0)]
  assert not runs.run_dir(tmp_path / "b", "block", 0).exists()

  other = study().configs()["block"]
  other.optimizer.lr = 1e-3
  with pytest.raises(workdir_lib.ConfigChanged, match="optimizer.lr"):
    runs.train_variants({"block": other}, tmp_path / "c", records=records)
  assert not (tmp_path / "c").exists()   # refused before anything was written


def test_trained_model_reproduces_the_runs_held_out_loss(trained):
  workdir, histories = trained
  config, model = runs.trained_model(runs.run_dir(workdir, "block", 0))
  assert config.model.residual.mode == "block"
  rows = pipeline.Mixture(config.data, config.seq_len, pipeline.derive_seed(config.seed, 0, "heldout"),
                          vocab_size=config.model.vocab_size, split="heldout").rows(0, config.eval.batch_size)
  logits, _ = model(jnp.asarray(rows["tokens"]), segment_ids_BT=jnp.asarray(rows["segment_ids"]))
  ce, _ = step_lib.token_losses(logits, jnp.asarray(rows["targets"]), jnp.asarray(rows["weights"]))
  assert float(ce) / rows["weights"].sum() == pytest.approx(histories["block"][0]["evals"][0]["heldout_loss"],
                                                            rel=1e-5)


def test_depth_weights_of_trained_models_are_distributions_over_each_read_outs_sources(trained):
  workdir, _ = trained
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 32), 0, 256)
  segments = jnp.concatenate([jnp.ones((2, 24), jnp.int32), jnp.zeros((2, 8), jnp.int32)], axis=1)
  counts = {"block": [1, 2, 2, 2, 2], "full": [1, 2, 3, 4, 5]}   # 2 layers, block_size 2, then the final read-out
  for mode in ("block", "full"):
    _, model = runs.trained_model(runs.run_dir(workdir, mode, 0))
    out = residual.depth_weights(model, tokens, segment_ids_BT=segments)
    assert [r["name"] for r in out] == ["layer 0 mla", "layer 0 ffn", "layer 1 mla", "layer 1 ffn", "final"]
    assert [len(r["weights"]) for r in out] == counts[mode]
    for r in out:
      assert sum(r["weights"]) == pytest.approx(1.0) and min(r["weights"]) >= 0
    # Trained away from zero, except the first read-out: one source, so its softmax has no gradient.
    assert out[0]["query_norm"] == 0 and all(r["query_norm"] > 0 for r in out[1:])
    assert max(abs(w - 1 / len(r["weights"])) for r in out for w in r["weights"]) > 1e-4   # learned, not uniform
    padded = residual.depth_weights(model, tokens)   # padding positions counted too: another average
    assert padded[-1]["weights"] != pytest.approx(out[-1]["weights"], abs=1e-7)


def test_depth_weights_are_uniform_at_init_and_need_attnres():
  m = small_config().model
  tokens = jnp.ones((1, 8), jnp.int32)
  for mode, counts in (("block", [1, 2, 2, 2, 2]), ("full", [1, 2, 3, 4, 5])):
    m.residual.mode = mode
    out = residual.depth_weights(K3Model(m, rngs=nnx.Rngs(0)), tokens)
    for r, n in zip(out, counts):
      np.testing.assert_allclose(r["weights"], np.full(n, 1 / n), rtol=1e-6)
  m.residual.mode = "none"
  with pytest.raises(ValueError, match="no AttnRes"):
    residual.depth_weights(K3Model(m, rngs=nnx.Rngs(0)), tokens)


@pytest.mark.parametrize("mode", ["block", "full"])
def test_the_walk_is_the_models_forward_and_scanned_groups_give_the_unrolled_layers_weights(mode):
  c = small_config().model
  c.num_layers, c.residual.mode, c.residual.block_size = 4, mode, 2
  c_unrolled = runs.override(c, {"scan_layers": False})
  unrolled = K3Model(c_unrolled, rngs=nnx.Rngs(0))
  for i, layer in enumerate(unrolled.layers):   # queries as if trained: away from the uniform start
    for k, res in enumerate((layer.mixer_res, layer.ffn_res)):
      res.query[...] = jax.random.normal(jax.random.PRNGKey(2 * i + k), res.query.shape)
  unrolled.final_res.query[...] = jax.random.normal(jax.random.PRNGKey(99), (c.d_model,))
  scanned = K3Model(c, rngs=nnx.Rngs(0))
  assert scanned.groups and not unrolled.groups   # four MLA layers: one group of one layer, four times
  nnx.update(scanned, scanned_layout(nnx.state(unrolled), c))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 256)
  segments = jnp.concatenate([jnp.ones((2, 10), jnp.int32), 2 * jnp.ones((2, 6), jnp.int32)], axis=1)
  counts = {"block": [1, 2, 2, 2, 2, 3, 3, 3, 3], "full": list(range(1, 10))}[mode]
  got = {}
  for name, model in (("scanned", scanned), ("unrolled", unrolled)):
    weights, stream = residual.walk(model, tokens, segment_ids_BT=segments)
    want, _ = model(tokens, segment_ids_BT=segments)
    np.testing.assert_allclose(model._logits(stream), want, rtol=1e-5, atol=1e-5, err_msg=name)
    assert [w.shape[0] for w in weights] == counts, name
    got[name] = residual.depth_weights(model, tokens, segment_ids_BT=segments)
  assert [r["name"] for r in got["scanned"]] == [r["name"] for r in got["unrolled"]]
  for a, b in zip(got["scanned"], got["unrolled"]):
    np.testing.assert_allclose(a["weights"], b["weights"], rtol=1e-5, atol=1e-6, err_msg=a["name"])
    assert a["query_norm"] == pytest.approx(b["query_norm"], rel=1e-6) and a["query_norm"] > 0


def test_forward_throughput_has_a_row_per_model_and_length_and_refuses_lengths_that_do_not_divide(trained):
  workdir, _ = trained
  models = {n: runs.trained_model(runs.run_dir(workdir, n, 0))[1] for n in ("block", "full")}
  out = throughput.forward_tokens_per_s(models, (16, 32), tokens=64, repeats=2)
  assert list(out) == ["block", "full"]
  for rows in out.values():
    assert [(r["seq_len"], r["rows"]) for r in rows] == [(16, 4), (32, 2)]
    assert all(r["tokens_per_s"] > 0 and r["ms"] > 0 and r["compile_s"] > 0 for r in rows)
  with pytest.raises(ValueError, match="multiple"):
    throughput.forward_tokens_per_s(models, (24,), tokens=64)


def test_study_configs_differ_from_the_base_only_in_their_overrides():
  s = study()
  configs = s.configs()
  assert configs["full"].model.residual.mode == "full" and s.base.model.residual.mode == "block"
  a, b = (json.loads(configs[n].to_json_best_effort()) for n in ("block", "full"))
  a["model"]["residual"].pop("mode"), b["model"]["residual"].pop("mode")
  assert a == b
  assert runs.train_tokens(configs["block"]) == STEPS * 4 * 32
  assert "full: model.residual.mode=full" in s.describe()
  with pytest.raises(ValueError, match="no field"):
    runs.Study("t", "cpu", small_config(), {"x": {"model.residual.moed": "full"}}).configs()


def test_override_sets_dotted_fields_on_a_copy_and_refuses_unknown_ones():
  c = small_config()
  d = runs.override(c, {"model.kda.gate": "softplus", "eval.lengths": (64,)})
  assert d.model.kda.gate == "softplus" and d.eval.lengths == (64,) and c.model.kda.gate == "bounded"
  for bad in ("model.kda.gait", "model.kdaa.gate"):
    with pytest.raises(ValueError, match="no field"):
      runs.override(c, {bad: 1})


def test_spread_and_tail_mean():
  s = runs.spread([1.0, 2.0, 3.0])
  assert s == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0, "n": 3}
  assert runs.spread([4])["std"] is None
  assert runs.tail_mean([None, 1.0, 2.0, 3.0, 4.0], 0.5) == 3.5
  assert runs.tail_mean([1.0, 2.0, 3.0], 0.5) == 2.5    # the last ceil(n/2)
  assert runs.tail_mean([1.0, 2.0], 0.01) == 2.0        # at least one
  with pytest.raises(ValueError):
    runs.spread([])


def test_precompiled_variants_train_on_programs_from_the_persistent_cache(tmp_path):
  # In a fresh process: JAX sets its persistent cache up once, at the first compile.
  script = textwrap.dedent(f"""
      import json, sys
      from jax import monitoring
      from experiments import harness
      from experiments.configs.common import set_stages
      sys.path[:0] = [{str(pathlib.Path(__file__).parent)!r}, {str(ROOT / "tests")!r}]
      from test_ablations_runs import small_config
      from experiments.ablations import runs
      if __name__ == "__main__":
        events = []
        monitoring.register_event_listener(lambda name, **kw: events.append(name))
        with __import__("pytest").raises(ValueError, match="persistent compilation cache"):
          runs.precompile_variants({{"a": small_config()}})
        harness.enable_compilation_cache({str(tmp_path / "cache")!r})
        c = small_config()   # two stages, task accuracy at two lengths: every kind of program a run compiles
        set_stages(c, [(32, 2, 4), (64, 1, 2)])
        c.data.mix = {{"stdlib": 0.5, "stack": 0.5}}
        c.eval.examples, c.eval.lengths = 4, (64, 96)
        runs.train_variants({{"a": c}}, {str(tmp_path / "runs")!r}, seeds=[0, 1], precompile=True)
        print(json.dumps({{k: events.count(k) for k in set(events) if "compilation_cache" in k}}))
      """)
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}   # no cache but its own
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=env)
  assert out.returncode == 0, out.stderr[-4000:]
  counts = json.loads(out.stdout.strip().splitlines()[-1])
  # Nothing compiled here: the init, both stages' train steps, the held-out evaluations at 32 and 64 and the task
  # evaluations at 96 (64 is the held-out one's shape) came from the cache, each once for both seeds.
  assert counts.get("/jax/compilation_cache/cache_hits", 0) >= 7, counts
  assert counts.get("/jax/compilation_cache/cache_misses", 0) == 0, counts


def test_the_seeds_of_a_variant_share_its_programs_and_train_as_apart(tmp_path):
  c = small_config()
  with compiled_programs() as names:
    (shared,) = runs.train_variants({"a": c}, tmp_path / "shared", seeds=[0, 1]).values()
  # Each program once: the second seed's run traces, lowers and loads none of them again.
  assert names.count("init") == 1 and names.count("train_step") == 1 and names.count("eval_step") == 1, names
  apart = runs.train_variants({"a": c}, tmp_path / "apart", seeds=[1])["a"][0]
  assert shared[1]["metrics"]["loss"] == apart["metrics"]["loss"] != shared[0]["metrics"]["loss"]
  assert shared[1]["evals"] == apart["evals"]
  other = runs.with_seed(c, 1)
  other.optimizer.lr = 1e-3
  with pytest.raises(ValueError, match="same config"):
    trainer.Run(other, programs=trainer.Run(c))


def test_summarize_spreads_the_last_evaluation_and_the_tail_over_seeds_and_plot_losses_draws_each_variant():
  def history(loss, acc, heldout=1.0):
    evals = [{"heldout_loss": 9.0, "accuracy": {"mqar@64": 0.0}},
             {"heldout_loss": heldout, "accuracy": {"mqar@64": acc, "mqar@128": acc / 2}}]
    return {"metrics": {"step": [1, 2, 3, 4, 5], "loss": loss, "tokens_per_s": [None, 10.0, 20.0, 30.0, 40.0]},
            "evals": evals, "wall_s": 1.5}
  out = runs.summarize({"a": [history([5, 4, 3, 2, 1], 0.5, 2.0), history([5, 4, 3, 2, 3], 0.7, 3.0)],
                        "b": [{**history([1] * 5, 0.1), "evals": []}]})
  a = out["a"]
  assert a["step"] == [1, 2, 3, 4, 5] and a["loss"][1] == [5, 4, 3, 2, 3] and a["wall_s"] == [1.5, 1.5]
  assert a["heldout_loss"] == runs.spread([2.0, 3.0]) and a["tail_loss"] == runs.spread([1.0, 3.0])
  assert a["accuracy"] == {"mqar@64": runs.spread([0.5, 0.7]), "mqar@128": runs.spread([0.25, 0.35])}
  assert a["tokens_per_s"] == runs.spread([35.0, 35.0])   # the last half of the logged values (None dropped)
  assert out["b"]["heldout_loss"] is None and out["b"]["accuracy"] == {}
  from matplotlib.figure import Figure
  ax = runs.plot_losses(out, Figure().subplots(), title="t")
  assert [line.get_label() for line in ax.get_lines()] == ["a (mean of 2)", "b (mean of 1)"]
  np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), [5, 4, 3, 2, 2])
