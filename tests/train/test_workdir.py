"""The run directory's guard (k3jax/train/workdir.py): a resumed run must get the config it was trained with,
except for the fields that only change how it is observed or stored; allowed changes are recorded; a change of
the run's length must keep the learning rate of the steps already taken. Nothing is written by a check."""
import json

import pytest

from experiments.configs import tiny
from k3jax.train import workdir as workdir_lib
from train_testing import snapshot


def started(tmp_path, config, step=40):
  """A run directory as training leaves it: config.json and a checkpoint step directory."""
  workdir_lib.commit(tmp_path, config, None)
  (tmp_path / "checkpoints" / "stage_0" / str(step)).mkdir(parents=True)
  return tmp_path


def test_a_new_or_unchanged_directory_passes_and_nothing_is_written(tmp_path):
  assert workdir_lib.check_resume(tmp_path / "new", tiny.get_config()) is None and not (tmp_path / "new").exists()
  started(tmp_path, tiny.get_config())
  before = snapshot(tmp_path)
  assert workdir_lib.check_resume(tmp_path, tiny.get_config()) is None
  assert snapshot(tmp_path) == before


def test_a_changed_config_is_refused_listing_every_differing_field_and_writing_nothing(tmp_path):
  started(tmp_path, tiny.get_config())
  c = tiny.get_config()
  c.optimizer.lr, c.seed, c.data.mix.stack, c.seq_len, c.model.d_model = 1e-3, 7, 0.25, 128, 32
  c.log_every = 1                            # a free field: not listed among the blocking ones
  before = snapshot(tmp_path)
  with pytest.raises(workdir_lib.ConfigChanged, match="--allow_config_change") as e:
    workdir_lib.check_resume(tmp_path, c)
  listed = [l.split(":")[0].strip() for l in str(e.value).splitlines()[1:6]]
  assert listed == ["data.mix.stack", "model.d_model", "optimizer.lr", "seed", "seq_len"]
  assert "log_every" not in listed and "to step 40" in str(e.value)
  assert snapshot(tmp_path) == before


def test_free_fields_pass_and_an_allowed_change_is_recorded(tmp_path):
  started(tmp_path, tiny.get_config())
  c = tiny.get_config()
  c.log_every, c.checkpoint_every, c.keep_checkpoints, c.eval.lengths = 1, 5, 9, (64, 512)
  c.model.mla.max_documents, c.model.residual.backward = 4, "barrier"
  record = workdir_lib.check_resume(tmp_path, c)
  assert record["allowed"] is False and set(record["changes"]) == {"log_every", "checkpoint_every",
                                                                   "keep_checkpoints", "eval.lengths",
                                                                   "model.mla.max_documents",
                                                                   "model.residual.backward"}
  c.optimizer.lr = 1e-3
  record = workdir_lib.check_resume(tmp_path, c, allow_change=True)
  assert record["allowed"] and record["at_step"] == 40 and record["changes"]["optimizer.lr"] == [3e-3, 1e-3]
  workdir_lib.commit(tmp_path, c, record)
  assert json.loads((tmp_path / "config_changes.jsonl").read_text())["changes"]["optimizer.lr"] == [3e-3, 1e-3]
  assert workdir_lib.remembered(tmp_path)["optimizer"]["lr"] == 1e-3
  assert workdir_lib.check_resume(tmp_path, c) is None   # the directory now remembers the new config


def test_extending_steps_must_keep_the_learning_rate_of_the_steps_taken(tmp_path):
  started(tmp_path, tiny.get_config(), step=100)   # 250 steps: warmup 12 (5%), decay from step 200 (20%)
  longer = tiny.get_config()
  longer.steps = 500                               # the warmup would stretch to 25 steps: the lr of steps 0-24 moves
  with pytest.raises(workdir_lib.ConfigChanged, match=r"learning rate of steps already taken \(step 0:") as e:
    workdir_lib.check_resume(tmp_path, longer, allow_change=True)
  assert "warmup_fraction=0.025" in str(e.value)
  longer.optimizer.warmup_fraction = 0.025         # 12 warmup steps again; the decay starts at 400 > 100
  assert workdir_lib.check_resume(tmp_path, longer, allow_change=True)["changes"]["steps"] == [250, 500]
  started(tmp_path, tiny.get_config(), step=220)   # already decaying: no extension keeps steps 201-219
  with pytest.raises(workdir_lib.ConfigChanged, match=r"step 201:"):  # the first step whose lr has decayed
    workdir_lib.check_resume(tmp_path, longer, allow_change=True)


def test_a_config_saved_before_scanned_layers_loads_as_the_unrolled_model_it_trained():
  saved = workdir_lib.as_json(tiny.get_config())
  del saved["model"]["scan_layers"]
  del saved["model"]["residual"]["readout"], saved["model"]["residual"]["backward"]
  del saved["model"]["residual"]["source_dtype"]
  del saved["model"]["kda"]["conv_backward"], saved["model"]["moe"]["glu_epilogue"]
  saved["model"]["remat"] = True
  c = workdir_lib.config_from_json(saved)
  assert (c.model.scan_layers, c.model.remat, c.model.residual.readout, c.model.residual.backward,
          c.model.residual.source_dtype, c.model.kda.conv_backward,
          c.model.moe.glu_epilogue) == (False, "full", "layer", "fused", "float32", "fused", False)
  c = workdir_lib.config_from_json(workdir_lib.as_json(tiny.get_config()))   # a current one is kept as saved
  assert (c.model.scan_layers, c.model.remat) == (True, "none")


def test_a_config_saved_with_removed_options_resumes_as_what_they_computed(tmp_path):
  """`model.residual.forward` and `residual.backward="kernel"` (the read-out's kernels, removed) named the fused
  passes' arithmetic, `model.scan_alike_layers` (an inner scan, removed) the same layers: a run that saved them
  resumes, the fields gone and the backward "fused"."""
  started(tmp_path, tiny.get_config())
  saved = json.loads((tmp_path / workdir_lib.CONFIG).read_text())
  saved["model"]["residual"]["forward"] = saved["model"]["residual"]["backward"] = "kernel"
  saved["model"]["scan_alike_layers"] = True
  (tmp_path / workdir_lib.CONFIG).write_text(json.dumps(saved))
  assert workdir_lib.check_resume(tmp_path, tiny.get_config()) is None
  model = workdir_lib.config_from_json(saved).model
  assert "forward" not in model.residual and model.residual.backward == "fused"
  assert "scan_alike_layers" not in model


def test_a_run_saved_before_a_field_existed_resumes_at_the_value_that_keeps_what_it_computed(tmp_path):
  started(tmp_path, tiny.get_config())
  saved = json.loads((tmp_path / workdir_lib.CONFIG).read_text())
  del saved["model"]["residual"]["readout"]
  (tmp_path / workdir_lib.CONFIG).write_text(json.dumps(saved))
  assert workdir_lib.check_resume(tmp_path, tiny.get_config()) is None
  c = tiny.get_config()
  c.model.residual.readout = "group"
  with pytest.raises(workdir_lib.ConfigChanged, match=r"model\.residual\.readout: 'layer' -> 'group'"):
    workdir_lib.check_resume(tmp_path, c)


def test_saved_configs_come_back_locked_with_tuples(tmp_path):
  c = workdir_lib.config_from_json(workdir_lib.as_json(tiny.get_config()))
  assert c.model.layer_pattern == ("kda", "kda", "kda", "mla")
  with pytest.raises(AttributeError):
    c.stpes = 1
