"""What the read-out's two kernels share: the column slice of their loads, and the load of one value's tile that
reads only the rows where the value counts."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton


def column_slice(d: int) -> int:
  """The widest power of two that divides D (the kernels' column slice: Triton's loads are powers of two)."""
  return d & -d


def load_value(buf_ref, val_refs, C: int, n: int, sl, rows_R, cols: int):
  """Value n's tile in the column slice `sl`: buffer slot n (n < C) or single value n − C, read only in the rows
  where `rows_R` is true and zeros elsewhere (a masked load: rows not read cost no traffic)."""
  ref = buf_ref.at[jnp.int32(n), :, sl] if n < C else val_refs[n - C].at[:, sl]
  return pltriton.load(ref, mask=jnp.broadcast_to(rows_R[:, None], (rows_R.shape[0], cols)), other=0.0)
