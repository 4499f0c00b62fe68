"""The single interface between k3jax kernels and Pallas's GPU lowerings: interpret mode, the Triton launch, the
precision of fp32 products, and whether a Mosaic GPU kernel applies."""
from __future__ import annotations

import functools
import os

import jax
import jax.extend
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def interpret_mode() -> bool:
  """Kernels run in interpret mode off the GPU (CI). K3JAX_PALLAS_INTERPRET=1 forces it anywhere; =0 lowers for
  the GPU anywhere (to export a GPU program from a CPU machine)."""
  forced = os.environ.get("K3JAX_PALLAS_INTERPRET")
  return forced == "1" if forced in ("0", "1") else jax.default_backend() != "gpu"


def traced_once(fn, *, static_argnums: tuple[int, ...]):
  """`fn` under `jax.jit`: inside a traced program, its calls with equal static arguments and input types (a model's
  layers, a forward and its recomputation) share one traced program, so each kernel in it is lowered once and XLA
  compiles one copy, not one per call (per layer, per pass). The interpret mode, which kernels read while tracing,
  is a static argument too: a process that switches it gets a fresh trace."""
  jitted = jax.jit(lambda interpret, *args: fn(*args), static_argnums=(0, *(i + 1 for i in static_argnums)))
  return functools.wraps(fn)(lambda *args: jitted(interpret_mode(), *args))


def fp32_products():
  """The `precision` of a kernel's fp32 products that are meant to be exact: 3xTF32 on the GPU (three tensor-core
  products, about fp32's accuracy), fp32 in interpret mode. Triton's IEEE fp32 product is an unrolled loop of
  CUDA-core FMAs, which made each fp32 KDA kernel set compile in about 40 s on the H200 (bf16: 2 s)."""
  return jax.lax.Precision.HIGHEST if interpret_mode() else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def mosaic_gpu_reason(*, off_gpu: bool = False) -> str | None:
  """Why Mosaic GPU kernels (Hopper's wgmma and TMA) cannot run here, or None when they can: on a GPU of compute
  capability 9.x. With `off_gpu`, also wherever there is no GPU (interpret mode, or lowering for the GPU from a
  machine without one), for kernels whose tests run them so."""
  if off_gpu and (interpret_mode() or jax.default_backend() != "gpu"):
    return None
  if jax.default_backend() != "gpu":
    return f"the default backend is {jax.default_backend()!r}, not 'gpu'"
  capability = getattr(jax.devices()[0], "compute_capability", "")
  if not str(capability).startswith("9."):
    return f"the kernels use Hopper wgmma (compute capability 9.x); this GPU has {capability!r}"
  return None


def triton_call(kernel, *, grid, in_specs, out_specs, out_shape, name, num_warps=4, num_stages=2):
  """`pl.pallas_call` with Triton compiler parameters; interpret mode where there is no GPU."""
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret_mode(),
      name=name,
  )


def triton_launches(fn, *args) -> dict[str, tuple[int, int]]:
  """The Triton kernels `fn(*args)` launches, by name, each with its (num_warps, num_stages), read from the traced
  program (nothing is compiled or run): which launches a call makes, with which parameters."""
  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      params = eqn.params.get("compiler_params")
      if eqn.primitive.name == "pallas_call" and isinstance(params, pltriton.CompilerParams):
        found[eqn.params["name"]] = (params.num_warps, params.num_stages)
    for sub in jax.extend.core.subjaxprs(jaxpr):
      walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def barrier():
  """Orders a CTA's global-memory writes before its later reads (a kernel's scratch round trip). Interpret mode
  runs a program sequentially and needs none."""
  if not interpret_mode():
    pltriton.debug_barrier()
