"""Trace and lower a config's train step on abstract inputs, nothing allocated: seconds and StableHLO size.

  python -m experiments.lower_train_step --config=k3_full --seq_len=4096 --batch=8

The train state comes from `jax.eval_shape` (k3_full's 2.78T parameters are never allocated) and the batch is a
ShapeDtypeStruct, so this measures the Python side of compilation: building the abstract state, tracing the step
(forward, backward, optimizer, balancer update) to a jaxpr, and lowering it to StableHLO. `--compile` also runs
XLA's compile (only sensible for small configs). The mesh defaults to every local device on `data` (on the CPU
run it with XLA_FLAGS=--xla_force_host_platform_device_count=8 to see the expert-parallel path with
`--mesh=data:1,expert:8`).
"""
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import configs, harness
from k3jax import parallel
from k3jax.train import batches, optimizer, stages as stages_lib, state as state_lib, step as step_lib

_CONFIG = flags.DEFINE_string("config", "k3_full", "config name under experiments/configs/, or a .py path")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "tokens per row")
_BATCH = flags.DEFINE_integer("batch", 8, "rows per micro-batch (a multiple of the mesh size)")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "micro-batches per step")
_MESH = flags.DEFINE_string("mesh", "data:-1,expert:1", "device mesh (see k3jax.parallel.mesh_from_string)")
_COMPILE = flags.DEFINE_bool("compile", False, "also compile the lowered step with XLA (and report its temp memory)")
_SCAN = flags.DEFINE_bool("scan_layers", None, "override the config's model.scan_layers")


def lower_train_step(config, *, seq_len: int, batch: int, micro_batches: int, mesh_spec: str,
                     compile_too: bool = False) -> dict:
  """Wall seconds to build the abstract state, trace and lower the train step (and compile it), the process-CPU
  seconds of trace + lower, and the StableHLO size."""
  config = config.copy_and_resolve_references()
  config.mesh = mesh_spec
  config.stages, config.seq_len, config.batch_size = (), seq_len, batch * micro_batches
  config.micro_batches = micro_batches
  mesh = parallel.mesh_from_string(mesh_spec)
  stages = stages_lib.stages_of(config)
  tx, lr = optimizer.make_optimizer(config, stages)
  clock = _Clock()
  graphdef, abstract, _ = state_lib.abstract_state(config, tx, mesh)
  t_state = clock.lap()
  sharding = batches.micro_batch_sharding(mesh)
  spec = lambda dtype: jax.ShapeDtypeStruct((micro_batches, batch, seq_len), dtype, sharding=sharding)
  batch_spec = {"tokens": spec(jnp.int32), "segment_ids": spec(jnp.int32), "targets": spec(jnp.int32),
                "weights": spec(jnp.float32)}
  step = jax.jit(step_lib.make_train_step(graphdef, tx, lr, config.model), donate_argnums=0)
  clock.lap()
  traced = step.trace(abstract, batch_spec)
  t_trace = clock.lap()
  lowered = traced.lower()
  t_lower = clock.lap()
  out = {"state_s": t_state[0], "trace_s": t_trace[0], "lower_s": t_lower[0], "trace_lower_s": t_trace[0] + t_lower[0],
         "trace_lower_cpu_s": t_trace[1] + t_lower[1], "stablehlo_mb": len(lowered.as_text().encode()) / 1e6,
         "jaxpr_eqns": len(traced.jaxpr.eqns)}
  if compile_too:
    clock.lap()
    mem = lowered.compile().memory_analysis()
    out["compile_s"], out["compile_cpu_s"] = clock.lap()
    if mem is not None:  # XLA's own count for the step: its temporaries (activations and the like)
      out["temp_gib"] = mem.temp_size_in_bytes / 2 ** 30
  return out


class _Clock:
  """Wall and process-CPU seconds between laps (the CPU time is what a shared, loaded machine does not inflate)."""

  def __init__(self):
    self.last = (time.perf_counter(), time.process_time())

  def lap(self) -> tuple[float, float]:
    now = (time.perf_counter(), time.process_time())
    lap, self.last = (now[0] - self.last[0], now[1] - self.last[1]), now
    return lap


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
    print(f"  {k:<16}{v:>10.2f}" if isinstance(v, float) else f"  {k:<16}{v:>10}")


if __name__ == "__main__":
  app.run(main)
