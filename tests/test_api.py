"""`k3jax.load` (k3jax/api.py): a trained run's checkpoint as a model that reproduces the run's evaluation, for the
newest or a chosen step, reading the run directory only and building no data pipeline; `import k3jax` stays
free of JAX."""
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax
from k3jax import parallel
from k3jax.data import pipeline
from k3jax.train import evaluate, step as step_lib
from train_testing import CHECKPOINT_EVERY, REPO, STAGE0_STEPS, snapshot


def no_data(*args, **kwargs):
  raise AssertionError("k3jax.load built a data pipeline")


@pytest.mark.xdist_group("train_loop")
def test_the_loaded_model_reproduces_the_run_evaluation_and_nothing_is_written(trained, monkeypatch):
  monkeypatch.setattr(pipeline, "Mixture", no_data)
  before = snapshot(trained.workdir)
  model, config = k3jax.load(trained.workdir)
  assert config.steps == STAGE0_STEPS + 4 and config.model.num_layers == 2
  assert snapshot(trained.workdir) == before

  @nnx.jit
  def scores(model, batch):   # the loaded model's own forward, not the trainer's state
    logits, _ = model(batch["tokens"], segment_ids_BT=batch["segment_ids"])
    ce_sum, correct = step_lib.token_losses(logits, batch["targets"], batch["weights"])
    return {"ce_sum": ce_sum, "correct": correct, "weight": jnp.sum(batch["weights"])}

  config.eval.lengths = (64,)
  got = evaluate.evaluate(lambda _, batch: scores(model, batch), None, config, 64,
                          parallel.mesh_from_string("data:1,expert:1"))
  accuracy = got["accuracy"]["stack@64"]
  assert accuracy == pytest.approx(trained.result["accuracy"]["stack@64"], abs=1 / 64)  # a tie may flip in argmax
  assert accuracy > 4 * trained.result["chance"]["stack"]


@pytest.mark.xdist_group("train_loop")
def test_a_chosen_step_loads_its_own_parameters_and_a_missing_one_is_an_error(trained):
  newest, _ = k3jax.load(trained.workdir)
  earlier, _ = k3jax.load(trained.workdir, step=STAGE0_STEPS - CHECKPOINT_EVERY)
  a, b = (jnp.asarray(nnx.state(m, nnx.Param)["embed"].get_value()) for m in (newest, earlier))
  assert not np.array_equal(a, b)
  with pytest.raises(FileNotFoundError, match="no checkpoint of step 7"):
    k3jax.load(trained.workdir, step=7)
  with pytest.raises(FileNotFoundError, match="no checkpoint under"):
    k3jax.load(trained.workdir / "absent")


def test_importing_k3jax_does_not_import_jax():
  proc = subprocess.run([sys.executable, "-c", "import sys, k3jax; assert 'jax' not in sys.modules; "
                         "assert callable(k3jax.load) and 'jax' not in sys.modules"], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
