"""Expert-parallel scaling: the first steps of a config trained from the same seed, data and global batch on one
device and on meshes of more (data × expert axes), each mesh compiled in its own process, all at once, then trained
one after another; per-step losses compared, tokens/s ratio:

  python -m experiments.bench_scaling --config=experiments/configs/small.py --steps=200 \\
      --mesh=data:1,expert:1 --mesh=data:1,expert:-1 --out=$OUT/bench_scaling.json

The first mesh is the reference. `scaling` = tokens/s ÷ (reference tokens/s × device ratio); 1.0 is linear.
Losses of bf16 training on different meshes differ by reduction order alone, so their gap should stay at bf16
noise (a fraction of a percent) and show no drift over the steps.
"""
import functools

from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from k3jax.train import benchmark

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_MESHES = flags.DEFINE_multi_string("mesh", ["data:1,expert:1", "data:1,expert:-1"],
                                    "meshes to train on (repeat the flag); the first is the reference")
_STEPS = flags.DEFINE_integer("steps", 200, "steps of the config's first stage")
_WARMUP = flags.DEFINE_integer("warmup", 5, "steps before timing starts (the first compiles)")
_TAIL = flags.DEFINE_integer("tail", 50, "last steps over which the mean loss gap is taken")
_OUT = flags.DEFINE_string("out", None, "JSON file for the curves and the comparison (rewritten after each curve)")
flags.mark_flags_as_required(["config"])


def main(argv):
  harness.check_argv(argv)
  if len(_MESHES.value) < 2:
    raise app.UsageError("give at least two --mesh values: the reference and one to compare")
  if not 0 < _TAIL.value <= _STEPS.value:
    raise app.UsageError(f"--tail must be in [1, --steps], got {_TAIL.value}")
  configs = [benchmark.variant(_CONFIG.value, mesh=mesh) for mesh in _MESHES.value]
  print(f"compiling {len(configs)} meshes, one process each", flush=True)
  measure = functools.partial(benchmark.loss_curve, steps=_STEPS.value, warmup=_WARMUP.value)
  curves = []
  for mesh, c in zip(_MESHES.value, benchmark.measure_in_turn(configs, measure)):
    if "error" in c:
      raise SystemExit(f"mesh {mesh} failed:\n{c['error']}")
    curves.append(c)
    print(f"mesh {mesh} ({c['devices']} devices): compiled in {c['compile_s']:.0f} s, {c['tokens_per_s']:,.0f} "
          f"tokens/s, {c['step_ms']:.1f} ms/step, loss {c['losses'][0]:.4f} -> {c['losses'][-1]:.4f}", flush=True)
    harness.write_json(_OUT.value, {"curves": curves})
  rows = [benchmark.compare_curves(curves[0], c, tail=_TAIL.value) for c in curves[1:]]
  print(f"{'mesh':<22} {'devices':>7} {'max rel gap':>11} {'tail rel gap':>12} {'tail gap':>9} {'scaling':>8}")
  for r in rows:
    print(f"{r['mesh']:<22} {r['devices']:>7} {r['max_rel_gap']:>11.4f} {r['tail_mean_rel_gap']:>12.4f} "
          f"{r['tail_mean_gap']:>+9.4f} {r['scaling']:>8.3f}", flush=True)
  harness.write_json(_OUT.value, {"curves": curves, "comparison": rows})


if __name__ == "__main__":
  app.run(main)
