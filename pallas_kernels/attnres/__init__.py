"""Pallas GPU kernels of the AttnRes read-out (docs/design.md, AttnRes): `readout_forward` and `readout_backward`,
the passes that `k3jax.ops.attnres.readout` runs with `forward="kernel"` and `backward="kernel"`."""
from pallas_kernels.attnres.readout_bwd import BLOCK_ROWS as BACKWARD_BLOCK_ROWS, readout_backward
from pallas_kernels.attnres.readout_fwd import BLOCK_ROWS as FORWARD_BLOCK_ROWS, readout_forward

__all__ = ["BACKWARD_BLOCK_ROWS", "FORWARD_BLOCK_ROWS", "readout_backward", "readout_forward"]
