"""Pallas GPU kernels for chunked KDA with the bounded decay gate (SPEC.md §2)."""
from pallas_kernels.kda.chunk import chunk_kda_pallas

__all__ = ["chunk_kda_pallas"]
