"""Parameter counts and a per-device memory plan for a config, without allocating anything (k3jax/train/sizing.py).

    python -m experiments.plan --config=small
    python -m experiments.plan --config=k3_full --mesh=data:64,expert:16 --seq_len=8192

Prints `total_params=<int> active_params=<int>`, a breakdown by layer type, and the per-device memory of parameters,
optimizer state and activations (the assumptions are printed with the numbers): on the config's own mesh and for
each of its stages (their lengths and rows per device), unless `--mesh`, `--seq_len` or `--micro_batch` say
otherwise. `--config` takes a name under experiments/configs/ or a .py path.
"""
from __future__ import annotations

import jax
from absl import app, flags

from experiments import configs, harness
from k3jax.train import sizing


def define_flags():
  """The script's flags, defined only when it runs (so that importing this module defines none)."""
  flags.DEFINE_string("config", "k3_full", f"config name ({', '.join(configs.names())}) or a path to a .py file")
  flags.DEFINE_string("mesh", None, "mesh to plan for, 'data:N,expert:M' (default: the config's)")
  flags.DEFINE_integer("seq_len", None, "tokens per sequence (default: each stage's)")
  flags.DEFINE_integer("micro_batch", None, "sequences per device per micro-batch (default: each stage's batch "
                       "over the devices and micro-batches; 1 with --seq_len)")
  flags.DEFINE_float("device_memory_gib", 140.0, "memory of one device (H200: 143,771 MiB)")


def main(argv):
  harness.check_argv(argv)
  f = flags.FLAGS
  try:
    config = configs.load(f.config)
    text = sizing.report(f.config, config, f.mesh, seq_len=f.seq_len, micro_batch=f.micro_batch,
                         device_gib=f.device_memory_gib)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None
  print(text)


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")   # shapes only: never touch an accelerator
  define_flags()
  app.run(main)
