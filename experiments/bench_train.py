"""Training throughput (tokens/s, MFU) of a config at several sequence lengths, with its own layer pattern and
with every layer MLA (or KDA), all in one process:

  python -m experiments.bench_train --config=experiments/configs/small.py --seq_lens=4096,16384 \
      --tokens_per_step=65536 --patterns=config,mla --out=$OUT/bench_train.json

MFU = tokens/s · flops/token / (peak dense bf16 FLOP/s · devices), flops/token as in k3jax/train/flops.py.
On a CPU use the tiny config and small sizes (MFU is then not reported).
"""
import json
import pathlib

from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from k3jax.train import benchmark

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "16384"], "sequence lengths")
_TOKENS = flags.DEFINE_integer("tokens_per_step", 65536, "tokens per step (batch = tokens / seq_len)")
_PATTERNS = flags.DEFINE_list("patterns", ["config", "mla"], f"layer patterns: {sorted(benchmark.PATTERNS)}")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps")
_WARMUP = flags.DEFINE_integer("warmup", 2, "steps before timing (the first compiles)")
_OUT = flags.DEFINE_string("out", None, "JSON file for the results")
flags.mark_flags_as_required(["config"])


def main(argv):
  harness.check_argv(argv)
  rows = []
  for pattern in _PATTERNS.value:
    for seq_len in map(int, _SEQ_LENS.value):
      config = benchmark.variant(_CONFIG.value, pattern=pattern, seq_len=seq_len, tokens_per_step=_TOKENS.value)
      rows.append({"variant": pattern, **benchmark.time_train_step(config, steps=_STEPS.value, warmup=_WARMUP.value)})
      print(benchmark.format_table(rows[-1:]).splitlines()[-1], flush=True)
  print(benchmark.format_table(rows), flush=True)
  if _OUT.value:
    pathlib.Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(_OUT.value).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
