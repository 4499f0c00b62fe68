"""The trainer (k3jax/train/trainer.py) on the tiny config cut to its first two layers (tests/train_testing.py):
micro-batches give the step of one batch and the balancer moves outside the gradient; the loss falls on a learnable
task; runs killed (SIGKILL), interrupted (SIGINT, SIGTERM) and resumed reproduce the uninterrupted losses, the
interrupted ones with a checkpoint of the step they reached; a damaged latest checkpoint is reported and the
previous one used, and a stage whose every checkpoint is damaged stops instead of starting over; a changed config
or a missing metrics.jsonl is refused before anything is written; stage 1 starts from stage 0's final checkpoint;
evaluation reproduces the run's and leaves the run directory as it was; a diverging run stops at the step, with
no non-finite checkpoint and strict-JSON metrics; each step is queued before the step before it is checked; a
one-device run's programs compile without the latency-hiding scheduler."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from experiments.configs import tiny
from k3jax.data import pipeline
from k3jax.train import batches, checkpoint, interrupt, metrics, trainer, workdir as workdir_lib
from train_testing import CHECKPOINT_EVERY, REPO, STAGE0_STEPS, STAGE1_STEPS, load_config, records, snapshot

uses_run = pytest.mark.xdist_group("train_loop")  # one worker builds the session's `trained` run (--dist loadgroup)


def stage0_dir(workdir):
  return workdir / "checkpoints" / "stage_0"


def damage(step_dir):
  victim = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  with open(victim, "r+b") as f:
    f.seek(victim.stat().st_size // 2)
    f.write(bytes(b ^ 0x5A for b in f.read(8)))


@uses_run
def test_micro_batches_give_the_step_of_one_batch_and_the_balancer_moves_outside_the_gradient(trained):
  config = load_config(trained.config_path)
  config.micro_batches = 2
  run, run2 = trained.run, trainer.Run(config)
  data = pipeline.Mixture(config.data, 64, 0, vocab_size=config.model.vocab_size)
  steps = {}
  for r in (run, run2):
    state = r.init()
    before = jax.tree.map(np.asarray, state.balancer)
    batch = batches.train_batch(data, 0, 8, r.config.micro_batches, r.mesh)
    after, m = r.train_step(state, batch)
    steps[r.config.micro_batches] = jax.tree.map(np.asarray, (after.opt_state, after.balancer)), jax.device_get(m)
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


@uses_run
def test_loss_falls_and_the_task_is_learned_above_chance(trained):
  losses = [r["loss"] for r in records(trained.workdir)]
  assert [r["step"] for r in records(trained.workdir)] == list(range(1, STAGE0_STEPS + 1))
  assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
  assert trained.result["accuracy"]["stack@64"] > 4 * trained.result["chance"]["stack"]


@uses_run
def test_killed_then_interrupted_run_saves_where_it_stopped_and_continues_exactly(trained, tmp_path):
  """SIGKILL once the first periodic checkpoint is on disk; the restart resumes there and gets SIGINT a few steps
  later: exit 130 with a one-line message, a checkpoint of the step reached, no carriage returns in its output
  (not a terminal); a third start finishes with the uninterrupted run's losses."""
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "experiments.train", f"--config={trained.config_path}", f"--workdir={workdir}",
         "--stage=0", "--config.eval.examples=0"]
  popen = lambda: subprocess.Popen(cmd, cwd=REPO, env=trained.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
  first = popen()
  while not (stage0_dir(workdir) / str(CHECKPOINT_EVERY)).exists() and first.poll() is None:
    time.sleep(0.05)  # a step directory appears once its save is complete
  assert first.poll() is None, "the run ended before it could be killed:\n" + first.stdout.read()[-3000:]
  first.kill()
  first.wait()

  second, lines = popen(), []
  for line in second.stdout:
    lines.append(line)
    progress = re.match(r"stage 0 step (\d+)/", line)
    if progress and int(progress.group(1)) >= CHECKPOINT_EVERY + 3:
      second.send_signal(signal.SIGINT)
      break
  out = "".join(lines) + second.stdout.read()
  assert second.wait(timeout=300) == 130, out[-3000:]
  assert f"resuming from step {CHECKPOINT_EVERY}" in out and "\r" not in out
  stopped = int(re.search(r"SIGINT: stopped at step (\d+) with a checkpoint of it", out).group(1))
  assert out.strip().splitlines()[-1].startswith("SIGINT: stopped at step")
  assert CHECKPOINT_EVERY + 3 <= stopped < STAGE0_STEPS and (stage0_dir(workdir) / str(stopped)).is_dir()
  assert records(workdir)[-1]["step"] == stopped

  third = subprocess.run(cmd, cwd=REPO, env=trained.env, capture_output=True, text=True, timeout=600)
  assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
  assert f"resuming from step {stopped}" in third.stdout
  assert records(workdir) == records(trained.workdir)


@uses_run
def test_sigterm_saves_the_step_reached_and_the_run_continues_exactly(trained, tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
  shutil.rmtree(stage0_dir(workdir) / str(STAGE0_STEPS))  # back to step 20
  run, calls = trained.run, []
  build = run.batch

  def batch_then_sigterm(stage, step_in_stage):  # the signal arrives while step 22's batch is built
    calls.append(step_in_stage)
    if len(calls) == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return build(stage, step_in_stage)

  monkeypatch.setattr(run, "batch", batch_then_sigterm)
  handler = signal.getsignal(signal.SIGTERM)
  with pytest.raises(interrupt.Interrupted) as stopped:
    run.train(workdir, stage=0)
  assert (stopped.value.signum, stopped.value.step, stopped.value.exit_code) == (signal.SIGTERM, 22, 143)
  assert signal.getsignal(signal.SIGTERM) is handler  # restored
  assert (stage0_dir(workdir) / "22").is_dir()
  monkeypatch.undo()
  run.train(workdir, stage=0)
  assert records(workdir) == records(trained.workdir)


@uses_run
def test_damaged_latest_checkpoint_is_reported_and_training_redone_from_the_previous(trained, tmp_path, capsys):
  workdir = tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
  damage(stage0_dir(workdir) / str(STAGE0_STEPS))
  trained.run.train(workdir, stage=0)
  out = capsys.readouterr().out
  assert f"checkpoint unusable: step {STAGE0_STEPS}" in out
  assert f"resuming from step {STAGE0_STEPS - CHECKPOINT_EVERY}" in out
  assert records(workdir) == records(trained.workdir)


@uses_run
def test_a_stage_whose_every_checkpoint_is_damaged_stops_instead_of_starting_over(trained, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
  for step in range(CHECKPOINT_EVERY, STAGE0_STEPS + 1, CHECKPOINT_EVERY):
    damage(stage0_dir(workdir) / str(step))
  logged = (workdir / "metrics.jsonl").read_text()
  for _ in range(2):  # the second start finds them moved aside: still no start from scratch
    with pytest.raises(trainer.UnusableCheckpoints, match="refusing to train the stage over"):
      trained.run.train(workdir, stage=0)
  assert (workdir / "metrics.jsonl").read_text() == logged and not list(stage0_dir(workdir).iterdir())


@uses_run
def test_a_changed_config_or_missing_metrics_is_refused_before_anything_is_written(trained, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
  config = load_config(trained.config_path)
  config.seed, config.data.mix.stack, config.optimizer.lr = 1, 0.5, 1e-3
  changed_run = trainer.Run(config)
  for remembered_by in ("config.json", "the newest checkpoint"):
    if remembered_by != "config.json":
      (workdir / "config.json").unlink()
    before = snapshot(workdir)
    with pytest.raises(workdir_lib.ConfigChanged) as changed:
      changed_run.train(workdir, stage=0)
    assert all(f"{f}:" in str(changed.value) for f in ("seed", "data.mix.stack", "optimizer.lr")), remembered_by
    assert snapshot(workdir) == before

  (workdir / "metrics.jsonl").unlink()
  before = snapshot(workdir)
  with pytest.raises(metrics.MissingMetrics, match=f"resumes at step {STAGE0_STEPS}"):
    trained.run.train(workdir, stage=0)
  assert snapshot(workdir) == before


@uses_run
def test_stage_one_starts_from_stage_zero_final_checkpoint(trained, tmp_path):
  run, workdir = trained.run, tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
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
  evals = (workdir / "eval.jsonl").read_text().splitlines()
  (workdir / "eval.jsonl").write_text(evals[1] + "\n")  # stage 0's evaluation cut short: evaluated again
  assert run.train(workdir)[0]["accuracy"] == trained.result["accuracy"]


@uses_run
def test_eval_script_reproduces_the_run_evaluation_and_writes_only_its_output(trained, tmp_path):
  out = tmp_path / "eval.json"
  before = snapshot(trained.workdir)
  proc = subprocess.run([sys.executable, "-m", "experiments.eval", f"--workdir={trained.workdir}", "--stage=0",
                         "--lengths=64,128", f"--output={out}"], cwd=REPO, env=trained.env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  got = json.loads(out.read_text())
  assert (got["stage"], got["step"], got["seq_len"]) == (0, STAGE0_STEPS, 64)
  assert got["accuracy"] == trained.result["accuracy"] and "(trained at 64)" in proc.stdout
  assert snapshot(trained.workdir) == before


@uses_run
def test_evaluating_moves_creates_and_deletes_nothing_in_the_run(trained, tmp_path, capsys):
  workdir = tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
  damage(stage0_dir(workdir) / str(STAGE0_STEPS))
  before = snapshot(workdir)
  got = trainer.evaluate_checkpoint(workdir, overrides={"eval.examples": 8, "eval.lengths": (64,)})
  assert got["step"] == STAGE0_STEPS - CHECKPOINT_EVERY and f"checkpoint unusable: step {STAGE0_STEPS}" in \
      capsys.readouterr().out
  with pytest.raises(FileNotFoundError, match="no checkpoints of stage 3"):
    trainer.evaluate_checkpoint(workdir, stage=3)
  assert snapshot(workdir) == before


def test_divergence_stops_at_the_step_without_a_non_finite_checkpoint_or_json(tmp_path):
  c = tiny.get_config()
  c.model.num_layers = 1
  c.seq_len, c.batch_size, c.steps, c.mesh = 32, 8, 8, "data:1,expert:1"
  c.log_every, c.checkpoint_every, c.keep_checkpoints = 1, 1, 10
  c.optimizer.lr = 1e4
  c.eval.examples, c.eval.batches = 0, 0
  run = trainer.Run(c)
  with pytest.raises(trainer.Diverged, match=r"training diverged at step \d+") as diverged:
    run.train(tmp_path)
  step = int(re.search(r"step (\d+)", str(diverged.value)).group(1))
  logged = records(tmp_path)                       # strict JSON: no NaN
  assert logged[-1]["step"] == step and None in (logged[-1]["loss"], logged[-1]["grad_norm"])
  saved = sorted(int(p.name) for p in stage0_dir(tmp_path).iterdir())
  assert saved and max(saved) < step
  with checkpoint.Checkpointer(stage0_dir(tmp_path), keep=10, read_only=True) as ckpt:
    state, _ = ckpt.restore_latest(run.abstract)
  assert checkpoint.nonfinite_leaves(state) == []
  with pytest.raises(checkpoint.NonFiniteState, match="non-finite values"):
    with checkpoint.Checkpointer(tmp_path / "other", keep=1) as ckpt:
      ckpt.save(1, jax.tree.map(lambda x: x * np.nan if x.dtype == np.float32 else x, state), {})


def test_each_step_is_queued_before_the_step_before_it_is_checked(tmp_path, monkeypatch):
  c = tiny.get_config()
  c.model.num_layers = 1
  c.seq_len, c.batch_size, c.steps, c.mesh = 32, 8, 4, "data:1,expert:1"
  c.log_every, c.checkpoint_every = 4, 4
  c.eval.examples, c.eval.batches = 0, 0
  run = trainer.Run(c)
  events, losses, step, device_get = [], [], run.train_step, jax.device_get

  def queued(state, batch):
    state, m = step(state, batch)
    losses.append(m["loss"])   # kept alive: no later array takes its id
    events.append(("queued", id(m["loss"])))
    return state, m

  def fetched(x):
    events.extend(("fetched", id(leaf)) for leaf in jax.tree.leaves(x))
    return device_get(x)

  run.train_step = queued
  monkeypatch.setattr(jax, "device_get", fetched)
  run.train(tmp_path)
  assert len(losses) == c.steps
  for before, after in zip(losses, losses[1:]):   # step k's loss is first read after step k + 1 is queued
    assert events.index(("queued", id(after))) < events.index(("fetched", id(before)))


@pytest.mark.parametrize("mesh, options", [("data:1,expert:1", (("xla_gpu_enable_latency_hiding_scheduler", False),)),
                                           ("data:2,expert:2", ())])
def test_one_device_programs_compile_without_the_latency_hiding_scheduler(mesh, options):
  c = tiny.get_config()
  c.model.num_layers = 1
  c.seq_len, c.batch_size, c.steps, c.mesh = 32, 8, 2, mesh
  run = trainer.Run(c)
  batch = run.batch(run.stages[0], 0)
  rows = jax.tree.map(lambda x: x[0], batch)
  programs = {"init": run.init_program.jitted.trace(run.seed), "train": run.train_step.trace(run.abstract, batch),
              "eval": run.eval_step.trace(run.abstract, rows)}
  assert {name: t._params["compiler_options_kvs"] for name, t in programs.items()} == dict.fromkeys(programs, options)
