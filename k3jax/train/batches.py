"""Host rows to device batches: rows split over all mesh devices (`data` × `expert`, as the MoE layer expects
its tokens), and a step's batch shaped `[micro_batches, rows, T]`."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import parallel


def rows_sharding(mesh) -> NamedSharding:
  """`[N, T]` rows: N over every device."""
  return NamedSharding(mesh, P(parallel.TOKENS))


def micro_batch_sharding(mesh) -> NamedSharding:
  """`[A, M, T]` micro-batches: M over every device."""
  return NamedSharding(mesh, P(None, parallel.TOKENS))


def to_device(arrays: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  """Global arrays from host arrays every process holds in full (each process places its own shards)."""
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in arrays.items()}


def train_batch(mixture, step_in_stage: int, batch_size: int, micro_batches: int, mesh) -> dict[str, jax.Array]:
  """The batch of a stage's step: rows `step·B .. (step+1)·B − 1` of the stage's mixture, `[A, B/A, T]`."""
  per_micro = batch_size // micro_batches
  if per_micro * micro_batches != batch_size or per_micro % mesh.size:
    raise ValueError(f"batch_size {batch_size} must split into config.micro_batches={micro_batches} micro-batches "
                     f"whose rows divide by the {mesh.size} mesh devices")
  rows = mixture.rows(step_in_stage * batch_size, (step_in_stage + 1) * batch_size)
  rows = {k: v.reshape(micro_batches, per_micro, *v.shape[1:]) for k, v in rows.items()}
  return to_device(rows, micro_batch_sharding(mesh))
