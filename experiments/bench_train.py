"""Training throughput (tokens/s, MFU) of a config at several sequence lengths, with its own layer pattern and
with every layer MLA (or KDA), in one call: each variant compiles in its own process, all at once, then they run
one at a time (`benchmark.measure_in_turn`):

  python -m experiments.bench_train --config=experiments/configs/small.py --seq_lens=4096,16384 \
      --tokens_per_step=65536 --patterns=config,mla --out=$OUT/bench_train.json

MFU = tokens/s · flops/token / (peak dense bf16 FLOP/s · devices), flops/token as in k3jax/train/flops.py.
On a CPU use the tiny config and small sizes (MFU is then not reported).
"""
import functools

from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from k3jax.train import benchmark

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "16384"], "sequence lengths")
_TOKENS = flags.DEFINE_integer("tokens_per_step", 65536, "tokens per step (batch = tokens / seq_len)")
_PATTERNS = flags.DEFINE_list("patterns", ["config", "mla"], f"layer patterns: {sorted(benchmark.PATTERNS)}")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed steps first")
_OUT = flags.DEFINE_string("out", None, "JSON file for the results (rewritten after each variant)")
flags.mark_flags_as_required(["config"])


def main(argv):
  harness.check_argv(argv)
  names = [(p, int(t)) for p in _PATTERNS.value for t in _SEQ_LENS.value]
  configs = [benchmark.variant(_CONFIG.value, pattern=p, seq_len=t, tokens_per_step=_TOKENS.value) for p, t in names]
  print(f"compiling {len(configs)} variants, one process each", flush=True)
  measure = functools.partial(benchmark.time_train_step, steps=_STEPS.value, warmup=_WARMUP.value)
  rows, failed = [], []
  for (pattern, seq_len), row in zip(names, benchmark.measure_in_turn(configs, measure)):
    if "error" in row:
      failed.append((pattern, seq_len))
      print(f"{pattern} at T={seq_len} failed:\n{row['error']}", flush=True)
      continue
    rows.append({"variant": pattern, **row})
    print(benchmark.format_table(rows[-1:]).splitlines()[-1], flush=True)
    harness.write_json(_OUT.value, rows)
  print(benchmark.format_table(rows), flush=True)
  if failed:
    raise SystemExit(f"failed variants: {failed}")


if __name__ == "__main__":
  app.run(main)
