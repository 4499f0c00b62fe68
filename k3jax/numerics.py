"""The error measure (docs/design.md, tolerances) and the output-and-gradient probe of the KDA tests and benchmarks."""
import jax
import jax.numpy as jnp
import numpy as np


def rel_err(out, ref) -> float:
  """RMS(out − ref) / RMS(ref) in float64; NaN or Inf anywhere in `out` gives inf."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(out)):
    return float("inf")
  return float(np.sqrt(np.mean((out - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def kda_cotangents(o_shape, S_shape, cot_seed=0):
  """The random linear functional of `kda_outputs_and_grads`: fp32 weights of o and of the final state (fp32 also
  under x64, so a float64 reference sees the same functional; another library's run can take them too)."""
  ko, ks = jax.random.split(jax.random.PRNGKey(cot_seed))
  return jax.random.normal(ko, o_shape, jnp.float32), jax.random.normal(ks, S_shape, jnp.float32)


def kda_outputs_and_grads(fn, inputs, S0, segment_ids=None, cot_seed=0):
  """(o, final state, grads) of a random linear functional of (o, final state) for a chunk_kda-like `fn`;
  grads maps each name in `inputs` and "initial_state" to its gradient."""
  def loss(x, S0):
    o, S = fn(**x, initial_state=S0, output_final_state=True, segment_ids=segment_ids)
    co, cs = kda_cotangents(o.shape, S.shape, cot_seed)
    return jnp.sum(o.astype(jnp.float32) * co) + jnp.sum(S * cs), (o, S)
  (_, (o, S)), (gx, gs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(inputs, S0)
  return o, S, {**gx, "initial_state": gs}
