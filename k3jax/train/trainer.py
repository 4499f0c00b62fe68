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

import json
import pathlib
import time

import jax
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.data import pipeline, tasks
from k3jax.train import batches, checkpoint, evaluate, flops, mesh as mesh_lib, metrics as metrics_lib
from k3jax.train import optimizer, stages as stages_lib, state as state_lib, step as step_lib


class Run:
  """What every stage of a run shares: config, mesh, optimizer, compiled steps."""

  def __init__(self, config, workdir):
    self.config, self.workdir = config, pathlib.Path(workdir)
    self.stages = stages_lib.stages_of(config)
    for field in ("log_every", "checkpoint_every", "keep_checkpoints"):
      if config[field] < 1:
        raise ValueError(f"config.{field} must be >= 1, got {config[field]}")
    self.mesh = mesh_lib.make_mesh(config.mesh)
    self.tx, self.lr = optimizer.make_optimizer(config, self.stages)
    self.graphdef, self.abstract, self.init = state_lib.abstract_state(config, self.tx, self.mesh)
    shardings = state_lib.shardings_of(self.abstract)
    self.train_step = jax.jit(step_lib.make_train_step(self.graphdef, self.tx, self.lr, config.model),
                              donate_argnums=0, out_shardings=(shardings, NamedSharding(self.mesh, P())))
    self.eval_step = jax.jit(step_lib.make_eval_step(self.graphdef))

  def checkpointer(self, stage_index: int) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(self.workdir / "checkpoints" / f"stage_{stage_index}",
                                   keep=self.config.keep_checkpoints)

  def initial_state(self, stage: stages_lib.Stage, ckpt: checkpoint.Checkpointer):
    """The newest usable checkpoint of the stage, else the previous stage's final one, else a fresh init."""
    restored = ckpt.restore_latest(self.abstract)
    if restored is not None:
      logging.info("stage %d: resuming from step %d", stage.index, restored[1]["step"])
      return restored[0]
    if stage.index == 0:
      return jax.jit(self.init, out_shardings=state_lib.shardings_of(self.abstract))()
    prev = self.checkpointer(stage.index - 1)
    restored = prev.restore_latest(self.abstract, at=stage.start)
    prev.close()
    if restored is None:
      raise FileNotFoundError(
          f"stage {stage.index} starts from the final checkpoint of stage {stage.index - 1} (step {stage.start}) "
          f"in {prev.directory}, which is missing or unusable: run stage {stage.index - 1} first")
    return restored[0]

  def run_stage(self, stage: stages_lib.Stage) -> dict | None:
    """Trains one stage to its end and evaluates it; returns the evaluation (None if it was already done)."""
    config = self.config
    ckpt = self.checkpointer(stage.index)
    state = self.initial_state(stage, ckpt)
    first = int(state.step)
    if not stage.start <= first <= stage.end:
      raise ValueError(f"stage {stage.index} covers steps [{stage.start}, {stage.end}], its state is at step {first}")
    if first == stage.end and ckpt.steps():
      ckpt.close()
      return None
    log = metrics_lib.RunLog(self.workdir, first)
    progress = metrics_lib.Progress(stage, first - stage.start)
    data = pipeline.Mixture(config.data, stage.seq_len, pipeline.derive_seed(config.seed, stage.index, "train"),
                            vocab_size=config.model.vocab_size)
    tokens_per_step = stage.batch_size * stage.seq_len
    flops_token = flops.flops_per_token(config.model, stage.seq_len)
    clock, timed_steps = None, 0
    for s in range(first, stage.end):
      batch = batches.train_batch(data, s - stage.start, stage.batch_size, config.micro_batches, self.mesh)
      state, m = self.train_step(state, batch)
      done = s + 1
      if clock is None:  # the first step compiles: time from its end
        jax.block_until_ready(m)
        clock = time.perf_counter()
      else:
        timed_steps += 1
      if done % config.log_every == 0 or done == stage.end:
        m = jax.device_get(m)
        now = time.perf_counter()
        tok_s = timed_steps * tokens_per_step / (now - clock) if timed_steps else None
        record = {"step": done, "stage": stage.index, "seq_len": stage.seq_len, **m, "tokens_per_s": tok_s}
        if tok_s is not None:
          record["mfu"] = flops.mfu(tok_s, flops_token, self.mesh.devices.flat)
        log.metrics(record)
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
    result = evaluate.evaluate(self.eval_step, state, config, stage.seq_len, self.mesh)
    log.evaluation({"step": stage.end, "stage": stage.index, "seq_len": stage.seq_len, **result})
    train_lengths = {name: config.data.task_length or stage.seq_len for name in tasks.TASKS}
    print(f"stage {stage.index} evaluation at step {stage.end}:\n" + evaluate.format_table(result, train_lengths),
          flush=True)
    log.close()
    ckpt.close()
    return result


def train(config, workdir, *, stage: int | None = None) -> list[dict | None]:
  """Trains every stage of `config` in `workdir` (or only stage `stage`); returns each stage's evaluation."""
  run = Run(config, workdir)
  if stage is not None and not 0 <= stage < len(run.stages):
    raise ValueError(f"--stage={stage}: the config has stages 0..{len(run.stages) - 1}")
  if jax.process_index() == 0:
    run.workdir.mkdir(parents=True, exist_ok=True)
    (run.workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
  chosen = run.stages if stage is None else [run.stages[stage]]
  return [run.run_stage(s) for s in chosen]


def init_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
  """`jax.distributed.initialize` for a multi-process run; arguments left None are auto-detected."""
  jax.distributed.initialize(coordinator_address, num_processes, process_id)
  logging.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
