"""The train step and loop on the tiny config cut to its first two layers (2 stages, expert-parallel mesh):
micro-batches give the step of one batch and the balancer moves outside the gradient; the loss falls on a learnable
task; a run killed with SIGKILL resumes with bit-identical losses; a damaged latest checkpoint is reported and the
previous one used; stage 1 starts from stage 0's final checkpoint; experiments.eval reproduces the run's evaluation.

Compiled programs go to a persistent compilation cache for the module's duration, so the subprocess runs reuse
what the in-process run compiled."""
import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from k3jax.data import pipeline
from k3jax.train import batches, checkpoint, trainer

pytestmark = pytest.mark.xdist_group("train_loop")  # one worker builds the module fixture (with --dist loadgroup)
REPO = pathlib.Path(__file__).resolve().parents[1]
STAGE0_STEPS, STAGE1_STEPS, CHECKPOINT_EVERY = 30, 4, 10
CONFIG = f"""
from experiments.configs import common, tiny


def get_config():
  c = tiny.get_config()
  c.model.num_layers = 2  # layer 0: KDA + dense FFN, layer 1: MLA + LatentMoE; 4x cheaper steps than 4 layers
  common.set_stages(c, [dict(seq_len=64, steps={STAGE0_STEPS}, batch_size=8),
                        dict(seq_len=128, steps={STAGE1_STEPS}, batch_size=4, lr=1e-3)])
  c.mesh = "data:2,expert:2"
  c.log_every, c.checkpoint_every, c.keep_checkpoints = 1, {CHECKPOINT_EVERY}, 10
  c.data.mix.stdlib, c.data.mix.stack = 0.0, 1.0   # stack: a learnable task (the top of the stack is often 2 back)
  c.eval.tasks, c.eval.lengths, c.eval.examples, c.eval.batch_size, c.eval.batches = ("stack",), (64, 128), 32, 8, 0
  return c
"""
TIMING = ("tokens_per_s", "mfu")


def load_config(path):
  spec = importlib.util.spec_from_file_location("test_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def records(workdir, name="metrics.jsonl"):
  lines = (pathlib.Path(workdir) / name).read_text().splitlines()
  return [{k: v for k, v in json.loads(l).items() if k not in TIMING} for l in lines]


CACHE_OPTIONS = {"jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": -1}


@contextlib.contextmanager
def persistent_compilation_cache(directory):
  before = {k: getattr(jax.config, k) for k in CACHE_OPTIONS}
  compilation_cache.reset_cache()
  compilation_cache.set_cache_dir(str(directory))
  for k, v in CACHE_OPTIONS.items():
    jax.config.update(k, v)
  try:
    yield {"JAX_COMPILATION_CACHE_DIR": str(directory), **{k.upper(): str(v) for k, v in CACHE_OPTIONS.items()}}
  finally:
    compilation_cache.set_cache_dir(None)
    for k, v in before.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(config path, Run, work directory with stage 0 done, its evaluation, env for subprocesses)."""
  root = tmp_path_factory.mktemp("train")
  path = root / "config.py"
  path.write_text(CONFIG)
  with persistent_compilation_cache(root / "jax_cache") as cache_env:
    run = trainer.Run(load_config(path))
    result = run.train(root / "run", stage=0)[0]
    yield path, run, root / "run", result, dict(os.environ, **cache_env)


def test_micro_batches_give_the_step_of_one_batch_and_the_balancer_moves_outside_the_gradient(trained):
  path, run, _, _, _ = trained
  config = load_config(path)
  config.micro_batches = 2
  run2 = trainer.Run(config)
  data = pipeline.Mixture(config.data, 64, 0, vocab_size=config.model.vocab_size)
  steps = {}
  for r in (run, run2):
    state = r.init()
    before = jax.tree.map(np.asarray, state.balancer)
    batch = batches.train_batch(data, 0, 8, r.config.micro_batches, r.mesh)
    after, metrics = r.train_step(state, batch)
    steps[r.config.micro_batches] = jax.tree.map(np.asarray, (after.opt_state, after.balancer)), jax.device_get(metrics)
  (opt1, bal1), m1 = steps[1]
  (opt2, bal2), m2 = steps[2]
  assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
  assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
  for a, b in zip(jax.tree.leaves((opt1, bal1)), jax.tree.leaves((opt2, bal2))):  # Adam's moments hold the gradient
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max() + 1e-12
  bias_before, bias_after = jax.tree.leaves(before)[0], jax.tree.leaves(bal1)[0]
  assert np.abs(bias_after - bias_before).max() > 0     # quantile balancing moved the bias
  assert not any("balancer" in jax.tree_util.keystr(p)  # and it is no parameter
                 for p, _ in jax.tree_util.tree_flatten_with_path(run.abstract.params)[0])
  moe_layers = config.model.num_layers - config.model.moe.first_dense_layers
  assert m1["moe_max_vio"].shape == m1["moe_load_p90"].shape == (moe_layers,)


def test_loss_falls_and_the_task_is_learned_above_chance(trained):
  _, _, workdir, result, _ = trained
  losses = [r["loss"] for r in records(workdir)]
  assert [r["step"] for r in records(workdir)] == list(range(1, STAGE0_STEPS + 1))
  assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
  assert result["accuracy"]["stack@64"] > 4 * result["chance"]["stack"]


def test_killed_run_resumes_and_reproduces_the_uninterrupted_losses(trained, tmp_path):
  path, _, reference, _, env = trained
  cmd = [sys.executable, "-m", "experiments.train", f"--config={path}", f"--workdir={tmp_path / 'run'}", "--stage=0",
         "--config.eval.examples=0"]
  first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  saved = tmp_path / "run" / "checkpoints" / "stage_0" / str(CHECKPOINT_EVERY)
  while not saved.exists() and first.poll() is None:  # a step directory appears once its save is complete
    time.sleep(0.05)
  assert first.poll() is None, "the run ended before it could be killed:\n" + first.stdout.read().decode()[-3000:]
  os.kill(first.pid, signal.SIGKILL)
  first.wait()
  second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  resumed = int(second.stdout.split("resuming from step ")[1].split()[0])
  assert CHECKPOINT_EVERY <= resumed < STAGE0_STEPS
  assert records(tmp_path / "run") == records(reference)


def test_damaged_latest_checkpoint_is_reported_and_training_redone_from_the_previous(trained, tmp_path, capsys):
  _, run, reference, _, _ = trained
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  last = workdir / "checkpoints" / "stage_0" / str(STAGE0_STEPS)
  victim = max((p for p in (last / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  with open(victim, "r+b") as f:
    f.seek(victim.stat().st_size // 2)
    f.write(bytes(b ^ 0x5A for b in f.read(8)))
  run.train(workdir, stage=0)
  out = capsys.readouterr().out
  assert f"checkpoint unusable: step {STAGE0_STEPS}" in out
  assert f"resuming from step {STAGE0_STEPS - CHECKPOINT_EVERY}" in out
  assert records(workdir) == records(reference)


def test_stage_one_starts_from_stage_zero_final_checkpoint(trained, tmp_path):
  _, run, reference, _, _ = trained
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  with pytest.raises(FileNotFoundError, match="run stage 0 first"):
    run.train(tmp_path / "empty", stage=1)
  stage1 = run.stages[1]
  with run.checkpointer(tmp_path / "unused", 1) as empty, run.checkpointer(workdir, 0) as stage0:
    start = run.initial_state(stage1, workdir, empty)
    final_meta = stage0.read_meta(STAGE0_STEPS)
  assert checkpoint.fingerprint(start) == final_meta["fingerprint"]
  result = run.train(workdir, stage=1)[0]
  stage1_records = [r for r in records(workdir) if r["stage"] == 1]
  assert [r["step"] for r in stage1_records] == list(range(STAGE0_STEPS + 1, STAGE0_STEPS + STAGE1_STEPS + 1))
  assert all(r["seq_len"] == 128 for r in stage1_records) and set(result["accuracy"]) == {"stack@64", "stack@128"}
  assert run.train(workdir) == [None, None]  # both stages complete: nothing to do


def test_eval_script_reproduces_the_run_evaluation_from_the_checkpoint(trained, tmp_path):
  _, _, workdir, result, env = trained
  out = tmp_path / "eval.json"
  proc = subprocess.run([sys.executable, "-m", "experiments.eval", f"--workdir={workdir}", "--stage=0",
                         "--lengths=64,128", f"--output={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  got = json.loads(out.read_text())
  assert (got["stage"], got["step"], got["seq_len"]) == (0, STAGE0_STEPS, 64)
  assert got["accuracy"] == result["accuracy"] and "(trained at 64)" in proc.stdout
