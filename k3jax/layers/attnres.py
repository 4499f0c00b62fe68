"""Attention residuals (docs/design.md, AttnRes): each sub-layer reads a softmax over depth of earlier representations.

    h_l = Σ_i softmax_i( w_lᵀ RMSNorm_l(v_i) ) · v_i,     w_l ∈ R^d initialised to zero (uniform weights at start)

The residual stream is a `Stream`: completed sources plus the partial sum of the current block.
- "block": sources are v_0 (the embedding) and the completed block sums b_1 … b_{n−1}; the partial sum of the
  current block is one more source. At the first sub-layer of a block that sum is empty and is *left out* of the
  softmax (a zero vector would get key RMSNorm(0) = 0 and still take a share of the weight); this matches the
  reference pseudocode, where the block that just closed is the last source instead.
- "full": every sub-layer output is a source of its own (a block of one sub-layer).
- "none": the standard pre-norm residual; the stream is the running sum x_0 + Σ f_l and is each sub-layer's input.
The stream is kept in fp32.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import RMSNorm


@flax.struct.dataclass
class Stream:
  """Completed sources (a tuple of `[B,T,D]`) and the current block's partial sum (`[B,T,D]`, or None when empty)."""
  sources: tuple
  partial: jax.Array | None


def start(x0_BTD, mode: str) -> Stream:
  x0 = x0_BTD.astype(jnp.float32)
  return Stream((), x0) if mode == "none" else Stream((x0,), None)


def add(stream: Stream, y_BTD, *, close: bool) -> Stream:
  """Adds a sub-layer output to the partial sum; `close` makes that sum a completed source (ignored in "none")."""
  y = y_BTD.astype(jnp.float32)
  partial = y if stream.partial is None else stream.partial + y
  if close and stream.sources:
    return Stream(stream.sources + (partial,), None)
  return Stream(stream.sources, partial)


class DepthAttention(nnx.Module):
  """One AttnRes read-out: a zero-initialised pseudo-query and the RMSNorm of its keys."""

  def __init__(self, d_model: int, *, eps: float = 1e-6):
    self.query = nnx.Param(jnp.zeros((d_model,), jnp.float32))
    self.key_norm = RMSNorm(d_model, eps=eps)

  def __call__(self, stream: Stream):
    """The input of the next sub-layer: softmax-weighted sum over the sources and the non-empty partial sum."""
    values = stream.sources + (() if stream.partial is None else (stream.partial,))
    v_NBTD = jnp.stack(values)
    logits_NBT = jnp.einsum("d,nbtd->nbt", self.query[...], self.key_norm(v_NBTD))
    weights_NBT = jax.nn.softmax(logits_NBT, axis=0)
    # Recorded only under `nnx.capture(..., nnx.Intermediate)` (k3jax.ablations.residual.depth_weights reads it).
    self.sow(nnx.Intermediate, "weights", weights_NBT, capture_noop=True)
    return jnp.einsum("nbt,nbtd->btd", weights_NBT, v_NBTD)


def read(stream: Stream, attn: DepthAttention | None):
  """A sub-layer's input: the AttnRes read-out, or the running sum when there is no AttnRes ("none")."""
  return stream.partial if attn is None else attn(stream)
