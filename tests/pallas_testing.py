"""Helpers for the Pallas kernels' tests: a jitted function's program as lowered for a CUDA GPU, from this CPU; the
Pallas kernels a traced program launches, and the precisions of their products; the short conv op's kernel at a
given tiling."""
import functools

import jax
import jax.extend


def cuda_module_text(monkeypatch, fn, *args) -> str:
  """StableHLO of `jax.jit(fn)` exported for CUDA from this CPU, the kernels lowered through Pallas's Triton
  lowering (not interpret mode) for a GPU described as an H200."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0")
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: registration.gpu_info_lib.GpuInfo(
      gpu_version=None, arch_name="9.0", compute_capability=90))
  triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(*args).mlir_module()


def use_short_conv_blocks(monkeypatch, blocks) -> None:
  """The short conv op's kernel backward (`k3jax.ops.short_conv`) tiled as `blocks` for the rest of the test."""
  from k3jax.ops import short_conv as conv_ops
  monkeypatch.setattr(conv_ops, "_kernel_backward", functools.partial(conv_ops._kernel_backward, blocks=blocks))


KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")   # Triton's and Mosaic GPU's (`plgpu.kernel`) launches


def _equations(closed_jaxpr):
  """(the name of the Pallas kernel it sits inside, or None; the equation) of every equation of a traced program,
  in nested programs too."""
  def walk(jaxpr, kernel):
    for eqn in jaxpr.eqns:
      yield kernel, eqn
      inside = eqn.params["name"] if eqn.primitive.name in KERNEL_PRIMITIVES else kernel
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from walk(sub, inside)
  return walk(closed_jaxpr.jaxpr, None)


def pallas_kernels_in(closed_jaxpr) -> set[str]:
  """The Pallas kernels a traced program launches, by name (nothing compiles): Triton's (`pallas_call`) and Mosaic
  GPU's (`plgpu.kernel`'s `mpmd_map`), in nested programs too."""
  return {eqn.params["name"] for _, eqn in _equations(closed_jaxpr) if eqn.primitive.name in KERNEL_PRIMITIVES}


def kernel_launches(closed_jaxpr, name: str) -> int:
  """How many times a traced program launches the Pallas kernel `name`: its launches counted where they stand,
  inside every call of a nested program (a scan's body counts once)."""
  return sum(eqn.primitive.name in KERNEL_PRIMITIVES and eqn.params["name"] == name
             for _, eqn in _equations(closed_jaxpr))


def scan_bodies(closed_jaxpr) -> list:
  """The bodies (closed jaxprs) of a traced program's outermost scans: those inside no other scan."""
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        yield eqn.params["jaxpr"]
      else:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          yield from walk(sub)
  return list(walk(closed_jaxpr.jaxpr))


def primitive_calls(closed_jaxpr, name: str) -> int:
  """How many times a traced program binds the primitive `name`, counted as `kernel_launches` counts."""
  return sum(eqn.primitive.name == name for _, eqn in _equations(closed_jaxpr))


def kernel_products(closed_jaxpr) -> set[tuple[str, str, object]]:
  """(kernel name, operand dtype, precision) of every product inside the Pallas kernels of a traced program."""
  return {(kernel, str(eqn.invars[0].aval.dtype), eqn.params["precision"]) for kernel, eqn in _equations(closed_jaxpr)
          if kernel is not None and eqn.primitive.name == "dot_general"}
