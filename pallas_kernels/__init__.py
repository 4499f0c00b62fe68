"""Pallas GPU kernels. Every Triton kernel goes through `pallas_kernels.triton_call`, the one place that knows the
lowering (Triton today, deprecated upstream) and runs kernels in interpret mode off the GPU; `mosaic_gpu_reason`
says whether a Mosaic GPU kernel applies."""
from pallas_kernels._triton import barrier, interpret_mode, mosaic_gpu_reason, triton_call, triton_launches

__all__ = ["barrier", "interpret_mode", "mosaic_gpu_reason", "triton_call", "triton_launches"]
