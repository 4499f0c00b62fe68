"""Runs ablation notebooks (notebooks/*.py, the sources of the .ipynb files) top to bottom at one scale, each in its
own Python with a time limit, and prints a table; the notebooks' JSON and PNGs go to `--out/<scale>/`, each
notebook's output to `--out/<name>.log`.

  python -m experiments.run_notebooks --scale=gpu --notebooks=01_gate,05_hybrid --out=$OUT/notebooks
  python -m experiments.run_notebooks --scale=cpu          # every notebook, the CPU smoke setting

Training runs go to `--workdir` (default `--out/runs`); running the same command again reuses finished runs.
"""
import pathlib
import sys

from absl import app, flags

from experiments import harness
from k3jax.ablations import notebook

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"

_SCALE = flags.DEFINE_enum("scale", "cpu", list(notebook.SCALES), "the notebooks' SCALE")
_NAMES = flags.DEFINE_list("notebooks", None, "notebooks to run, by file stem or number prefix (default: all)")
_OUT = flags.DEFINE_string("out", "notebooks/results", "results directory (JSON and PNGs under <out>/<scale>/)")
_WORKDIR = flags.DEFINE_string("workdir", None, "training runs (default <out>/runs)")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1800.0, "time limit per notebook, seconds")


def chosen(names) -> list[pathlib.Path]:
  """The notebook sources named by stem ("01_gate") or number ("01"), in order; all when `names` is empty."""
  paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
  if not names:
    return paths
  picked = []
  for n in names:
    match = [p for p in paths if p.stem == n or p.stem.split("_")[0] == n]
    if len(match) != 1:
      raise app.UsageError(f"--notebooks: {n!r} names none of {[p.stem for p in paths]}")
    picked += match
  return picked


def main(argv):
  harness.check_argv(argv)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  workdir = pathlib.Path(_WORKDIR.value or out / "runs")
  rows = []
  for path in chosen(_NAMES.value):
    print(f"== {path.stem} at scale {_SCALE.value}", flush=True)
    with open(out / f"{path.stem}.log", "w") as log:
      row = notebook.run_notebook(path, scale=_SCALE.value, out=out, workdir=workdir, timeout_s=_TIMEOUT.value,
                                  log=log)
    status = "timed out" if row["returncode"] is None else f"exit {row['returncode']}"
    print(row["output"][-3000:] if row["returncode"] != 0 else "", f"{path.stem}: {status}, "
          f"{row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU", flush=True)
    rows.append({k: v for k, v in row.items() if k != "output"})
    harness.write_json(str(out / f"run_notebooks_{_SCALE.value}.json"), rows)
  print(f"{'notebook':<14} {'status':>10} {'wall s':>8} {'CPU s':>8}")
  for r in rows:
    status = "timeout" if r["returncode"] is None else f"exit {r['returncode']}"
    print(f"{r['notebook']:<14} {status:>10} {r['wall_s']:8.0f} {r['cpu_s']:8.0f}")
  if any(r["returncode"] != 0 for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
