"""Launch parameters of the KDA forward's Triton kernels (warps, pipeline stages), each set timed in the whole
undifferentiated forward beside FLA's, interleaved in one process.

  python -m experiments.bench_kda_launch --shapes=8x4096x16x128 \
      --variant=prep4:kda_prepare.num_warps=4 --variant=keys3:kda_intra_fwd_key_tiles.num_stages=3

Each --variant is NAME:KERNEL.PARAM=VALUE[,KERNEL.PARAM=VALUE...] (PARAM num_warps or num_stages): those launches'
parameters in `KDAKernelOptions` over the shipped defaults, which run as "default". Times are device time per call
as in `bench_kda`, the median of --rounds rounds that each time every variant once (`kda_benchmark.launch_rows`).
--shapes, --repeats, --warmup, --profile and --out are `bench_kda`'s flags; the rows are of kind "launch".
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and PyTorch share the GPU here

from absl import app, flags  # noqa: E402

from experiments import bench_kda, harness  # noqa: E402,F401 (bench_kda defines the shared flags)
from experiments.benchmarks import kda as kda_benchmark  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("variant", [], "NAME:KERNEL.PARAM=VALUE[,...], e.g. w4:kda_prepare.num_warps=4.")
flags.DEFINE_integer("rounds", 3, "Rounds, each timing every variant (and FLA) once; the median is reported.")
flags.DEFINE_integer("calls", 10, "Back-to-back calls per timed repetition (harness.pipelined_seconds).")


def main(argv):
  harness.check_argv(argv)
  try:
    variants = dict([("default", {})] + [kda_benchmark.parse_launch_variant(v) for v in FLAGS.variant])
    if len(variants) != len(FLAGS.variant) + 1:
      raise ValueError("--variant names must be unique and not 'default'")
    for shape in FLAGS.shapes:
      kda_benchmark.launch_variants(shape, variants)   # every named launch exists, before any compile
  except ValueError as e:
    raise app.UsageError(str(e))
  rows = []
  for shape in FLAGS.shapes:
    rows += kda_benchmark.launch_rows(shape, variants, rounds=FLAGS.rounds, repeats=FLAGS.repeats, calls=FLAGS.calls,
                                      warmup=FLAGS.warmup, profile=FLAGS.profile)
    harness.write_json(FLAGS.out, rows)


if __name__ == "__main__":
  app.run(main)
