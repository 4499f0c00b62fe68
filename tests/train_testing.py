"""Shared by the tests that need a trained run: the tiny config cut to its first two layers (2 stages,
expert-parallel mesh), stage 0 trained once per test session (the `trained` fixture in conftest.py), and helpers
to read and compare run directories.

Compiled programs go to a persistent compilation cache for the session, so subprocess runs of the same config
reuse what the in-process run compiled."""
import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
STAGE0_STEPS, STAGE1_STEPS, CHECKPOINT_EVERY = 30, 4, 10
CONFIG = f"""
from experiments.configs import common, tiny


def get_config():
  c = tiny.get_config()
  c.model.num_layers = 2  # layer 0: KDA + dense FFN, layer 1: MLA + LatentMoE; 4x cheaper steps than 4 layers
  common.set_stages(c, [dict(seq_len=64, steps={STAGE0_STEPS}, batch_size=8),
                        dict(seq_len=128, steps={STAGE1_STEPS}, batch_size=4, lr=1e-3)])
  c.mesh = "data:2,expert:2"
  c.log_every, c.checkpoint_every, c.keep_checkpoints = 1, {CHECKPOINT_EVERY}, 10
  c.data.mix.stdlib, c.data.mix.stack = 0.0, 1.0   # stack: a learnable task (the top of the stack is often 2 back)
  c.eval.tasks, c.eval.lengths, c.eval.examples, c.eval.batch_size, c.eval.batches = ("stack",), (64, 128), 32, 8, 0
  return c
"""
TIMING = ("tokens_per_s", "mfu")
CACHE_OPTIONS = {"jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": -1}


@dataclasses.dataclass
class Trained:
  config_path: pathlib.Path
  run: object               # trainer.Run of the config, compiled
  workdir: pathlib.Path     # stage 0 done; tests copy it before changing anything
  result: dict              # stage 0's evaluation
  env: dict                 # environment for subprocesses (the persistent compilation cache)


def load_config(path):
  spec = importlib.util.spec_from_file_location("test_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def records(workdir, name="metrics.jsonl"):
  """The records of a run's JSONL file without the timing fields; strict JSON (a NaN would raise)."""
  def no_constants(token):
    raise ValueError(f"{name} holds the non-JSON number {token}")
  lines = (pathlib.Path(workdir) / name).read_text().splitlines()
  return [{k: v for k, v in json.loads(l, parse_constant=no_constants).items() if k not in TIMING} for l in lines]


def snapshot(directory):
  """{relative path: (size, mtime)} of every file and folder under `directory`: what a read-only user must keep."""
  root = pathlib.Path(directory)
  return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else None, p.stat().st_mtime_ns)
          for p in sorted(root.rglob("*"))}


@contextlib.contextmanager
def persistent_compilation_cache(directory):
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  before = {k: getattr(jax.config, k) for k in CACHE_OPTIONS}
  compilation_cache.reset_cache()
  compilation_cache.set_cache_dir(str(directory))
  for k, v in CACHE_OPTIONS.items():
    jax.config.update(k, v)
  try:
    yield {"JAX_COMPILATION_CACHE_DIR": str(directory), **{k.upper(): str(v) for k, v in CACHE_OPTIONS.items()}}
  finally:
    compilation_cache.set_cache_dir(None)
    for k, v in before.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


@contextlib.contextmanager
def trained_run(root):
  """A `Trained` run under `root` (stage 0 of CONFIG), inside the persistent compilation cache."""
  from k3jax.train import trainer
  path = root / "config.py"
  path.write_text(CONFIG)
  with persistent_compilation_cache(root / "jax_cache") as cache_env:
    run = trainer.Run(load_config(path))
    result = run.train(root / "run", stage=0)[0]
    yield Trained(path, run, root / "run", result, dict(os.environ, **cache_env))
