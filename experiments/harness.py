"""What the experiment scripts share: their argv check, the training scripts' exit statuses and the benchmarks'
timers."""
import collections
import glob
import json
import os
import pathlib
import statistics
import tempfile
import time

import jax
from absl import app, flags, logging


def check_argv(argv):
  """Rejects stray positional arguments; keeps absl's logging at WARNING unless --verbosity was given."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def define_run_flags():
  """(--allow_config_change, --allow_missing_metrics, --compilation_cache): the flags of every script that trains
  into a run directory, defined once per script (at import)."""
  from k3jax.data import corpus
  return (flags.DEFINE_bool("allow_config_change", False, "resume a run directory with a config that differs from "
                            "its config.json (the change is recorded in config_changes.jsonl)"),
          flags.DEFINE_bool("allow_missing_metrics", False, "resume although metrics.jsonl is missing (the new file "
                            "then starts at the resumed step)"),
          flags.DEFINE_string("compilation_cache", str(corpus.default_cache_dir() / "xla"),
                              "directory of JAX's persistent compilation cache ('': none)"))


def run_guarded(fn) -> int | None:
  """`fn()` as the training scripts run it: a run stopped by a signal prints why and returns its exit status
  (128 + the signal); a refused, diverged or unusable run exits with a one-line error."""
  from k3jax.train import interrupt, metrics, trainer, workdir
  try:
    fn()
  except interrupt.Interrupted as e:
    print(e, flush=True)
    return e.exit_code
  except (workdir.ConfigChanged, trainer.Diverged, trainer.UnusableCheckpoints, metrics.MissingMetrics) as e:
    raise SystemExit(f"error: {e}") from None
  return None


def median_seconds(fn, *args, repeats: int, warmup: int = 2) -> float:
  """Median wall time of `fn(*args)` by a host timer around `block_until_ready`, after `warmup` calls (the first
  compiles)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def pipelined_seconds(fn, *args, repeats: int, calls: int = 10, warmup: int = 2) -> float:
  """Median over `repeats` of the wall time of `calls` back-to-back calls of `fn(*args)`, divided by `calls`: the
  host enqueues ahead of the device, so this is device time per call, as CUDA events time PyTorch's anchors
  (`triton.testing.do_bench`), without `median_seconds`' per-call launch and synchronisation."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)  # one stream: the last call finishes after all the others
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def kernel_times_from_profile(profile, calls: int):
  """Device kernels in a `jax.profiler.ProfileData` of `calls` calls: [(name, launches per call, ms per call)],
  slowest first. Counts the GPU planes' stream lines only (the derived "XLA Ops" line repeats the same time)."""
  launches, ns = collections.Counter(), collections.Counter()
  for plane in profile.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if line.name.startswith("Stream #"):
        for event in line.events:
          launches[event.name] += 1
          ns[event.name] += event.duration_ns
  return sorted(((n, launches[n] / calls, ns[n] / calls / 1e6) for n in ns), key=lambda r: -r[2])


def device_kernel_times(fn, *args, calls: int = 5):
  """Per-kernel device time of `fn(*args)` by the JAX profiler (GPU; [] on a CPU): where a program's time goes,
  as `torch.profiler` shows it for the PyTorch anchors. Call `fn` once before, so compiling is not traced."""
  from jax.profiler import ProfileData
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    path, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    return kernel_times_from_profile(ProfileData.from_file(path), calls)


def write_json(path: str | None, obj) -> None:
  """Writes `obj` as JSON to `path` (creating its folder); nothing when `path` is empty."""
  if path:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def enable_compilation_cache(directory: str) -> None:
  """Keeps compiled programs under `directory` (a GPU train step takes minutes to compile), so a restarted run
  starts at once; `JAX_COMPILATION_CACHE_DIR`, when set, wins; an empty `directory` leaves the cache off. Set in
  the environment too, so processes started from this one (benchmark variants) share the cache."""
  if directory and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", directory)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
