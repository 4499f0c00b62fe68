"""Pallas GPU kernels. Every Triton kernel goes through `pallas_kernels.triton_call`, the one place that knows the
lowering (Triton today, deprecated upstream) and runs kernels in interpret mode off the GPU; `fp32_products` is
the precision of their exact fp32 products, `mosaic_gpu_reason` says whether a Mosaic GPU kernel applies."""
from pallas_kernels._triton import (barrier, fp32_products, interpret_mode, mosaic_gpu_reason, triton_call,
                                   triton_launches)

__all__ = ["barrier", "fp32_products", "interpret_mode", "mosaic_gpu_reason", "triton_call", "triton_launches"]
