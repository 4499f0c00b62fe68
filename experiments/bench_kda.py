"""KDA benchmark: our paths and FLA's `chunk_kda` side by side in one process, forward and forward+backward.

  python -m experiments.bench_kda --shapes=8x4096x16x128,2x16384x16x128 --impls=pallas,xla,fla

Each implementation runs the layer's fused operator (q/k L2 norm, bounded gate, β sigmoid, KDA) in bf16.
`--check` then compares the Pallas kernels in bf16 with the XLA path in fp32 (outputs and every gradient), and with
`fla` among the impls FLA's on the same inputs against the same reference, one table of both at the end.
`pallas:FORM` (FORM in `pallas_kernels.kda.options.COLS_FORMS`) is the Pallas path with the backward's column pass
in that form. What it measures and how: `experiments/benchmarks/kda.py`.
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and PyTorch share the GPU here

from absl import app, flags  # noqa: E402

from experiments import harness  # noqa: E402
from experiments.benchmarks import kda as kda_benchmark  # noqa: E402
from pallas_kernels.kda import KDAKernelOptions  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["1x512x4x64"], "BxTxHxD shapes (K = V = D).")
flags.DEFINE_list("impls", ["recurrent", "xla"], "Any of: recurrent, xla, pallas, pallas:FORM (the backward's "
                  "column pass in that form, pallas_kernels.kda.options.COLS_FORMS), fla.")
flags.DEFINE_list("modes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd.")
flags.DEFINE_list("fla_modes", None, "Modes for FLA if not --modes (its first backward compile takes minutes).")
flags.DEFINE_list("variant_modes", ["fwdbwd"], "Modes for pallas:FORM (its forward is the default's).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Input dtype.")
flags.DEFINE_integer("repeats", 20, "Timed repetitions (median reported).")
flags.DEFINE_integer("warmup", 3, "Untimed runs first.")
flags.DEFINE_bool("check", False, "After timing, check Pallas against the XLA path in fp32 "
                  "(k3jax.ops.kda.testing.check_case).")
flags.DEFINE_list("check_cases", None, "With --check: only these cases (default all of testing.CHECK_CASES).")
flags.DEFINE_bool("per_kernel", False, "Also time each Pallas kernel alone.")
flags.DEFINE_bool("sweep", True, "With --per_kernel: also other options (warps, blocks, forms) than the defaults.")
flags.DEFINE_list("kernels", None, "With --per_kernel: only these kernels (e.g. intra_fwd,state_fwd); default all.")
flags.DEFINE_bool("profile", False, "Also each implementation's GPU kernels, by name, from a profiler (torch's for "
                  "FLA, JAX's for ours): where each program's time goes.")
flags.DEFINE_enum("solve", None, ["triton", "mosaic"], "Run the whole op with this solve launch, not the default.")
flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "bench_kda.json") if os.environ.get("OUT") else "",
                    "JSON file for the rows (default $OUT/bench_kda.json when $OUT is set).")


def main(argv):
  harness.check_argv(argv)
  options = KDAKernelOptions(solve=FLAGS.solve) if FLAGS.solve else None
  tuple_or_none = lambda v: None if v is None else tuple(v)
  try:
    settings = kda_benchmark.Settings(
        shapes=tuple(FLAGS.shapes), impls=tuple(FLAGS.impls), modes=tuple(FLAGS.modes),
        fla_modes=tuple_or_none(FLAGS.fla_modes), variant_modes=tuple(FLAGS.variant_modes), dtype=FLAGS.dtype,
        repeats=FLAGS.repeats, warmup=FLAGS.warmup, check=FLAGS.check, check_cases=tuple_or_none(FLAGS.check_cases),
        per_kernel=FLAGS.per_kernel, sweep=FLAGS.sweep, kernels=tuple_or_none(FLAGS.kernels), profile=FLAGS.profile,
        options=options)
    for shape in settings.shapes:
      kda_benchmark.parse_shape(shape)
  except ValueError as e:
    raise app.UsageError(str(e))
  rows = kda_benchmark.run(settings, save=lambda rows: harness.write_json(FLAGS.out, rows))
  kda_benchmark.print_table(rows)
  kda_benchmark.print_error_table(rows)


if __name__ == "__main__":
  app.run(main)
