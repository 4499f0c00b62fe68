"""MLA decode attention over a long latent cache: the split-K Pallas kernel against XLA's einsums and JAX's own
Pallas decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention.mqa`, given the latents as keys and values).

  python -m experiments.bench_mla_decode                     # GPU: L = 8K, 64K, 256K, 1M; B = 1, 8; small's MLA
  python -m experiments.bench_mla_decode --small             # CPU: tiny shapes, interpret mode, checks only

Every implementation is checked against the fp32 reference, then timed as device time per call; GB/s counts the
latents each row must read once. What it measures and how: `experiments/benchmarks/mla_decode.py`. Rows to
$OUT/bench_mla_decode.json; the table last.
"""
import os
import traceback

from absl import app, flags

from experiments import harness
from experiments.benchmarks import mla_decode as mla_decode_benchmark

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["8192", "65536", "262144", "1048576"], "cache lengths L")
flags.DEFINE_list("batches", ["1", "8"], "batch sizes B")
flags.DEFINE_integer("heads", 6, "query heads H (small: 6)")
flags.DEFINE_integer("rank", 256, "latent width R = kv_lora_rank (small: 256; K3: 512)")
flags.DEFINE_list("impls", list(mla_decode_benchmark.IMPLS), "pallas (ours), xla (einsums), jax_mqa (JAX's kernel)")
flags.DEFINE_bool("ragged", True, "also B > 1 with row lengths drawn in [1, L]")
flags.DEFINE_bool("sweep", False, "time kernel launch configurations at the first shape")
flags.DEFINE_integer("repeats", 20, "timed repetitions (median)")
flags.DEFINE_bool("small", False, "tiny shapes on the CPU (interpret mode): checks, no meaningful times")
flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "bench_mla_decode.json") if os.environ.get("OUT") else "",
                    "JSON file for the rows (default $OUT/bench_mla_decode.json when $OUT is set)")


def main(argv):
  harness.check_argv(argv)
  if FLAGS.small:
    args = mla_decode_benchmark.SMALL
  else:
    args = dict(lengths=[int(x) for x in FLAGS.lengths], batches=[int(x) for x in FLAGS.batches], H=FLAGS.heads,
                R=FLAGS.rank, repeats=FLAGS.repeats)
  try:
    rows = mla_decode_benchmark.run(**args, impls=FLAGS.impls, ragged=FLAGS.ragged, sweep=FLAGS.sweep)
  except Exception:  # noqa: BLE001
    traceback.print_exc()
    raise SystemExit(1)
  harness.write_json(FLAGS.out, rows)
  print(mla_decode_benchmark.format_table(rows))
  failed = mla_decode_benchmark.failed_rows(rows)
  if failed:
    raise SystemExit(f"the Pallas kernel failed its check or did not run: {failed}")


if __name__ == "__main__":
  app.run(main)
