"""experiments.ablations.records: a finished run's record reads back only for the same config (where files live
may differ, and fields added since keep what it computed), with its commit; values read back as they were written;
the runs recorded on the H200 still read back; a measurement (timings) is taken once per device kind and settings,
and stays valid when only fields its models never read change (notebook 05's committed timings read back)."""
import json
import pathlib

import numpy as np
import pytest

from experiments.ablations import records, runs
from experiments.configs import ablations, tiny
from k3jax.train import workdir as workdir_lib

GPU_RECORDS = pathlib.Path(__file__).resolve().parents[3] / "notebooks" / "results" / "gpu" / "records"


def config(shards="/machine_a/data/train_0.bin,/machine_a/data/train_1.bin"):
  c = tiny.get_config()
  c.data.shards = shards
  return c


def test_a_record_reads_back_for_the_same_config_wherever_its_files_live(tmp_path, monkeypatch):
  monkeypatch.setenv(records.COMMIT_ENV, "abc1234")
  assert records.load(tmp_path, "a", 0, config()) is None
  path = records.save(tmp_path, "a", 0, config(), {"loss": np.float32(1.5), "curve": np.arange(3), "pair": (1, 2)})
  assert path == tmp_path / "a" / "seed_0.json" and [p.name for p in path.parent.iterdir()] == ["seed_0.json"]
  moved = config("/machine_b/elsewhere/train_0.bin, /machine_b/train_1.bin")
  moved.data.cache_dir = "/machine_b/cache"
  assert records.load(tmp_path, "a", 0, moved) == {"loss": 1.5, "curve": [0, 1, 2], "pair": [1, 2]}
  assert records.load(tmp_path, "a", 1, moved) is None   # another seed has no record
  assert '"commit": "abc1234"' in path.read_text()


def test_provenance_counts_runs_and_measurements_by_commit_and_device(tmp_path, monkeypatch):
  assert records.provenance(tmp_path) == ""
  monkeypatch.setenv(records.COMMIT_ENV, "aaa1111")
  for variant, seed in (("a", 0), ("a", 1), ("b", 0)):
    records.save(tmp_path, variant, seed, config(), {})
  old = json.loads((tmp_path / "b" / "seed_0.json").read_text())
  del old["device"]   # a record written before the device was recorded
  (tmp_path / "b" / "seed_0.json").write_text(json.dumps(old))
  monkeypatch.setenv(records.COMMIT_ENV, "bbb2222")
  records.measured(tmp_path, "speed", {"n": 1}, lambda: 1.0, device="GPU X")
  device = json.loads((tmp_path / "a" / "seed_0.json").read_text())["device"]
  assert device and device != "device not recorded"
  assert records.provenance(tmp_path) == (f"aaa1111, {device}: 2 runs; aaa1111, device not recorded: 1 run; "
                                          "bbb2222, GPU X: 1 measurement")


@pytest.mark.parametrize("field, value", [("data.shards", "/machine_a/data/train_0.bin"), ("optimizer.lr", 1.0),
                                          ("seed", 7)])
def test_a_record_of_another_config_is_refused_naming_the_field(tmp_path, field, value):
  records.save(tmp_path, "a", 0, config(), {})
  other = workdir_lib.override(config(), {field: value})
  with pytest.raises(workdir_lib.ConfigChanged, match=field.replace(".", r"\.")):
    records.load(tmp_path, "a", 0, other)


def test_a_record_written_before_a_field_existed_reads_back_at_the_value_that_keeps_what_it_computed(tmp_path):
  path = records.save(tmp_path, "a", 0, config(), {"loss": 1.0})
  record = json.loads(path.read_text())
  del record["config"]["model"]["residual"]["readout"]    # as written before the field existed
  path.write_text(json.dumps(record))
  assert records.load(tmp_path, "a", 0, config()) == {"loss": 1.0}   # "layer": what every read-out did then
  with pytest.raises(workdir_lib.ConfigChanged, match=r"model\.residual\.readout"):
    records.load(tmp_path, "a", 0, workdir_lib.override(config(), {"model.residual.readout": "group"}))


def test_a_record_stays_valid_when_only_settings_its_run_never_reads_change(tmp_path):
  records.save(tmp_path, "a", 0, config(), {"loss": 1.0})   # tiny: the MoE on, the article balancer
  unread = workdir_lib.override(config(), {"model.moe.sign_update_rate": 0.5, "model.moe.aux_loss_coef": 0.5})
  assert records.load(tmp_path, "a", 0, unread) == {"loss": 1.0}
  with pytest.raises(workdir_lib.ConfigChanged, match=r"model\.moe\.correction_step"):
    records.load(tmp_path, "a", 0, workdir_lib.override(config(), {"model.moe.correction_step": 3.0}))
  records.save(tmp_path, "off", 0, workdir_lib.override(config(), {"model.moe.enabled": False}), {"loss": 2.0})
  off = workdir_lib.override(config(), {"model.moe.enabled": False, "model.moe.num_experts": 16})
  assert records.load(tmp_path, "off", 0, off) == {"loss": 2.0}
  kernels = workdir_lib.override(config(), {"model.moe.glu_epilogue": False, "model.kda.conv_backward": "kernel"})
  assert records.load(tmp_path, "a", 0, kernels) == {"loss": 1.0}   # other kernels, the same formulas


@pytest.mark.parametrize("notebook", ["01_gate", "02_balance", "03_residual", "04_context", "05_hybrid", "06_rl"])
def test_the_runs_recorded_on_the_gpu_read_back_with_the_configs_their_study_builds_now(notebook):
  """A change to what a GPU-scale study trains makes its committed records another config's, which the notebook
  would refuse: such a change must mean training them again, not slip in unnoticed."""
  s = ablations.NOTEBOOKS[notebook]("gpu")
  found = sorted((GPU_RECORDS / notebook).glob("*/seed_*.json"))
  assert found
  for path in found:
    variant, seed = path.parent.name, int(path.stem.removeprefix("seed_"))
    config = runs.with_seed(workdir_lib.override(s.base, dict(s.variants[variant])), seed)
    assert records.load(GPU_RECORDS / notebook, variant, seed, config) is not None, path


def test_plain_is_what_a_record_reads_back_and_other_objects_are_refused(tmp_path):
  assert records.plain({"x": np.ones(2, np.float32), "n": np.int64(3)}) == {"x": [1.0, 1.0], "n": 3}
  with pytest.raises(TypeError, match="JSON values"):
    records.save(tmp_path, "a", 0, config(), {"x": object()})
  assert not (tmp_path / "a" / "seed_0.json").exists()


def test_a_measurement_is_taken_once_per_device_kind_and_settings_and_read_back_after(tmp_path, monkeypatch):
  monkeypatch.setenv(records.COMMIT_ENV, "abc1234")
  calls = []
  measure = lambda: calls.append(1) or {"ms": np.float32(2.5), "shape": (8, 4096)}
  settings = {"shapes": [(8, 4096, 16, 128)], "repeats": 20, "fla": "0.6.0"}
  first = records.measured(tmp_path, "speed", settings, measure, device="NVIDIA H200")
  again = records.measured(tmp_path, "speed", settings, measure, device="NVIDIA H200")
  assert first == ({"ms": 2.5, "shape": [8, 4096]}, False) and again == ({"ms": 2.5, "shape": [8, 4096]}, True)
  assert calls == [1]
  path = records.measurement_path(tmp_path, "speed", "NVIDIA H200")
  assert path == tmp_path / "measured" / "speed@NVIDIA_H200.json" and '"commit": "abc1234"' in path.read_text()
  assert records.measured(tmp_path, "speed", settings, measure, device="cpu") == (first[0], False)   # its own
  assert calls == [1, 1]
  with pytest.raises(workdir_lib.ConfigChanged, match=r"fla: '0\.6\.0' -> None"):
    records.measured(tmp_path, "speed", {**settings, "fla": None}, measure, device="NVIDIA H200")
  assert calls == [1, 1]


def test_a_measurement_of_models_stays_valid_when_only_fields_they_never_read_change(tmp_path):
  off = workdir_lib.override(config(), {"model.moe.enabled": False})
  settings = lambda c: {"repeats": 3, "models": {"a": {"model": workdir_lib.as_json(c.model), "seed": 0}}}
  records.measured(tmp_path, "speed", settings(off), lambda: 1.0, device="cpu")
  path = records.measurement_path(tmp_path, "speed", "cpu")
  record = json.loads(path.read_text())
  moe = record["settings"]["models"]["a"]["model"]["moe"]
  moe["correction_rate"] = moe.pop("correction_step")     # as written before the article method's step changed
  del record["settings"]["models"]["a"]["model"]["residual"]["readout"]   # and before this field existed
  path.write_text(json.dumps(record))
  assert records.measured(tmp_path, "speed", settings(off), lambda: 2.0, device="cpu") == (1.0, True)
  with pytest.raises(workdir_lib.ConfigChanged, match=r"models\.a\.model\.d_model"):
    records.measured(tmp_path, "speed", settings(workdir_lib.override(off, {"model.d_model": 48})), lambda: 2.0,
                     device="cpu")


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_the_committed_timings_of_notebook_05_read_back_with_the_models_its_study_builds_now(scale):
  """notebook 05 records its forward timings with the models it timed; a committed record must still match them."""
  from experiments.ablations import throughput
  s = ablations.NOTEBOOKS["05_hybrid"](scale)
  timing = {k: s.settings[k] for k in ("throughput_lengths", "throughput_tokens", "repeats")}
  root = GPU_RECORDS.parent.parent / scale / "records" / "05_hybrid"
  (path,) = (root / "measured").glob("forward_tokens_per_s@*.json")
  device = json.loads(path.read_text())["device"]
  settings = {**timing, "models": throughput.described(s.configs())}
  result, found = records.measured(root, "forward_tokens_per_s", settings, lambda: pytest.fail("measured again"),
                                   device=device)
  assert found and set(result) == set(s.variants)


def test_a_measurement_that_fails_records_nothing(tmp_path):
  def fail():
    raise RuntimeError("out of memory")
  with pytest.raises(RuntimeError, match="out of memory"):
    records.measured(tmp_path, "speed", {}, fail, device="cpu")
  assert not list(tmp_path.rglob("*.json"))
