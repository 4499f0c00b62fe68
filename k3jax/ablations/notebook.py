"""What the ablation notebooks share: the scale choice and where their results and runs go.

A notebook picks its scale in one cell (`SCALE = notebook.scale("cpu")`); the environment variable
K3JAX_NOTEBOOK_SCALE, when set, wins (experiments/run_notebooks.py runs the notebooks that way). Results (JSON and
PNGs) go to `$K3JAX_NOTEBOOK_OUT/<scale>/` (default `results/<scale>/`), training runs to
`$K3JAX_NOTEBOOK_WORKDIR/<notebook>/<scale>/` (default `runs/...`), both relative to the working directory.
"""
from __future__ import annotations

import json
import os
import pathlib

SCALES = ("cpu", "gpu")
SCALE_ENV, OUT_ENV, WORKDIR_ENV = "K3JAX_NOTEBOOK_SCALE", "K3JAX_NOTEBOOK_OUT", "K3JAX_NOTEBOOK_WORKDIR"


def scale(default: str) -> str:
  """`default`, or $K3JAX_NOTEBOOK_SCALE when set; one of SCALES."""
  value = os.environ.get(SCALE_ENV) or default
  if value not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {value!r} (from ${SCALE_ENV} or the notebook)")
  return value


def directories(name: str, scale: str) -> tuple[pathlib.Path, pathlib.Path]:
  """(results directory, work directory of the training runs) of notebook `name` at `scale`, created."""
  out = pathlib.Path(os.environ.get(OUT_ENV) or "results") / scale
  work = pathlib.Path(os.environ.get(WORKDIR_ENV) or "runs") / name / scale
  out.mkdir(parents=True, exist_ok=True)
  work.mkdir(parents=True, exist_ok=True)
  return out, work


class Session:
  """One notebook run: its study at the chosen scale, where its results and runs go, and the results so far.

  Creating it prints the platform and the study's settings and turns on JAX's persistent compilation cache under
  the work directory (later seeds reuse the first one's programs, and `runs.train_variants(..., precompile=True)`
  needs it; JAX_COMPILATION_CACHE_DIR, when set, wins). `save()` writes `results` to `<out>/<name>.json`; the notebooks save
  after every section, so a notebook cut short keeps what it finished.
  """

  def __init__(self, name: str, study):
    import jax

    self.name, self.study = name, study
    self.out, self.workdir = directories(name, study.scale)
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
      jax.config.update("jax_compilation_cache_dir", str(self.workdir / "xla_cache"))
    device = jax.devices()[0]
    self.results = {"scale": study.scale, "platform": jax.default_backend(), "device": device.device_kind,
                    "run": study.summary(), "study": study.describe()}
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({device.device_kind}); results in {self.out}")
    print(study.describe())

  @property
  def path(self) -> pathlib.Path:
    return self.out / f"{self.name}.json"

  def save(self) -> pathlib.Path:
    self.path.write_text(json.dumps(self.results, indent=2) + "\n")
    return self.path


# Runs a notebook's percent-format source as one script. Its __name__ is not "__main__", so processes it spawns
# (multiprocessing's "spawn") do not run it again.
_RUNNER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__notebook__')"


def run_notebook(path, *, scale: str, out, workdir, timeout_s: float, log=None, env: dict | None = None) -> dict:
  """Executes notebook source `path` (a `# %%` .py file) in a fresh Python at `scale`, its results under `out`,
  its runs under `workdir`, the working directory the repository root (the notebook's parent's parent); kills it
  (and what it started) after `timeout_s`. Returns {"notebook", "returncode" (None: timed out), "wall_s",
  "cpu_s" (user + system of it and its children), "output" (its stdout and stderr)}; `log` receives the output
  too (a text file)."""
  import resource
  import signal
  import subprocess
  import sys
  import time

  path = pathlib.Path(path).resolve()
  child_env = {**os.environ, **(env or {}), SCALE_ENV: scale, OUT_ENV: str(pathlib.Path(out).resolve()),
               WORKDIR_ENV: str(pathlib.Path(workdir).resolve()), "MPLBACKEND": "Agg"}
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(path)], cwd=path.parent.parent, env=child_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    output, _ = proc.communicate(timeout=timeout_s)
    returncode = proc.returncode
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    output, _ = proc.communicate()
    returncode = None
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if log is not None:
    log.write(output)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return {"notebook": path.stem, "returncode": returncode, "wall_s": wall, "cpu_s": cpu, "output": output}
