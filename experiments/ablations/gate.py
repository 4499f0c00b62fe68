"""Bounded vs softplus KDA gate, at the op level: inputs, the timed forward+backward, and finiteness at long T.

The bounded gate `g = γ_min·σ(·) ≥ γ_min` lets every 16-token diagonal tile factorise `e^{G_i − G_j}` into
`e^{G_i}·e^{−G_j}` (one matrix product; `|G| ≤ 16·|γ_min|` stays inside the fp32/bf16 range). The softplus gate is
unbounded, so its diagonal tiles take the pairwise path (`lower_bound=None`). `finiteness` runs both at long T with
saturated gates, and the softplus gate through the factorised path as well, to show what the bound prevents.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.numerics import rel_err
from k3jax.ops import kda
from k3jax.ops.kda.testing import kda_outputs_and_grads
from k3jax.train import benchmark

GATES = {"bounded": -5.0, "softplus": None}   # the lower bound each gate lets the ops assume
SATURATED_Z = 30.0                            # gate pre-activation of a saturated gate: σ(·) ≈ 1, softplus(·) ≈ 30
# FLA's kernels with each gate (`experiments.benchmarks.kda.FLA_GATES`), the like-with-like comparison of the claim.
FLA_PATHS = {"bounded": "FLA kernels, safe_gate (GEMM tiles)", "softplus": "FLA kernels, position-wise diagonal"}


def raw_inputs(B: int, T: int, H: int, D: int, *, dtype=jnp.bfloat16, seed: int = 0, saturated: bool = False):
  """(inputs of `kda.fused_kda` by name, an output cotangent `do`): fresh normal draws, K = V = D; `A_log` as the
  layer initialises it (log U[1, 16]). `saturated` shifts the gate pre-activation to +SATURATED_Z: the bounded
  gate then sits at γ_min on every step, the softplus gate at −e^{A_log}·30 (−30 to −480)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
  g_raw = normal(ks[3], (B, T, H, D)) + (SATURATED_Z if saturated else 0.0)
  x = {"q": normal(ks[0], (B, T, H, D)).astype(dtype), "k": normal(ks[1], (B, T, H, D)).astype(dtype),
       "v": normal(ks[2], (B, T, H, D)).astype(dtype), "g_raw": g_raw.astype(dtype),
       "beta_logits": normal(ks[4], (B, T, H)).astype(dtype),
       "A_log": jnp.log(jax.random.uniform(ks[5], (H,), minval=1.0, maxval=16.0)),
       "dt_bias": 0.1 * normal(ks[6], (H, D))}
  return x, normal(ks[7], (B, T, H, D)).astype(dtype)


def fused_fwd_bwd(gate: str, backend: str = "auto"):
  """Jitted `(inputs, do) -> (o, gradients of every input)` of `kda.fused_kda` with `gate`'s parameterisation on
  `backend` (the layer's entry: q/k norm, gate, β sigmoid, chunked KDA). The output stays live, as in training."""
  lower_bound = _lower_bound(gate)

  def run(x):
    return kda.fused_kda(**{n: x[n] for n in kda.FUSED_INPUTS}, lower_bound=lower_bound, backend=backend)[0]

  def forward_backward(x, do):
    o, pullback = jax.vjp(run, x)
    return o, pullback(do.astype(o.dtype))[0]
  return jax.jit(forward_backward)


def timed_variants(platform: str | None = None) -> list[dict]:
  """The (gate, backend) pairs worth timing on `platform` (default: JAX's): on a GPU the bounded gate on "auto"
  (the Pallas kernels) and on the XLA path, and the softplus gate on the XLA path (the kernels refuse unbounded
  gates); elsewhere both gates on the XLA path, the one path there is."""
  platform = platform or jax.default_backend()
  if platform == "gpu":
    return [{"gate": "bounded", "backend": "auto", "path": "Pallas kernels, factorised tiles"},
            {"gate": "bounded", "backend": "xla", "path": "XLA, factorised tiles"},
            {"gate": "softplus", "backend": "xla", "path": "XLA, pairwise diagonal tiles"}]
  return [{"gate": "bounded", "backend": "xla", "path": "XLA, factorised tiles"},
          {"gate": "softplus", "backend": "xla", "path": "XLA, pairwise diagonal tiles"}]


def compiled_variants(shapes, *, dtype=jnp.bfloat16, platform: str | None = None) -> list[dict]:
  """Every `timed_variants` pair at every (B, T, H, D) of `shapes`, compiled ahead: one dict each with the
  variant, "shape", "dtype", "fn" (the compiled `fused_fwd_bwd`) and "args" (its inputs, fresh draws). The
  programs are lowered first and then compiled (`benchmark.compile_lowered`)."""
  rows = []
  for B, T, H, D in shapes:
    x, do = raw_inputs(B, T, H, D, dtype=dtype)
    for v in timed_variants(platform):
      rows.append({**v, "shape": f"{B}x{T}x{H}x{D}", "dtype": jnp.dtype(dtype).name, "args": (x, do),
                   "lowered": fused_fwd_bwd(v["gate"], v["backend"]).lower(x, do)})
  compiled = benchmark.compile_lowered({i: r.pop("lowered") for i, r in enumerate(rows)})
  return [{**r, "fn": compiled[i][0]} for i, r in enumerate(rows)]


FINITENESS_CASES = (
    {"case": "bounded gate, factorised tiles", "gate": "bounded", "lower_bound": -5.0},
    {"case": "softplus gate, pairwise tiles", "gate": "softplus", "lower_bound": None},
    {"case": "softplus gate forced through factorised tiles", "gate": "softplus", "lower_bound": -5.0},
)


def finiteness(B: int, T: int, H: int, D: int, *, dtype=jnp.bfloat16, seed: int = 0, backend: str = "auto"):
  """`kda.chunk_kda` at length T with saturated gates, for each of FINITENESS_CASES: whether o, the final state
  and every gradient (q, k, v, g, β, initial state) are finite, and o's error against the fp32 recurrence. The
  third case breaks the promise `g >= lower_bound` on purpose: the factorised tiles then overflow."""
  x, _ = raw_inputs(B, T, H, D, dtype=dtype, seed=seed, saturated=True)
  S0 = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, H, D, D), jnp.float32)

  def measure(case):
    q, k, g, beta = kda.fused_inputs(x["q"], x["k"], x["g_raw"], x["beta_logits"], x["A_log"], x["dt_bias"],
                                     lower_bound=_lower_bound(case["gate"]))
    inputs = {"q": q, "k": k, "v": x["v"], "g": g, "beta": beta}   # g and β in fp32, as the layer passes them
    op = functools.partial(kda.chunk_kda, lower_bound=case["lower_bound"], backend=backend)
    o, S, grads = kda_outputs_and_grads(op, inputs, S0)
    ref, _ = kda.naive_recurrent_kda(*(inputs[n].astype(jnp.float32) for n in ("q", "k", "v", "g", "beta")),
                                     initial_state=S0)
    finite = lambda a: bool(np.all(np.isfinite(np.asarray(a, np.float32))))
    return {**case, "B": B, "T": T, "H": H, "D": D, "dtype": jnp.dtype(dtype).name,
            "g_min": float(jnp.min(g)), "g_max": float(jnp.max(g)), "finite_o": finite(o), "finite_state": finite(S),
            "finite_grads": {n: finite(v) for n, v in grads.items()}, "rel_err_o": rel_err(o, ref)}

  return [measure(case) for case in FINITENESS_CASES]


def _lower_bound(gate: str):
  if gate not in GATES:
    raise ValueError(f"gate must be one of {sorted(GATES)}, got {gate!r}")
  return GATES[gate]
