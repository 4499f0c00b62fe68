"""The train state: fp32 master parameters, optimizer state, balancer state, the rest of the model's state, and
the step (which is also the data position: batches are pure functions of the step).

The model is used functionally: `nnx.split` separates its parameters (differentiated), its balancer state
(updated outside the gradient) and everything else; the train step merges them back inside `jax.jit`.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax._src import config as jax_config   # the threefry-lowering context (jax exports no public one)
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import parallel
from k3jax.balancer import BalancerState
from k3jax.model import K3Model


@flax.struct.dataclass
class TrainState:
  step: jax.Array           # int32 scalar: optimizer steps taken
  params: nnx.State         # nnx.Param variables, fp32
  opt_state: optax.OptState
  balancer: nnx.State       # BalancerState variables of the MoE layers
  other: nnx.State          # any other model state


def split(model):
  """(graphdef, params, balancer, other) of a model."""
  return nnx.split(model, nnx.Param, BalancerState, ...)


def merge(graphdef, state: TrainState):
  return nnx.merge(graphdef, state.params, state.balancer, state.other)


def abstract_state(config, tx: optax.GradientTransformation, mesh):
  """(graphdef, shape/dtype/sharding tree of the TrainState, the init function), without allocating.

  `init(seed)` builds the state of a seed (an int, or an int32 scalar array: under `jax.jit` one program then
  serves every seed, where a seed taken from the config would be a constant compiled into it). The parameters are
  those of `nnx.Rngs(seed)`."""
  def init(seed):
    model = K3Model(config.model, rngs=nnx.Rngs(jax.random.key(seed)), mesh=mesh)
    _, params, balancer, other = split(model)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), balancer, other)

  graphdef = split(nnx.eval_shape(lambda: K3Model(config.model, rngs=nnx.Rngs(0), mesh=mesh)))[0]
  shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((), jnp.int32))
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                          _shardings(shapes, mesh))
  return graphdef, abstract, init


class InitProgram:
  """`init` (of `abstract_state`) under `jax.jit` for a mesh: one program for every seed, laid out as `abstract`.

  Its random draws lower to threefry's GPU kernel (`jax_threefry_gpu_kernel_lowering`) where XLA would otherwise
  get threefry's unrolled rounds as HLO, one large fusion per parameter shape for its fusion pass and codegen:
  the same bits either way, and on the GPU a fraction of the compile (docs/design.md, Compilation). Elsewhere the
  option changes nothing."""

  def __init__(self, init, abstract, mesh):
    # The jitted init itself: its options and trace; lowered outside `lower` its draws would be threefry's rounds.
    self.jitted = jax.jit(init, out_shardings=shardings_of(abstract), compiler_options=parallel.compiler_options(mesh))

  def lower(self, seed, *, platforms: tuple[str, ...] | None = None):
    """The program lowered for this process's devices, or for `platforms` (e.g. ("cuda",), from any machine)."""
    with jax_config.threefry_gpu_kernel_lowering(True):
      return self.jitted.trace(seed).lower(lowering_platforms=platforms)

  def __call__(self, seed):
    with jax_config.threefry_gpu_kernel_lowering(True):   # in jit's cache key: the call lowers the same way
      return self.jitted(seed)


def _shardings(shapes, mesh):
  """NamedShardings from the variables' `out_sharding` metadata (e.g. experts over `expert`); the rest, such as
  the balancer's state or the step, replicated."""
  replicated = NamedSharding(mesh, P())

  def of(x):
    if isinstance(x, nnx.Variable) and hasattr(x.get_value(), "shape"):
      return x.replace(NamedSharding(mesh, nnx.spmd.get_var_pspec(x)))
    if isinstance(x, nnx.Variable):
      return x.replace(jax.tree.map(lambda _: replicated, x.get_value()))
    return replicated
  return jax.tree.map(of, shapes, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shardings_of(abstract):
  return jax.tree.map(lambda a: a.sharding, abstract)
