"""Trace and lower a config's train step on abstract inputs, nothing allocated: seconds and StableHLO size.

  python -m experiments.lower_train_step --config=k3_full --seq_len=4096 --batch=8

The train state comes from `jax.eval_shape` (k3_full's 2.78T parameters are never allocated) and the batch is a
ShapeDtypeStruct, so this measures the Python side of compilation: building the abstract state, tracing the step
(forward, backward, optimizer, balancer update) to a jaxpr, and lowering it to StableHLO. `--compile` also runs
XLA's compile (only sensible for small configs). The mesh defaults to every local device on `data` (on the CPU
run it with XLA_FLAGS=--xla_force_host_platform_device_count=8 to see the expert-parallel path with
`--mesh=data:1,expert:8`). The measurement is `k3jax.train.lowering.lower_train_step`.
"""
import jax
from absl import app, flags

from experiments import configs, harness
from k3jax.train.lowering import lower_train_step

_CONFIG = flags.DEFINE_string("config", "k3_full", "config name under experiments/configs/, or a .py path")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "tokens per row")
_BATCH = flags.DEFINE_integer("batch", 8, "rows per micro-batch (a multiple of the mesh size)")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "micro-batches per step")
_MESH = flags.DEFINE_string("mesh", "data:-1,expert:1", "device mesh (see k3jax.parallel.mesh_from_string)")
_COMPILE = flags.DEFINE_bool("compile", False, "also compile the lowered step with XLA (and report its temp memory)")
_SCAN = flags.DEFINE_bool("scan_layers", None, "override the config's model.scan_layers")


def main(argv):
  harness.check_argv(argv)
  config = configs.load(_CONFIG.value)
  if _SCAN.value is not None:
    config.model.scan_layers = _SCAN.value
  r = lower_train_step(config, seq_len=_SEQ_LEN.value, batch=_BATCH.value, micro_batches=_MICRO.value,
                       mesh_spec=_MESH.value, compile_too=_COMPILE.value)
  print(f"{_CONFIG.value}: {config.model.num_layers} layers, {_MICRO.value} x {_BATCH.value} x {_SEQ_LEN.value} "
        f"tokens, mesh {_MESH.value} on {jax.devices()[0].platform}")
  for k, v in r.items():
    print(f"  {k:<20}{v:>10.2f}" if isinstance(v, float) else f"  {k:<20}{v:>10}")


if __name__ == "__main__":
  app.run(main)
