"""SiTU-GLU, the bounded SwiGLU of the dense FFN, the routed and the shared experts (docs/design.md, LatentMoE)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

BETA1 = 4.0
BETA2 = 25.0


def situ_glu(ab_X2F, beta1: float = BETA1, beta2: float = BETA2):
  """`[β1·tanh(a/β1)·σ(a)] ⊙ [β2·tanh(b/β2)]` of the gate units a = `ab[..., 0, :]` and the up units b =
  `ab[..., 1, :]`, `[..., 2, F] -> [..., F]` in ab's dtype; |out| <= β1·β2, and β -> ∞ gives SwiGLU `silu(a)·b`.

  Computed in fp32 and rounded once. The backward pass writes the pair's cotangent as one array in one pass:
  autodiff of the two halves writes each half's cotangent, then pads and adds them (a third pass over 2F columns).
  """
  return _situ_glu(ab_X2F, beta1, beta2)


def _situ_glu_parts(ab_X2F, beta1, beta2):
  """(gate factor, up factor, tanh(a/β1), σ(a), tanh(b/β2)), fp32."""
  a, b = ab_X2F[..., 0, :].astype(jnp.float32), ab_X2F[..., 1, :].astype(jnp.float32)
  ta, sa, tb = jnp.tanh(a / beta1), jax.nn.sigmoid(a), jnp.tanh(b / beta2)
  return beta1 * ta * sa, beta2 * tb, ta, sa, tb


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _situ_glu(ab_X2F, beta1, beta2):
  gate, up, *_ = _situ_glu_parts(ab_X2F, beta1, beta2)
  return (gate * up).astype(ab_X2F.dtype)


def _situ_glu_fwd(ab_X2F, beta1, beta2):
  return _situ_glu(ab_X2F, beta1, beta2), ab_X2F


def _situ_glu_bwd(beta1, beta2, ab_X2F, dout):
  gate, up, ta, sa, tb = _situ_glu_parts(ab_X2F, beta1, beta2)
  dout = dout.astype(jnp.float32)
  da = dout * up * ((1.0 - ta * ta) * sa + beta1 * ta * sa * (1.0 - sa))
  db = dout * gate * (1.0 - tb * tb)
  return (jnp.stack([da, db], axis=-2).astype(ab_X2F.dtype),)


_situ_glu.defvjp(_situ_glu_fwd, _situ_glu_bwd)


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
    h = situ_glu(ab, self.beta1, self.beta2)
    return jnp.einsum("btf,fd->btd", h, self.w_down[...].astype(self.dtype))
