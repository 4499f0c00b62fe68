"""Trace and lower a config's train step on abstract inputs, nothing allocated: seconds and StableHLO size.

  python -m experiments.lower_train_step --config=k3_full --seq_len=4096 --batch=8

The train state comes from `jax.eval_shape` (k3_full's 2.78T parameters are never allocated) and the batch is a
ShapeDtypeStruct, so this measures the Python side of compilation: building the abstract state, tracing the step
(forward, backward, optimizer, balancer update) to a jaxpr, and lowering it to StableHLO. `--compile` also runs
XLA's compile (only sensible for small configs). The mesh defaults to every local device on `data` (on the CPU
run it with XLA_FLAGS=--xla_force_host_platform_device_count=8 to see the expert-parallel path with
`--mesh=data:1,expert:8`). `--compile` compiles the state's init as well; `--compile --profile_compile` prints XLA's
compile of each by phase (passes, autotuning, each kernel's compile) without initialising or running anything, e.g.
on the GPU for `small`'s step with every layer MLA: `--config=small --seq_len=4096 --batch=16 --pattern=mla --compile
--profile_compile`. The measurement is `k3jax.train.lowering.lower_train_step`.
"""
import jax
from absl import app, flags

from experiments import configs, harness
from k3jax.train import benchmark, profile
from k3jax.train.lowering import lower_train_step

_CONFIG = flags.DEFINE_string("config", "k3_full", "config name under experiments/configs/, or a .py path")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "tokens per row")
_BATCH = flags.DEFINE_integer("batch", 8, "rows per micro-batch (a multiple of the mesh size)")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "micro-batches per step")
_MESH = flags.DEFINE_string("mesh", "data:-1,expert:1", "device mesh (see k3jax.parallel.mesh_from_string)")
_COMPILE = flags.DEFINE_bool("compile", False, "also compile the lowered step with XLA (and report its temp memory)")
_SCAN = flags.DEFINE_bool("scan_layers", None, "override the config's model.scan_layers")
_PATTERN = flags.DEFINE_enum("pattern", "config", list(benchmark.PATTERNS), "every layer of this type ('config': "
                             "the config's own pattern), as bench_train's --patterns")
_PHASES = flags.DEFINE_bool("profile_compile", False, "with --compile: trace XLA's compile and print it by phase")
_OUT = flags.DEFINE_string("out", None, "JSON file for the results")


def main(argv):
  harness.check_argv(argv)
  config = benchmark.variant(configs.load(_CONFIG.value), pattern=_PATTERN.value)
  if _SCAN.value is not None:
    config.model.scan_layers = _SCAN.value
  r = lower_train_step(config, seq_len=_SEQ_LEN.value, batch=_BATCH.value, micro_batches=_MICRO.value,
                       mesh_spec=_MESH.value, compile_too=_COMPILE.value, compile_phases=_PHASES.value)
  print(f"{_CONFIG.value}: {config.model.num_layers} layers, {_MICRO.value} x {_BATCH.value} x {_SEQ_LEN.value} "
        f"tokens, mesh {_MESH.value} on {jax.devices()[0].platform}")
  phases = {name: r.pop(key, None) for name, key in (("step", "compile_phases"), ("init", "init_compile_phases"))}
  for k, v in r.items():
    print(f"  {k:<20}{v:>10.2f}" if isinstance(v, float) else f"  {k:<20}{v:>10}")
  for name, program_phases in phases.items():
    if program_phases is not None:
      print(f"XLA's compile of the {name} by phase (summed over threads):\n"
            + profile.format_compile_phases(program_phases))
  harness.write_json(_OUT.value, {"config": _CONFIG.value, "pattern": _PATTERN.value, **r,
                                  "compile_phases": phases["step"], "init_compile_phases": phases["init"]})


if __name__ == "__main__":
  app.run(main)
