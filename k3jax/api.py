"""A trained run as a model: `k3jax.load(workdir)` for generation, evaluation or inspection.

    model, config = k3jax.load("runs/tiny")            # the newest usable checkpoint of the last stage
    new = generate(model, prompt_BT, 32)             # from k3jax.generate import generate

The checkpoint is restored through the run's own train-state description (the config saved in the checkpoint,
`trainer.state_spec`), so it loads whatever the model's parameter layout; the run directory is only read, and no
data pipeline is built. Text goes through `k3jax.data.tokenizer` (`encode`, `decode`).
"""
from __future__ import annotations

import os


def load(workdir: str | os.PathLike, step: int | None = None, *, stage: int | None = None,
         mesh: str = "data:1,expert:1"):
  """(model, config) of a training run's checkpoint: the newest usable step of the last stage that has one, or
  step `step` (of the stage that holds it, or of `stage`). The model is a `K3Model` (nnx) with the checkpoint's
  parameters and balancer state on `mesh` (default one device); `config` is the run's config (locked).
  FileNotFoundError if the run has no such checkpoint."""
  from k3jax.train import state as state_lib, trainer
  restored = trainer.restore(workdir, stage=stage, step=step, mesh=mesh)
  return state_lib.merge(restored.spec.graphdef, restored.state), restored.config
