"""The reference for the MLA decode kernel: the same attention in plain JAX, fp32 throughout."""
import jax
import jax.numpy as jnp


def mla_decode_reference(q_BHR, ckv_BLR, lengths_B, *, scale: float):
  """softmax(scale · q̃ ckvᵀ) ckv over each row's first `lengths_B[b]` latents, every step in fp32 (exact products)."""
  q, ckv = q_BHR.astype(jnp.float32), ckv_BLR.astype(jnp.float32)
  s = jnp.einsum("bhr,blr->bhl", q, ckv, precision="highest") * scale
  s = jnp.where(jnp.arange(ckv.shape[1])[None, None] < lengths_B[:, None, None], s, -jnp.inf)
  return jnp.einsum("bhl,blr->bhr", jax.nn.softmax(s, axis=-1), ckv, precision="highest")
