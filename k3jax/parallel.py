"""Device meshes and expert parallelism: routed experts sharded over the `expert` mesh axis.

Tokens are sharded over every device (`data` × `expert`). Inside `jax.shard_map`, each device sorts its token-slots
by expert (`k3jax.ops.moe_dispatch`), sends each expert's slots to the device owning it with a ragged all-to-all,
runs its local experts on what it received (grouped by expert, then by source device), returns the results the same
way and combines each token's slots.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from k3jax.ops import moe_dispatch

DATA, EXPERT = "data", "expert"
TOKENS = (DATA, EXPERT)  # token rows are sharded over both axes
A2A_IMPLS = ("auto", "ragged", "dense")


def mesh_from_string(spec: str, devices=None) -> Mesh:
  """`"data:4,expert:2"` -> a Mesh with those axes (Auto axis types) over the first data·expert devices. One size
  may be -1: all the devices the other leaves (`"data:-1,expert:1"` puts every device on `data`)."""
  devices = jax.devices() if devices is None else devices
  try:
    sizes = {name.strip(): int(size) for name, size in (part.split(":") for part in spec.split(","))}
  except ValueError:
    raise ValueError(f"mesh must look like 'data:4,expert:2', got {spec!r}") from None
  if set(sizes) != {DATA, EXPERT} or len(spec.split(",")) != 2:
    raise ValueError(f"mesh must give sizes for exactly the axes {DATA!r} and {EXPERT!r}, got {spec!r}")
  free = [a for a, n in sizes.items() if n == -1]
  if len(free) > 1 or any(n < 1 for a, n in sizes.items() if a not in free):
    raise ValueError(f"mesh sizes must be positive, at most one of them -1, got {spec!r}")
  if free:
    other = sizes[EXPERT if free[0] == DATA else DATA]
    if len(devices) % other:
      raise ValueError(f"mesh {spec!r}: {len(devices)} devices are not divisible by {other}")
    sizes[free[0]] = len(devices) // other
  count = sizes[DATA] * sizes[EXPERT]
  if count > len(devices):
    raise ValueError(f"mesh {spec!r} needs {count} devices, {len(devices)} available")
  return Mesh(np.asarray(devices[:count]).reshape(sizes[DATA], sizes[EXPERT]), (DATA, EXPERT),
              axis_types=(AxisType.Auto, AxisType.Auto))


def compiler_options(mesh: Mesh | None) -> dict:
  """XLA options for a program on `mesh` (None: on the default device alone): on one device, no latency-hiding
  scheduler. It orders a program to overlap collectives and asynchronous copies with compute, which a one-device
  program has none of, and on the GPU its order kept a third more memory live in the train step for no speed
  (docs/design.md, Compilation). On a mesh of several devices XLA's defaults stand."""
  return {"xla_gpu_enable_latency_hiding_scheduler": False} if mesh is None or mesh.size == 1 else {}


def expert_parallel_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape[EXPERT]


def check_mesh(mesh: Mesh, num_experts: int, num_tokens: int) -> None:
  """ValueErrors for a mesh the expert-parallel layer cannot use."""
  if set(mesh.axis_names) != {DATA, EXPERT}:
    raise ValueError(f"the mesh must have exactly the axes {DATA!r} and {EXPERT!r}, got {mesh.axis_names}")
  ep = mesh.shape[EXPERT]
  if num_experts % ep:
    raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep}")
  if num_tokens % mesh.size:
    raise ValueError(f"the {num_tokens} tokens (batch × length) are not divisible by the {mesh.size} devices")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      impl: str = "auto"):
  """`jax.lax.ragged_all_to_all` ("ragged"), or the same exchange over a dense all-to-all ("dense"); "auto" is
  "dense" on the CPU, which has no ragged all-to-all, else "ragged".

  The dense form pads each device's slices to `operand.shape[0]` rows per destination: for tests, not speed.
  It needs the slices sent to one destination to fit in `operand.shape[0]` rows together (true for disjoint slices).
  """
  if impl not in A2A_IMPLS:
    raise ValueError(f"impl must be one of {A2A_IMPLS}, got {impl!r}")
  if impl == "ragged" or (impl == "auto" and jax.default_backend() != "cpu"):
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)
  n = jax.lax.axis_size(axis_name)
  rows = operand.shape[0]
  packed = _pack(operand, input_offsets.reshape(n, -1), send_sizes.reshape(n, -1))  # [dest, rows, ...]
  received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)               # [source, rows, ...]
  where_NS = jax.lax.all_to_all(output_offsets.reshape(n, -1), axis_name, 0, 0, tiled=True)
  dest_NR = _slice_rows(where_NS, recv_sizes.reshape(n, -1), rows, fill=output.shape[0])
  return output.at[dest_NR.reshape(-1)].set(received.reshape(n * rows, *operand.shape[1:]), mode="drop")


def _slice_rows(offsets_NS, sizes_NS, rows: int, fill: int):
  """For slices packed back to back in `rows` rows per n: the row each packed row maps to (`fill` past the end)."""
  ends_NS = jnp.cumsum(sizes_NS, axis=1)
  r_R = jnp.arange(rows)
  slot_NR = jnp.sum(r_R[None, :, None] >= ends_NS[:, None, :], axis=-1)
  valid_NR = slot_NR < sizes_NS.shape[1]
  slot_NR = jnp.minimum(slot_NR, sizes_NS.shape[1] - 1)
  start_NR = jnp.take_along_axis(ends_NS - sizes_NS, slot_NR, axis=1)
  target_NR = jnp.take_along_axis(offsets_NS, slot_NR, axis=1) + r_R[None, :] - start_NR
  return jnp.where(valid_NR, target_NR, fill)


def _pack(operand, offsets_NS, sizes_NS):
  """Each destination's slices of `operand`, back to back, zero-padded to `operand.shape[0]` rows."""
  rows = operand.shape[0]
  src_NR = _slice_rows(offsets_NS, sizes_NS, rows, fill=rows)
  return jnp.take(operand, src_NR, axis=0, mode="fill", fill_value=0)


def _exclusive_cumsum(a, axis=-1):
  return jnp.cumsum(a, axis=axis) - a


def local_routed_outputs(z_TL, expert_ids_TK, weights_TK, expert_weights, *, num_experts: int,
                         expert_fn: Callable):
  """`u[t] = Σ_j w[t, j] · E_{ids[t, j]}(z[t])`, `[T, L]`, with every expert on this device: the slots sorted by
  expert once (`moe_dispatch.plan`), gathered, run through `expert_fn` (see `expert_parallel_routed_outputs`) and
  combined, in z's dtype (the combine accumulates in fp32)."""
  p = moe_dispatch.plan(expert_ids_TK, num_experts)
  y_ML = expert_fn(moe_dispatch.dispatch(z_TL, p), p.group_sizes_E, *expert_weights)
  return moe_dispatch.combine(y_ML, weights_TK, p, z_TL.dtype)


def _ep_routed_outputs(z_TL, expert_ids_TK, weights_TK, expert_weights, *, num_experts: int, expert_fn: Callable,
                       a2a_impl: str):
  """Per device (inside shard_map): the routed output of every local token, `[T, L]`."""
  t, k = expert_ids_TK.shape
  ep = jax.lax.axis_size(EXPERT)
  me = jax.lax.axis_index(EXPERT)
  if ep == 1:  # every expert is local: no exchange (a one-device all-to-all would still copy every row twice)
    return local_routed_outputs(z_TL, expert_ids_TK, weights_TK, expert_weights, num_experts=num_experts,
                                expert_fn=expert_fn)
  e_loc = num_experts // ep
  p = moe_dispatch.plan(expert_ids_TK, num_experts)
  counts_E = p.group_sizes_E
  x_sorted = moe_dispatch.dispatch(z_TL, p)

  # counts_SE[s, e]: slots device s (along `expert`) routes to expert e. Receivers lay rows out by local expert,
  # then by source device: expert e's rows from source s start at start_E[e] + before_SE[s, e].
  counts_SE = jax.lax.all_gather(counts_E, EXPERT)
  total_E = counts_SE.sum(0)
  start_E = _exclusive_cumsum(total_E.reshape(ep, e_loc)).reshape(-1)
  before_SE = _exclusive_cumsum(counts_SE, axis=0)
  mine_SJ = jax.lax.dynamic_slice_in_dim(counts_SE, me * e_loc, e_loc, axis=1)   # what I receive, [source, j]
  my_start_J = jax.lax.dynamic_slice_in_dim(start_E, me * e_loc, e_loc)
  my_before_SJ = jax.lax.dynamic_slice_in_dim(before_SE, me * e_loc, e_loc, axis=1)

  capacity = ep * t * k  # dropless: every slot of every peer may come here
  x_recv = ragged_all_to_all(
      x_sorted, jnp.zeros((capacity, z_TL.shape[1]), z_TL.dtype),
      _exclusive_cumsum(counts_E), counts_E, start_E + before_SE[me], mine_SJ.reshape(-1), axis_name=EXPERT,
      impl=a2a_impl)
  y_recv = expert_fn(x_recv, mine_SJ.sum(0), *expert_weights)
  # Back: slice (s, j) goes to source s, to where its slots of my expert j sat in its sorted order.
  src_offsets_SE = _exclusive_cumsum(counts_SE, axis=1)
  y_sorted = ragged_all_to_all(
      y_recv, jnp.zeros((t * k, y_recv.shape[1]), y_recv.dtype),
      (my_start_J[None, :] + my_before_SJ).reshape(-1), mine_SJ.reshape(-1),
      jax.lax.dynamic_slice_in_dim(src_offsets_SE, me * e_loc, e_loc, axis=1).reshape(-1), counts_E,
      axis_name=EXPERT, impl=a2a_impl)
  return moe_dispatch.combine(y_sorted, weights_TK, p, z_TL.dtype)


def expert_parallel_routed_outputs(z_TL, expert_ids_TK, weights_TK, expert_weights, *, mesh: Mesh,
                                   num_experts: int, expert_fn: Callable, a2a_impl: str = "auto"):
  """`local_routed_outputs` with the experts sharded over `expert` and the tokens over all devices.

  `expert_weights`: arrays with the expert axis first (sharded over `expert`); `expert_fn(x_ML, group_sizes_G,
  *local_weights) -> y_ML` runs the local experts on rows grouped by expert (rows past the groups: anything).
  """
  check_mesh(mesh, num_experts, z_TL.shape[0])
  tok, exp = P(TOKENS), P(EXPERT)
  fn = jax.shard_map(
      lambda z, ids, w, ws: _ep_routed_outputs(z, ids, w, ws, num_experts=num_experts, expert_fn=expert_fn,
                                               a2a_impl=a2a_impl),
      mesh=mesh, in_specs=(tok, tok, tok, exp), out_specs=tok,
      # Mosaic-GPU kernels type their outputs as replicated, which check_vma would reject in the custom VJP;
      # unchecked, shard_map still sums the experts' gradients over `data` (their in_spec does not name it).
      check_vma=False)
  if not all(t == AxisType.Explicit for t in mesh.axis_types):
    return fn(z_TL, expert_ids_TK, weights_TK, expert_weights)
  # Explicit axes: shard_map takes its inputs as in_specs says, and the result goes back to the tokens' sharding.
  reshard = lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec))
  out = fn(reshard(z_TL, tok), reshard(expert_ids_TK, tok), reshard(weights_TK, tok),
           [reshard(w, exp) for w in expert_weights])
  return reshard(out, P(jax.typeof(z_TL).sharding.spec[0]))
