"""Grouped GEMM for MoE experts: forward, dX and dW kernels behind one differentiable op, and a gated expert with
its unit in the kernels' epilogues (see ops.py)."""
from pallas_kernels.grouped_gemm.mosaic import Configs, TileConfig
from pallas_kernels.grouped_gemm.ops import BACKENDS, GluTiles, GroupedGemmOptions, glu_ffn, grouped_matmul

__all__ = ["BACKENDS", "Configs", "GluTiles", "GroupedGemmOptions", "TileConfig", "glu_ffn", "grouped_matmul"]
