"""The forward's launches (interpret mode): the pre-pass, the intra pass's key tiles and solve against the float64
per-chunk intermediates, the state pass in segments, the substitution-free inverse; bad parameters refused."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.numerics import rel_err
from k3jax.ops.kda.testing import random_inputs
from kda_kernel_testing import OUTPUTS, kernel_case, launches, reference_intermediates, state_pass_inputs
from pallas_kernels.kda import KDAKernelOptions, fwd


def fused_args(seed, B, T, H, K, V):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  return (jax.random.normal(ks[0], (B, T, H, K)), jax.random.normal(ks[1], (B, T, H, K)),
          jax.random.normal(ks[2], (B, T, H, V)), 3 * jax.random.normal(ks[3], (B, T, H, K)),
          jax.random.normal(ks[4], (B, T, H)), jnp.log(jax.random.uniform(ks[5], (H,), minval=1, maxval=16)),
          jax.random.normal(ks[6], (H, K)))


def test_prepare_writes_the_backwards_outputs_only_when_saving_and_the_same_operands_either_way():
  """`prepare` without `save` (the undifferentiated forward) skips normalised q, k and the cumulative sums, and its
  operands equal those written with them; with the gate fused, q and k come back unit-norm and qe = q ⊙ e^{G-R-c}."""
  B, T, H, K, V = 1, 100, 2, 32, 32
  q, k, _, g_raw, beta_logits, A_log, dt_bias = fused_args(35, B, T, H, K, V)
  q, k, g_raw = (jnp.pad(x, ((0, 0), (0, 128 - T), (0, 0), (0, 0))) for x in (q, k, g_raw))
  beta_logits = jnp.pad(beta_logits, ((0, 0), (0, 128 - T), (0, 0)))
  run = lambda save: fwd.prepare(q, k, g_raw, beta_logits, (A_log, dt_bias), None, lower_bound=-5.0,
                                 valid_len=T, save=save)
  saved, unsaved = run(True), run(False)
  assert unsaved.q is None and unsaved.k is None and unsaved.loc is None
  for name in ("qe", "kq", "ke", "tot", "beta"):
    chex.assert_trees_all_equal(getattr(saved, name), getattr(unsaved, name))
  chex.assert_trees_all_close(jnp.linalg.norm(saved.q[:, :T], axis=-1), jnp.ones((B, T, H)), rtol=1e-5)
  c = 8 * -5.0
  chex.assert_trees_all_close(saved.qe, saved.q * jnp.exp(saved.loc - c), rtol=1e-5)
  # Padding decays nothing: the sums stay flat past T within its tile (rows 96-111) and later tiles total zero.
  assert float(jnp.max(jnp.abs(jnp.diff(saved.loc[:, T - 1:112], axis=1)))) == 0.0
  assert float(jnp.max(jnp.abs(saved.tot[:, 112 // 16:]))) == 0.0


@pytest.mark.parametrize("case", ["random_with_resets", "gates_at_bound", "repeated_keys"])
def test_intra_launches_give_the_float64_chunk_intermediates(case):
  """The pre-pass, key-tile and solve launches, fp32, give the nine per-chunk outputs of the definitions in float64,
  with resets mid-tile, at a tile start and at a chunk start."""
  B, T, H, K, V = 1, 128, 2, 32, 32
  x, reset = kernel_case(26, case, B, T, H, K, V)
  outs, ref = launches(x, reset, scale=K ** -0.5, lower_bound=-5.0), reference_intermediates(x, reset, scale=K ** -0.5)
  chex.assert_tree_all_finite(outs)
  assert set(outs) == set(ref) == set(OUTPUTS)
  for name in OUTPUTS:
    assert rel_err(outs[name], ref[name]) <= 1e-5, (name, rel_err(outs[name], ref[name]))


def test_rows_stay_finite_on_large_unnormalised_inputs_with_gates_at_the_bound():
  """The key-tile launch scales every row of tile I >= J for key tile J's anchor. With large unnormalised q, k and
  every gate at the bound, a product of one anchor's factors over the whole chunk overflows in fp32 (e^{80}·q·k, as
  v7's discarded rows did); the launch's rows stay finite and equal the definitions'."""
  x, _ = kernel_case(31, "gates_at_bound", 1, 64, 1, 32, 32)
  x["q"], x["k"] = 1e4 * x["q"], 1e4 * x["k"]
  loc = jnp.cumsum(x["g"][0, :, 0].reshape(4, 16, -1), axis=1).reshape(64, -1)   # the kernel's factors, c = -40
  unanchored = (x["q"][0, 48:, 0] * jnp.exp(loc[48:] + 40.0)) @ (x["k"][0, :16, 0] * jnp.exp(-40.0 - loc[:16])).T
  assert not jnp.all(jnp.isfinite(unanchored))          # tile 3's queries against anchor 0's keys, unscaled
  outs, ref = launches(x, None, scale=1.0, lower_bound=-5.0), reference_intermediates(x, None, scale=1.0)
  for name in ("qs", "kd", "aqk", "kk"):
    chex.assert_tree_all_finite(outs[name])
    assert rel_err(outs[name], ref[name]) <= 1e-6, (name, rel_err(outs[name], ref[name]))


def test_k_unlike_v_and_several_column_blocks_give_the_intermediates():
  """The key tiles loop over K in 32-column blocks and the solve's U and W loops tile V and K separately; K = 128
  and V = 32 exercise both."""
  B, T, H, K, V = 1, 128, 1, 128, 32
  x, reset = kernel_case(29, "random_with_resets", B, T, H, K, V)
  outs, ref = launches(x, reset, scale=K ** -0.5, lower_bound=-5.0), reference_intermediates(x, reset, scale=K ** -0.5)
  for name in OUTPUTS:
    assert rel_err(outs[name], ref[name]) <= 1e-5, (name, rel_err(outs[name], ref[name]))


@pytest.mark.parametrize("case", ["slow_decay", "gates_at_bound"])
def test_segment_starts_are_the_states_the_one_pass_reaches(case):
  """`segment_starts` (each segment's affine map from one parallel pass, composed by an associative scan) against
  the states the one sequential pass enters those chunks with, fp32, and the pass in 4 segments gives the one
  pass's outputs and final state. Slow decay (gates / 20) carries the initial state through every segment; gates
  at the bound forget it within a chunk (each segment's start is its map's F)."""
  B, T, H, K, V = 1, 512, 2, 32, 32
  x, _ = kernel_case(33, "gates_at_bound" if case == "gates_at_bound" else "random", B, T, H, K, V)
  if case == "slow_decay":
    x["g"] = x["g"] / 20
  w, u, qs, kd, aqk, decay = state_pass_inputs(x, None, scale=K ** -0.5, lower_bound=-5.0)
  S0 = jax.random.normal(jax.random.PRNGKey(34), (B, H, K, V))
  h = fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=16, save=True)[2].reshape(B, H, T // 64, K, V)
  starts = fwd.segment_starts(w, u, kd, decay, S0, segments=4, block_v=16)
  chex.assert_shape(starts, (B, H, 4, K, V))
  assert rel_err(starts[:, :, 1:], h[:, :, 2::2]) <= 1e-5
  o, S = fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=16)
  o_c, S_c = fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=16, segments=4)
  assert rel_err(o_c, o) <= 1e-5 and rel_err(S_c, S) <= 1e-5, (rel_err(o_c, o), rel_err(S_c, S))


@pytest.mark.parametrize("size", [64, 16])
@pytest.mark.parametrize("case", ["random", "repeated_keys"])
def test_unit_lower_inverse_is_the_inverse(case, size):
  """The forward's substitution-free (I + a)⁻¹ (Neumann 4x4 blocks, then doubling) against a float64 solve, for a
  random strictly lower a and for βkkᵀ with one key repeated (every row of a near one, the inverse far from I), at
  the chunk's 64 rows (the solve) and a tile's 16 (the key tiles' diagonal blocks)."""
  from pallas_kernels.kda.tiles import unit_lower_inverse
  if case == "random":
    a = 0.3 * jax.random.normal(jax.random.PRNGKey(40), (size, size))
  else:
    a = jnp.full((size, size), 0.99)                   # β = 0.99 times kᵀk = 1 for one unit key throughout
  a = jnp.tril(a, -1)
  ref = np.linalg.inv(np.eye(size) + np.asarray(a, np.float64))
  err = rel_err(unit_lower_inverse(a, exact=True), ref)
  assert err <= 1e-6, err


def test_bad_kernel_parameters_are_refused_before_any_work():
  x, _, _ = random_inputs(31, 1, 128, 2, 32, 32)
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, None, lower_bound=-5.0)
  with pytest.raises(ValueError, match="key_tiles_block_k=24"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, None, scale=1.0, lower_bound=-5.0,
                      options=KDAKernelOptions(key_tiles_block_k=24))
  with pytest.raises(ValueError, match="invert_diagonal needs the Mosaic solve"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, None, scale=1.0, lower_bound=-5.0, save=False,
                      invert_diagonal=True)
