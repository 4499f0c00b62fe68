"""SiTU-GLU, the bounded SwiGLU of the dense FFN, the routed and the shared experts (docs/design.md, LatentMoE)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

BETA1 = 4.0
BETA2 = 25.0


def situ_glu(a, b, beta1: float = BETA1, beta2: float = BETA2):
  """`[β1·tanh(a/β1)·σ(a)] ⊙ [β2·tanh(b/β2)]`; |out| <= β1·β2, and β -> ∞ gives SwiGLU `silu(a)·b`."""
  return (beta1 * jnp.tanh(a / beta1) * jax.nn.sigmoid(a)) * (beta2 * jnp.tanh(b / beta2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def situ_glu_stacked(ab, beta1: float = BETA1, beta2: float = BETA2):
  """`situ_glu(ab[..., 0, :], ab[..., 1, :])` of the gate and up units stacked, `[..., 2, F] -> [..., F]`, computed
  in fp32 and returned in ab's dtype. Its backward pass is one elementwise pass that writes the stacked cotangent
  (autodiff through the two slices adds two padded cotangents, one more pass over `[..., 2, F]`)."""
  a, b = ab[..., 0, :].astype(jnp.float32), ab[..., 1, :].astype(jnp.float32)
  return situ_glu(a, b, beta1, beta2).astype(ab.dtype)


def _situ_glu_stacked_fwd(ab, beta1, beta2):
  return situ_glu_stacked(ab, beta1, beta2), ab


def _situ_glu_stacked_bwd(beta1, beta2, ab, dy):
  a, b = ab[..., 0, :].astype(jnp.float32), ab[..., 1, :].astype(jnp.float32)
  ta, tb, sa = jnp.tanh(a / beta1), jnp.tanh(b / beta2), jax.nn.sigmoid(a)
  gate, up, dy = beta1 * ta * sa, beta2 * tb, dy.astype(jnp.float32)
  da = dy * up * ((1.0 - ta * ta) * sa + gate * (1.0 - sa))       # d/da [β1 tanh(a/β1) σ(a)]
  db = dy * gate * (1.0 - tb * tb)                                 # d/db [β2 tanh(b/β2)]
  return (jnp.stack([da, db], axis=-2).astype(ab.dtype),)


situ_glu_stacked.defvjp(_situ_glu_stacked_fwd, _situ_glu_stacked_bwd)


class SiTUGLU(nnx.Module):
  """Dense SiTU-GLU FFN `W_down situ_glu(W_gate x, W_up x)`, d -> hidden -> d."""

  def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16,
               beta1: float = BETA1, beta2: float = BETA2):
    init = nnx.initializers.normal(d_model ** -0.5)
    self.w_gate_up = nnx.Param(init(rngs.params(), (d_model, 2, hidden), jnp.float32))
    self.w_down = nnx.Param(nnx.initializers.normal(hidden ** -0.5)(rngs.params(), (hidden, d_model), jnp.float32))
    self.dtype, self.beta1, self.beta2 = dtype, beta1, beta2

  @jax.named_scope("ffn")
  def __call__(self, x_BTD):
    x = x_BTD.astype(self.dtype)
    ab = jnp.einsum("btd,dgf->btgf", x, self.w_gate_up[...].astype(self.dtype))
    h = situ_glu_stacked(ab, self.beta1, self.beta2)
    return jnp.einsum("btf,fd->btd", h, self.w_down[...].astype(self.dtype))
