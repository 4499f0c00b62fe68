"""Inputs and references shared by the Pallas KDA kernels' tests: the cases the launches are held to, the launches
of the forward's intra pass, and the float64 references of their outputs and of the intra backward's."""
import jax
import jax.numpy as jnp

from k3jax.ops.kda.common import IntraOutputs
from k3jax.ops.kda.naive import naive_chunk_intermediates
from k3jax.ops.kda.testing import random_inputs
from pallas_kernels.kda import fwd

# The intra pass's outputs and the tiles' cumulative gates: the names `launches` and `reference_intermediates` give.
OUTPUTS = IntraOutputs._fields + ("loc",)
STATE_PASS_INPUTS = ("w", "u", "qs", "kd", "aqk", "decay")   # what the state pass reads of them


def kernel_case(seed, case, B, T, H, K, V):
  """Inputs (dict, reset mask) of the kernel-level cases: random with resets (mid-tile, at a tile start, at a chunk
  start, two in one tile), every gate at the bound, or repeated keys with no decay."""
  x, _, _ = random_inputs(seed, B, T, H, K, V, saturate=-5.0 if case == "gates_at_bound" else None)
  reset = None
  if case == "random_with_resets":
    reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 16, 37, 41, 64, 100])].set(1)
  if case == "repeated_keys":
    x["k"] = jnp.broadcast_to(x["k"][:, :1], x["k"].shape)
    x["g"], x["beta"] = jnp.full_like(x["g"], -1e-3), jnp.full_like(x["beta"], 0.99)
  return x, reset


def launches(x, reset, **kw) -> dict:
  """The forward's pre-pass and intra launches on (q, k, v, g, β): their outputs by name (OUTPUTS)."""
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, reset, lower_bound=kw["lower_bound"])
  return {**fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, **kw)._asdict(), "loc": p.loc}


def state_pass_inputs(x, reset, **kw) -> tuple:
  """The state pass's inputs (STATE_PASS_INPUTS) from the forward's launches on (q, k, v, g, β)."""
  outs = launches(x, reset, **kw)
  return tuple(outs[n] for n in STATE_PASS_INPUTS)


def reference_intermediates(x, reset, *, scale) -> dict:
  """`naive_chunk_intermediates` in float64 on the (fp32) inputs, by name (OUTPUTS)."""
  with jax.enable_x64(True):
    intra, loc = naive_chunk_intermediates(*(x[n].astype(jnp.float64) for n in ("q", "k", "v", "g", "beta")), reset,
                                           scale=scale)
    return {**intra._asdict(), "loc": loc}


def reference_intra_gradients(x, reset, cotangents, *, scale):
  """dq, dk, dv, dg, dβ of Σ ⟨cotangent, output⟩ over the intra pass's outputs W, U, Qs, Kd, A_qk and the state
  decay (`naive_chunk_intermediates`, float64, by autodiff): what `bwd.intra_backward` computes from the state
  pass's gradients. `cotangents`: (dW, dU = dv_new, dQs, dKd, dA_qk, d decay)."""
  with jax.enable_x64(True):
    f64 = lambda a: a.astype(jnp.float64)
    args = tuple(f64(x[n]) for n in ("q", "k", "v", "g", "beta"))
    def outputs(*a):
      intra, _ = naive_chunk_intermediates(*a, reset, scale=scale)
      return tuple(getattr(intra, n) for n in STATE_PASS_INPUTS)
    _, pullback = jax.vjp(outputs, *args)
    return pullback(tuple(f64(c) for c in cotangents))


def dA_qk(do, v_new):
  """`[B,T,H,64]`: the cotangent of A_qk through o = A_qk v_new within each chunk, do_i · v_new_j (row i)."""
  B, T, H, V = do.shape
  c = lambda a: a.reshape(B, T // 64, 64, H, V)
  return jnp.einsum("bnihv,bnjhv->bnihj", c(do), c(v_new)).reshape(B, T, H, 64)
