"""Building blocks shared by the layers: bias-free projections (full or low rank), RMSNorm, the embedding lookup.

Parameters are stored in fp32 (the master copy); each module computes in its `dtype`. Projections are initialised
N(0, 1/fan_in) so that unit-scale inputs give unit-scale outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

# Up to this vocabulary a lookup's gradient is a one-hot matrix product (2·V·d FLOPs per token): autodiff's
# scatter-add would have each token's row collide with about T/V others on the GPU's atomics (some 250 per row for the
# byte vocabulary at 65,536 tokens a step).
ONE_HOT_GRAD_MAX_VOCAB = 2048


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


def embed(table_VD, tokens, dtype=jnp.float32):
  """`table[tokens]`, `[..., d]` in the table's dtype. Up to ONE_HOT_GRAD_MAX_VOCAB rows its gradient is
  `one_hot(tokens)ᵀ · dy` in `dtype` with fp32 accumulation (fp32: exact to summation order; bf16: dy rounded once),
  not a scatter-add. Tokens index as `jnp.take`'s: negative ones from the end; outside [-V, V) they read NaN and get
  no gradient."""
  if table_VD.shape[0] > ONE_HOT_GRAD_MAX_VOCAB:
    return jnp.take(table_VD, tokens, axis=0)
  return _one_hot_grad_lookup(table_VD, tokens, jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _one_hot_grad_lookup(table_VD, tokens, dtype):
  return jnp.take(table_VD, tokens, axis=0)


def _one_hot_grad_lookup_fwd(table_VD, tokens, dtype):
  return jnp.take(table_VD, tokens, axis=0), (table_VD, tokens)


def _one_hot_grad_lookup_bwd(dtype, res, dy):
  table_VD, tokens = res
  vocab = table_VD.shape[0]
  one_hot = jax.nn.one_hot(jnp.where(tokens < 0, tokens + vocab, tokens), vocab, dtype=dtype)
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  d_table = jnp.einsum("...v,...d->vd", one_hot, dy.astype(dtype), preferred_element_type=jnp.float32,
                       precision=precision)
  return d_table.astype(table_VD.dtype), None


_one_hot_grad_lookup.defvjp(_one_hot_grad_lookup_fwd, _one_hot_grad_lookup_bwd)
