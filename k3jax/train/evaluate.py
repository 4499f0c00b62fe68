"""Evaluation: held-out loss (the training mixture on its held-out split) and synthetic-task accuracy at several
lengths, including lengths beyond the training length.

Task accuracy is the fraction of answer tokens the model predicts exactly (argmax), each example alone in a row
of the evaluated length; `chance` is what uniform guessing among the task's answer tokens scores.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from k3jax.data import pipeline, tasks
from k3jax.train import batches


def task_rows(name: str, seed: int, start: int, stop: int, length: int) -> dict[str, np.ndarray]:
  """Examples `start..stop-1` of task `name` at `length`, one per row: `[stop - start, length]` arrays."""
  return pipeline.stack_rows([pipeline.pack([tasks.make_example(name, seed, i, length)], length)
                              for i in range(start, stop)])


def eval_lengths(config, seq_len: int) -> tuple[int, ...]:
  """`config.eval.lengths`, or by default the stage's length and 2 and 4 times it."""
  return tuple(config.eval.lengths) or (seq_len, 2 * seq_len, 4 * seq_len)


def eval_tasks(config) -> tuple[str, ...]:
  """`config.eval.tasks`, or by default the synthetic tasks the data mix trains on."""
  return tuple(config.eval.tasks) or tuple(n for n, _ in pipeline.parse_mix(config.data.mix) if n in tasks.TASKS)


def check(config, seq_lens, mesh) -> None:
  """ValueErrors for an evaluation config that cannot run (before any training)."""
  e = config.eval
  if e.batches < 0 or e.examples < 0 or e.batch_size < 1 or e.batch_size % mesh.size or e.examples % e.batch_size:
    raise ValueError(f"config.eval: batch_size={e.batch_size} must divide examples={e.examples} and be divisible by "
                     f"the {mesh.size} mesh devices; batches={e.batches} must be >= 0")
  for name in eval_tasks(config) if e.examples else ():
    if name not in tasks.TASKS:
      raise ValueError(f"config.eval.tasks: unknown task {name!r}; expected some of {sorted(tasks.TASKS)}")
    short = [n for t in seq_lens for n in eval_lengths(config, t) if n < tasks.TASKS[name].min_length]
    if short:
      raise ValueError(f"config.eval: task {name!r} needs lengths >= {tasks.TASKS[name].min_length}, got {short}")


def evaluate(eval_step, state, config, seq_len: int, mesh, *, interrupt: Callable[[], None] | None = None) -> dict:
  """{"heldout_loss", "heldout_tokens", "accuracy": {"task@L": acc}, "chance": {task: p}} for a stage of
  length `seq_len`; `eval_step` is the jitted `step.make_eval_step` function. `interrupt` is called before each
  batch (it may raise to stop the evaluation)."""
  check(config, [seq_len], mesh)
  e = config.eval

  def run(rows):
    if interrupt is not None:
      interrupt()
    out = eval_step(state, batches.to_device(rows, batches.rows_sharding(mesh)))
    return {k: float(v) for k, v in out.items()}

  ce = weight = 0.0
  if e.batches:
    heldout = pipeline.Mixture(config.data, seq_len, pipeline.derive_seed(config.seed, 0, "heldout"),
                               vocab_size=config.model.vocab_size, split="heldout")
    for b in range(e.batches):
      out = run(heldout.rows(b * e.batch_size, (b + 1) * e.batch_size))
      ce, weight = ce + out["ce_sum"], weight + out["weight"]
  result = {"heldout_loss": ce / weight if weight else None, "heldout_tokens": weight, "accuracy": {}, "chance": {}}

  seed = pipeline.derive_seed(config.seed, 0, "tasks")
  for name in eval_tasks(config) if e.examples else ():
    result["chance"][name] = tasks.TASKS[name].chance
    for length in eval_lengths(config, seq_len):
      correct = weight = 0.0
      for start in range(0, e.examples, e.batch_size):
        out = run(task_rows(name, seed, start, start + e.batch_size, length))
        correct, weight = correct + out["correct"], weight + out["weight"]
      result["accuracy"][f"{name}@{length}"] = correct / max(weight, 1.0)
  return result


def format_table(result: dict, train_length: int) -> str:
  """The result as text: held-out loss, then accuracy per task and length against chance."""
  lines = [f"held-out loss {result['heldout_loss']:.4f} ({result['heldout_tokens']:.0f} tokens)"
           if result["heldout_loss"] is not None else "held-out loss: not measured (config.eval.batches = 0)",
           "task          length  accuracy  chance"]
  for key, acc in result["accuracy"].items():
    name, length = key.split("@")
    beyond = f"  (trained at {train_length})" if int(length) > train_length else ""
    lines.append(f"{name:<12} {length:>7}  {acc:8.3f}  {result['chance'][name]:6.3f}{beyond}")
  return "\n".join(lines)
