"""Trains a K3 model: `python -m experiments.train --config=experiments/configs/tiny.py --workdir=DIR`.

Config overrides: `--config.steps=200 --config.optimizer.lr=1e-3`. `--stage=N` runs one stage of a staged config
(from the previous stage's final checkpoint). Running the same command again resumes from the last checkpoint;
the run directory must then get the same config (`--allow_config_change` continues with another one and records
the change). Ctrl-C or SIGTERM stops after the current step with a checkpoint of it (exit status 130 / 143).
Multi-process (one process per host or per GPU): add `--distributed`, with the coordinator given by flags or
found by `jax.distributed.initialize()` (SLURM, Open MPI, or JAX_COORDINATOR_ADDRESS).
"""
from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from k3jax.train import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics.jsonl, TensorBoard events")
_STAGE = flags.DEFINE_integer("stage", None, "run only this stage (needs the previous stage's final checkpoint)")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() first (multi-process)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (with --distributed)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "number of processes (with --distributed)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index (with --distributed)")
_ALLOW_CHANGE, _ALLOW_MISSING_METRICS, _CACHE = harness.define_run_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  harness.check_argv(argv)
  harness.enable_compilation_cache(_CACHE.value)
  if _DISTRIBUTED.value:
    trainer.init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  return harness.run_guarded(lambda: trainer.train(
      _CONFIG.value, _WORKDIR.value, stage=_STAGE.value, allow_config_change=_ALLOW_CHANGE.value,
      allow_missing_metrics=_ALLOW_MISSING_METRICS.value))


if __name__ == "__main__":
  app.run(main)
