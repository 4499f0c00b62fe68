"""What the ablation notebooks share: the scale choice and where their results and runs go.

A notebook picks its scale in one cell (`SCALE = notebook.scale("cpu")`); the environment variable
K3JAX_NOTEBOOK_SCALE, when set, wins (experiments/run_notebooks.py runs the notebooks that way). Results (JSON and
PNGs) go to `$K3JAX_NOTEBOOK_OUT/<scale>/` (default `results/<scale>/`), training runs to
`$K3JAX_NOTEBOOK_WORKDIR/<notebook>/<scale>/` (default `runs/...`), both relative to the working directory. Each
finished training run is also recorded under `<results>/records/<notebook>/` (`experiments.ablations.records`): a
notebook run again, on any machine with those files, skips the runs recorded there.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal

SCALES = ("cpu", "gpu", "research")
SCALE_ENV, OUT_ENV, WORKDIR_ENV = "K3JAX_NOTEBOOK_SCALE", "K3JAX_NOTEBOOK_OUT", "K3JAX_NOTEBOOK_WORKDIR"
PRECOMPILED_ENV = "K3JAX_NOTEBOOK_PRECOMPILED"


def scale(default: str) -> str:
  """`default`, or $K3JAX_NOTEBOOK_SCALE when set; one of SCALES."""
  value = os.environ.get(SCALE_ENV) or default
  if value not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {value!r} (from ${SCALE_ENV} or the notebook)")
  return value


def precompile(scale: str) -> bool:
  """Whether a notebook compiles its runs' programs side by side before training them (`runs.train_variants`'
  `precompile`): at the GPU scale, where each takes tens of seconds to minutes, unless experiments.run_notebooks
  has already compiled every notebook's programs into the cache ($K3JAX_NOTEBOOK_PRECOMPILED set)."""
  return scale == "gpu" and not os.environ.get(PRECOMPILED_ENV)


def directories(name: str, scale: str) -> tuple[pathlib.Path, pathlib.Path]:
  """(results directory, work directory of the training runs) of notebook `name` at `scale`, created."""
  out = pathlib.Path(os.environ.get(OUT_ENV) or "results") / scale
  work = pathlib.Path(os.environ.get(WORKDIR_ENV) or "runs") / name / scale
  out.mkdir(parents=True, exist_ok=True)
  work.mkdir(parents=True, exist_ok=True)
  return out, work


def records_dir(out, name: str) -> pathlib.Path:
  """Where notebook `name` records its finished runs, under its results directory `out` (`directories`)."""
  return pathlib.Path(out) / "records" / name


def research_hours(study, gpu_records) -> dict[str, float | None]:
  """{variant: estimated hours of one training run of `study` (at the research scale)} on the GPU the GPU scale ran
  on: the training tokens/s of that variant's runs recorded under `gpu_records` (the notebook's records at scale
  "gpu"; the mean over the last half of each run's logged steps, then over its seeds), times the ratio of FLOPs per
  token between the two configs (`k3jax.train.flops.flops_per_token` at each one's final length), over the research
  run's tokens. An estimate: it assumes the same share of the GPU's peak at both sizes. None for a variant with no
  recorded GPU run, or whose records log no training tokens/s (the RL study's)."""
  from experiments.ablations import records, runs
  from k3jax.train import flops, stages as stages_lib, workdir as workdir_lib

  out = {}
  for variant, config in study.configs().items():
    rates = []
    for record in records.of_variant(gpu_records, variant):
      logged = record["result"].get("metrics", {}).get("tokens_per_s")
      if logged and any(x is not None for x in logged):
        gpu = workdir_lib.config_from_json(record["config"])
        final_length = stages_lib.training_plan(gpu).stages[-1].seq_len
        rates.append(runs.tail_mean(logged, 0.5) * flops.flops_per_token(gpu.model, final_length))
    plan = stages_lib.training_plan(config)
    work = sum(s.steps * s.batch_size * s.seq_len * flops.flops_per_token(config.model, s.seq_len)
               for s in plan.stages)
    out[variant] = work / (sum(rates) / len(rates)) / 3600 if rates else None
  return out


def pick(paths, names) -> list[pathlib.Path]:
  """The notebook sources among `paths` named by stem ("01_gate") or number ("01"), in the order named; all of
  `paths` when `names` is empty. ValueError for a name that picks none."""
  paths = [pathlib.Path(p) for p in paths]
  picked = []
  for n in names or ():
    match = [p for p in paths if p.stem == n or p.stem.split("_")[0] == n]
    if len(match) != 1:
      raise ValueError(f"{n!r} names none of {[p.stem for p in paths]}")
    picked += match
  return picked or paths


def precompile_studies(studies, workdir, out) -> dict:
  """Compiles the programs of every training run of `studies` ({notebook: Study}) still to train at once
  (`runs.precompile_variants`: each variant with a seed still to train, once; of an RL study, its SFT stage), the
  runs where the notebooks put them under `workdir` and `out` (the results directory of the scale, whose records
  count as trained; `directories`); needs JAX's persistent compilation cache on. Returns {"wall_s", "variants":
  {notebook/variant: compile seconds or the error}}."""
  import time

  from experiments.ablations import records, runs
  from k3jax.data import corpus

  configs = {}
  for name, study in studies.items():
    for variant, config in study.configs().items():
      directory = lambda s: runs.run_dir(pathlib.Path(workdir) / name / study.scale, variant, s)
      if any(not records.path(records_dir(out, name), variant, s).exists()
             and not runs.finished(_trained_dir(directory(s), config), _trained(runs.with_seed(config, s)))
             for s in study.seeds):
        configs[f"{name}/{variant}"] = _trained(config)
  start = time.perf_counter()
  corpus.stdlib_shards()   # tokenised once here, not by every process at once
  print(f"compiling the programs of {len(configs)} variants at once: {', '.join(configs) or 'none'}", flush=True)
  compiled = runs.precompile_variants(configs) if configs else {}
  for name, result in compiled.items():
    print(f"  {name}: " + (f"{result:.0f} s" if isinstance(result, float) else f"failed ({result})"), flush=True)
  return {"wall_s": time.perf_counter() - start, "variants": compiled}


def _trained(config):
  """The config of the ordinary training run of a study's run: itself, or of an RL config (one with an `rl`
  section) its SFT stage (`k3jax.rl.runner`, which compiles the RL programs while SFT trains)."""
  if "rl" not in config:
    return config
  from k3jax.rl import config as rl_config_lib
  return rl_config_lib.sft_config(config)


def _trained_dir(directory: pathlib.Path, config) -> pathlib.Path:
  """Where that training run lives: the run's directory, or an RL run's `sft/` in it."""
  return directory / "sft" if "rl" in config else directory


class Session:
  """One notebook run: its study at the chosen scale, where its results and runs go, and the results so far.

  Creating it prints the platform and the study's settings and turns on JAX's persistent compilation cache under
  the work directory (later seeds reuse the first one's programs, and `runs.train_variants(..., precompile=True)`
  needs it; JAX_COMPILATION_CACHE_DIR, when set, wins). `save()` writes `results` to `<out>/<name>.json`; the
  notebooks save after every section, so a notebook cut short keeps what it finished.
  """

  def __init__(self, name: str, study):
    import jax

    self.name, self.study = name, study
    self.out, self.workdir = directories(name, study.scale)
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
      jax.config.update("jax_compilation_cache_dir", str(self.workdir / "xla_cache"))
    device = jax.devices()[0]
    # At the research scale, the hours each run should take, from the GPU scale's recorded runs when there are any.
    hours = research_hours(study, records_dir(self.out.parent / "gpu", name)) if study.scale == "research" else None
    self.results = {"scale": study.scale, "platform": jax.default_backend(), "device": device.device_kind,
                    "run": study.summary(), "study": study.describe(hours)}
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({device.device_kind}); results in {self.out}")
    print(self.results["study"])

  @property
  def path(self) -> pathlib.Path:
    return self.out / f"{self.name}.json"

  @property
  def records(self) -> pathlib.Path:
    """Where the notebook's finished runs are recorded (`runs.train_variants(records=...)`)."""
    return records_dir(self.out, self.name)

  def measured(self, name: str, settings: dict, measure):
    """What `measure()` returns, or what it returned in an earlier run of this notebook on a device of this kind
    with these `settings` (`records.measured`, under `records`): timings that took minutes are then read, not
    measured again, and a notebook cut short after them continues with the rest. Says which."""
    from experiments.ablations import records

    result, found = records.measured(self.records, name, settings, measure, device=self.results["device"])
    print(f"{name}: " + (f"read from {records.measurement_path(self.records, name, self.results['device'])}"
                         if found else "measured and recorded"))
    return result

  def save(self) -> pathlib.Path:
    self.path.write_text(json.dumps(self.results, indent=2) + "\n")
    return self.path


EXECUTORS = ("script", "kernel")
# Runs a notebook's percent-format source as one script. Its __name__ is not "__main__", so processes it spawns
# (multiprocessing's "spawn") do not run it again. SIGINT raises KeyboardInterrupt even when this runner was started
# with SIGINT ignored (`nohup ... &` from a shell), which the child would inherit: it is `run_notebook`'s stop.
_SCRIPT = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "runpy.run_path(sys.argv[1], run_name='__notebook__')")
# Executes an .ipynb with `execute_ipynb` of this k3jax (its parent directory first on the path).
_KERNEL = ("import sys; sys.path.insert(0, sys.argv[1]); from experiments.ablations import notebook; "
           "notebook.execute_ipynb(*sys.argv[2:4], float(sys.argv[4]))")


def execute_ipynb(source, executed, timeout_s: float) -> None:
  """Executes notebook `source` (.ipynb) cell by cell in a Jupyter kernel (nbclient, as Jupyter or Colab would,
  inline plots included), the working directory the current one, each cell within `timeout_s`; prints each cell's
  text output as it finishes and writes the notebook with its outputs to `executed` (also when a cell fails, which
  raises nbclient's CellExecutionError)."""
  import nbclient
  import nbformat

  nb = nbformat.read(source, as_version=4)

  def echo(cell, **_):
    for output in cell.get("outputs", ()):
      if output.get("output_type") == "stream":
        print(output["text"], end="", flush=True)

  client = nbclient.NotebookClient(nb, timeout=int(timeout_s), kernel_name="python3",
                                   resources={"metadata": {"path": os.getcwd()}}, on_cell_executed=echo)

  def forward(signum, frame):
    # The kernel runs in a session of its own (jupyter_client starts it so): a stop asked of this process (by
    # `run_notebook`'s time limit) is passed on, so that a training run in the kernel checkpoints and stops.
    kernel = getattr(client.km, "provisioner", None)
    if getattr(kernel, "pgid", None) is None:
      raise KeyboardInterrupt
    os.killpg(kernel.pgid, signum)   # the kernel and what it started

  previous = signal.signal(signal.SIGINT, forward)
  try:
    client.execute()
  finally:
    signal.signal(signal.SIGINT, previous)
    nbformat.write(nb, executed)


def run_notebook(path, *, scale: str, out, workdir, timeout_s: float, executor: str = "script", log=None,
                 env: dict | None = None, grace_s: float = 60.0) -> dict:
  """Executes a notebook in a fresh Python at `scale`, its results under `out`, its runs under `workdir`, the
  working directory the repository root (the notebook's parent's parent); after `timeout_s` asks it (and what it
  started) to stop with SIGINT, on which a training run saves a checkpoint of the step it reached and stops (a
  rerun continues from there), and kills them `grace_s` later if they are still running. `executor`: "script"
  runs the percent-format source `path` (a `# %%` .py file) as one script (no Jupyter needed; plots are only
  saved); "kernel" executes the .ipynb beside it in a Jupyter kernel (`execute_ipynb`; needs nbclient and
  ipykernel, the `test` extras) and writes it with its outputs to `out/<scale>/<name>.ipynb`, beside the JSON and
  PNGs of that scale. Returns {"notebook", "executor", "returncode" (None: timed out), "wall_s", "cpu_s" (user +
  system of it and its children), "output" (its stdout and stderr)}; `log` (a text file) receives the output line
  by line as it comes, so a run stopped from outside still shows how far it got."""
  import resource
  import subprocess
  import sys
  import threading
  import time

  if executor not in EXECUTORS:
    raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
  path = pathlib.Path(path).resolve()
  out = pathlib.Path(out).resolve()
  child_env = {**os.environ, **(env or {}), SCALE_ENV: scale, OUT_ENV: str(out),
               WORKDIR_ENV: str(pathlib.Path(workdir).resolve()), "PYTHONUNBUFFERED": "1"}
  if executor == "script":
    child_env["MPLBACKEND"] = "Agg"
    command = [sys.executable, "-c", _SCRIPT, str(path)]
  else:
    child_env.pop("MPLBACKEND", None)   # the kernel's inline backend puts the plots into the executed notebook
    (out / scale).mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", _KERNEL, str(pathlib.Path(__file__).resolve().parents[2]),
               str(path.with_suffix(".ipynb")), str(out / scale / f"{path.stem}.ipynb"), str(timeout_s)]
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  proc = subprocess.Popen(command, cwd=path.parent.parent, env=child_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines = []

  def pump():
    for line in proc.stdout:
      lines.append(line)
      if log is not None:
        log.write(line)
        log.flush()

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  try:
    returncode = proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGINT)
    try:
      proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    returncode = None
  reader.join()
  output = "".join(lines)
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return {"notebook": path.stem, "executor": executor, "returncode": returncode, "wall_s": wall, "cpu_s": cpu,
          "output": output}
