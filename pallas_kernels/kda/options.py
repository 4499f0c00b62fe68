"""The Pallas KDA kernels' options as data: the form each pass takes, its blocking, and every Triton launch's
parameters, in one frozen value passed explicitly from the entry (`chunk_kda(..., kernel_options=...)`) down to
each launch. The defaults are the fastest measured on the H200 (BUILD_NOTES.md, KDA kernels); a benchmark sweeps
variants by passing other values.

A new form of the backward's column pass is one more value of `COLS_FORMS` and its walk in `bwd._PAIR_WALKS`."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

SOLVES = ("triton", "mosaic")        # the intra pass's solve: `fwd._solve_kernel` or `solve_mosaic.solve`
STATE_PASSES = ("triton", "mosaic")  # the sequential passes: `fwd.state_forward` / `bwd.state_backward`'s Triton
                                     # kernels or `state_mosaic`'s
COLS_FORMS = ("loop", "unrolled")    # the backward column pass's pair products (`bwd._pair_products`)


class Launch(NamedTuple):
  """Triton launch parameters of one kernel."""
  num_warps: int
  num_stages: int


# Each Triton kernel's launch by its name (`kda_` + the field of `KDAKernelOptions` that overrides it). The state
# passes' defaults depend on their column block: `state_bwd_launch`.
DEFAULT_LAUNCHES = {
    "prepare": Launch(4, 1),
    "intra_fwd_key_tiles": Launch(2, 3),
    "intra_fwd_solve": Launch(4, 1),
    "state_fwd": Launch(4, 2),            # 4 warps beat 8 at every column block
    "state_segment_maps": Launch(4, 2),
    "state_bwd": None,
    "state_grads": Launch(4, 1),
    "intra_bwd_rows": Launch(4, 1),
    "intra_bwd_cols": Launch(4, 3),       # 3 stages prefetch the next tile's keys and queries in the pair loops
    "intra_bwd_dg": Launch(4, 1),
}
FORWARD_LAUNCHES = ("prepare", "intra_fwd_key_tiles", "intra_fwd_solve", "state_fwd", "state_segment_maps")


@dataclasses.dataclass(frozen=True)
class KDAKernelOptions:
  """How the Pallas kernels run; None fields take their default for the call's shapes and dtype.

  block_v: value columns per program of the sequential passes (both); None: `chunk.default_block_v` for each.
  segments: runs the forward's state pass is cut into; None: `chunk.default_segments`.
  state_pass: "triton" or "mosaic" (`STATE_PASSES`); None: Mosaic GPU's where `state_mosaic.available`.
  solve: "triton" or "mosaic" (`SOLVES`); None: Mosaic GPU's where `solve_mosaic.available`.
  invert_diagonal: with the Mosaic solve, the undifferentiated forward's key tiles invert B's 16x16 diagonal blocks
    (`fwd.intra_forward`); the forward that keeps the backward's residuals never does.
  key_tiles_block_k: K columns per step of the key-tile launch; None: min(K, 32).
  solve_block_cols: columns of U and W per step of the Triton solve.
  state_grads_block_k: K columns per program of the state-gradient products.
  bwd_block_k: K columns per program of the backward's column pass and dg sum (`bwd.intra_backward`).
  cols_form: the backward column pass's form (`COLS_FORMS`, `bwd._pair_products`).
  The remaining fields, one per Triton kernel `kda_<field>`, override its `Launch` (`DEFAULT_LAUNCHES`); one given
  for a kernel that does not run (a Mosaic GPU pass in its place) is an error.
  """
  block_v: int | None = None
  segments: int | None = None
  state_pass: str | None = None
  solve: str | None = None
  invert_diagonal: bool = True
  key_tiles_block_k: int | None = None
  solve_block_cols: int = 64
  state_grads_block_k: int = 64
  bwd_block_k: int = 64
  cols_form: str = "loop"
  prepare: Launch | None = None
  intra_fwd_key_tiles: Launch | None = None
  intra_fwd_solve: Launch | None = None
  state_fwd: Launch | None = None
  state_segment_maps: Launch | None = None
  state_bwd: Launch | None = None
  state_grads: Launch | None = None
  intra_bwd_rows: Launch | None = None
  intra_bwd_cols: Launch | None = None
  intra_bwd_dg: Launch | None = None

  def __post_init__(self):
    for name, value, allowed in (("state_pass", self.state_pass, STATE_PASSES), ("solve", self.solve, SOLVES),
                                 ("cols_form", self.cols_form, COLS_FORMS)):
      if value is not None and value not in allowed:
        raise ValueError(f"KDAKernelOptions.{name} must be one of {allowed}" + (" or None" if name != "cols_form"
                         else "") + f", got {value!r}")
    for name in ("block_v", "segments", "key_tiles_block_k", "solve_block_cols", "state_grads_block_k",
                 "bwd_block_k"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, int) and value > 0):
        raise ValueError(f"KDAKernelOptions.{name} must be a positive integer, got {value!r}")
    for name in DEFAULT_LAUNCHES:
      value = getattr(self, name)
      if value is not None and not (isinstance(value, tuple) and len(value) == 2
                                    and all(isinstance(p, int) and p > 0 for p in value)):
        raise ValueError(f"KDAKernelOptions.{name} must be a Launch(num_warps, num_stages) of positive integers, "
                         f"got {value!r}")
      if value is not None and not isinstance(value, Launch):
        object.__setattr__(self, name, Launch(*value))

  def launch(self, name: str) -> Launch:
    """The launch of kernel `kda_<name>` (not `state_bwd`'s: `state_bwd_launch`)."""
    return getattr(self, name) or DEFAULT_LAUNCHES[name]

  def state_bwd_launch(self, block_v: int) -> Launch:
    """The Triton reverse state pass's launch: 8 warps above 64 value columns per program, else 4; 2 stages."""
    return self.state_bwd or Launch(8 if block_v > 64 else 4, 2)

  def with_launches(self, **launches) -> KDAKernelOptions:
    """A copy with these kernels' launches (by field name: `prepare=Launch(4, 1)`) merged over the current ones; a
    partial override ({"num_stages": 3}) keeps the other parameter."""
    unknown = sorted(set(launches) - set(DEFAULT_LAUNCHES))
    if unknown:
      raise ValueError(f"no kernel launch named {unknown}; the launches are {sorted(DEFAULT_LAUNCHES)}")
    merged = {}
    for name, value in launches.items():
      if isinstance(value, dict):
        base = getattr(self, name) or DEFAULT_LAUNCHES[name]
        if base is None and set(value) != set(Launch._fields):
          raise ValueError(f"{name}'s default launch depends on the call; give both of {Launch._fields}")
        value = (base or Launch(0, 0))._replace(**value)
      merged[name] = value
    return dataclasses.replace(self, **merged)
