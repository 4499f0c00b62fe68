"""Agentic RL on a K3 model: `python -m experiments.rl --config=experiments/configs/rl_tiny.py --workdir=DIR`.

Trains the SFT stage on the environments' demonstrations (`DIR/sft`, the ordinary trainer), then runs GRPO from
its final checkpoint (`DIR/rl`: metrics.jsonl, eval.jsonl, checkpoints, TensorBoard) and prints the held-out
success before and after RL. Running the same command again resumes where it stopped; the directories must then
get the same config (`--allow_config_change` continues with another one and records the change). Ctrl-C or SIGTERM
stops after the current step or iteration with a checkpoint of it (exit status 130 / 143). Config overrides as
for training: `--config.rl.iterations=50 --config.rl.kl_coef=0.02`.
"""
from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from k3jax.rl import runner

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (with a `rl` section)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: sft/ and rl/")
_UNTIL = flags.DEFINE_integer("until", None, "stop after this many RL iterations (default: all; 0: only the SFT "
                              "stage); the same command without it continues")
_ALLOW_CHANGE, _ALLOW_MISSING_METRICS, _CACHE = harness.define_run_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  harness.check_argv(argv)
  harness.enable_compilation_cache(_CACHE.value)
  return harness.run_guarded(lambda: runner.RLRun(_CONFIG.value).run(
      _WORKDIR.value, until=_UNTIL.value, allow_config_change=_ALLOW_CHANGE.value,
      allow_missing_metrics=_ALLOW_MISSING_METRICS.value))


if __name__ == "__main__":
  app.run(main)
