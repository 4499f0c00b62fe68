"""Shared helpers for KDA tests: random inputs and the float64 NumPy recurrence."""
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.numerics import rel_err  # noqa: F401 (re-exported for the tests)
from k3jax.ops import kda


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
  g = kda.kda_gate(g_raw, A_log, dt_bias, lower_bound=-5.0 if gate == "bounded" else None)
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


def cuda_module_text(monkeypatch, fn, *args) -> str:
  """StableHLO of `jax.jit(fn)` exported for CUDA from this CPU, the kernels lowered through Pallas's Triton
  lowering (not interpret mode) for a GPU described as an H200."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0")
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: registration.gpu_info_lib.GpuInfo(
      gpu_version=None, arch_name="9.0", compute_capability=90))
  triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(*args).mlir_module()

