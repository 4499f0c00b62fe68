"""Pallas GPU kernels. Every kernel goes through `pallas_kernels.triton_call`, the one place that knows the
lowering (Triton today, deprecated upstream) and runs kernels in interpret mode off the GPU."""
from pallas_kernels._triton import barrier, interpret_mode, triton_call

__all__ = ["barrier", "interpret_mode", "triton_call"]
