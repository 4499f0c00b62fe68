"""The single interface between k3jax kernels and Pallas's GPU lowerings: interpret mode, the Triton launch, the
precision of fp32 products, and whether a Mosaic GPU kernel applies."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.extend
from jax.interpreters import batching, mlir
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def interpret_mode() -> bool:
  """Kernels run in interpret mode off the GPU (CI). K3JAX_PALLAS_INTERPRET=1 forces it anywhere; =0 lowers for
  the GPU anywhere (to export a GPU program from a CPU machine)."""
  forced = os.environ.get("K3JAX_PALLAS_INTERPRET")
  return forced == "1" if forced in ("0", "1") else jax.default_backend() != "gpu"


def traced_once(fn, *, static_argnums: tuple[int, ...]):
  """`fn` as one opaque call, lowered once per program: inside a traced program, its calls with equal static
  arguments and input types (a model's layers, a forward and its recomputation, the scanned layers and the unrolled
  ones) become one function of the lowered module, so each kernel in it is lowered once and XLA compiles one copy.

  The call is a primitive whose parameter is a `_Call` (the function and its static arguments): JAX's
  transformations copy it as it is, and its program, traced once per input types, is lowered through one
  `jax.jit` function, which the module lowers once. A `jax.jit` around `fn` was not enough: JAX rebuilds a jit's
  traced program under each transformation (the scan's partial evaluation, the remat's, the linearisation), equal
  programs that are distinct objects were lowered once each, and each Mosaic GPU lowering names its kernel with a
  process-wide counter, so XLA compiled every copy. `fn` is not differentiated through this call (put it inside a
  custom VJP's forward and backward); it can be batched (`jax.vmap` traces it again). The interpret mode, which
  kernels read while tracing, is part of the call: a process that switches it gets a fresh one. A program with
  effects (interpreted Mosaic GPU kernels call back to Python) runs inline instead, as traced."""
  static_argnums = tuple(sorted(static_argnums))

  @functools.wraps(fn)
  def call(*args):
    static = tuple(args[i] for i in static_argnums)
    dynamic = [a for i, a in enumerate(args) if i not in static_argnums]
    leaves, in_tree = jax.tree.flatten(dynamic)
    c = _Call.get(fn, static_argnums, static, in_tree, interpret_mode())
    program = c.program(tuple(jax.typeof(x) for x in leaves))
    if program.jaxpr.effects:   # the interpreters' callbacks (interpret mode): run inline, as traced
      return jax.tree.unflatten(program.out_tree, jax.extend.core.jaxpr_as_fun(program.jaxpr)(*leaves))
    return jax.tree.unflatten(program.out_tree, _call_p.bind(*leaves, call=c, jaxpr=program.jaxpr))
  return call


class _Program(NamedTuple):
  jaxpr: Any          # the call's program for one tuple of input types (a ClosedJaxpr)
  out_tree: Any       # its output's structure
  jitted: Callable    # the program as a jitted function of flat inputs: one object, so one function per module


class _Call:
  """One function with its static arguments, as a hashable primitive parameter. `get` returns one object per
  (function, static arguments, input structure, interpret mode); `program` traces the function once per input
  types."""
  _made: dict = {}   # process-wide, as jit's caches: one entry per distinct kernel call

  @classmethod
  def get(cls, fn, static_argnums, static, in_tree, interpret: bool) -> "_Call":
    key = (fn, static_argnums, static, in_tree, interpret)
    if key not in cls._made:
      cls._made[key] = cls(fn, static_argnums, static, in_tree)
    return cls._made[key]

  def __init__(self, fn, static_argnums, static, in_tree):
    self.fn, self.static_argnums, self.static, self.in_tree = fn, static_argnums, static, in_tree
    self._programs = {}

  def program(self, avals) -> _Program:
    if avals not in self._programs:
      jaxpr, out_shape = jax.make_jaxpr(self._flat_in, return_shape=True)(*avals)
      run = jax.extend.core.jaxpr_as_fun(jaxpr)
      named = functools.wraps(self.fn)(lambda *leaves: run(*leaves))   # the module's function is named for fn
      self._programs[avals] = _Program(jaxpr, jax.tree.structure(out_shape), jax.jit(named))
    return self._programs[avals]

  def flat(self, *leaves):
    """`fn` on flat input leaves, returning flat output leaves."""
    return jax.tree.leaves(self._flat_in(*leaves))

  def _flat_in(self, *leaves):
    """`fn` on flat input leaves (the static arguments put back in their places), returning its own output."""
    dynamic = jax.tree.unflatten(self.in_tree, leaves)
    parts = (iter(self.static), iter(dynamic))
    n = len(self.static) + len(dynamic)
    return self.fn(*[next(parts[i not in self.static_argnums]) for i in range(n)])


_call_p = jax.extend.core.Primitive("traced_once")
_call_p.multiple_results = True
# `jaxpr` (the program, one object per call and input types) is a parameter so that whoever walks a traced
# program's nested jaxprs (`jax.extend.core.jaxprs_in_params`) finds the kernels inside.
_call_p.def_abstract_eval(lambda *avals, call, jaxpr: jaxpr.out_avals)
_call_p.def_impl(lambda *args, call, jaxpr: call.program(tuple(jax.typeof(a) for a in args)).jitted(*args))
mlir.register_lowering(_call_p, lambda ctx, *args, call, jaxpr: mlir.lower_fun(
    call.program(tuple(ctx.avals_in)).jitted, multiple_results=True)(ctx, *args))


def _call_batching(args, dims, *, call: _Call, jaxpr):
  out = jax.vmap(call.flat, in_axes=dims)(*args)
  return out, [0] * len(out)


batching.primitive_batchers[_call_p] = _call_batching


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
