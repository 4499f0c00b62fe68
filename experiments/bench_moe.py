"""Grouped-GEMM kernels and the LatentMoE layer on one device, in one run (the numbers of issue 5): the grouped
GEMM's check against `jax.lax.ragged_dot` in fp32 (exit 1 when a relative error exceeds 1e-2), each expert GEMM
against a dense GEMM of the same FLOPs and against `jax.lax.ragged_dot`, the layer against a dense SiTU-GLU FFN of
the same activated FLOPs, the routed part with the custom-VJP dispatch against autodiff, the routed experts with the
SiTU-GLU between the grouped GEMMs and in their epilogues, and (GPU) a tile sweep.
What each section measures and how: `experiments/benchmarks/moe.py`. JSON to $OUT/bench_moe.json. --sections picks
among gemm, layer, dispatch, glu.

    python -m experiments.bench_moe            # GPU: E = 64 and 256, top-8, d = 2048, ℓ = h = 1024, 32768 tokens
    python -m experiments.bench_moe --small    # CPU: tiny shapes, checks that everything runs
    python -m experiments.bench_moe --sections=dispatch,layer,glu --experts=64 --tokens=65536 --top_k=4 --d_model=768 \
        --latent_dim=384 --expert_hidden=512 --shared_hidden=1024 --nosweep     # the `small` config's MoE
"""
import dataclasses
import os
import sys
import time

from absl import app, flags

from experiments import harness
from experiments.benchmarks import moe as moe_benchmark

FLAGS = flags.FLAGS
flags.DEFINE_list("experts", ["64", "256"], "numbers of routed experts E")
flags.DEFINE_integer("tokens", 32768, "tokens per call (B·T); grouped GEMMs have tokens·top_k rows")
flags.DEFINE_integer("top_k", 8, "experts per token")
flags.DEFINE_integer("d_model", 2048, "model width d")
flags.DEFINE_integer("latent_dim", 1024, "latent width ℓ (K3: d/2)")
flags.DEFINE_integer("expert_hidden", 1024, "routed expert hidden width h (in ℓ-space)")
flags.DEFINE_integer("num_shared", 1, "shared experts")
flags.DEFINE_integer("shared_hidden", 1024, "each shared expert's hidden width (full d)")
flags.DEFINE_integer("repeats", 10, "timed calls per measurement (median)")
flags.DEFINE_integer("ragged_rows", 262144, "rows for the ragged_dot comparison: all of them by default, halved while "
                     "ragged_dot runs out of memory (XLA expands it densely over the groups)")
flags.DEFINE_integer("check_rows", 8160, "rows of the numerical check (not a multiple of 128 on purpose)")
flags.DEFINE_bool("sweep", True, "time a few kernel tile configurations (GPU only)")
flags.DEFINE_bool("small", False, "tiny shapes for a CPU run")
flags.DEFINE_list("sections", list(moe_benchmark.SECTIONS), "sections to run: gemm, layer, dispatch, glu")


def main(argv):
  harness.check_argv(argv)
  sections = tuple(FLAGS.sections)
  if not sections or set(sections) - set(moe_benchmark.SECTIONS):
    raise app.UsageError(f"--sections must name some of {moe_benchmark.SECTIONS}, got {FLAGS.sections}")
  if FLAGS.small:
    shapes = dataclasses.replace(moe_benchmark.SMALL, sections=sections)
  else:
    shapes = moe_benchmark.Shapes(
        experts=tuple(int(e) for e in FLAGS.experts), tokens=FLAGS.tokens, top_k=FLAGS.top_k,
        d_model=FLAGS.d_model, latent_dim=FLAGS.latent_dim, expert_hidden=FLAGS.expert_hidden,
        num_shared=FLAGS.num_shared, shared_hidden=FLAGS.shared_hidden, repeats=FLAGS.repeats,
        ragged_rows=FLAGS.ragged_rows, check_rows=FLAGS.check_rows, sweep=FLAGS.sweep, sections=sections)
  start = time.perf_counter()
  results, ok = moe_benchmark.run(shapes)
  results["wall_s"] = time.perf_counter() - start
  results["summary"] = table = moe_benchmark.summary(results, shapes)
  print(table, flush=True)
  harness.write_json(os.environ.get("OUT") and os.path.join(os.environ["OUT"], "bench_moe.json"), results)
  print(f"total {results['wall_s']:.0f} s; {'OK' if ok else 'FAILED (see above)'}", flush=True)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
