"""Trace and lower a config's train step on abstract inputs, nothing allocated: seconds and StableHLO size.

The train state comes from `jax.eval_shape` (a config's parameters are never allocated) and the batch is a
ShapeDtypeStruct, so this measures the Python side of compilation: building the abstract state, tracing the step
(forward, backward, optimizer, balancer update) to a jaxpr, and lowering it to StableHLO; optionally XLA's compile.
The script is experiments/lower_train_step.py.
"""
import re
import time

import jax
import jax.numpy as jnp

from k3jax import parallel
from k3jax.train import batches, optimizer, profile, stages as stages_lib, state as state_lib, step as step_lib


def lower_train_step(config, *, seq_len: int, batch: int, micro_batches: int, mesh_spec: str,
                     compile_too: bool = False, compile_phases: bool = False) -> dict:
  """Wall seconds to build the abstract state, trace and lower the train step (and compile it), the process-CPU
  seconds of trace + lower, and the StableHLO size. With `compile_too` the state's init is compiled too, after the
  step (`init_compile_s`), nothing run. `compile_phases` (with `compile_too`): the compiles run under the profiler
  and `out["compile_phases"]` / `out["init_compile_phases"]` hold XLA's phases (`profile.trace_compile`), the
  quickest way to see where a GPU compile goes."""
  if compile_phases and not compile_too:
    raise ValueError("compile_phases needs compile_too")
  config = config.copy_and_resolve_references()
  config.mesh = mesh_spec
  config.stages, config.seq_len, config.batch_size = (), seq_len, batch * micro_batches
  config.micro_batches = micro_batches
  mesh = parallel.mesh_from_string(mesh_spec)
  plan = stages_lib.training_plan(config)
  lr = plan.learning_rate
  tx = optimizer.make_optimizer(config.optimizer, lr)
  clock = _Clock()
  graphdef, abstract, init = state_lib.abstract_state(config, tx, mesh)
  t_state = clock.lap()
  sharding = batches.micro_batch_sharding(mesh)
  spec = lambda dtype: jax.ShapeDtypeStruct((micro_batches, batch, seq_len), dtype, sharding=sharding)
  batch_spec = {"tokens": spec(jnp.int32), "segment_ids": spec(jnp.int32), "targets": spec(jnp.int32),
                "weights": spec(jnp.float32)}
  options = parallel.compiler_options(mesh)
  step = jax.jit(step_lib.make_train_step(graphdef, tx, lr, config.model), donate_argnums=0, compiler_options=options)
  clock.lap()
  traced = step.trace(abstract, batch_spec)
  t_trace = clock.lap()
  lowered = traced.lower()
  t_lower = clock.lap()
  text = lowered.as_text()
  out = {"state_s": t_state[0], "trace_s": t_trace[0], "lower_s": t_lower[0], "trace_lower_s": t_trace[0] + t_lower[0],
         "trace_lower_cpu_s": t_trace[1] + t_lower[1], "stablehlo_mb": len(text.encode()) / 1e6,
         "jaxpr_eqns": len(traced.jaxpr.eqns), **kernel_calls(text)}
  if compile_too:
    compile_ = lambda lowered: profile.trace_compile(lowered.compile) if compile_phases else (lowered.compile(), None)
    clock.lap()
    compiled, phases = compile_(lowered)
    mem = compiled.memory_analysis()
    out["compile_s"], out["compile_cpu_s"] = clock.lap()
    if mem is not None:  # XLA's own count for the step: its temporaries (activations and the like)
      out["temp_gib"] = mem.temp_size_in_bytes / 2 ** 30
    init_program = state_lib.InitProgram(init, abstract, mesh)
    clock.lap()
    _, init_phases = compile_(init_program.lower(jnp.int32(config.seed)))
    out["init_compile_s"] = clock.lap()[0]
    if phases is not None:
      out["compile_phases"], out["init_compile_phases"] = phases, init_phases
  return out


def kernel_calls(stablehlo_text: str) -> dict[str, int]:
  """The GPU kernels a lowered program launches (none in interpret mode): Triton custom calls, Mosaic GPU custom
  calls and their distinct kernels (by kernel hash: XLA compiles each distinct one, in series)."""
  mosaic = re.findall(r'custom_call @mosaic_gpu_v2\(.*?kernel_hash = "((?:[^"\\]|\\.)*)"', stablehlo_text)
  return {"triton_calls": len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(", stablehlo_text)),
          "mosaic_gpu_calls": len(mosaic), "mosaic_gpu_kernels": len(set(mosaic))}


class _Clock:
  """Wall and process-CPU seconds between laps (the CPU time is what a shared, loaded machine does not inflate)."""

  def __init__(self):
    self.last = (time.perf_counter(), time.process_time())

  def lap(self) -> tuple[float, float]:
    now = (time.perf_counter(), time.process_time())
    lap, self.last = (now[0] - self.last[0], now[1] - self.last[1]), now
    return lap
