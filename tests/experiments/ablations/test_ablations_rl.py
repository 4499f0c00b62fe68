"""experiments.ablations.rl: a finished `experiments.rl` run, its logs alone, becomes the RL notebook's record of
that seed, which the notebook then reads instead of training; a run of another config or an unfinished one is
refused before anything is written."""
import json
import pathlib

import pytest

from experiments.ablations import records, rl
from experiments.configs import ablations
from k3jax.rl import config as rl_config_lib
from k3jax.train import metrics as metrics_lib
from k3jax.train import workdir as workdir_lib


def write_run(directory: pathlib.Path, config, *, eval_steps=(0, None), rl_config=None) -> pathlib.Path:
  """A run directory as `experiments.rl` leaves it with its checkpoints removed: configs and logs."""
  rl_config = config if rl_config is None else rl_config
  points = [f"{name}@{n}" for name, n in rl_config_lib.eval_points(config.rl)]
  for part, ran in (("sft", rl_config_lib.sft_config(config)), ("rl", rl_config)):
    (directory / part).mkdir(parents=True)
    (directory / part / workdir_lib.CONFIG).write_text(json.dumps(workdir_lib.as_json(ran)))
  lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)
  (directory / "sft" / metrics_lib.METRICS).write_text(lines({"step": s, "loss": 1.0 / s} for s in (20, 40)))
  (directory / "rl" / metrics_lib.METRICS).write_text(lines(
      {"step": s, "reward_mean": 0.5, "success_rate": 0.5, "kl": 0.01, "loss": 0.0} for s in (1, 2)))
  steps = [config.rl.iterations if s is None else s for s in eval_steps]
  (directory / "rl" / metrics_lib.EVALS).write_text(lines(
      {"step": s, **{p: {"success_rate": 0.25 + s / 1000, "correct": [1, 0, 0, 0]} for p in points}} for s in steps))
  return directory


def test_a_finished_run_is_recorded_with_its_commit_and_device_and_read_back_by_the_notebook(tmp_path):
  study = ablations.rl("cpu")
  (variant,), seed = study.configs(), study.seeds[0]
  config = study.configs()[variant]
  run = write_run(tmp_path / "run", config)
  path = rl.record_run(study, run, tmp_path / "records", seed=seed, commit="abc1234", device="NVIDIA H200")
  saved = json.loads(path.read_text())
  assert (saved["commit"], saved["device"]) == ("abc1234", "NVIDIA H200")
  result = rl.train(study, tmp_path / "work", records=tmp_path / "records")   # reads it: nothing trains
  assert not (tmp_path / "work").exists()
  (entry,) = result["runs"]
  assert entry["sft"]["loss"] == [1 / 20, 1 / 40] and entry["rl"]["step"] == [1, 2] and entry["wall_s"] is None
  assert all(result["success"][p]["after"]["mean"] > result["success"][p]["before"]["mean"]
             for p in result["points"])


def test_a_run_of_another_config_or_an_unfinished_one_is_refused_and_nothing_is_written(tmp_path):
  study = ablations.rl("cpu")
  (variant,) = study.configs()
  config = study.configs()[variant]
  other = config.copy_and_resolve_references()
  other.rl.lr = config.rl.lr * 2
  with pytest.raises(workdir_lib.ConfigChanged, match="rl.lr"):
    rl.record_run(study, write_run(tmp_path / "other", config, rl_config=other), tmp_path / "records", seed=0,
                  commit="abc1234", device="cpu")
  with pytest.raises(ValueError, match="no finished run"):
    rl.record_run(study, write_run(tmp_path / "unfinished", config, eval_steps=(0,)), tmp_path / "records",
                  seed=0, commit="abc1234", device="cpu")
  assert not (tmp_path / "records").exists()


def test_recording_for_the_notebook_does_not_overwrite_a_record(tmp_path):
  study = ablations.rl("cpu")
  (variant,) = study.configs()
  run = write_run(tmp_path / "run", study.configs()[variant])
  path = rl.record_for_notebook(tmp_path, "cpu", run, commit="abc1234", device="cpu")
  assert path == records.path(tmp_path / "cpu" / "records" / rl.NOTEBOOK, variant, study.seeds[0])
  before = path.read_text()
  with pytest.raises(FileExistsError, match="exists"):
    rl.record_for_notebook(tmp_path, "cpu", run, commit="def5678", device="cpu")
  with pytest.raises(ValueError, match="not one of the study's seeds"):
    rl.record_for_notebook(tmp_path, "cpu", run, commit="abc1234", device="cpu", seed=99)
  assert path.read_text() == before
