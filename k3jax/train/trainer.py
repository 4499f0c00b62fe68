"""The training run: stages one after another, each resumable from its own checkpoints.

Layout of a work directory:
    config.json                     the run's config
    checkpoints/stage_<i>/<step>/   orbax steps of stage i (global step numbers)
    metrics.jsonl, eval.jsonl       one JSON object per logged step / per evaluation
    tensorboard/                    event files

Running the same command again continues each stage from its newest usable checkpoint; a finished stage is
skipped. Stage i > 0 starts from stage i−1's final checkpoint (its last step), which must exist when a stage is
run alone.
"""
from __future__ import annotations

import copy
import json
import pathlib
import time

import jax
import ml_collections
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import parallel
from k3jax.data import pipeline
from k3jax.train import batches, checkpoint, evaluate, flops, metrics as metrics_lib
from k3jax.train import optimizer, stages as stages_lib, state as state_lib, step as step_lib


class Run:
  """A config made runnable: its stages, mesh, optimizer and compiled steps (reusable across work directories)."""

  def __init__(self, config):
    self.config = config
    self.stages = stages_lib.stages_of(config)
    for field in ("log_every", "checkpoint_every", "keep_checkpoints"):
      if config[field] < 1:
        raise ValueError(f"config.{field} must be >= 1, got {config[field]}")
    self.mesh = parallel.mesh_from_string(config.mesh)
    # Every stage's data and evaluation are checked here, before anything trains.
    self.data = [pipeline.Mixture(config.data, s.seq_len, pipeline.derive_seed(config.seed, s.index, "train"),
                                  vocab_size=config.model.vocab_size) for s in self.stages]
    evaluate.check(config, [s.seq_len for s in self.stages], self.mesh)
    self.tx, self.lr = optimizer.make_optimizer(config, self.stages)
    self.graphdef, self.abstract, init = state_lib.abstract_state(config, self.tx, self.mesh)
    shardings = state_lib.shardings_of(self.abstract)
    self.init = jax.jit(init, out_shardings=shardings)
    self.train_step = jax.jit(step_lib.make_train_step(self.graphdef, self.tx, self.lr, config.model),
                              donate_argnums=0, out_shardings=(shardings, NamedSharding(self.mesh, P())))
    self.eval_step = jax.jit(step_lib.make_eval_step(self.graphdef))

  def train(self, workdir, *, stage: int | None = None) -> list[dict | None]:
    """Trains every stage in `workdir` (or only stage `stage`); returns each stage's evaluation (None: skipped,
    the stage was already complete)."""
    if stage is not None and not 0 <= stage < len(self.stages):
      raise ValueError(f"stage={stage}: the config has stages 0..{len(self.stages) - 1}")
    workdir = pathlib.Path(workdir)
    if jax.process_index() == 0:
      workdir.mkdir(parents=True, exist_ok=True)
      (workdir / "config.json").write_text(self.config.to_json_best_effort(indent=2) + "\n")
    chosen = self.stages if stage is None else [self.stages[stage]]
    return [self.run_stage(s, workdir) for s in chosen]

  def batch(self, stage: stages_lib.Stage, step_in_stage: int) -> dict:
    """The device batch of a stage's step (a pure function of the stage and the step)."""
    return batches.train_batch(self.data[stage.index], step_in_stage, stage.batch_size, self.config.micro_batches,
                               self.mesh)

  def checkpointer(self, workdir, stage_index: int) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(pathlib.Path(workdir) / "checkpoints" / f"stage_{stage_index}",
                                   keep=self.config.keep_checkpoints)

  def initial_state(self, stage: stages_lib.Stage, workdir, ckpt: checkpoint.Checkpointer):
    """The newest usable checkpoint of the stage, else the previous stage's final one, else a fresh init."""
    restored = ckpt.restore_latest(self.abstract)
    if restored is not None:
      print(f"stage {stage.index}: resuming from step {restored[1]['step']} ({ckpt.directory})", flush=True)
      return restored[0]
    if stage.index == 0:
      return self.init()
    with self.checkpointer(workdir, stage.index - 1) as prev:
      restored = prev.restore_latest(self.abstract, at=stage.start)
    if restored is None:
      raise FileNotFoundError(
          f"stage {stage.index} starts from the final checkpoint of stage {stage.index - 1} (step {stage.start}) "
          f"in {prev.directory}, which is missing or unusable: run stage {stage.index - 1} first")
    return restored[0]

  def run_stage(self, stage: stages_lib.Stage, workdir) -> dict | None:
    """Trains one stage to its end and evaluates it; returns the evaluation (None if it was already done)."""
    workdir = pathlib.Path(workdir)
    with self.checkpointer(workdir, stage.index) as ckpt:
      state = self.initial_state(stage, workdir, ckpt)
      first = int(state.step)
      if not stage.start <= first <= stage.end:
        raise ValueError(f"stage {stage.index} covers steps [{stage.start}, {stage.end}], its state is at step "
                         f"{first}")
      if first == stage.end:
        print(f"stage {stage.index}: already complete at step {first}", flush=True)
        return None
      log = metrics_lib.RunLog(workdir, first)
      try:
        state = self._steps(stage, state, ckpt, log)
        result = evaluate.evaluate(self.eval_step, state, self.config, stage.seq_len, self.mesh)
        log.evaluation({"step": stage.end, "stage": stage.index, "seq_len": stage.seq_len, **result})
      finally:
        log.close()
    print(f"stage {stage.index} evaluation at step {stage.end}:\n"
          + evaluate.format_table(result, self.config.data.task_length or stage.seq_len), flush=True)
    return result

  def _steps(self, stage, state, ckpt, log):
    """The stage's remaining steps: train, log every `log_every`, checkpoint every `checkpoint_every` and at the
    end (waiting until the last save is on disk)."""
    config = self.config
    first = int(state.step)
    print(f"stage {stage.index}: compiling the train step for {stage.batch_size} x {stage.seq_len} tokens (minutes "
          f"on a GPU for the larger configs)", flush=True)
    progress = metrics_lib.Progress(stage, first - stage.start)
    tokens_per_step = stage.batch_size * stage.seq_len
    flops_token = flops.flops_per_token(config.model, stage.seq_len)
    clock, timed_steps, m = None, 0, None
    start = time.perf_counter()
    for s in range(first, stage.end):
      batch = self.batch(stage, s - stage.start)
      jax.block_until_ready(m)  # keep one step in flight: the next batch is built while this one runs
      state, m = self.train_step(state, batch)
      done = s + 1
      if clock is None:  # the first step compiles: time from its end
        jax.block_until_ready(m)
        clock = time.perf_counter()
        print(f"stage {stage.index}: first step done in {clock - start:.0f} s, compilation included", flush=True)
      else:
        timed_steps += 1
      if done % config.log_every == 0 or done == stage.end:
        m = jax.device_get(m)
        now = time.perf_counter()
        tok_s = timed_steps * tokens_per_step / (now - clock) if timed_steps else None
        log.metrics({"step": done, "stage": stage.index, "seq_len": stage.seq_len, **m, "tokens_per_s": tok_s,
                     "mfu": tok_s and flops.mfu(tok_s, flops_token, list(self.mesh.devices.flat))})
        progress.update(1, float(m["loss"]), tok_s or 0.0)
        clock, timed_steps = now, 0
      else:
        progress.update(1)
      if done % config.checkpoint_every == 0 or done == stage.end:
        ckpt.save(done, state, {"stage": stage.index, "seq_len": stage.seq_len,
                                "data_rows": (done - stage.start) * stage.batch_size,
                                "config": json.loads(config.to_json_best_effort())})
    progress.close()
    ckpt.wait()
    return state


def train(config, workdir, *, stage: int | None = None) -> list[dict | None]:
  """Trains every stage of `config` in `workdir` (or only stage `stage`); see `Run.train`."""
  return Run(config).train(workdir, stage=stage)


def config_from_json(d: dict) -> ml_collections.ConfigDict:
  """A config saved as JSON (lists back to tuples, as the config files write them)."""
  def tuples(x):
    if isinstance(x, dict):
      return {k: tuples(v) for k, v in x.items()}
    return tuple(tuples(v) for v in x) if isinstance(x, list) else x
  return ml_collections.ConfigDict(tuples(d))


def override(config, overrides: dict | None) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted fields set (e.g. {"eval.lengths": (64, 256), "model.remat": False}); a field
  that does not exist is a ValueError naming it."""
  config = copy.deepcopy(config)
  for dotted, value in (overrides or {}).items():
    *path, last = dotted.split(".")
    node = config
    for p in path:
      node = node[p] if p in node else {}
    if last not in node:
      raise ValueError(f"config has no field {dotted!r}")
    node[last] = value
  return config


def restore(workdir, *, stage: int | None = None, step: int | None = None, overrides: dict | None = None):
  """(Run, train state, checkpoint meta) of a run's checkpoint (default: the newest usable step of the last stage
  that has one), the Run built from the config saved in it with `overrides` applied (see `override`)."""
  root = pathlib.Path(workdir) / "checkpoints"
  if stage is None:
    found = sorted(int(p.name.split("_")[1]) for p in root.glob("stage_*") if p.name.split("_")[1].isdigit()
                   and any(q.name.isdigit() for q in p.iterdir()))
    if not found:
      raise FileNotFoundError(f"no checkpoints under {root}")
    stage = found[-1]
  with checkpoint.Checkpointer(root / f"stage_{stage}", keep=1) as ckpt:
    steps = [s for s in ckpt.steps() if step is None or s == step]
    if not steps:
      raise FileNotFoundError(f"no checkpoint step {step or ''} in {ckpt.directory} (have {ckpt.steps()})")
    config = override(config_from_json(ckpt.read_meta(steps[-1])["config"]), overrides)
    run = Run(config)
    restored = ckpt.restore_latest(run.abstract, at=step)
    if restored is None:
      raise FileNotFoundError(f"no usable checkpoint in {ckpt.directory}")
  state, meta = restored
  return run, state, meta


def evaluate_checkpoint(workdir, *, stage: int | None = None, step: int | None = None,
                        overrides: dict | None = None) -> dict:
  """Evaluates a run's checkpoint (see `restore`) with the config saved in it; `overrides` maps dotted config
  fields (e.g. "eval.lengths") to new values."""
  run, state, meta = restore(workdir, stage=stage, step=step, overrides=overrides)
  config = run.config
  result = evaluate.evaluate(run.eval_step, state, config, meta["seq_len"], run.mesh)
  print(f"stage {meta['stage']}, step {meta['step']}:\n"
        + evaluate.format_table(result, config.data.task_length or meta["seq_len"]), flush=True)
  return {"stage": meta["stage"], "step": meta["step"], "seq_len": meta["seq_len"], **result}


def init_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
  """`jax.distributed.initialize` for a multi-process run; arguments left None are auto-detected."""
  jax.distributed.initialize(coordinator_address, num_processes, process_id)
  logging.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
