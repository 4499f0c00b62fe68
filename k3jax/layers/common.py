"""Building blocks shared by the layers: bias-free projections (full or low rank) and RMSNorm.

Parameters are stored in fp32 (the master copy); each module computes in its `dtype`. Projections are initialised
N(0, 1/fan_in) so that unit-scale inputs give unit-scale outputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(rngs: nnx.Rngs, shape, std: float) -> nnx.Param:
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


class Linear(nnx.Module):
  """`x W` without bias, d_in -> d_out; with `rank` it is the low-rank product `(x W_a) W_b`, d_in -> rank -> d_out."""

  def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, rank: int | None = None):
    if rank is None:
      self.w = normal_param(rngs, (d_in, d_out), d_in ** -0.5)
      self.w_b = None
    else:
      self.w = normal_param(rngs, (d_in, rank), d_in ** -0.5)
      self.w_b = normal_param(rngs, (rank, d_out), rank ** -0.5)
    self.dtype = dtype

  def __call__(self, x):
    y = jnp.einsum("...i,io->...o", x.astype(self.dtype), self.w[...].astype(self.dtype))
    if self.w_b is not None:
      y = jnp.einsum("...r,ro->...o", y, self.w_b[...].astype(self.dtype))
    return y


def rms_norm(x, weight, eps: float):
  """`x / RMS(x) · weight` over the last axis, computed in fp32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned weight (initialised to one)."""

  def __init__(self, dim: int, *, eps: float = 1e-6):
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.weight[...], self.eps)
