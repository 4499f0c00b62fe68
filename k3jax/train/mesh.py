"""The device mesh of a run from `config.mesh`: `"data:N,expert:M"`, where one size may be -1 (all the devices
the other leaves), e.g. the default `"data:-1,expert:1"`: every device on `data`."""
from __future__ import annotations

import jax
from jax.sharding import Mesh

from k3jax import parallel


def resolve(spec: str, num_devices: int) -> str:
  """`spec` with its -1 replaced by the size that uses all `num_devices` devices."""
  sizes = {}
  for part in spec.split(","):
    name, _, size = (x.strip() for x in part.partition(":"))
    ok = name in (parallel.DATA, parallel.EXPERT) and name not in sizes and (
        size == "-1" or (size.isdigit() and int(size) > 0))
    if not ok:
      raise ValueError(f"config.mesh {spec!r}: expected 'data:N,expert:M' with sizes >= 1 or one -1, got {part!r}")
    sizes[name] = int(size)
  if len(sizes) != 2 or list(sizes.values()).count(-1) > 1:
    raise ValueError(f"config.mesh {spec!r}: give both axes 'data' and 'expert', at most one of them -1")
  free = [a for a, s in sizes.items() if s == -1]
  if free:
    other = [s for s in sizes.values() if s != -1][0]
    if num_devices % other:
      raise ValueError(f"config.mesh {spec!r}: {num_devices} devices are not divisible by {other}")
    sizes[free[0]] = num_devices // other
  return f"data:{sizes[parallel.DATA]},expert:{sizes[parallel.EXPERT]}"


def make_mesh(spec: str) -> Mesh:
  return parallel.mesh_from_string(resolve(spec, jax.device_count()))
