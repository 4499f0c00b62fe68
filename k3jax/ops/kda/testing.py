"""What the KDA tests and benchmarks share: fresh random inputs, the float64 NumPy recurrence, the output-and-gradient
probe of a random linear functional, and the benchmark's checks of a fast path against the XLA path in fp32 (with
an anchor's errors, e.g. FLA's, on the same inputs beside them)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.numerics import rel_err
from k3jax.ops.kda.api import FUSED_INPUTS, chunk_kda, fused_kda
from k3jax.ops.kda.gate import fused_inputs, kda_gate

# The benchmark's tolerances in bf16 against the fp32 XLA path (docs/design.md, tolerances), by output or gradient.
CHECK_TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2,
             "g_raw": 2e-2, "beta_logits": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}
CHECK_CASES = ("random", "gates_at_bound", "fused", "packed", "repeated_keys")
# The tolerances hold for random inputs; repeated keys are reported, not held to them.
GATED_CASES = ("random", "gates_at_bound", "fused", "packed")


def random_inputs(seed, B, T, H, K, V, *, gate="bounded", saturate=None, dtype=jnp.float32, segments=False):
  """Fresh random q,k (L2-normalised), v, g (from the gate), beta, initial state and segment ids."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = l2(jax.random.normal(ks[0], (B, T, H, K)))
  k = l2(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, H, V))
  g_raw = 3.0 * jax.random.normal(ks[3], (B, T, H, K))
  A_log = jnp.log(jax.random.uniform(ks[4], (H,), minval=1.0, maxval=16.0))
  dt_bias = jax.random.normal(ks[5], (H, K))
  g = kda_gate(g_raw, A_log, dt_bias, lower_bound=-5.0 if gate == "bounded" else None)
  if saturate is not None:
    g = jnp.full_like(g, saturate)
  beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
  S0 = jax.random.normal(ks[7], (B, H, K, V))
  seg = None
  if segments:
    starts = jax.random.bernoulli(jax.random.fold_in(ks[7], 1), 0.05, (B, T))
    seg = jnp.cumsum(starts, axis=1).astype(jnp.int32)
  cast = lambda x: x.astype(dtype)
  return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta)), S0, seg


def raw_inputs(B, T, H, D, dtype, seed=0):
  """`fused_kda`'s raw inputs by name (q, k, v, g_raw, beta_logits in `dtype`; A_log, dt_bias fp32; K = V = D) and
  an output cotangent: fresh normal draws, as the layer's projections give them."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  x = dict(q=jax.random.normal(ks[0], (B, T, H, D), dtype), k=jax.random.normal(ks[1], (B, T, H, D), dtype),
           v=jax.random.normal(ks[2], (B, T, H, D), dtype), g_raw=jax.random.normal(ks[3], (B, T, H, D), dtype),
           beta_logits=jax.random.normal(ks[4], (B, T, H), dtype),
           A_log=jnp.log(jax.random.uniform(ks[5], (H,), minval=1.0, maxval=16.0)),
           dt_bias=jax.random.normal(ks[6], (H, D)))
  return x, jax.random.normal(ks[7], (B, T, H, D), dtype)


def numpy_recurrence(q, k, v, g, beta, S0, seg=None, scale=None):
  """The recurrence (docs/design.md, KDA) in float64, written independently of the JAX code."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  B, T, H, K = q.shape
  scale = K ** -0.5 if scale is None else scale
  S = np.array(S0, np.float64).copy()
  o = np.zeros(v.shape)
  for t in range(T):
    if seg is not None and t > 0:
      S[np.asarray(seg)[:, t] != np.asarray(seg)[:, t - 1]] = 0.0
    S = np.exp(g[:, t])[..., None] * S
    u = beta[:, t][..., None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S))
    S = S + np.einsum("bhk,bhv->bhkv", k[:, t], u)
    o[:, t] = np.einsum("bhk,bhkv->bhv", scale * q[:, t], S)
  return o, S


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


def check_case(x, case, *, lower_bound, backend="pallas", kernel_options=None, anchor=None):
  """`backend` (with `kernel_options`) in the inputs' dtype against the XLA path in fp32 on the same (upcast) inputs:
  o, the final state and every gradient. Returns (errors by name, all within CHECK_TOL, the anchor's errors against
  the same reference on the fused case or None). `x`: `raw_inputs`' first output; `anchor`: S0 -> (o, final state,
  gradients by our names) of the same functional (`kda_cotangents`) on the fused entry, or None.
  The q/k L2 norm, gate and β sigmoid are applied first, as the layer does. Cases: random gates; every gate at the
  bound; the fused entry on the raw projections (the kernels' own norm, gate and sigmoid, and the gradients through
  them to A_log and dt_bias); packed documents (about 300 tokens each, starts anywhere in a tile, one always
  mid-tile); one key repeated through the sequence with β ≈ 1 and no decay (I + A_kk is then as far from the
  identity as it gets). The fused and packed cases also check the undifferentiated forward (no residuals)."""
  if case not in CHECK_CASES:
    raise ValueError(f"case must be one of {CHECK_CASES}, got {case!r}")
  B, T, H, K = x["q"].shape
  S0 = jax.random.normal(jax.random.PRNGKey(3), (B, H, K, x["v"].shape[-1]), jnp.float32)
  seg = None
  if case == "fused":
    inputs = {n: x[n] for n in FUSED_INPUTS}
    entry = fused_kda
  else:
    q, k, g, beta = fused_inputs(*(x[n] for n in ("q", "k", "g_raw", "beta_logits", "A_log", "dt_bias")),
                                 lower_bound=lower_bound)
    if case == "gates_at_bound":
      g = jnp.full_like(g, lower_bound)
    elif case == "repeated_keys":
      k = jnp.broadcast_to(k[:, :1], k.shape)
      g, beta = jnp.full_like(g, -1e-3), jnp.full_like(beta, 0.99)
    elif case == "packed":
      starts = jax.random.bernoulli(jax.random.PRNGKey(4), 1 / 300, (B, T)).at[:, min(T - 1, T // 2 + 7)].set(True)
      seg = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    inputs = dict(q=q, k=k, v=x["v"], g=g, beta=beta)
    entry = chunk_kda
  fast = lambda **kw: entry(**kw, lower_bound=lower_bound, backend=backend, kernel_options=kernel_options)
  xla = lambda **kw: entry(**kw, lower_bound=lower_bound, backend="xla")
  o, S, grads = kda_outputs_and_grads(fast, inputs, S0, seg)
  o_ref, S_ref, grads_ref = kda_outputs_and_grads(xla, {n: a.astype(jnp.float32) for n, a in inputs.items()}, S0, seg)
  errors = lambda o, S, grads: {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref),
                                **{n: rel_err(grads[n], grads_ref[n]) for n in grads_ref}}
  errs = errors(o, S, grads)
  if case in ("fused", "packed"):  # undifferentiated, the forward writes no residuals (save=False): check it too
    o_fwd, S_fwd = jax.jit(lambda x, S0: fast(**x, initial_state=S0, output_final_state=True,
                                              segment_ids=seg))(inputs, S0)
    errs.update(o_fwd=rel_err(o_fwd, o_ref), S_fwd=rel_err(S_fwd, S_ref))
  anchor_errs = errors(*anchor(S0)) if anchor is not None and case == "fused" else None
  return errs, all(e <= CHECK_TOL[n.removesuffix("_fwd")] for n, e in errs.items()), anchor_errs
