"""Pallas GPU kernel of the short convolution's backward pass (`k3jax.ops.short_conv`, `backward="kernel"`)."""
from pallas_kernels.short_conv.backward import applies, conv_backward

__all__ = ["applies", "conv_backward"]
