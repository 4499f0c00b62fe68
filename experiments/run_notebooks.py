"""Runs the ablation notebooks (notebooks/NN_*.ipynb and their .py sources) top to bottom at one scale, each in its
own Python with a time limit; their JSON and PNGs go to `--out/<scale>/`, each one's output to `--out/<name>.log`;
prints a table of the runs, then the results table of docs/results.md for that scale.

  python -m experiments.run_notebooks --scale=gpu --out=$OUT/notebooks     # all six on one H200
  python -m experiments.run_notebooks --scale=cpu --notebooks=01,05        # the CPU smoke setting, two of them

At the GPU scale every program that the notebooks' training runs compile (each variant's init, train step
per stage, evaluations; of the RL notebook, its SFT stage: its RL programs compile while SFT trains) is first
compiled at once, one process per variant, into a compilation cache under `--workdir` (`runs.precompile_variants`);
the notebooks then find them compiled. Training runs go to `--workdir`
(default `--out/runs`): running the same command again reuses the finished runs and the compiled programs, so a run
cut short continues where it stopped. `--executor=kernel` executes the .ipynb files in a Jupyter kernel (nbclient,
as CI does) and writes them with their outputs to `--out/<scale>/<name>.ipynb`; the default runs the .py sources as
scripts, which needs no Jupyter.
"""
import pathlib
import sys
import time

from absl import app, flags

from experiments import harness
from experiments.configs import ablations
from experiments.ablations import notebook, verdicts

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"

_SCALE = flags.DEFINE_enum("scale", "cpu", list(notebook.SCALES), "the notebooks' SCALE")
_NAMES = flags.DEFINE_list("notebooks", None, "notebooks to run, by file stem or number prefix (default: all)")
_OUT = flags.DEFINE_string("out", "notebooks/results", "results directory (JSON and PNGs under <out>/<scale>/)")
_WORKDIR = flags.DEFINE_string("workdir", None, "training runs and the compilation cache (default <out>/runs)")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1800.0, "time limit per notebook, seconds")
_EXECUTOR = flags.DEFINE_enum("executor", "script", list(notebook.EXECUTORS),
                              "script: the .py sources as scripts; kernel: the .ipynb in a Jupyter kernel")
_PRECOMPILE = flags.DEFINE_bool("precompile", None, "compile every notebook's programs at once first (default: at "
                                "the GPU scale)")


def main(argv):
  harness.check_argv(argv)
  scale = _SCALE.value
  out = pathlib.Path(_OUT.value).resolve()
  out.mkdir(parents=True, exist_ok=True)
  workdir = pathlib.Path(_WORKDIR.value or out / "runs").resolve()
  try:
    paths = notebook.pick(sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py")), _NAMES.value)
  except ValueError as e:
    raise app.UsageError(f"--notebooks: {e}") from None
  summary = {"scale": scale, "executor": _EXECUTOR.value, "precompile": None, "notebooks": []}
  env = {}
  if _PRECOMPILE.value if _PRECOMPILE.value is not None else scale == "gpu":
    env = {"JAX_COMPILATION_CACHE_DIR": str(workdir / "xla_cache"), notebook.PRECOMPILED_ENV: "1"}
    harness.enable_compilation_cache(env["JAX_COMPILATION_CACHE_DIR"])
    summary["precompile"] = notebook.precompile_studies({p.stem: ablations.NOTEBOOKS[p.stem](scale) for p in paths},
                                                        workdir, out / scale)
  start = time.perf_counter()
  for path in paths:
    print(f"== {path.stem} at scale {scale}", flush=True)
    with open(out / f"{path.stem}.log", "w") as log:
      row = notebook.run_notebook(path, scale=scale, out=out, workdir=workdir, timeout_s=_TIMEOUT.value,
                                  executor=_EXECUTOR.value, log=log, env=env)
    status = "timed out" if row["returncode"] is None else f"exit {row['returncode']}"
    print(row["output"][-3000:] if row["returncode"] != 0 else "", f"{path.stem}: {status}, "
          f"{row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU", flush=True)
    summary["notebooks"].append({k: v for k, v in row.items() if k != "output"})
    summary["wall_s"] = time.perf_counter() - start + (summary["precompile"] or {}).get("wall_s", 0.0)
    harness.write_json(str(out / f"run_notebooks_{scale}.json"), summary)
  print(f"\n{'notebook':<14} {'status':>10} {'wall s':>8} {'CPU s':>8}")
  if summary["precompile"]:
    print(f"{'(precompile)':<14} {'':>10} {summary['precompile']['wall_s']:8.0f}")
  for r in summary["notebooks"]:
    status = "timeout" if r["returncode"] is None else f"exit {r['returncode']}"
    print(f"{r['notebook']:<14} {status:>10} {r['wall_s']:8.0f} {r['cpu_s']:8.0f}")
  print(f"{'total':<14} {'':>10} {summary['wall_s']:8.0f}\n")
  print(verdicts.table(out, scale))
  if any(r["returncode"] != 0 for r in summary["notebooks"]):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
