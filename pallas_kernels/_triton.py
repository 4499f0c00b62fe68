"""The single interface between k3jax kernels and the Pallas Triton lowering."""
from __future__ import annotations

import os

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def interpret_mode() -> bool:
  """Kernels run in interpret mode off the GPU (CI). K3JAX_PALLAS_INTERPRET=1 forces it anywhere; =0 lowers for
  the GPU anywhere (to export a GPU program from a CPU machine)."""
  forced = os.environ.get("K3JAX_PALLAS_INTERPRET")
  return forced == "1" if forced in ("0", "1") else jax.default_backend() != "gpu"


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


def barrier():
  """Orders a CTA's global-memory writes before its later reads (a kernel's scratch round trip). Interpret mode
  runs a program sequentially and needs none."""
  if not interpret_mode():
    pltriton.debug_barrier()
