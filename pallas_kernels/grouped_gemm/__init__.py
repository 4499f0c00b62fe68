"""Grouped GEMM for MoE experts: forward, dX and dW kernels behind one differentiable op (see ops.py)."""
from pallas_kernels.grouped_gemm.mosaic import Configs, TileConfig
from pallas_kernels.grouped_gemm.ops import BACKENDS, grouped_matmul

__all__ = ["BACKENDS", "Configs", "TileConfig", "grouped_matmul"]
