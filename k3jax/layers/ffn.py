"""SiTU-GLU, the bounded SwiGLU of the dense FFN, the routed and the shared experts (docs/design.md, LatentMoE)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

BETA1 = 4.0
BETA2 = 25.0


@dataclasses.dataclass(frozen=True)
class SiTU:
  """The SiTU gated unit `h = [β1·tanh(a/β1)·σ(a)] ⊙ [β2·tanh(b/β2)]` of gate units a and up units b, elementwise;
  |h| <= β1·β2, and β -> ∞ gives SwiGLU's `silu(a)·b`. Static (hashable): a grouped GEMM's epilogue takes it."""
  beta1: float = BETA1
  beta2: float = BETA2

  def __call__(self, a, b):
    return (self.beta1 * jnp.tanh(a / self.beta1) * jax.nn.sigmoid(a)) * (self.beta2 * jnp.tanh(b / self.beta2))

  def grads(self, a, b, dh):
    """(da, db): the cotangents of a and b for h's cotangent dh (the epilogue's backward, checked against
    autodiff of `__call__`)."""
    ta, tb, sa = jnp.tanh(a / self.beta1), jnp.tanh(b / self.beta2), jax.nn.sigmoid(a)
    gate, up = self.beta1 * ta * sa, self.beta2 * tb
    return dh * up * ((1.0 - ta * ta) * sa + gate * (1.0 - sa)), dh * gate * (1.0 - tb * tb)


def situ_glu(ab_X2F, beta1: float = BETA1, beta2: float = BETA2):
  """`SiTU(beta1, beta2)` of the gate units `ab[..., 0, :]` and the up units `ab[..., 1, :]`, `[..., 2, F] ->
  [..., F]`.

  Computed in ab's dtype and differentiated by autodiff, as a bf16 SwiGLU is: in a GPU train step this ran faster
  than an fp32 form rounded once with a hand-written backward pass (docs/design.md, LatentMoE). The routed experts
  on Hopper run `SiTU` in their grouped GEMMs' epilogues instead (`pallas_kernels.grouped_gemm.glu_ffn`,
  `moe.glu_epilogue`).
  """
  return SiTU(beta1, beta2)(ab_X2F[..., 0, :], ab_X2F[..., 1, :])


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
