"""Grouped GEMM for MoE experts: forward, dX and dW kernels behind one differentiable op (see ops.py)."""
from pallas_kernels.grouped_gemm.mosaic import Configs, TileConfig
from pallas_kernels.grouped_gemm.ops import BACKENDS, GroupedGemmOptions, grouped_matmul

__all__ = ["BACKENDS", "Configs", "GroupedGemmOptions", "TileConfig", "grouped_matmul"]
