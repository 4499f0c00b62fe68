"""Pallas GPU kernels for chunked KDA with the bounded decay gate (docs/design.md, KDA): `chunk_kda_pallas`, the
differentiable entry `k3jax.ops.kda.chunk_kda` calls, and `KDAKernelOptions`, the kernels' options as data."""
from pallas_kernels.kda.chunk import chunk_kda_pallas
from pallas_kernels.kda.options import KDAKernelOptions, Launch

__all__ = ["KDAKernelOptions", "Launch", "chunk_kda_pallas"]
