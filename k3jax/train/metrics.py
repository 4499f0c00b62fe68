"""Run logs: `metrics.jsonl` (one JSON object per logged step), `eval.jsonl` (one per evaluation), TensorBoard
event files under `tensorboard/`, and the progress of a stage (tokens/s, ETA). Only process 0 writes.

The JSON files are strict JSON: a non-finite number is written as null. They grow by appending across restarts:
a resumed run first drops the records logged after the step it resumed from (a killed run may have logged past
its last checkpoint), so the files read as one uninterrupted run. A run resumed at a step > 0 without a
metrics.jsonl stops with `MissingMetrics` (the earlier records would be lost without a word) unless that is
allowed; a metrics.jsonl deleted during a run is reported and started afresh.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import sys

import jax
import numpy as np
import tqdm
from absl import logging

METRICS, EVALS = "metrics.jsonl", "eval.jsonl"


class MissingMetrics(FileNotFoundError):
  """A run resumes at a step > 0 but its metrics.jsonl is missing or empty."""


def to_python(value):
  """Arrays as numbers (scalars) or lists, non-finite floats as None, recursively through dicts and lists."""
  if hasattr(value, "shape"):
    value = np.asarray(value)
    value = value.item() if value.ndim == 0 else value.tolist()
  if isinstance(value, dict):
    return {k: to_python(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_python(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """The records of a JSONL file ([] if it does not exist)."""
  path = pathlib.Path(path)
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _truncate_jsonl(path: pathlib.Path, after_step: int) -> int:
  """Drops the records with `step > after_step`; returns how many."""
  if not path.exists():
    return 0
  lines = [l for l in path.read_text().splitlines() if l.strip()]
  keep = [l for l in lines if json.loads(l)["step"] <= after_step]
  if len(keep) < len(lines):
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    os.replace(tmp, path)
  return len(lines) - len(keep)


def check_continuation(workdir: str | os.PathLike, start_step: int, *, allow_missing: bool = False) -> None:
  """MissingMetrics if a run resuming at `start_step` > 0 has no metrics.jsonl records to continue; with
  `allow_missing`, a warning instead (the file then starts at `start_step`)."""
  path = pathlib.Path(workdir) / METRICS
  if start_step == 0 or read_jsonl(path):
    return
  message = (f"{path} is missing or empty, but the run resumes at step {start_step}: the records of steps up to "
             f"{start_step} would be lost")
  if not allow_missing:
    raise MissingMetrics(f"{message}. Put the file back, or pass --allow_missing_metrics (allow_missing_metrics="
                         f"True) to continue with a file that starts at step {start_step}")
  print(f"WARNING: {message}; continuing as allowed, the file starts at step {start_step}", flush=True)


def has_evaluation(workdir: str | os.PathLike, stage: int, step: int) -> bool:
  return any(r.get("stage") == stage and r["step"] == step for r in read_jsonl(pathlib.Path(workdir) / EVALS))


def _scalars(prefix: str, value):
  """(tag, number) pairs of a record's value: lists as `tag/i`, dicts as `tag/key`; non-numbers skipped."""
  if isinstance(value, dict):
    return [pair for k, v in value.items() for pair in _scalars(f"{prefix}/{k}", v)]
  if isinstance(value, list):
    return [pair for i, v in enumerate(value) for pair in _scalars(f"{prefix}/{i}", v)]
  return [(prefix, value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


class RunLog:
  """Writers for one run directory, opened at the step the run starts from (`start_step`; None: only appends,
  nothing is dropped)."""

  def __init__(self, workdir: str | os.PathLike, start_step: int | None):
    self.enabled = jax.process_index() == 0
    self.workdir = pathlib.Path(workdir)
    self.tb = None
    self._written = set()   # files this log has written to (a vanished one is reported)
    if not self.enabled:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    for name in (METRICS, EVALS) if start_step is not None else ():
      dropped = _truncate_jsonl(self.workdir / name, start_step)
      if dropped:
        logging.info("%s: dropped %d records logged after step %d (resumed there)", name, dropped, start_step)
      if (self.workdir / name).exists():
        self._written.add(name)
    from tensorboardX import SummaryWriter  # only the writing process needs it
    purge = {} if start_step is None else {"purge_step": start_step + 1}
    self.tb = SummaryWriter(str(self.workdir / "tensorboard"), **purge)

  def _write(self, name: str, record: dict, prefix: str) -> None:
    if not self.enabled:
      return
    record = to_python(record)
    path = self.workdir / name
    if name in self._written and not path.exists():
      print(f"WARNING: {path} was deleted during the run: the records before step {record['step']} are lost; "
            f"a new file starts there", flush=True)
    with open(path, "a") as f:
      f.write(json.dumps(record, allow_nan=False) + "\n")
    self._written.add(name)
    for key, value in record.items():
      if key != "step":
        for tag, v in _scalars(prefix + key, value):
          self.tb.add_scalar(tag, v, record["step"])

  def metrics(self, record: dict) -> None:
    """Appends one training record (must hold `step`)."""
    self._write(METRICS, record, "train/")

  def evaluation(self, record: dict) -> None:
    """Appends one evaluation record (must hold `step`); nested results (accuracy per task@length) become
    TensorBoard tags `eval/accuracy/<task>@<length>`."""
    self._write(EVALS, record, "eval/")

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()
      self.tb = None


def _duration(seconds: float) -> str:
  s = int(round(seconds))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
  """A stage's progress: a tqdm bar on a terminal; elsewhere (a file, a pipe) one line per logged step with the
  step, loss, tokens/s and ETA, so logs hold no carriage returns. `tty=None`: whether stderr is a terminal."""

  def __init__(self, stage, done: int, *, tokens_per_step: int, tty: bool | None = None):
    self.stage, self.done, self.tokens_per_step = stage, done, tokens_per_step
    self.enabled = jax.process_index() == 0
    self.tty = sys.stderr.isatty() if tty is None else tty
    self.bar = tqdm.tqdm(total=stage.steps, initial=done, unit="step", dynamic_ncols=True,
                         desc=f"stage {stage.index} (T={stage.seq_len})",
                         disable=not (self.enabled and self.tty))

  def update(self, steps: int, loss: float | None = None, tokens_per_s: float | None = None,
             extra: dict[str, float] | None = None) -> None:
    """`steps` more steps done; `loss`, `tokens_per_s` and any `extra` values to show at a logged step."""
    self.done += steps
    extra = extra or {}
    if self.tty:
      if loss is not None:
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s or 0:,.0f}",
                             **{k: f"{v:.4g}" for k, v in extra.items()}, refresh=False)
      self.bar.update(steps)
    elif loss is not None and self.enabled:
      s = self.stage
      left = (s.steps - self.done) * self.tokens_per_step / tokens_per_s if tokens_per_s else None
      shown = "".join(f"{k} {v:.4g}  " for k, v in extra.items())
      print(f"stage {s.index} step {s.start + self.done}/{s.end}  loss {loss:.4f}  {shown}"
            f"{f'{tokens_per_s:,.0f}' if tokens_per_s else '-'} tok/s  "
            f"ETA {_duration(left) if left is not None else '-'}", flush=True)

  def close(self) -> None:
    self.bar.close()
