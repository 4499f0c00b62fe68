"""Long-context generation (issue 28): chunked prefill and batched decode of a config with its own layer pattern and
with every layer MLA, at several contexts and batch sizes, in one run.

  python -m experiments.bench_generate --config=experiments/configs/small.py     # H200: 8K … 1M, B = 1 and 32
  python -m experiments.bench_generate --small                                   # CPU: tiny config, checks it runs
  python -m experiments.bench_generate --prefill=false --check=false --contexts=262144   # decode alone

Weights are random, matrices in bf16; per context the prefill's speed (estimated from its first and last chunk, and
run for real at B = 1 where the estimate fits --prefill_budget_s), the decode loop's, the cache's bytes and the
estimated peak memory, and at the first context the chunked prefill checked against the full forward. What it
measures and how: `experiments/benchmarks/generate.py`. Rows to $OUT/bench_generate.json; the table last.
"""
import os

from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from experiments.benchmarks import generate as generate_benchmark

FLAGS = flags.FLAGS
_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/small.py", "experiment config file",
                                          lock_config=False)
flags.DEFINE_list("patterns", ["config", "mla"], "layer patterns: config (the config's own), mla (every layer MLA)")
flags.DEFINE_list("contexts", ["8192", "65536", "262144", "1048576"], "prompt lengths")
flags.DEFINE_list("batches", ["1", "32"], "batch sizes")
flags.DEFINE_integer("chunk_tokens", 65536, "prefill tokens per chunk step, all rows together (chunk = this / B)")
flags.DEFINE_integer("decode_steps", 64, "tokens decoded per row")
flags.DEFINE_float("prefill_budget_s", 120.0, "run the real prefill (B = 1) only where its estimate is below this")
flags.DEFINE_float("memory_fraction", 0.8, "skip contexts whose cache exceeds this share of device memory")
flags.DEFINE_bool("check", True, "check the chunked prefill against the full forward at the first context")
flags.DEFINE_bool("prefill", True, "compile and time the chunked prefill (off: the decode loop alone, from a cache "
                  "of arbitrary contents at each context; needs --check=false)")
flags.DEFINE_bool("profile", False, "trace the decode loop at the first context: device time per token by kind")
flags.DEFINE_bool("small", False, "tiny config and sizes for a CPU run")
flags.DEFINE_string("compilation_cache", "", "keep compiled programs here (e.g. runs/xla_cache): a rerun skips them")
flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "bench_generate.json") if os.environ.get("OUT") else "",
                    "JSON file for the rows (default $OUT/bench_generate.json when $OUT is set)")


def main(argv):
  harness.check_argv(argv)
  if FLAGS.small:
    from experiments.configs import tiny
    config, sizes = tiny.get_config(), generate_benchmark.SMALL
  else:
    config = _CONFIG.value
    sizes = dict(contexts=tuple(int(x) for x in FLAGS.contexts), batches=tuple(int(x) for x in FLAGS.batches),
                 chunk_tokens=FLAGS.chunk_tokens, decode_steps=FLAGS.decode_steps)
  try:
    settings = generate_benchmark.Settings(patterns=tuple(FLAGS.patterns), **sizes,
                                           prefill_budget_s=FLAGS.prefill_budget_s,
                                           memory_fraction=FLAGS.memory_fraction, check=FLAGS.check,
                                           profile=FLAGS.profile, prefill=FLAGS.prefill)
  except ValueError as e:
    raise app.UsageError(str(e))
  harness.enable_compilation_cache(FLAGS.compilation_cache)
  rows = generate_benchmark.run(config, settings, save=lambda rows: harness.write_json(FLAGS.out, rows))
  print(generate_benchmark.format_table(rows))
  print("\n".join(generate_benchmark.summary(rows)))
  bad = generate_benchmark.failed_rows(rows)
  if bad:
    raise SystemExit(f"{len(bad)} rows failed: {[(r['pattern'], r['L'], r['B']) for r in bad]}")


if __name__ == "__main__":
  app.run(main)
