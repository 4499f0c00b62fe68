"""Pallas GPU kernels of the AttnRes read-out (docs/design.md, AttnRes): `readout_backward`, the backward pass that
`k3jax.ops.attnres.readout` runs with `backward="kernel"`."""
from pallas_kernels.attnres.readout_bwd import BLOCK_ROWS, readout_backward

__all__ = ["BLOCK_ROWS", "readout_backward"]
