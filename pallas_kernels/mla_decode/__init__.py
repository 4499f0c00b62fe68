"""A Pallas (Triton) kernel for absorbed MLA decode attention over a long latent cache, split-K (docs/design.md,
gated MLA)."""
from pallas_kernels.mla_decode.decode import DecodeConfig, mla_decode
from pallas_kernels.mla_decode.naive import mla_decode_reference

__all__ = ["DecodeConfig", "mla_decode", "mla_decode_reference"]
