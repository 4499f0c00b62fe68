"""What the experiment scripts share: their argv check and the benchmarks' host timer."""
import json
import os
import pathlib
import statistics
import time

import jax
from absl import app, flags, logging


def check_argv(argv):
  """Rejects stray positional arguments; keeps absl's logging at WARNING unless --verbosity was given."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


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


def write_json(path: str | None, obj) -> None:
  """Writes `obj` as JSON to `path` (creating its folder); nothing when `path` is empty."""
  if path:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def enable_compilation_cache(directory: str) -> None:
  """Keeps compiled programs under `directory` (a GPU train step takes minutes to compile), so a restarted run
  starts at once; `JAX_COMPILATION_CACHE_DIR`, when set, wins; an empty `directory` leaves the cache off."""
  if directory and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", directory)
