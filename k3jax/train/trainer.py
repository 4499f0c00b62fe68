"""The training run: stages one after another, each resumable from its own checkpoints.

Layout of a work directory:
    config.json                     the run's config (`workdir.py`: a resumed run must match it)
    config_changes.jsonl            changes made on resume, one JSON object each
    checkpoints/stage_<i>/<step>/   orbax steps of stage i (global step numbers)
    metrics.jsonl, eval.jsonl       one JSON object per logged step / per evaluation
    tensorboard/                    event files

Running the same command again continues each stage from its newest usable checkpoint; a finished stage is
skipped (evaluated if its evaluation is missing). Stage i > 0 starts from stage i−1's final checkpoint (its last
step), which must exist when a stage is run alone. SIGINT / SIGTERM stop the run after the current step with a
checkpoint of it (`Interrupted`); a non-finite loss or gradient norm stops it before anything of that step is
saved (`Diverged`); a stage whose every checkpoint is unusable stops instead of starting over.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import parallel
from k3jax.data import pipeline
from k3jax.train import batches, checkpoint, evaluate, flops, interrupt, loop, metrics as metrics_lib
from k3jax.train import optimizer, stages as stages_lib, state as state_lib, step as step_lib
from k3jax.train import workdir as workdir_lib

config_from_json = workdir_lib.config_from_json


class Diverged(FloatingPointError):
  """The loss or the gradient norm of a step is not finite."""


class UnusableCheckpoints(RuntimeError):
  """Every checkpoint of a stage is unusable: the stage would otherwise start over."""


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """What a config's train state is, without data or compiled steps: enough to restore a checkpoint."""
  config: ml_collections.ConfigDict
  plan: stages_lib.TrainingPlan
  mesh: Any
  tx: optax.GradientTransformation
  graphdef: Any
  abstract: state_lib.TrainState       # ShapeDtypeStructs with shardings
  init: Callable[[Any], state_lib.TrainState]   # seed -> fresh state (`state.abstract_state`)


def state_spec(config, *, mesh: str | None = None) -> StateSpec:
  """The StateSpec of `config`, its arrays placed on `mesh` (default `config.mesh`)."""
  plan = stages_lib.training_plan(config)
  mesh = parallel.mesh_from_string(config.mesh if mesh is None else mesh)
  tx = optimizer.make_optimizer(config.optimizer, plan.learning_rate)
  graphdef, abstract, init = state_lib.abstract_state(config, tx, mesh)
  return StateSpec(config, plan, mesh, tx, graphdef, abstract, init)


@dataclasses.dataclass
class _Session:
  """One call of `Run.train`: where, the signal guard, and the config record written once before the first write."""
  workdir: pathlib.Path
  stop: interrupt.StopSignals
  allow_missing_metrics: bool
  change: dict | None
  committed: bool = False

  def commit(self, config) -> None:
    if not self.committed:
      workdir_lib.commit(self.workdir, config, self.change)
      self.committed = True


# What a Run shares with the Runs of other seeds of its config (`Run(config, programs=...)`).
_PROGRAMS = ("plan", "mesh", "tx", "graphdef", "abstract", "init_program", "train_step", "eval_step")


def _but_seed(config) -> dict:
  out = workdir_lib.as_json(config)
  out.pop("seed")
  return out


class Run:
  """A config made runnable: its stages, mesh, optimizer and compiled steps (reusable across work directories).

  `programs`: a Run of the same config but for its seed, whose mesh, state spec and jitted programs this one takes
  (none of them depends on the seed): the seeds of a study then trace, lower and load each program once.
  """

  def __init__(self, config, *, programs: Run | None = None):
    self.config = config
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or not 0 <= config.seed < 2 ** 31:
      raise ValueError(f"config.seed must be an int in [0, 2**31), got {config.seed!r}")
    for field in ("log_every", "checkpoint_every", "keep_checkpoints"):
      if isinstance(config[field], bool) or not isinstance(config[field], int) or config[field] < 1:
        raise ValueError(f"config.{field} must be an int >= 1, got {config[field]!r}")
    if programs is not None and _but_seed(programs.config) != _but_seed(config):
      raise ValueError("programs= must be a Run of the same config (but for its seed)")
    if programs is None:
      self._build_programs(state_spec(config))
    else:
      for name in _PROGRAMS:
        setattr(self, name, getattr(programs, name))
    # Every stage's data and evaluation are checked here, before anything trains.
    self.data = [pipeline.Mixture(config.data, s.seq_len, pipeline.derive_seed(config.seed, s.index, "train"),
                                  vocab_size=config.model.vocab_size) for s in self.stages]
    evaluate.check(config, [s.seq_len for s in self.stages], self.mesh)

  def _build_programs(self, spec: StateSpec) -> None:
    self.plan, self.mesh, self.tx = spec.plan, spec.mesh, spec.tx
    self.graphdef, self.abstract = spec.graphdef, spec.abstract
    shardings = state_lib.shardings_of(self.abstract)
    # One program for every seed (the seed is its argument): a run of another seed finds it compiled.
    self.init_program = state_lib.InitProgram(spec.init, spec.abstract, self.mesh)
    options = parallel.compiler_options(self.mesh)
    step = step_lib.make_train_step(self.graphdef, self.tx, self.plan.learning_rate, self.config.model)
    self.train_step = jax.jit(step, donate_argnums=0, out_shardings=(shardings, NamedSharding(self.mesh, P())),
                              compiler_options=options)
    self.eval_step = eval_program(self.graphdef, self.mesh)

  @property
  def stages(self) -> tuple[stages_lib.Stage, ...]:
    return self.plan.stages

  @property
  def seed(self) -> np.ndarray:
    """`config.seed` as the init program's argument."""
    return np.asarray(self.config.seed, np.int32)

  def init(self) -> state_lib.TrainState:
    """The fresh train state of `config.seed`."""
    return self.init_program(self.seed)

  def train(self, workdir, *, stage: int | None = None, allow_config_change: bool = False,
            allow_missing_metrics: bool = False) -> list[dict | None]:
    """Trains every stage in `workdir` (or only stage `stage`); returns each stage's evaluation (None: skipped,
    the stage was already complete and evaluated).

    A directory trained with another config is refused (`workdir.ConfigChanged`) unless `allow_config_change`;
    a resume without the metrics.jsonl of the earlier steps is refused unless `allow_missing_metrics`.
    """
    if stage is not None and not 0 <= stage < len(self.stages):
      raise ValueError(f"stage={stage}: the config has stages 0..{len(self.stages) - 1}")
    workdir = pathlib.Path(workdir)
    change = workdir_lib.check_resume(workdir, self.config, allow_change=allow_config_change)
    chosen = self.stages if stage is None else [self.stages[stage]]
    with interrupt.StopSignals() as stop:
      session = _Session(workdir, stop, allow_missing_metrics, change)
      return [self.run_stage(s, session) for s in chosen]

  def batch(self, stage: stages_lib.Stage, step_in_stage: int) -> dict:
    """The device batch of a stage's step (a pure function of the stage and the step)."""
    return batches.train_batch(self.data[stage.index], step_in_stage, stage.batch_size, self.config.micro_batches,
                               self.mesh)

  def checkpointer(self, workdir, stage_index: int) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(workdir_lib.stage_directory(workdir, stage_index),
                                   keep=self.config.keep_checkpoints)

  def initial_state(self, stage: stages_lib.Stage, workdir, ckpt: checkpoint.Checkpointer):
    """The newest usable checkpoint of the stage, else the previous stage's final one, else a fresh init.
    UnusableCheckpoints if the stage has checkpoints but none of them is usable."""
    had = ckpt.steps()
    restored = ckpt.restore_latest(self.abstract)
    if restored is not None:
      print(f"stage {stage.index}: resuming from step {restored[1]['step']} ({ckpt.directory})", flush=True)
      return restored[0]
    quarantined = sorted(p.name for p in ckpt.quarantine_directory.glob("*"))
    if had or quarantined:
      raise UnusableCheckpoints(
          f"stage {stage.index}: no checkpoint in {ckpt.directory} is usable (unusable steps moved to "
          f"{ckpt.quarantine_directory}: {quarantined}); refusing to train the stage over from its start. Repair "
          f"them, or move both directories away to start the stage afresh")
    if stage.index == 0:
      return self.init()
    with self.checkpointer(workdir, stage.index - 1) as prev:
      restored = prev.restore_latest(self.abstract, at=stage.start)
    if restored is None:
      raise FileNotFoundError(
          f"stage {stage.index} starts from the final checkpoint of stage {stage.index - 1} (step {stage.start}) "
          f"in {prev.directory}, which is missing or unusable: run stage {stage.index - 1} first")
    return restored[0]

  def run_stage(self, stage: stages_lib.Stage, session: _Session) -> dict | None:
    """Trains one stage to its end and evaluates it; returns the evaluation (None if it was already done)."""
    workdir = session.workdir
    with self.checkpointer(workdir, stage.index) as ckpt:
      state = self.initial_state(stage, workdir, ckpt)
      first = int(state.step)
      if not stage.start <= first <= stage.end:
        raise ValueError(f"stage {stage.index} covers steps [{stage.start}, {stage.end}], its state is at step "
                         f"{first}")
      metrics_lib.check_continuation(workdir, first, allow_missing=session.allow_missing_metrics)
      session.commit(self.config)
      if first == stage.end:
        if metrics_lib.has_evaluation(workdir, stage.index, stage.end):
          print(f"stage {stage.index}: already complete at step {first}", flush=True)
          return None
        print(f"stage {stage.index}: complete at step {first}, evaluating it (no evaluation recorded)", flush=True)
      log = metrics_lib.RunLog(workdir, first if first < stage.end else None)
      try:
        if first < stage.end:
          state = self._steps(stage, state, ckpt, log, session.stop)
        result = evaluate.evaluate(self.eval_step, state, self.config, stage.seq_len, self.mesh,
                                   interrupt=lambda: session.stop.check(stage.end))
        log.evaluation({"step": stage.end, "stage": stage.index, "seq_len": stage.seq_len, **result})
      finally:
        log.close()
    print(f"stage {stage.index} evaluation at step {stage.end}:\n"
          + evaluate.format_table(result, self.config.data.task_length or stage.seq_len), flush=True)
    return result

  def _steps(self, stage, state, ckpt, log, stop):
    """The stage's remaining steps (`loop.run_steps`): train, log every `log_every`, checkpoint every
    `checkpoint_every`, at the end and when a stop is requested; every step's loss and gradient norm are checked
    before the next step's result is awaited and before any save. Step s is queued before step s − 1's check waits
    for it, so the GPU goes from one step to the next without waiting on the host (a diverged step s − 1 stops the
    run before step s's result is used or saved)."""
    config = self.config
    first = int(state.step)
    print(f"stage {stage.index}: compiling the train step for {stage.batch_size} x {stage.seq_len} tokens (minutes "
          f"on a GPU for the larger configs)", flush=True)
    tokens_per_step = stage.batch_size * stage.seq_len
    progress = metrics_lib.Progress(stage, first - stage.start, tokens_per_step=tokens_per_step)
    flops_token = flops.flops_per_token(config.model, stage.seq_len)
    clock, timed_steps, m, saved = None, 0, None, first
    start = time.perf_counter()

    def check_finite(metrics, step):
      loss, grad_norm = (float(x) for x in jax.device_get((metrics["loss"], metrics["grad_norm"])))
      if math.isfinite(loss) and math.isfinite(grad_norm):
        return
      log.metrics({"step": step, "stage": stage.index, "seq_len": stage.seq_len, **jax.device_get(metrics)})
      raise Diverged(f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}. Nothing of this "
                     f"step was saved; the newest checkpoint is step {saved}. Lower config.optimizer.lr (now "
                     f"{config.optimizer.lr:g}) or raise the warmup, then start a new run or resume with "
                     f"--allow_config_change")

    def advance(state, s):
      nonlocal clock, timed_steps, m
      batch = self.batch(stage, s - stage.start)
      previous = m
      state, m = self.train_step(state, batch)
      if previous is not None:
        check_finite(previous, s)  # waits for step s − 1 while step s is queued behind it
      done = s + 1
      if clock is None:  # the first step compiles: time from its end
        jax.block_until_ready(m)
        clock = time.perf_counter()
        print(f"stage {stage.index}: first step done in {clock - start:.0f} s, compilation included", flush=True)
      else:
        timed_steps += 1
      if done % config.log_every == 0 or done == stage.end:
        check_finite(m, done)
        m = jax.device_get(m)
        now = time.perf_counter()
        tok_s = timed_steps * tokens_per_step / (now - clock) if timed_steps else None
        log.metrics({"step": done, "stage": stage.index, "seq_len": stage.seq_len, **m, "tokens_per_s": tok_s,
                     "mfu": tok_s and flops.mfu(tok_s, flops_token, list(self.mesh.devices.flat))})
        progress.update(1, float(m["loss"]), tok_s)
        clock, timed_steps = now, 0
      else:
        progress.update(1)
      return state

    def before_save(done):
      nonlocal saved
      check_finite(m, done)
      saved = done

    return loop.run_steps(
        state, range(first, stage.end), advance, ckpt=ckpt, stop=stop, checkpoint_every=config.checkpoint_every,
        progress=progress, before_save=before_save,
        save_meta=lambda done: {"stage": stage.index, "seq_len": stage.seq_len,
                                "data_rows": (done - stage.start) * stage.batch_size,
                                "config": workdir_lib.as_json(config)})


def train(config, workdir, *, stage: int | None = None, allow_config_change: bool = False,
          allow_missing_metrics: bool = False) -> list[dict | None]:
  """Trains every stage of `config` in `workdir` (or only stage `stage`); see `Run.train`."""
  return Run(config).train(workdir, stage=stage, allow_config_change=allow_config_change,
                           allow_missing_metrics=allow_missing_metrics)


@dataclasses.dataclass(frozen=True)
class Restored:
  """A checkpoint of a run, restored: its stage, its config (with any overrides), the state and its meta."""
  stage: int
  config: ml_collections.ConfigDict
  spec: StateSpec
  state: state_lib.TrainState
  meta: dict


def restore(workdir, *, stage: int | None = None, step: int | None = None, overrides: dict | None = None,
            mesh: str | None = None) -> Restored:
  """A run's checkpoint (default: the newest usable step of the last stage that has one; with `step` alone, the
  stage holding that step) with the config saved in it, without touching the run directory: nothing there is
  created, moved or removed (an unusable step is reported and skipped). `overrides` maps dotted config fields
  (e.g. "eval.lengths") to new values; `mesh` places the arrays (default: the run's mesh). Builds no data."""
  found = workdir_lib.checkpointed_stages(workdir)
  root = pathlib.Path(workdir) / "checkpoints"
  if stage is None:
    holding = [i for i, steps in found.items() if step is None or step in steps]
    if not holding:
      raise FileNotFoundError(f"no checkpoint {'' if step is None else f'of step {step} '}under {root} "
                              f"(steps by stage: {found})")
    stage = holding[-1]
  if stage not in found:
    raise FileNotFoundError(f"no checkpoints of stage {stage} under {root} (steps by stage: {found})")
  with checkpoint.Checkpointer(workdir_lib.stage_directory(workdir, stage), keep=1, read_only=True) as ckpt:
    steps = [s for s in ckpt.steps() if step is None or s == step]
    if not steps:
      raise FileNotFoundError(f"no checkpoint step {step} in {ckpt.directory} (have {ckpt.steps()})")
    config = workdir_lib.override(config_from_json(ckpt.read_meta(steps[-1])["config"]), overrides)
    spec = state_spec(config, mesh=mesh)
    restored = ckpt.restore_latest(spec.abstract, at=step)
    if restored is None:
      raise FileNotFoundError(f"no usable checkpoint {'' if step is None else f'of step {step} '}in "
                              f"{ckpt.directory}")
  return Restored(stage, config, spec, *restored)


def eval_program(graphdef, mesh):
  """The eval step (`step.make_eval_step`) jitted for `mesh`: a Run's, and a checkpoint's evaluation's."""
  return jax.jit(step_lib.make_eval_step(graphdef), compiler_options=parallel.compiler_options(mesh))


def evaluate_checkpoint(workdir, *, stage: int | None = None, step: int | None = None,
                        overrides: dict | None = None) -> dict:
  """Evaluates a run's checkpoint (see `restore`; the "mesh" override also places the arrays); returns
  {stage, step, seq_len, **evaluation}. Writes nothing."""
  r = restore(workdir, stage=stage, step=step, overrides=overrides)
  result = evaluate.evaluate(eval_program(r.spec.graphdef, r.spec.mesh), r.state, r.config, r.meta["seq_len"],
                             r.spec.mesh)
  print(f"stage {r.stage}, step {r.meta['step']}:\n"
        + evaluate.format_table(result, r.config.data.task_length or r.meta["seq_len"]), flush=True)
  return {"stage": r.stage, "step": r.meta["step"], "seq_len": r.meta["seq_len"], **result}


def init_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
  """`jax.distributed.initialize` for a multi-process run; arguments left None are auto-detected."""
  jax.distributed.initialize(coordinator_address, num_processes, process_id)
  logging.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
