"""The ablation notebooks: each .ipynb runs top to bottom in a Jupyter kernel (nbclient, as Colab or Jupyter runs
it) at its CPU setting within a time bound and writes the results it promises; the committed .ipynb files hold
exactly the cells of their .py sources, without outputs, and the sync script finds and fixes any that do not."""
import importlib.util
import json
import math
import pathlib
import shutil

import nbformat
import pytest

from experiments.ablations import notebook
from experiments.configs import ablations

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
# Each notebook's CPU setting takes about a minute alone on a 2-core machine; the bound leaves room for a CI machine
# running other tests beside it, and still fails a notebook that hangs.
TIME_LIMIT_S = 600


def _sync():
  spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "scripts" / "sync_notebooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_there_are_the_six_notebooks():
  assert [p.stem for p in SOURCES] == ["01_gate", "02_balance", "03_residual", "04_context", "05_hybrid", "06_rl"]


def test_committed_ipynb_hold_the_cells_of_their_sources_without_outputs():
  sync = _sync()
  assert sync.stale(sync.sources()) == []


def test_sync_reads_percent_cells_and_refuses_what_it_cannot_convert(tmp_path):
  sync = _sync()
  source = "# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\ny = 2\n\n# %%\nprint(x)\n"
  cells = sync.cells_of(source)
  assert cells == [("markdown", "# Title\n\ntext"), ("code", "x = 1\n\ny = 2"), ("code", "print(x)")]
  nb = sync.notebook_of(cells)
  assert nb["nbformat"] == 4 and [c["cell_type"] for c in nb["cells"]] == ["markdown", "code", "code"]
  assert all(c["outputs"] == [] and c["execution_count"] is None for c in nb["cells"][1:])
  py = tmp_path / "x.py"
  py.write_text(source)
  py.with_suffix(".ipynb").write_text(sync.render(py))
  assert sync.stale([py]) == []
  py.write_text(source.replace("y = 2", "y = 3"))
  assert sync.stale([py]) == ["x.ipynb: its cells differ from x.py"]
  for bad, match in (("x = 1\n# %%\n", "before the first"), ("# %% [raw]\n", "unknown cell marker"),
                     ("# %% [markdown]\ntext\n", "must be comments")):
    with pytest.raises(ValueError, match=match):
      sync.cells_of(bad)


def test_check_fails_on_a_notebook_that_diverged_from_its_source_and_sync_repairs_it(tmp_path, capsys):
  sync = _sync()
  for py in SOURCES[:2]:
    shutil.copy(py, tmp_path / py.name)
    shutil.copy(py.with_suffix(".ipynb"), tmp_path / py.with_suffix(".ipynb").name)
  assert sync.main(["--check", f"--dir={tmp_path}"]) == 0
  edited = tmp_path / SOURCES[0].name
  edited.write_text(edited.read_text().replace("SCALE = notebook.scale(", "SCALE  = notebook.scale("))
  saved = json.loads((tmp_path / SOURCES[1].with_suffix(".ipynb").name).read_text())
  saved["cells"][-1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["x\n"]}]
  (tmp_path / SOURCES[1].with_suffix(".ipynb").name).write_text(json.dumps(saved))
  capsys.readouterr()
  assert sync.main(["--check", f"--dir={tmp_path}"]) == 1
  report = capsys.readouterr().out
  assert f"{SOURCES[0].stem}.ipynb: its cells differ from {SOURCES[0].name}" in report
  assert f"{SOURCES[1].stem}.ipynb: has outputs (strip them)" in report
  (tmp_path / SOURCES[1].with_suffix(".ipynb").name).unlink()   # a missing one is written
  assert sync.main([f"--dir={tmp_path}"]) == 0
  assert sync.main(["--check", f"--dir={tmp_path}"]) == 0
  cells = sync.cells_in_ipynb(tmp_path / SOURCES[0].with_suffix(".ipynb").name)
  assert any("SCALE  = notebook.scale(" in text for _, text in cells)


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_committed_ipynb_is_a_valid_notebook_that_runs_in_the_python3_kernel(path):
  nb = nbformat.read(path.with_suffix(".ipynb"), as_version=4)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_notebook_installs_k3jax_when_missing_and_picks_its_scale_in_one_cell(path):
  cells = _sync().cells_of(path.read_text())
  code = [text for kind, text in cells if kind == "code"]
  assert cells[0][0] == "markdown" and "smoke run" in cells[0][1] and "not evidence" in cells[0][1]
  assert "K3JAX_REPO = " in code[0] and 'importlib.util.find_spec("k3jax") is None' in code[0]
  assert sum('SCALE = notebook.scale("cpu")' in text for text in code) == 1


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def _check_gate(out):
  r = json.loads((out / "01_gate.json").read_text())
  assert {(s["gate"], s["backend"]) for s in r["speed"]} == {("bounded", "xla"), ("softplus", "xla")}
  assert all(_finite(s["ms"]) and s["ms"] > 0 for s in r["speed"])
  assert set(r["training"]) == {"bounded", "softplus"}
  assert all(_finite(t["heldout_loss"]["mean"]) for t in r["training"].values())
  bounded, softplus, forced = r["finiteness"]
  for row in (bounded, softplus):   # saturated gates, each on its own path: finite and equal to the recurrence
    assert row["finite_o"] and row["finite_state"] and all(row["finite_grads"].values())
    assert row["rel_err_o"] < 1e-4
  assert bounded["g_min"] >= -5.0 and softplus["g_max"] < -5.0
  assert not forced["finite_o"]     # the softplus gate through the factorised tiles overflows
  return ["01_gate_speed.png", "01_gate_loss.png"]


def _check_balance(out):
  r = json.loads((out / "02_balance.json").read_text())
  assert list(r["methods"]) == ["none", "aux_loss", "sign", "article", "cutoff", "cutoff_histogram"]
  first = {name: (m["runs"][0]["loss"][0], m["runs"][0]["max_vio"][0]) for name, m in r["methods"].items()}
  assert len(set(first.values())) == 1   # step 1 runs before any balancer update: the same for every method
  for m in r["methods"].values():
    assert all(0.0 <= v <= r["max_vio_bound"] for v in m["runs"][0]["max_vio"])
    assert _finite(m["summary"]["heldout_loss"]["mean"])
  return ["02_balance.png"]


def _check_residual(out):
  r = json.loads((out / "03_residual.json").read_text())
  assert set(r["training"]) == {"block", "full", "prenorm"}
  for mode, readouts in r["depth_weights"].items():
    assert readouts[-1]["name"] == "final" and len(readouts) == 2 * 2 + 1
    for x in readouts:
      assert abs(sum(x["weights"]) - 1.0) < 1e-5
    assert any(x["query_norm"] > 0 for x in readouts)   # trained away from the zero init
  assert len(r["depth_weights"]["full"][-1]["weights"]) == 2 * 2 + 1   # the embedding and every sub-layer output
  return ["03_residual_loss.png", "03_residual_depth_weights.png"]


def _check_context(out):
  r = json.loads((out / "04_context.json").read_text())
  staged, direct = r["summary"]["staged"], r["summary"]["direct"]
  assert [e["seq_len"] for e in staged["stage_evals"][0]] == [128, 256]
  assert [e["seq_len"] for e in direct["stage_evals"][0]] == [256]
  assert staged["step"][-1] == direct["step"][-1]
  keys = {f"{t}@{n}" for t in ("mqar", "passkey") for n in (256, 512)}
  for s in (staged, direct):
    assert set(s["accuracy"]) == keys and all(0.0 <= a["mean"] <= 1.0 for a in s["accuracy"].values())
  return ["04_context.png"]


def _check_hybrid(out):
  r = json.loads((out / "05_hybrid.json").read_text())
  assert list(r["recall"]) == ["3to1", "all_kda", "all_mla"]   # the CPU setting leaves 7:1 out
  for rows in r["forward_tokens_per_s"].values():
    assert [x["seq_len"] for x in rows] == [256] and all(x["tokens_per_s"] > 0 for x in rows)
  assert all(0.0 <= a["mean"] <= 1.0 for x in r["recall"].values() for a in x["accuracy"].values())
  return ["05_hybrid.png"]


def _check_rl(out):
  r = json.loads((out / "06_rl.json").read_text())
  assert r["points"] == ["lookup@320", "calc@320"] and r["train_length"] == 320
  (run,) = r["runs"]
  assert set(run["before"]) == set(run["after"]) == set(r["points"])   # the SFT policy and the RL one, same points
  assert run["sft"]["step"][-1] == 12 and all(_finite(x) for x in run["sft"]["loss"])
  assert run["sft"]["loss"][-1] < run["sft"]["loss"][0]
  assert run["rl"]["step"] == [1, 2, 3, 4]
  assert all(_finite(x) for k in ("reward_mean", "success_rate", "kl", "loss") for x in run["rl"][k])
  assert all(0.0 <= s[w]["mean"] <= 1.0 for s in r["success"].values() for w in ("before", "after"))
  return ["06_rl.png"]


# The timings each notebook records (`Session.measured`), read back by a rerun.
MEASURED = {"01_gate": ("speed",), "05_hybrid": ("forward_tokens_per_s",)}
CHECKS = {"01_gate": _check_gate, "02_balance": _check_balance, "03_residual": _check_residual,
          "04_context": _check_context, "05_hybrid": _check_hybrid, "06_rl": _check_rl}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xdist_group(f"notebook_{p.stem}"))
                                  for p in SOURCES], ids=[p.stem for p in SOURCES])
def test_notebook_runs_top_to_bottom_at_its_cpu_setting(path, tmp_path):
  # One simulated device, as on a user's CPU (conftest asks for 8 for the sharding tests); LLVM at -O0 as conftest
  # sets it for the suite (the notebooks' time is mostly compiling).
  flags = "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"
  row = notebook.run_notebook(path, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "runs",
                              timeout_s=TIME_LIMIT_S, executor="kernel", env={"XLA_FLAGS": flags})
  assert row["returncode"] is not None, f"{path.stem} ran past {TIME_LIMIT_S} s:\n{row['output'][-4000:]}"
  assert row["returncode"] == 0, f"{path.stem} failed:\n{row['output'][-8000:]}"
  out = tmp_path / "out" / "cpu"
  for png in CHECKS[path.stem](out):
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
  executed = json.loads((out / f"{path.stem}.ipynb").read_text())
  images = sum("image/png" in o.get("data", {}) for c in executed["cells"] for o in c.get("outputs", ()))
  assert images == len(CHECKS[path.stem](out)), "every plot is shown inline"
  study = ablations.NOTEBOOKS[path.stem]("cpu")
  recorded = sorted(p.relative_to(out / "records" / path.stem).as_posix()
                    for p in (out / "records" / path.stem).glob("*/*.json"))
  assert recorded == sorted([f"{v}/seed_{s}.json" for v in study.variants for s in study.seeds]
                            + [f"measured/{m}@cpu.json" for m in MEASURED.get(path.stem, ())]), recorded
  print(f"{path.stem}: {row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU")


def test_a_notebook_run_again_on_a_machine_without_its_runs_reads_its_records_and_gives_the_same_results(tmp_path):
  """03_residual, whose depth weights come from the trained models: run once, then again with an empty work
  directory (a fresh machine) and the first run's records: nothing trains, and the results are the same."""
  path = ROOT / "notebooks" / "03_residual.py"
  flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
  first = notebook.run_notebook(path, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "runs_a",
                                timeout_s=TIME_LIMIT_S, env=flags)
  assert first["returncode"] == 0, first["output"][-8000:]
  before = json.loads((tmp_path / "out" / "cpu" / "03_residual.json").read_text())
  again = notebook.run_notebook(path, scale="cpu", out=tmp_path / "out", workdir=tmp_path / "runs_b",
                                timeout_s=TIME_LIMIT_S, env=flags)
  assert again["returncode"] == 0, again["output"][-8000:]
  study = ablations.residual("cpu")
  assert again["output"].count("recorded in") == len(study.variants) * len(study.seeds)
  assert not list((tmp_path / "runs_b").glob("03_residual/cpu/*/seed_*")), "a recorded run trained again"
  after = json.loads((tmp_path / "out" / "cpu" / "03_residual.json").read_text())
  assert after["training"] == before["training"] and after["depth_weights"] == before["depth_weights"]
