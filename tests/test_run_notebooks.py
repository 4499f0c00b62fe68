"""experiments/run_notebooks.py: notebooks picked by number or stem; the GPU scale's compile-first phase asks for
every unfinished run of the chosen notebooks (each variant once, with the seeds still to train)."""

import pytest
from absl import app

from experiments import run_notebooks
from experiments.configs import ablations
from k3jax.ablations import runs


def test_notebooks_are_chosen_by_number_or_stem_in_the_order_given():
  assert [p.stem for p in run_notebooks.chosen(None)] == list(ablations.NOTEBOOKS)
  assert [p.stem for p in run_notebooks.chosen(["05", "01_gate"])] == ["05_hybrid", "01_gate"]
  for bad in (["06"], ["gate"]):
    with pytest.raises(app.UsageError, match="names none"):
      run_notebooks.chosen(bad)


def test_precompile_asks_for_each_unfinished_variant_with_its_remaining_seeds(monkeypatch, tmp_path):
  asked = {}
  monkeypatch.setattr(runs, "precompile_variants", lambda configs, seeds: asked.update(configs=configs, seeds=seeds)
                      or {n: 1.0 for n in configs})
  done = {("bounded", 1), ("softplus", 0), ("softplus", 1)}   # finished runs: nothing to compile for softplus
  monkeypatch.setattr(runs, "finished", lambda directory, config: (directory.parent.name,
                                                                   int(directory.name.split("_")[1])) in done)
  paths = run_notebooks.chosen(["01"])
  out = run_notebooks.precompile(paths, "gpu", tmp_path)
  assert list(asked["configs"]) == ["01_gate/bounded"] and asked["seeds"] == {"01_gate/bounded": [0]}
  assert asked["configs"]["01_gate/bounded"].model.kda.gate == "bounded"
  assert out["variants"] == {"01_gate/bounded": 1.0} and out["wall_s"] >= 0
