"""Agentic RL on a K3 model: `python -m experiments.rl --config=experiments/configs/rl_tiny.py --workdir=DIR`.

Trains the SFT stage on the environments' demonstrations (`DIR/sft`, the ordinary trainer), then runs GRPO from
its final checkpoint (`DIR/rl`: metrics.jsonl, eval.jsonl, checkpoints, TensorBoard) and prints the held-out
success before and after RL. Running the same command again resumes where it stopped. Config overrides as for
training: `--config.rl.iterations=50 --config.rl.kl_coef=0.02`.
"""
from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from k3jax.data import corpus
from k3jax.rl import runner

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (with a `rl` section)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: sft/ and rl/")
_CACHE = flags.DEFINE_string("compilation_cache", str(corpus.default_cache_dir() / "xla"),
                             "directory of JAX's persistent compilation cache ('': none)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  harness.check_argv(argv)
  harness.enable_compilation_cache(_CACHE.value)
  runner.RLRun(_CONFIG.value).run(_WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
