"""Pallas GPU kernel of the short convolution's backward pass (`k3jax.ops.short_conv`, `backward="kernel"`)."""
from pallas_kernels.short_conv.backward import DPRE_FORMS, Blocks, applies, dx_and_dw

__all__ = ["DPRE_FORMS", "Blocks", "applies", "dx_and_dw"]
