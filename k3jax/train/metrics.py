"""Run logs: `metrics.jsonl` (one JSON object per logged step), `eval.jsonl` (one per evaluation), TensorBoard
event files under `tensorboard/`, and a progress bar with tokens/s and ETA. Only process 0 writes.

A resumed run first drops the records logged after the step it resumed from (a killed run may have logged past
its last checkpoint), so the files read as one uninterrupted run.
"""
from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import tqdm
from absl import logging


def to_python(value):
  """Arrays as floats (scalars) or lists; everything else unchanged."""
  if hasattr(value, "shape"):
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()
  return value


def _truncate_jsonl(path: pathlib.Path, after_step: int) -> int:
  """Drops the records with `step > after_step`; returns how many."""
  if not path.exists():
    return 0
  lines = path.read_text().splitlines()
  keep = [l for l in lines if l.strip() and json.loads(l)["step"] <= after_step]
  tmp = path.with_suffix(".tmp")
  tmp.write_text("".join(l + "\n" for l in keep))
  os.replace(tmp, path)
  return len(lines) - len(keep)


class RunLog:
  """Writers for one run directory, opened at the step the run starts from."""

  def __init__(self, workdir: str | os.PathLike, start_step: int):
    self.enabled = jax.process_index() == 0
    self.workdir = pathlib.Path(workdir)
    self.tb = None
    if not self.enabled:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "eval.jsonl"):
      dropped = _truncate_jsonl(self.workdir / name, start_step)
      if dropped:
        logging.info("%s: dropped %d records logged after step %d (resumed there)", name, dropped, start_step)
    from tensorboardX import SummaryWriter  # only the writing process needs it
    self.tb = SummaryWriter(str(self.workdir / "tensorboard"), purge_step=start_step + 1)

  def _write(self, name: str, record: dict, prefix: str) -> None:
    if not self.enabled:
      return
    record = {k: to_python(v) for k, v in record.items()}
    with open(self.workdir / name, "a") as f:
      f.write(json.dumps(record) + "\n")
    for key, value in record.items():
      if key == "step":
        continue
      values = value if isinstance(value, list) else [value]
      for i, v in enumerate(values):
        if isinstance(v, (int, float)):
          self.tb.add_scalar(prefix + key + (f"/{i}" if isinstance(value, list) else ""), v, record["step"])

  def metrics(self, record: dict) -> None:
    """Appends one training record (must hold `step` and `loss`)."""
    self._write("metrics.jsonl", record, "train/")

  def evaluation(self, record: dict) -> None:
    """Appends one evaluation record (must hold `step`)."""
    self._write("eval.jsonl", record, "eval/")

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


class Progress:
  """tqdm bar over a stage's steps, showing loss and tokens/s (tqdm gives the ETA)."""

  def __init__(self, stage, done: int):
    self.bar = tqdm.tqdm(total=stage.steps, initial=done, unit="step", dynamic_ncols=True,
                         desc=f"stage {stage.index} (T={stage.seq_len})", disable=jax.process_index() != 0)

  def update(self, steps: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
    if loss is not None:
      self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
    self.bar.update(steps)

  def close(self) -> None:
    self.bar.close()
