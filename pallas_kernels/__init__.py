"""Pallas GPU kernels. Every kernel goes through `pallas_kernels.triton_call`, the one place that knows the
lowering (Triton today, deprecated upstream) and runs kernels in interpret mode off the GPU."""
from pallas_kernels._triton import interpret_mode, triton_call

__all__ = ["interpret_mode", "triton_call"]
