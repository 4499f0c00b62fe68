"""The training plan, derived from a config once: its stages (staged context extension: sequence length, steps,
batch size, each stage's learning-rate schedule) and the learning rate over global steps.

`config.stages` lists the stages as dicts; empty means one stage from the top-level `seq_len`, `batch_size`,
`steps`. Every stage keeps `seq_len * batch_size` (tokens per step) of the first; steps count on across stages, so
stage i covers global steps `[start, end)`, and it starts from stage i-1's checkpoint at `start`.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import optax

from k3jax.train import optimizer

REQUIRED = ("seq_len", "steps", "batch_size")
SCHEDULE = ("lr", "warmup_fraction", "decay_fraction")


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int
  seq_len: int
  batch_size: int
  steps: int
  start: int                # first global step of the stage
  lr: float                 # peak learning rate
  warmup_fraction: float
  decay_fraction: float

  @property
  def end(self) -> int:
    return self.start + self.steps


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
  """A config's training: its stages and what follows from them. Build it with `training_plan(config)`."""
  stages: tuple[Stage, ...]
  final_lr_fraction: float      # each stage's decay ends at this fraction of its peak

  @property
  def steps(self) -> int:
    return self.stages[-1].end

  @property
  def tokens(self) -> int:
    """Tokens trained on: the sum over the stages of steps × rows × sequence length."""
    return sum(s.steps * s.batch_size * s.seq_len for s in self.stages)

  @functools.cached_property
  def learning_rate(self) -> optax.Schedule:
    """One schedule over global steps: each stage's warmup-stable-decay, started at the stage's first step."""
    scheds = [optimizer.wsd_schedule(s.lr, s.steps, s.warmup_fraction, s.decay_fraction, self.final_lr_fraction)
              for s in self.stages]
    return optax.join_schedules(scheds, [s.start for s in self.stages[1:]]) if len(scheds) > 1 else scheds[0]


def training_plan(config) -> TrainingPlan:
  """The training plan of `config`, validated (positive sizes, constant tokens per step, divisible micro-batches,
  the optimizer's fields)."""
  stages = tuple(_stages(config))
  optimizer.check(config.optimizer)
  return TrainingPlan(stages, float(config.optimizer.final_lr_fraction))


def _stages(config) -> list[Stage]:
  opt = config.optimizer
  if isinstance(config.micro_batches, bool) or not isinstance(config.micro_batches, int) or config.micro_batches < 1:
    raise ValueError(f"config.micro_batches must be a positive int, got {config.micro_batches!r}")
  raw = [dict(s) for s in config.stages] or [dict(seq_len=config.seq_len, steps=config.steps,
                                                   batch_size=config.batch_size)]
  out, start = [], 0
  for i, s in enumerate(raw):
    unknown = set(s) - set(REQUIRED) - set(SCHEDULE)
    missing = set(REQUIRED) - set(s)
    if unknown or missing:
      raise ValueError(f"config.stages[{i}]: needs {REQUIRED}, may set {SCHEDULE}; "
                       f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    stage = Stage(i, int(s["seq_len"]), int(s["batch_size"]), int(s["steps"]), start,
                  float(s.get("lr", opt.lr)), float(s.get("warmup_fraction", opt.warmup_fraction)),
                  float(s.get("decay_fraction", opt.decay_fraction)))
    if not (math.isfinite(stage.lr) and stage.lr > 0):
      raise ValueError(f"stage {i}: the peak learning rate (config.optimizer.lr or the stage's lr) must be > 0, got "
                       f"{stage.lr}")
    if min(stage.seq_len, stage.batch_size, stage.steps) <= 0:
      raise ValueError(f"config.stages[{i}]: seq_len, batch_size and steps must be positive, got {s}")
    if stage.batch_size % config.micro_batches:
      raise ValueError(f"stage {i}: batch_size {stage.batch_size} is not divisible by "
                       f"config.micro_batches={config.micro_batches}")
    if not (0 <= stage.warmup_fraction and 0 <= stage.decay_fraction and
            stage.warmup_fraction + stage.decay_fraction <= 1):
      raise ValueError(f"stage {i}: warmup_fraction and decay_fraction must be >= 0 with sum <= 1, got "
                       f"{stage.warmup_fraction}, {stage.decay_fraction}")
    if out and stage.seq_len * stage.batch_size != out[0].seq_len * out[0].batch_size:
      raise ValueError(f"stage {i}: seq_len*batch_size = {stage.seq_len * stage.batch_size} tokens per step, "
                       f"stage 0 has {out[0].seq_len * out[0].batch_size}; stages keep tokens per step constant")
    out.append(stage)
    start = stage.end
  if config.stages and config.steps != start:
    raise ValueError(f"config.steps ({config.steps}) must equal the sum of the stages' steps ({start})")
  return out
