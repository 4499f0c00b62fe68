"""Run logs (k3jax/train/metrics.py): strict JSON (non-finite numbers as null), nested evaluation results as
TensorBoard tags, records after the resumed step dropped, a missing metrics.jsonl at a resume refused, a file
deleted during a run reported, and off a terminal one progress line per logged step."""
import json
import math

import numpy as np
import pytest

from k3jax.train import metrics, stages
from train_testing import records


class Scalars:
  """Stands in for the TensorBoard writer: records the scalars written."""

  def __init__(self):
    self.tags = {}

  def add_scalar(self, tag, value, step):
    self.tags[tag] = (value, step)

  def close(self):
    pass


def test_non_finite_numbers_are_written_as_null(tmp_path):
  log = metrics.RunLog(tmp_path, 0)
  log.metrics({"step": 1, "loss": np.float32(np.nan), "grad_norm": math.inf, "moe_max_vio": np.array([0.5, np.nan])})
  log.close()
  assert records(tmp_path) == [{"step": 1, "loss": None, "grad_norm": None, "moe_max_vio": [0.5, None]}]


def test_evaluation_accuracies_reach_tensorboard_per_task_and_length(tmp_path):
  log = metrics.RunLog(tmp_path, 0)
  log.tb.close()
  log.tb = Scalars()
  log.evaluation({"step": 30, "stage": 0, "heldout_loss": None, "accuracy": {"stack@64": 0.75, "stack@256": 0.5},
                  "chance": {"stack": 0.04}})
  assert log.tb.tags == {"eval/stage": (0, 30), "eval/accuracy/stack@64": (0.75, 30),
                         "eval/accuracy/stack@256": (0.5, 30), "eval/chance/stack": (0.04, 30)}


def test_a_resume_drops_later_records_and_a_missing_file_is_refused(tmp_path, capsys):
  log = metrics.RunLog(tmp_path, 0)
  for step in range(1, 6):
    log.metrics({"step": step, "loss": 1.0 / step})
  log.close()
  metrics.RunLog(tmp_path, 3).close()
  assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]
  metrics.check_continuation(tmp_path, 3)
  (tmp_path / "metrics.jsonl").unlink()
  metrics.check_continuation(tmp_path, 0)            # a fresh start needs nothing
  with pytest.raises(metrics.MissingMetrics, match="resumes at step 3"):
    metrics.check_continuation(tmp_path, 3)
  metrics.check_continuation(tmp_path, 3, allow_missing=True)
  assert "WARNING" in capsys.readouterr().out


def test_a_file_deleted_during_the_run_is_reported(tmp_path, capsys):
  log = metrics.RunLog(tmp_path, 0)
  log.metrics({"step": 1, "loss": 2.0})
  (tmp_path / "metrics.jsonl").unlink()
  log.metrics({"step": 2, "loss": 1.0})
  log.close()
  assert "was deleted during the run: the records before step 2 are lost" in capsys.readouterr().out
  assert [r["step"] for r in records(tmp_path)] == [2]


def test_off_a_terminal_progress_is_one_line_per_logged_step(capsys):
  stage = stages.Stage(0, seq_len=64, batch_size=16, steps=100, start=0, lr=1e-3, warmup_fraction=0.0,
                       decay_fraction=0.0)
  progress = metrics.Progress(stage, 10, tokens_per_step=1024, tty=False)
  progress.update(1)                        # an unlogged step: no output
  progress.update(1, 2.5, None)             # the first logged interval is all compilation: no rate yet
  progress.update(8)
  progress.update(1, 1.25, 2048.0)          # 79 steps left at 2 steps/s: 39.5 s
  progress.update(1, 1.0, 2048.0, extra={"reward": 0.375})   # values a run adds (RL: reward, success)
  progress.close()
  captured = capsys.readouterr()
  assert captured.out.splitlines() == ["stage 0 step 12/100  loss 2.5000  - tok/s  ETA -",
                                       "stage 0 step 21/100  loss 1.2500  2,048 tok/s  ETA 40s",
                                       "stage 0 step 22/100  loss 1.0000  reward 0.375  2,048 tok/s  ETA 39s"]
  assert "\r" not in captured.out + captured.err
