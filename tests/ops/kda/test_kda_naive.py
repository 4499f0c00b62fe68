"""The references: the recurrence against a float64 NumPy loop, and the per-chunk intermediates (from pairwise decays
and a dense solve) carried through the chunks' state recursion against the same loop."""
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.numerics import rel_err
from k3jax.ops import kda
from k3jax.ops.kda.naive import naive_chunk_intermediates
from k3jax.ops.kda.testing import numpy_recurrence, random_inputs

FWD_TOL = 1e-5


def test_naive_recurrence_matches_float64_loop():
  x, S0, seg = random_inputs(0, 2, 37, 3, 16, 8, segments=True)
  o, S = kda.naive_recurrent_kda(**x, initial_state=S0, output_final_state=True, segment_ids=seg)
  o_ref, S_ref = numpy_recurrence(**x, S0=S0, seg=seg)
  assert rel_err(o, o_ref) < FWD_TOL and rel_err(S, S_ref) < FWD_TOL


def test_chunk_intermediates_through_the_state_recursion_give_the_recurrence():
  """o = Qs S + A_qk v_new, v_new = U − W S, S ← decay ⊙ S + Kdᵀ v_new over the chunks, from the intermediates in
  float64: the float64 loop's outputs and final state, with documents starting mid-tile, at a tile start and at a
  chunk start (the state reaches no row after them); `loc` is the tiles' cumulative gates."""
  B, T, H, K, V = 1, 192, 2, 16, 8
  x, S0, _ = random_inputs(1, B, T, H, K, V)
  reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 16, 64, 100, 101])].set(1)
  seg = jnp.cumsum(reset, axis=1)
  with jax.enable_x64(True):
    f64 = {n: a.astype(jnp.float64) for n, a in x.items()}
    (w, u, qs, kd, aqk, decay, kk, minv), loc = naive_chunk_intermediates(*f64.values(), reset, scale=K ** -0.5)
    chunks = lambda a: a.reshape(B, T // 64, 64, H, -1).transpose(1, 0, 3, 2, 4)    # [N,B,H,C,·]
    S, o = S0.astype(jnp.float64), []
    for n, (w_n, u_n, qs_n, kd_n, aqk_n) in enumerate(zip(*(chunks(a) for a in (w, u, qs, kd, aqk)))):
      v_new = u_n - w_n @ S
      o.append(qs_n @ S + aqk_n @ v_new)
      S = decay[:, n][..., None] * S + jnp.swapaxes(kd_n, -1, -2) @ v_new
    o = jnp.concatenate(o, axis=2).transpose(0, 2, 1, 3)
  o_ref, S_ref = numpy_recurrence(**x, S0=S0, seg=seg)
  assert rel_err(o, o_ref) < 1e-12 and rel_err(S, S_ref) < 1e-12, (rel_err(o, o_ref), rel_err(S, S_ref))
  g = np.asarray(x["g"], np.float64).reshape(B, T // 16, 16, H, K)
  assert rel_err(loc, np.cumsum(g, axis=2).reshape(B, T, H, K)) < 1e-12
