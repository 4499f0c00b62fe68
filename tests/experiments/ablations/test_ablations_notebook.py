"""The notebooks' settings (experiments/configs/ablations.py) and helpers (experiments.ablations.notebook): every study's
variants differ from the base only in what they ablate, train on equal tokens, and build a Run at both scales
(the GPU settings are checked here, on the CPU, without compiling); the scale choice, the directories, and the
notebook runner's exit status, time bound and CPU time."""
import contextlib
import importlib.util
import json
import pathlib
import signal
import threading
import time

import pytest

from experiments.configs import ablations
from k3jax import config as config_lib
from experiments.ablations import notebook, records, runs
from k3jax.train import flops, trainer

STUDIES = ("gate", "balance", "residual", "context", "hybrid")
ROOT = pathlib.Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "scripts" / "sync_notebooks.py")
sync_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sync_notebooks)


def _flat(config):
  out = {}

  def walk(prefix, node):
    for k, v in node.items():
      walk(f"{prefix}{k}.", v) if isinstance(v, dict) else out.__setitem__(f"{prefix}{k}", v)
  walk("", json.loads(config.to_json_best_effort()))
  return out


@pytest.mark.parametrize("scale", ablations.SCALES)
@pytest.mark.parametrize("name", STUDIES)
def test_variants_change_only_their_overrides_and_train_equal_tokens(name, scale):
  study = getattr(ablations, name)(scale)
  assert study.name == name and study.scale == scale and len(study.variants) >= 2
  base = _flat(study.base)
  configs = study.configs()
  for variant, config in configs.items():
    changed = {k for k, v in _flat(config).items() if base.get(k) != v}
    assert changed <= set(study.variants[variant]) | {"stages", "steps"}, (variant, changed)
  assert len({runs.train_tokens(c) for c in configs.values()}) == 1
  if scale != "cpu" and name != "rl":
    assert len(study.seeds) >= {"gpu": 2, "research": 3}[scale]   # a spread over seeds
  for config in configs.values():
    # The balance study's shards exist (configs() wrote them); one device, as the notebooks run.
    run = trainer.Run(runs.override(config, {"mesh": "data:1,expert:1"}))   # validates model, stages, data and evaluation; builds the abstract state
    assert run.stages[0].seq_len * run.stages[0].batch_size == run.stages[-1].seq_len * run.stages[-1].batch_size


def test_the_context_study_is_staged_against_direct_at_the_final_length():
  for scale, lengths, beyond in (("cpu", [128, 256], (1, 2)), ("gpu", [1024, 4096, 16384], (1, 2, 4))):
    study = ablations.context(scale)
    staged, direct = (trainer.Run(runs.override(study.configs()[n], {"mesh": "data:1,expert:1"})).stages
                      for n in ("staged", "direct"))
    assert [s.seq_len for s in staged] == lengths and [s.seq_len for s in direct] == lengths[-1:]
    assert sum(s.steps for s in staged) == direct[0].steps
    assert study.settings["eval_lengths"] == tuple(k * lengths[-1] for k in beyond)


def test_the_hybrid_study_spans_the_four_ratios_over_eight_layers():
  study = ablations.hybrid("gpu")
  types = {n: config_lib.layer_types(c.model) for n, c in study.configs().items()}
  assert {n: t.count("mla") for n, t in types.items()} == {"3to1": 2, "7to1": 1, "all_kda": 0, "all_mla": 8}
  assert all(len(t) == 8 for t in types.values())


def test_the_rl_study_is_rl_small_on_the_gpu_and_a_cut_rl_tiny_on_the_cpu():
  from experiments.configs import rl_small, rl_tiny
  from k3jax.rl import config as rl_config_lib
  gpu, cpu = ablations.rl("gpu"), ablations.rl("cpu")
  assert _flat(gpu.configs()["grpo"]) == _flat(rl_small.get_config()) and list(gpu.variants) == ["grpo"]
  changed = {k for k, v in _flat(cpu.base).items() if _flat(rl_tiny.get_config()).get(k) != v}
  assert changed <= {"model.num_layers", "model.moe.enabled", "model.residual.mode", "steps", "batch_size",
                     "log_every", "rl.iterations", "rl.prompts", "rl.group_size", "rl.max_turns", "rl.log_every",
                     "rl.eval_at", "rl.eval_examples", "rl.eval_batch"}, changed
  for study in (gpu, cpu):
    rl_config_lib.validate(study.base.rl)
    trainer.Run(rl_config_lib.sft_config(study.base))   # the SFT stage builds
    assert study.settings["eval_at"] == tuple(f"{n}@{t}" for n, t in rl_config_lib.eval_points(study.base.rl))
  assert cpu.base.rl.eval_batch == cpu.base.rl.prompts * cpu.base.rl.group_size   # shares the rollouts' programs


def test_precompile_compiles_the_sft_stage_of_an_rl_study_where_the_runner_trains_it(monkeypatch, tmp_path):
  asked, looked = {}, []
  monkeypatch.setattr(runs, "precompile_variants", lambda configs: asked.update(configs=configs)
                      or {n: 1.0 for n in configs})
  monkeypatch.setattr(runs, "finished", lambda directory, config: looked.append((directory, config)) or False)
  notebook.precompile_studies({"06_rl": ablations.rl("cpu")}, tmp_path, tmp_path / "results")
  ((directory, config),) = looked
  assert directory == tmp_path / "06_rl" / "cpu" / "grpo" / "seed_0" / "sft" and "rl" not in config
  assert list(asked["configs"]) == ["06_rl/grpo"] and "rl" not in asked["configs"]["06_rl/grpo"]


def test_scale_comes_from_the_notebook_unless_the_environment_sets_it(monkeypatch, tmp_path):
  monkeypatch.delenv(notebook.SCALE_ENV, raising=False)
  assert notebook.scale("gpu") == "gpu"
  monkeypatch.setenv(notebook.SCALE_ENV, "cpu")
  assert notebook.scale("gpu") == "cpu"
  monkeypatch.setenv(notebook.SCALE_ENV, "tpu")
  with pytest.raises(ValueError, match="scale must be"):
    notebook.scale("cpu")
  monkeypatch.setenv(notebook.OUT_ENV, str(tmp_path / "o"))
  monkeypatch.setenv(notebook.WORKDIR_ENV, str(tmp_path / "w"))
  out, work = notebook.directories("01_x", "cpu")
  assert out == tmp_path / "o" / "cpu" and work == tmp_path / "w" / "01_x" / "cpu" and out.is_dir() and work.is_dir()


FAKE_NOTEBOOK = """\
# %%
import os, pathlib, sys
out = pathlib.Path(os.environ["K3JAX_NOTEBOOK_OUT"]) / os.environ["K3JAX_NOTEBOOK_SCALE"]
out.mkdir(parents=True, exist_ok=True)
(out / "x.json").write_text(str(__name__))
n = 0
for i in range(3 * 10 ** 6):
  n += i
print("done", os.getcwd())

# %%
if os.environ.get("FAIL"):
  raise SystemExit(3) if __name__ == "__notebook__" else RuntimeError("failed on purpose")
if os.environ.get("HANG"):
  import signal, time
  if os.environ.get("STUBBORN"):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    time.sleep(60)
  except KeyboardInterrupt:
    (out / "stopped").write_text("on SIGINT")
    raise
"""


@contextlib.contextmanager
def _sigint_ignored():
  """This process with SIGINT ignored, as a runner started by `nohup ... &` from a shell is (and what it starts
  inherits that): the notebook must still get run_notebook's stop."""
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _fake_notebook(tmp_path):
  nb = tmp_path / "notebooks" / "01_x.py"
  nb.parent.mkdir()
  nb.write_text(FAKE_NOTEBOOK)
  nb.with_suffix(".ipynb").write_text(sync_notebooks.render(nb))
  return nb


def test_script_runner_reports_exit_status_and_cpu_time_and_asks_a_late_notebook_to_stop_first(tmp_path):
  nb = _fake_notebook(tmp_path)
  row = notebook.run_notebook(nb, scale="gpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=60)
  assert row["returncode"] == 0 and f"done {tmp_path}" in row["output"] and row["cpu_s"] > 0.05
  assert row["executor"] == "script"
  assert (tmp_path / "out" / "gpu" / "x.json").read_text() == "__notebook__"   # not __main__: spawn-safe
  (tmp_path / "out" / "gpu" / "x.json").unlink()
  assert notebook.run_notebook(nb, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=60,
                               env={"FAIL": "1"})["returncode"] == 3
  (tmp_path / "out" / "cpu" / "x.json").unlink()
  with _sigint_ignored():
    row = notebook.run_notebook(nb, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=5,
                                env={"HANG": "1"})
  assert row["returncode"] is None and row["wall_s"] < 30
  assert (tmp_path / "out" / "cpu" / "stopped").read_text() == "on SIGINT"   # asked to stop first
  (tmp_path / "out" / "cpu" / "stopped").unlink()
  row = notebook.run_notebook(nb, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=5,
                              grace_s=2, env={"HANG": "1", "STUBBORN": "1"})
  assert row["returncode"] is None and row["wall_s"] < 30   # killed when it does not stop
  assert not (tmp_path / "out" / "cpu" / "stopped").exists()
  with pytest.raises(ValueError, match="executor"):
    notebook.run_notebook(nb, scale="cpu", out=tmp_path, workdir=tmp_path, timeout_s=5, executor="papermill")


def test_script_runner_writes_its_log_while_the_notebook_runs(tmp_path):
  """A run stopped from outside (a device call's time limit) must still show how far it got: the log has the first
  cell's output while the second still runs."""
  nb = _fake_notebook(tmp_path)
  log_path = tmp_path / "01_x.log"
  with open(log_path, "w") as log:
    runner = threading.Thread(target=notebook.run_notebook, args=(nb,), kwargs=dict(
        scale="cpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=10, log=log, env={"HANG": "1"}))
    runner.start()
    deadline = time.monotonic() + 8
    while "done" not in log_path.read_text() and time.monotonic() < deadline:
      time.sleep(0.2)
    assert "done" in log_path.read_text() and runner.is_alive()
    runner.join()


def test_kernel_runner_executes_the_ipynb_and_keeps_its_outputs(tmp_path):
  nb = _fake_notebook(tmp_path)
  nb.write_text("# %%\nraise RuntimeError('the .py is not what the kernel runs')\n")
  row = notebook.run_notebook(nb, scale="gpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=120,
                              executor="kernel")
  assert row["returncode"] == 0, row["output"]
  assert row["executor"] == "kernel" and f"done {tmp_path}" in row["output"] and row["cpu_s"] > 0.05
  assert (tmp_path / "out" / "gpu" / "x.json").read_text() == "__main__"
  executed = json.loads((tmp_path / "out" / "gpu" / "01_x.ipynb").read_text())
  assert ["".join(o["text"]) for o in executed["cells"][0]["outputs"]] == [f"done {tmp_path}\n"]
  failed = notebook.run_notebook(nb, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=120,
                                 executor="kernel", env={"FAIL": "1"})
  assert failed["returncode"] not in (0, None) and "failed on purpose" in failed["output"]
  with _sigint_ignored():
    hung = notebook.run_notebook(nb, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "w", timeout_s=12,
                                 executor="kernel", env={"HANG": "1"})
  assert hung["returncode"] is None and hung["wall_s"] < 37
  assert (tmp_path / "out" / "cpu" / "stopped").read_text() == "on SIGINT"   # the stop reached the kernel


def test_notebooks_precompile_on_the_gpu_unless_the_runner_has(monkeypatch):
  monkeypatch.delenv(notebook.PRECOMPILED_ENV, raising=False)
  assert notebook.precompile("gpu") and not notebook.precompile("cpu")
  monkeypatch.setenv(notebook.PRECOMPILED_ENV, "1")
  assert not notebook.precompile("gpu")


def test_notebooks_are_picked_by_number_or_stem_in_the_order_named():
  paths = [pathlib.Path(f"notebooks/{n}.py") for n in ablations.NOTEBOOKS]
  assert notebook.pick(paths, None) == paths
  assert [p.stem for p in notebook.pick(paths, ["05", "01_gate"])] == ["05_hybrid", "01_gate"]
  for bad in (["07"], ["gate"]):
    with pytest.raises(ValueError, match="names none"):
      notebook.pick(paths, bad)


def test_precompile_asks_for_each_variant_with_a_seed_neither_finished_nor_recorded(monkeypatch, tmp_path):
  asked = {}
  monkeypatch.setattr(runs, "precompile_variants", lambda configs: asked.update(configs=configs)
                      or {n: 1.0 for n in configs})
  done = {("bounded", 1), ("softplus", 0)}   # finished runs; softplus's seed 1 is recorded: nothing for softplus
  monkeypatch.setattr(runs, "finished", lambda directory, config: (directory.parent.name,
                                                                   int(directory.name.split("_")[1])) in done)
  study = ablations.gate("gpu")
  results = tmp_path / "results"
  records.save(notebook.records_dir(results, "01_gate"), "softplus", 1, study.configs()["softplus"], {})
  out = notebook.precompile_studies({"01_gate": study}, tmp_path, results)
  assert list(asked["configs"]) == ["01_gate/bounded"]
  assert asked["configs"]["01_gate/bounded"].model.kda.gate == "bounded"
  assert out["variants"] == {"01_gate/bounded": 1.0} and out["wall_s"] >= 0


def test_research_hours_scale_the_gpu_runs_recorded_throughput_by_the_flops_per_token(tmp_path, monkeypatch):
  monkeypatch.setenv(notebook.OUT_ENV, str(tmp_path))
  gpu, research = ablations.gate("gpu"), ablations.gate("research")
  records_gpu = notebook.records_dir(tmp_path / "gpu", "01_gate")
  for seed, rate in ((0, 1000.0), (1, 3000.0)):   # the mean of each run's last half, then over seeds: 2,000 tokens/s
    records.save(records_gpu, "bounded", seed, runs.with_seed(gpu.configs()["bounded"], seed),
                 {"metrics": {"tokens_per_s": [None, 5.0, rate, rate]}})
  hours = notebook.research_hours(research, records_gpu)
  g, r = gpu.configs()["bounded"], research.configs()["bounded"]
  expected = (runs.train_tokens(r) * flops.flops_per_token(r.model, r.seq_len)
              / (2000.0 * flops.flops_per_token(g.model, g.seq_len)) / 3600)
  assert hours == {"bounded": pytest.approx(expected, rel=1e-9), "softplus": None}
  assert expected > 1.0   # hours, at 2,000 tokens/s of the small model
  session = notebook.Session("01_gate", research)
  assert f"hours a run: ≈ {expected:.1f}" in session.results["study"]
  assert f"hours, every variant and seed: ≈ {3 * expected:.1f} (the variants estimated only)" in \
      session.results["study"]
  assert "not estimated (no training throughput" in research.describe(notebook.research_hours(research, tmp_path))
