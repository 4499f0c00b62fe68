"""Launch parameters of the KDA forward's Triton kernels (warps, pipeline stages), each set timed in the whole
undifferentiated forward beside FLA's, interleaved in one process.

  python -m experiments.bench_kda_launch --shapes=8x4096x16x128 \
      --variant=prep4:kda_prepare.num_warps=4 --variant=keys3:kda_intra_fwd_key_tiles.num_stages=3

Each --variant is NAME:KERNEL.PARAM=VALUE[,KERNEL.PARAM=VALUE...] (PARAM num_warps or num_stages) and replaces those
launches' parameters in `pallas_kernels.kda.fwd`; the shipped defaults run as "default". Times are device time per
call as in `bench_kda`, the median of --rounds rounds that each time every variant once (drift hits all alike).
--shapes, --repeats, --warmup, --profile and --out are `bench_kda`'s flags; the rows are of kind "launch".
"""
import contextlib
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and PyTorch share the GPU here

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import bench_kda, harness
from pallas_kernels.kda import fwd

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("variant", [], "NAME:KERNEL.PARAM=VALUE[,...], e.g. w4:kda_prepare.num_warps=4.")
flags.DEFINE_integer("rounds", 3, "Rounds, each timing every variant (and FLA) once; the median is reported.")
flags.DEFINE_integer("calls", 10, "Back-to-back calls per timed repetition (harness.pipelined_seconds).")

PARAMS = ("num_warps", "num_stages")


def parse_variant(text):
  """'name:kernel.param=value,...' -> (name, {kernel: {param: int}}); a UsageError for anything else."""
  name, sep, spec = text.partition(":")
  if not (name and sep and spec):
    raise app.UsageError(f"--variant {text!r}: expected NAME:KERNEL.PARAM=VALUE[,...]")
  over = {}
  for item in spec.split(","):
    lhs, eq, value = item.partition("=")
    kernel, dot, param = lhs.rpartition(".")
    if not (eq and dot and kernel) or param not in PARAMS or not value.isdigit() or int(value) < 1:
      raise app.UsageError(f"--variant {text!r}: {item!r} is not KERNEL.PARAM=VALUE with PARAM in {PARAMS} and "
                           "VALUE a positive integer")
    over.setdefault(kernel, {})[param] = int(value)
  return name, over


@contextlib.contextmanager
def launches(over, seen):
  """`fwd.triton_call` with the launch parameters in `over` (by kernel name); the names launched go to `seen`."""
  base = fwd.triton_call

  def call(kernel, *, name, **kw):
    seen.add(name)
    return base(kernel, name=name, **{**kw, **over.get(name, {})})
  fwd.triton_call = call
  try:
    yield
  finally:
    fwd.triton_call = base


def compile_variant(x, over):
  """The forward compiled with `over`; a UsageError if it names a kernel the forward does not launch."""
  seen = set()
  with launches(over, seen):
    compiled = bench_kda.jax_fns("pallas")[0].lower(x).compile()
  unknown = set(over) - seen
  if unknown:
    raise app.UsageError(f"no launch named {sorted(unknown)} in the forward (it launches {sorted(seen)})")
  return compiled


def main(argv):
  harness.check_argv(argv)
  variants = dict([("default", {})] + [parse_variant(v) for v in FLAGS.variant])
  if len(variants) != len(FLAGS.variant) + 1:
    raise app.UsageError("--variant names must be unique and not 'default'")
  rows = []
  for shape in FLAGS.shapes:
    B, T, H, D = (int(s) for s in shape.split("x"))
    x, do = bench_kda.make_inputs(B, T, H, D, jnp.bfloat16)
    fla = bench_kda.fla_runner(x, do)
    compiled = {}
    for name, over in variants.items():
      compiled[name] = compile_variant(x, over)
      jax.block_until_ready(compiled[name](x))
      print(f"[bench_kda_launch] {shape} {name}: compiled", flush=True)
    runs = {n: [] for n in (["fla"] if fla else []) + list(compiled)}
    for r in range(FLAGS.rounds):
      if fla:
        runs["fla"].append(fla["fwd"]())
      for name, fn in compiled.items():
        runs[name].append(1e3 * harness.pipelined_seconds(fn, x, repeats=FLAGS.repeats, calls=FLAGS.calls,
                                                          warmup=FLAGS.warmup))
      print(f"[bench_kda_launch] {shape} round {r + 1}/{FLAGS.rounds}", flush=True)
    fla_ms = statistics.median(runs["fla"]) if fla else None
    for name, times in runs.items():
      ms = statistics.median(times)
      row = dict(kind="launch", shape=shape, variant=name, launches=variants.get(name), ms=ms, runs=times,
                 x_fla=fla_ms / ms if fla_ms else None)
      if FLAGS.profile and name != "fla":
        row["kernels"] = harness.device_kernel_times(compiled[name], x)
      rows.append(row)
      ratio = f"  {row['x_fla']:.3f}x FLA" if fla_ms else ""
      print(f"[bench_kda_launch] {shape} {name:>12s} {ms:8.4f} ms{ratio}  rounds {[f'{t:.4f}' for t in times]}",
            flush=True)
      for kernel, _, kernel_ms in row.get("kernels", []):
        print(f"    {kernel_ms:8.4f} ms  {kernel}", flush=True)
    harness.write_json(FLAGS.out, rows)


if __name__ == "__main__":
  app.run(main)
