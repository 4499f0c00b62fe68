"""Dropless MoE dispatch: the token-slots sorted by expert once, and the two row movements that permutation drives.

A token t routed to k experts has k slots `s = t·k + j`. One sort gives the plan (see `Plan`), and then

    dispatch:  x[i] = z[order[i] // k]                        backward  dz[t] = Σ_j dx[inverse[t, j]]
    combine:   u[t] = Σ_j w[t, j] · y[inverse[t, j]]           backward  dy[i] = w[order[i]] · du[order[i] // k]
                                                                         dw[t, j] = ⟨y[inverse[t, j]], du[t]⟩

Every backward is again a gather, by the other of the two permutations: autodiff of `z[order // k]` would instead
scatter-add k duplicate rows per token, and of an unsort `y_sorted.at[order].set(...)` would chain a scatter and a
gather. The gathers are plain XLA gathers (row copies that XLA fuses with the weighting, the sum over k and the
casts around them). `dispatch_reference` / `combine_reference` are the same maps written with autodiff, for tests and
benchmarks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

SCOPE = "moe_dispatch"  # the named scope of the ops' forward and backward (profiles count it as dispatch)


@struct.dataclass
class Plan:
  """The token-slots sorted by expert (stable: slots of one expert stay in token order)."""
  order_M: jax.Array        # int32 [T·k]: the slot at each sorted position
  inverse_TK: jax.Array     # int32 [T, k]: the sorted position of each slot
  group_sizes_E: jax.Array  # int32 [E]: slots per expert (expert e's rows follow expert e−1's)


def expert_counts(expert_ids, num_experts: int, dtype=jnp.int32, weights=None):
  """How many entries of `expert_ids` (any shape) name each expert, `[E]`: a compare-and-sum that XLA fuses into
  one reduction (an `.at[ids].add(1)` would be a scatter with every slot colliding on E addresses). `weights`
  (broadcast against `expert_ids` from the left, e.g. `[T]` for ids `[T, k]`): each entry counted at its weight."""
  hits = expert_ids.reshape(-1, 1) == jnp.arange(num_experts, dtype=expert_ids.dtype)
  if weights is None:
    return jnp.sum(hits, axis=0, dtype=dtype)
  w = jnp.broadcast_to(weights.reshape(weights.shape + (1,) * (expert_ids.ndim - weights.ndim)), expert_ids.shape)
  return jnp.sum(hits * w.reshape(-1, 1).astype(dtype), axis=0, dtype=dtype)


def plan(expert_ids_TK, num_experts: int) -> Plan:
  """The plan of `expert_ids_TK` (int `[T, k]`, values in [0, E)): one stable sort of the slots by expert."""
  if expert_ids_TK.ndim != 2 or not jnp.issubdtype(expert_ids_TK.dtype, jnp.integer):
    raise ValueError(f"expert ids must be an integer [T, k] array, got {expert_ids_TK.dtype}"
                     f"{list(expert_ids_TK.shape)}")
  t, k = expert_ids_TK.shape
  slots = jnp.arange(t * k, dtype=jnp.int32)
  _, order = jax.lax.sort((expert_ids_TK.reshape(-1).astype(jnp.int32), slots), num_keys=1, is_stable=True)
  inverse = jnp.zeros_like(slots).at[order].set(slots, unique_indices=True, mode="promise_in_bounds")
  return Plan(order_M=order, inverse_TK=inverse.reshape(t, k), group_sizes_E=expert_counts(expert_ids_TK, num_experts))


def _rows(a, index):
  return a.at[index].get(mode="promise_in_bounds")


def _sum_over_slots(rows_of_slot, k: int):
  """`Σ_j rows_of_slot(j)` in fp32: k gathers added in one fusion (no `[T, k, L]` intermediate)."""
  return functools.reduce(jnp.add, (rows_of_slot(j).astype(jnp.float32) for j in range(k)))


def _check_rows(name, a, rows: int):
  if a.ndim != 2 or a.shape[0] != rows:
    raise ValueError(f"{name} must be [{rows}, L] for this plan, got {list(a.shape)}")


def dispatch(z_TL, p: Plan):
  """Each slot's token row in sorted order, `[T·k, L]`: `x[i] = z[order[i] // k]`."""
  _check_rows("z", z_TL, p.inverse_TK.shape[0])
  return _dispatch(z_TL, p)


@jax.custom_vjp
@jax.named_scope(SCOPE)
def _dispatch(z_TL, p: Plan):
  return _rows(z_TL, p.order_M // p.inverse_TK.shape[1])


def _dispatch_fwd(z_TL, p):
  return _dispatch(z_TL, p), p


@jax.named_scope(SCOPE)
def _dispatch_bwd(p, dx_ML):
  dz_TL = _sum_over_slots(lambda j: _rows(dx_ML, p.inverse_TK[:, j]), p.inverse_TK.shape[1])
  return dz_TL.astype(dx_ML.dtype), None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
@jax.named_scope(SCOPE)
def _combine(y_ML, weights_TK, p: Plan, out_dtype):
  k = p.inverse_TK.shape[1]
  w_TK = weights_TK.astype(jnp.float32)
  return _sum_over_slots(lambda j: w_TK[:, j, None] * _rows(y_ML, p.inverse_TK[:, j]), k).astype(out_dtype)


def _combine_fwd(y_ML, weights_TK, p, out_dtype):
  return _combine(y_ML, weights_TK, p, out_dtype), (y_ML, weights_TK, p)


@jax.named_scope(SCOPE)
def _combine_bwd(out_dtype, res, du_TL):
  y_ML, weights_TK, p = res
  k = p.inverse_TK.shape[1]
  du_ML = _rows(du_TL, p.order_M // k).astype(jnp.float32)          # each sorted row's token cotangent
  w_M = _rows(weights_TK.reshape(-1), p.order_M).astype(jnp.float32)
  dy_ML = (w_M[:, None] * du_ML).astype(y_ML.dtype)
  # The weights' cotangents in sorted order, from the same gathered rows (one pass over y), then put back per slot:
  # a gather of M scalars, not k gathers of y's rows each reduced over L.
  dw_M = jnp.sum(y_ML.astype(jnp.float32) * du_ML, axis=-1)
  return dy_ML, _rows(dw_M, p.inverse_TK).astype(weights_TK.dtype), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(y_ML, weights_TK, p: Plan, out_dtype=None):
  """The slots' rows (`[T·k, L]`, sorted order) weighted and summed per token, `[T, L]`, accumulated in fp32 and
  returned in `out_dtype` (y's dtype when None): `u[t] = Σ_j w[t, j] · y[inverse[t, j]]`."""
  _check_rows("y", y_ML, p.order_M.shape[0])
  if weights_TK.shape != p.inverse_TK.shape:
    raise ValueError(f"weights must be {list(p.inverse_TK.shape)} for this plan, got {list(weights_TK.shape)}")
  return _combine(y_ML, weights_TK, p, jnp.dtype(out_dtype or y_ML.dtype))


def dispatch_reference(z_TL, p: Plan):
  """`dispatch` by autodiff of a gather (its backward scatter-adds duplicate rows)."""
  return z_TL[p.order_M // p.inverse_TK.shape[1]]


def combine_reference(y_ML, weights_TK, p: Plan, out_dtype=jnp.float32):
  """`combine` by autodiff of an unsort (a scatter) and an fp32 einsum over the slots."""
  t, k = p.inverse_TK.shape
  y_TKL = jnp.zeros_like(y_ML).at[p.order_M].set(y_ML).reshape(t, k, -1)
  return jnp.einsum("tkl,tk->tl", y_TKL.astype(jnp.float32), weights_TK.astype(jnp.float32)).astype(out_dtype)
