"""Pallas GPU kernels for chunked KDA with the bounded decay gate (docs/design.md, KDA)."""
from pallas_kernels.kda.chunk import chunk_kda_pallas

__all__ = ["chunk_kda_pallas"]
