"""Pallas KDA kernels in interpret mode against the recurrence: outputs and gradients (docs/design.md, tolerances)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda
from kda_testing import cuda_module_text, random_inputs, rel_err
from k3jax.numerics import kda_outputs_and_grads
from pallas_kernels.kda import bwd, fwd

# (B, T, H, K, V): T not a multiple of the 64-token chunk; K = V = 32 keeps interpret mode fast.
SHAPE = (1, 100, 2, 32, 32)
BF16_TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2}


def _pallas(**kw):
  return kda.chunk_kda(**kw, lower_bound=-5.0, backend="pallas")


def _compare(x, S0, seg, tol):
  o, S, grads = kda_outputs_and_grads(_pallas, x, S0, seg, cot_seed=11)
  f32 = {n: a.astype(jnp.float32) for n, a in x.items()}
  o_ref, S_ref, grads_ref = kda_outputs_and_grads(kda.naive_recurrent_kda, f32, S0, seg, cot_seed=11)
  errs = {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}
  errs.update({n: rel_err(grads[n], grads_ref[n]) for n in grads_ref})
  bad = {n: e for n, e in errs.items() if not e <= tol(n)}
  assert not bad, f"errors above tolerance: {bad} (all: {errs})"


def test_fp32_outputs_and_grads_with_segments_and_states():
  x, S0, seg = random_inputs(21, *SHAPE, segments=True)
  _compare(x, S0, seg, lambda n: 1e-5 if n in ("o", "S") else 1e-4)


@pytest.mark.parametrize("dtype,packed", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_state_pass_in_segments_matches_the_recurrence(dtype, packed, monkeypatch):
  """The forward's state pass cut into 3 segments of 2 chunks (each from the state XLA's scan composes) gives the
  recurrence's outputs and gradients: T = 380 (not a chunk multiple), an initial state, packed documents in fp32."""
  from pallas_kernels.kda import chunk
  monkeypatch.setattr(chunk, "default_segments", lambda B, H, N: 3)
  x, S0, seg = random_inputs(23, 1, 380, 2, 32, 32, dtype=dtype, segments=packed)
  _compare(x, S0, seg, (lambda n: 1e-5 if n in ("o", "S") else 1e-4) if dtype == jnp.float32 else BF16_TOL.get)


@pytest.mark.parametrize("segments", [1, 3])
def test_no_initial_state_is_a_zero_one_without_materialising_it(segments, monkeypatch):
  """initial_state=None (the kernels start from zeros; no zero state is built) gives the outputs, final state and
  input gradients of an explicit zero state, fp32, in one segment and in three."""
  from pallas_kernels.kda import chunk
  monkeypatch.setattr(chunk, "default_segments", lambda B, H, N: segments)
  x, S0, _ = random_inputs(48, 1, 380, 2, 32, 32)

  def loss(x, state):
    o, S = kda.chunk_kda(**x, initial_state=state, output_final_state=True, lower_bound=-5.0, backend="pallas")
    return jnp.sum(o * x["v"]) + jnp.sum(S), (o, S)
  (_, none), grads = jax.value_and_grad(loss, has_aux=True)(x, None)
  (_, zero), grads_zero = jax.value_and_grad(loss, has_aux=True)(x, jnp.zeros_like(S0))
  chex.assert_trees_all_close((none, grads), (zero, grads_zero), rtol=1e-6, atol=1e-6)


def test_undifferentiated_forward_with_inverted_diagonal_blocks_matches_the_differentiated_one(monkeypatch):
  """The forward alone (the key tiles invert B's diagonal blocks, the Mosaic solve in interpret mode, bf16) against
  the forward that keeps the backward's residuals (B as it is): outputs and final state to bf16 rounding, with
  documents and a state; and only the former inverts."""
  x, S0, seg = random_inputs(47, 1, 200, 2, 64, 64, dtype=jnp.bfloat16, segments=True)
  run = lambda **x: kda.chunk_kda(**x, initial_state=S0, output_final_state=True, segment_ids=seg, lower_bound=-5.0,
                                  backend="pallas")
  inverted = []
  intra_forward = fwd.intra_forward
  monkeypatch.setattr(fwd, "intra_forward",
                      lambda *a, **kw: (inverted.append(kw["invert_diagonal"]), intra_forward(*a, **kw))[1])
  o, S = run(**x)
  (o_ref, S_ref), _ = jax.vjp(lambda q: run(**{**x, "q": q}), x["q"])
  assert inverted == [True, False], inverted
  assert rel_err(o, o_ref) <= 1e-3 and rel_err(S, S_ref) <= 1e-4, (rel_err(o, o_ref), rel_err(S, S_ref))


@pytest.mark.parametrize("case", ["slow_decay", "gates_at_bound"])
def test_segment_starts_are_the_states_the_one_pass_reaches(case):
  """`segment_starts` (each segment's affine map from one parallel pass, composed by an associative scan) against
  the states the one sequential pass enters those chunks with, fp32, and the pass in 4 segments gives the one
  pass's outputs and final state. Slow decay (gates / 20) carries the initial state through every segment; gates
  at the bound forget it within a chunk (each segment's start is its map's F)."""
  B, T, H, K, V = 1, 512, 2, 32, 32
  x, _ = variant_case(33, "gates_at_bound" if case == "gates_at_bound" else "random", B, T, H, K, V)
  if case == "slow_decay":
    x["g"] = x["g"] / 20
  w, u, qs, kd, aqk, decay, *_ = launches(x, None, scale=K ** -0.5, lower_bound=-5.0)
  S0 = jax.random.normal(jax.random.PRNGKey(34), (B, H, K, V))
  h = fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=16, save=True)[2].reshape(B, H, T // 64, K, V)
  starts = fwd.segment_starts(w, u, kd, decay, S0, segments=4, block_v=16)
  chex.assert_shape(starts, (B, H, 4, K, V))
  assert rel_err(starts[:, :, 1:], h[:, :, 2::2]) <= 1e-5
  o, S = fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=16)
  o_c, S_c = fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=16, segments=4)
  assert rel_err(o_c, o) <= 1e-5 and rel_err(S_c, S) <= 1e-5, (rel_err(o_c, o), rel_err(S_c, S))


@pytest.mark.parametrize("saturate,variant", [(None, None), (-5.0, None), (None, "v3_bwd"), (-5.0, "v5_bwd")])
def test_bf16_outputs_and_grads_within_spec_tolerances(saturate, variant, monkeypatch):
  if variant == "v5_bwd":   # K = 32 in two column blocks
    monkeypatch.setattr(bwd, "intra_backward", functools.partial(bwd.intra_backward, variant="v5", block_k=16))
  elif variant == "v3_bwd":
    monkeypatch.setattr(bwd, "intra_backward", functools.partial(bwd.intra_backward, variant="v3"))
  x, S0, _ = random_inputs(22, *SHAPE, dtype=jnp.bfloat16, saturate=saturate)
  _compare(x, S0, None, BF16_TOL.get)


def test_gate_at_zero_is_exact_and_finite():
  x, S0, _ = random_inputs(23, *SHAPE, saturate=0.0)
  o, S = _pallas(**x, initial_state=S0, output_final_state=True)
  o_ref, S_ref = kda.naive_recurrent_kda(**x, initial_state=S0, output_final_state=True)
  chex.assert_tree_all_finite((o, S))
  assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def fused_args(seed):
  """`fused_kda`'s raw inputs at SHAPE (q, k, v, g_raw, beta_logits, A_log, dt_bias), fp32, and a spare key."""
  B, T, H, K, V = SHAPE
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  return (jax.random.normal(ks[0], (B, T, H, K)), jax.random.normal(ks[1], (B, T, H, K)),
          jax.random.normal(ks[2], (B, T, H, V)), 3 * jax.random.normal(ks[3], (B, T, H, K)),
          jax.random.normal(ks[4], (B, T, H)), jnp.log(jax.random.uniform(ks[5], (H,), minval=1, maxval=16)),
          jax.random.normal(ks[6], (H, K))), ks[7]


def test_prepare_writes_the_backwards_outputs_only_when_saving_and_the_same_operands_either_way():
  """`prepare` without `save` (the undifferentiated forward) skips normalised q, k and the cumulative sums, and its
  operands equal those written with them; with the gate fused, q and k come back unit-norm and qe = q ⊙ e^{G-R-c}."""
  B, T, H, K, V = SHAPE
  (q, k, _, g_raw, beta_logits, A_log, dt_bias), _ = fused_args(35)
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


def test_fused_entry_differentiates_through_norm_gate_and_sigmoid():
  args, key = fused_args(24)
  cot = jax.random.normal(key, args[2].shape)

  def loss(backend, *a):
    return jnp.sum(kda.fused_kda(*a, backend=backend)[0] * cot)

  grads = jax.grad(lambda *a: loss("pallas", *a), argnums=tuple(range(7)))(*args)
  grads_ref = jax.grad(lambda *a: loss("xla", *a), argnums=tuple(range(7)))(*args)
  for name, d, d_ref in zip(("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias"), grads, grads_ref):
    assert rel_err(d, d_ref) < 1e-4, name


def test_bf16_gate_gradients_are_as_accurate_as_dq_dk_at_every_tile_position():
  """bf16, the fused entry on random raw projections (about half the gates near the bound): d g_raw, d A_log and
  d dt_bias against the XLA path in fp32 within dq and dk's tolerance, and d g_raw's error alike at the four tile
  positions of a chunk. The loss is linear in o alone: a final-state cotangent or an initial state adds a part of dg
  that the pairs of rows inside a chunk do not touch, and at this length it hides their error. A pair's two terms
  in dg must cancel: with the operands of other tiles rounded against the row tile's anchor they did not, and here
  d g_raw was 1.6e-2, d A_log 1.6e-2, d dt_bias 2.8e-2, d g_raw 3.0e-2 in a chunk's first tile and 7e-3 in its last."""
  B, T, H, K, V = 2, 256, 2, 32, 32
  ks = jax.random.split(jax.random.PRNGKey(37), 8)
  bf16 = lambda i, *shape: jax.random.normal(ks[i], shape).astype(jnp.bfloat16)
  args = (bf16(0, B, T, H, K), bf16(1, B, T, H, K), bf16(2, B, T, H, V), bf16(3, B, T, H, K), bf16(4, B, T, H),
          jnp.log(jax.random.uniform(ks[5], (H,), minval=1, maxval=16)), jax.random.normal(ks[6], (H, K)))
  cot = jax.random.normal(ks[7], (B, T, H, V))

  def grads(backend, args):
    loss = lambda *a: jnp.sum(kda.fused_kda(*a, backend=backend)[0].astype(jnp.float32) * cot)
    return dict(zip(("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias"),
                    jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*args)))
  got, ref = grads("pallas", args), grads("xla", [a.astype(jnp.float32) for a in args])
  errs = {n: rel_err(got[n], ref[n]) for n in ("q", "k", "g_raw", "A_log", "dt_bias")}
  assert max(errs.values()) <= BF16_TOL["q"], errs
  position = (jnp.arange(T) % 64) // 16
  by_tile = [rel_err(got["g_raw"][:, position == t], ref["g_raw"][:, position == t]) for t in range(4)]
  assert max(by_tile) <= 2 * min(by_tile), by_tile


def test_fused_entry_forward_matches_xla_with_padding_documents_and_states():
  """Undifferentiated, the fused entry's kernels run without their residuals and take the gate, norms and sigmoid in
  their pre-pass: o and the final state against the XLA path, T = 100 (the padding's gate must decay nothing, or the
  final state is off by e^{-2.5·28}), two packed documents and an initial state, fp32."""
  B, T, H, K, V = SHAPE
  args, key = fused_args(32)
  S0 = jax.random.normal(key, (B, H, K, V))
  seg = jnp.zeros((B, T), jnp.int32).at[:, 40:].set(1)
  run = lambda backend: kda.fused_kda(*args, backend=backend, initial_state=S0, output_final_state=True,
                                      segment_ids=seg)
  (o, S), (o_ref, S_ref) = run("pallas"), run("xla")
  assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5, (rel_err(o, o_ref), rel_err(S, S_ref))


def test_repeated_keys_with_no_decay_are_exact():
  """I + A_kk is then far from the identity (every row near one): the inverse must stay exact."""
  x, S0, _ = random_inputs(25, *SHAPE)
  x["k"] = jnp.broadcast_to(x["k"][:, :1], x["k"].shape)
  x["g"], x["beta"] = jnp.full_like(x["g"], -1e-3), jnp.full_like(x["beta"], 0.99)
  _compare(x, S0, None, lambda n: 1e-5 if n in ("o", "S") else 1e-4)


def variant_case(seed, case, B, T, H, K, V):
  """Inputs (dict, reset mask) of the variant-agreement cases: random with resets (mid-tile, at a tile start, at a
  chunk start, two in one tile), every gate at the bound, or repeated keys with no decay."""
  x, _, _ = random_inputs(seed, B, T, H, K, V, saturate=-5.0 if case == "gates_at_bound" else None)
  reset = None
  if case == "random_with_resets":
    reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 16, 37, 41, 64, 100])].set(1)
  if case == "repeated_keys":
    x["k"] = jnp.broadcast_to(x["k"][:, :1], x["k"].shape)
    x["g"], x["beta"] = jnp.full_like(x["g"], -1e-3), jnp.full_like(x["beta"], 0.99)
  return x, reset


def launches(x, reset, **kw):
  """The forward's pre-pass and intra launches on (q, k, v, g, β), their outputs in `intra_forward_reference`'s
  order: w, u, qs, kd, aqk, decay, kk, minv, loc."""
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, reset, lower_bound=kw["lower_bound"])
  return (*fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, **kw), p.loc)


OUTPUTS = ("w", "u", "qs", "kd", "aqk", "decay", "kk", "minv", "loc")


@pytest.mark.parametrize("case", ["random_with_resets", "gates_at_bound", "repeated_keys"])
def test_intra_launches_give_the_one_kernel_references_outputs(case):
  """The pre-pass, key-tile and solve launches give v3's nine outputs (one kernel from g) to fp32 rounding, with
  resets mid-tile, at a tile start and at a chunk start."""
  B, T, H, K, V = 1, 128, 2, 32, 32
  x, reset = variant_case(26, case, B, T, H, K, V)
  kw = dict(scale=K ** -0.5, lower_bound=-5.0)
  outs, ref = launches(x, reset, **kw), fwd.intra_forward_reference(*x.values(), reset, **kw)
  chex.assert_tree_all_finite(outs)
  for name, a, b in zip(OUTPUTS, outs, ref):
    # Repeated keys: W's rows cancel, and the launches' βΓK (from the anchored keys) differs from v3's in the last
    # bit; both are within 1e-5 of float64 (the launches 3e-6, v3 1e-5).
    tol = 3e-5 if (case, name) == ("repeated_keys", "w") else 1e-5
    assert rel_err(a, b) <= tol, (name, rel_err(a, b))


def bwd_inputs(x, loc):
  """q, k, v, the forward's cumulative gates in g's place, β: the intra backward's first five arguments."""
  return x["q"], x["k"], x["v"], loc, x["beta"]


@pytest.mark.parametrize("case", ["random_with_resets", "gates_at_bound", "repeated_keys"])
def test_intra_backward_variants_agree(case):
  """v5 (a row pass, a column pass and dg's suffix sum, each a program per tile), its column pass in either form,
  gives v3's five gradients to fp32 rounding. With every gate at the bound dg cancels ~500x, so its summation order
  shows (up to ~3e-5 between variants; each is as far from float64, see the next test)."""
  B, T, H, K, V = 1, 128, 1, 32, 32
  x, reset = variant_case(27, case, B, T, H, K, V)
  kw = dict(scale=K ** -0.5, lower_bound=-5.0)
  w, u, _, _, _, _, kk, minv, loc = fwd.intra_forward_reference(*x.values(), reset, **kw)
  ks = jax.random.split(jax.random.PRNGKey(28), 7)
  vn, dvn, do = (jax.random.normal(ks[i], (B, T, H, V)) for i in range(3))
  dw, dqs, dkd = (jax.random.normal(ks[i], (B, T, H, K)) for i in range(3, 6))
  dd = jax.random.normal(ks[6], (B, T // 64, H, K))
  run = lambda **v: bwd.intra_backward(*bwd_inputs(x, loc), reset, u, w, kk, minv, vn, dvn, do, dw, dqs, dkd, dd,
                                       **kw, **v)
  ref = run(variant="v3")
  for form in bwd.COLS_FORMS:
    outs = run(variant="v5", block_k=K // 2, cols_form=form)
    chex.assert_tree_all_finite(outs)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), outs, ref):
      tol = 5e-5 if (name, case) == ("dg", "gates_at_bound") else 1e-5
      assert rel_err(a, b) <= tol, (form, name, rel_err(a, b))


def test_rows_stay_finite_on_large_unnormalised_inputs_with_gates_at_the_bound():
  """The key-tile launch scales every row of tile I >= J for key tile J's anchor. With large unnormalised q, k and
  every gate at the bound, a product of one anchor's factors over the whole chunk overflows in fp32 (e^{80}·q·k, as
  v7's discarded rows did); the launch's rows stay finite and equal v3's."""
  x, _ = variant_case(31, "gates_at_bound", 1, 64, 1, 32, 32)
  x["q"], x["k"] = 1e4 * x["q"], 1e4 * x["k"]
  loc = jnp.cumsum(x["g"][0, :, 0].reshape(4, 16, -1), axis=1).reshape(64, -1)   # the kernel's factors, c = -40
  unanchored = (x["q"][0, 48:, 0] * jnp.exp(loc[48:] + 40.0)) @ (x["k"][0, :16, 0] * jnp.exp(-40.0 - loc[:16])).T
  assert not jnp.all(jnp.isfinite(unanchored))          # tile 3's queries against anchor 0's keys, unscaled
  kw = dict(scale=1.0, lower_bound=-5.0)
  (_, _, qs, kd, aqk, _, kk, _, _), ref = launches(x, None, **kw), fwd.intra_forward_reference(*x.values(), None, **kw)
  chex.assert_tree_all_finite((qs, kd, aqk, kk))
  for name, a, b in zip(("qs", "kd", "aqk", "kk"), (qs, kd, aqk, kk), (ref[2], ref[3], ref[4], ref[6])):
    assert rel_err(a, b) <= 1e-6, (name, rel_err(a, b))


def test_k_unlike_v_and_several_column_blocks_agree_with_v3():
  """The key tiles loop over K in 32-column blocks, the solve's U and W loops tile V and K separately, and v5's
  column pass splits K; K = 128 and V = 32 exercise all three."""
  B, T, H, K, V = 1, 128, 1, 128, 32
  x, reset = variant_case(29, "random_with_resets", B, T, H, K, V)
  kw = dict(scale=K ** -0.5, lower_bound=-5.0)
  ref = fwd.intra_forward_reference(*x.values(), reset, **kw)
  outs = launches(x, reset, **kw)
  for name, a, b in zip(OUTPUTS, outs, ref):
    assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
  w, u, _, _, _, _, kk, minv, loc = ref
  ks = jax.random.split(jax.random.PRNGKey(30), 7)
  vn, dvn, do = (jax.random.normal(ks[i], (B, T, H, V)) for i in range(3))
  dw, dqs, dkd = (jax.random.normal(ks[i], (B, T, H, K)) for i in range(3, 6))
  dd = jax.random.normal(ks[6], (B, T // 64, H, K))
  run = lambda **v: bwd.intra_backward(*bwd_inputs(x, loc), reset, u, w, kk, minv, vn, dvn, do, dw, dqs, dkd, dd,
                                       **kw, **v)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), run(variant="v5", block_k=32), run(variant="v3")):
    assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("variant", ["v3", "v5"])
def test_saturated_gate_gradients_of_every_backward_variant_are_within_fp32_tolerance_of_float64(variant, monkeypatch):
  monkeypatch.setattr(bwd, "intra_backward", functools.partial(bwd.intra_backward, variant=variant, block_k=16))
  x, S0, _ = random_inputs(22, *SHAPE, saturate=-5.0)
  _, _, grads = kda_outputs_and_grads(_pallas, x, S0, None, cot_seed=11)
  with jax.enable_x64(True):
    f64 = {n: a.astype(jnp.float64) for n, a in x.items()}
    _, _, ref = kda_outputs_and_grads(kda.naive_recurrent_kda, f64, S0.astype(jnp.float64), None, cot_seed=11)
  errs = {n: rel_err(grads[n], ref[n]) for n in ref}
  assert max(errs.values()) <= 1e-4, errs


def test_kernels_lower_to_triton_for_the_gpu(monkeypatch):
  """Forward and backward lower through Pallas's Triton lowering here (interpret mode would not catch an op the
  lowering lacks); the GPU is described as an H200. The forward's state pass runs in 2 segments."""
  from pallas_kernels.kda import chunk
  monkeypatch.setattr(chunk, "default_segments", lambda B, H, N: 2)
  B, T, H, K, V = 1, 128, 2, 64, 64
  shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes] + [jax.ShapeDtypeStruct((B, T), jnp.int32)]

  def loss(q, k, v, g, beta, seg):
    return kda.chunk_kda(q, k, v, g, beta, segment_ids=seg, lower_bound=-5.0, backend="pallas")[0].sum()
  grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  text = cuda_module_text(monkeypatch, grads, *args)
  assert "kda_intra_fwd_solve_mosaic" in text   # bf16 on the (described) H200
  for name in ("kda_prepare", "kda_intra_fwd_key_tiles", "kda_state_segment_maps",
               "kda_state_fwd", "kda_state_bwd", "kda_state_grads", "kda_intra_bwd_v5_rows", "kda_intra_bwd_v5_cols",
               "kda_intra_bwd_v5_dg"):
    assert f'name = "{name}"' in text, name
  gate = [jax.ShapeDtypeStruct((H,), jnp.float32), jax.ShapeDtypeStruct((H, K), jnp.float32)]
  for dtype in (jnp.bfloat16, jnp.float32):   # the fused forward and v3, in both precisions of their products
    f_args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    fused = lambda *a: kda.fused_kda(*a, lower_bound=-5.0, backend="pallas")[0]
    text = cuda_module_text(monkeypatch, fused, *f_args, *gate)
    names = ("kda_prepare", "kda_intra_fwd_key_tiles") + (("kda_intra_fwd_solve",) if dtype == jnp.float32 else ())
    assert all(f'name = "{n}"' in text for n in names), dtype
    assert ("kda_intra_fwd_solve_mosaic" in text) == (dtype == jnp.bfloat16), dtype
    reference = functools.partial(fwd.intra_forward_reference, scale=K ** -0.5, lower_bound=-5.0)
    text = cuda_module_text(monkeypatch, reference, *f_args, jax.ShapeDtypeStruct((B, T), jnp.int32))
    assert 'name = "kda_intra_fwd_reference"' in text, dtype
  monkeypatch.setattr(bwd, "intra_backward", functools.partial(bwd.intra_backward, variant="v3"))
  grads = jax.grad(lambda *a: loss(*a), argnums=(0, 1, 2, 3, 4))  # a new function: no trace cache
  assert 'name = "kda_intra_bwd"' in cuda_module_text(monkeypatch, grads, *args)


@pytest.mark.parametrize("save", [True, False])
def test_mosaic_solve_gives_the_triton_solves_outputs(save):
  """The Mosaic GPU solve (products on bf16 halves, interpret mode) against the Triton one (fp32 here): W, U and M,
  bf16 inputs with K unlike V and resets, with and without M written for the backward; and it is the default there."""
  B, T, H, K, V = 1, 128, 2, 64, 128
  x, _, _ = random_inputs(40, B, T, H, K, V, dtype=jnp.bfloat16)
  reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 64, 100])].set(1)
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, reset, lower_bound=-5.0)
  run = lambda solve: fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, scale=K ** -0.5,
                                        lower_bound=-5.0, save=save, solve=solve)
  (w, u, *_, minv), (w_ref, u_ref, *_, minv_ref) = run("mosaic"), run("triton")
  assert rel_err(w, w_ref) <= 1e-3 and rel_err(u, u_ref) <= 1e-3, (rel_err(w, w_ref), rel_err(u, u_ref))
  assert (minv is None) == (not save)
  if save:
    assert rel_err(minv, minv_ref) <= 1e-5, rel_err(minv, minv_ref)
  chex.assert_trees_all_equal(run(None), run("mosaic"))


def test_inverting_the_diagonal_blocks_in_the_key_tiles_gives_the_same_solve():
  """With `invert_diagonal` the key tiles write (I + βB_II)⁻¹ − I on B's diagonal blocks (fp32 products) and the
  Mosaic solve (interpret mode) takes two doubling steps from there: W and U as the default's (its four steps on
  bf16 halves differ in rounding), the other outputs unchanged; bf16, K unlike V, documents; the off-diagonal
  blocks of B are kept and the diagonal ones are the inverses."""
  B, T, H, K, V = 1, 128, 2, 64, 128
  x, _, _ = random_inputs(46, B, T, H, K, V, dtype=jnp.bfloat16)
  reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 64, 100])].set(1)
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, reset, lower_bound=-5.0, save=False)
  run = lambda inv: fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, scale=K ** -0.5,
                                      lower_bound=-5.0, save=False, invert_diagonal=inv)
  (w, u, qs, kd, aqk, decay, kk, _), (w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref, kk_ref, _) = (run(True),
                                                                                                      run(False))
  assert rel_err(w, w_ref) <= 1e-4 and rel_err(u, u_ref) <= 1e-4, (rel_err(w, w_ref), rel_err(u, u_ref))
  chex.assert_trees_all_equal((qs, kd, aqk, decay), (qs_ref, kd_ref, aqk_ref, decay_ref))
  blocks = lambda m: m[0, :, 0].reshape(2, 4, 16, 4, 16)           # chunk, row tile, row, column tile, column
  diag = jnp.eye(4, dtype=bool)[None, :, None, :, None]
  chex.assert_trees_all_equal(jnp.where(diag, 0.0, blocks(kk)), jnp.where(diag, 0.0, blocks(kk_ref)))
  beta = p.beta[0, :, 0].reshape(2, 4, 16, 1)
  for c in range(2):
    for i in range(4):
      n = beta[c, i] * blocks(kk_ref)[c, i, :, i]
      inverse = np.linalg.inv(np.eye(16) + np.asarray(n, np.float64))
      assert rel_err(blocks(kk)[c, i, :, i] + np.eye(16), inverse) <= 1e-5, (c, i)
  with pytest.raises(ValueError, match="invert_diagonal"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, scale=1.0, lower_bound=-5.0, save=True,
                      invert_diagonal=True)


def test_the_solve_is_mosaic_only_where_it_can_run():
  """bf16 with K, V multiples of 64 (up to 256) takes the Mosaic solve (here in interpret mode); fp32, or K = 32,
  the Triton one; on a GPU older than Hopper neither Mosaic kernel is picked."""
  from pallas_kernels.kda import solve_mosaic
  assert solve_mosaic.available(jnp.bfloat16, 128, 64)
  assert not solve_mosaic.available(jnp.float32, 128, 128)
  assert not solve_mosaic.available(jnp.bfloat16, 32, 128)
  assert not solve_mosaic.available(jnp.bfloat16, 128, 320)


def test_mosaic_launches_lower_for_cuda_and_refuse_what_they_cannot_take(monkeypatch):
  """The Mosaic solve, with and without resets and M, and from the key tiles' inverted diagonal blocks, and the Mosaic
  state pass, with the backward's residuals and in segments: lowering checks the shared-memory layouts and transfers
  that interpret mode does not."""
  B, T, H, K, V = 1, 128, 2, 128, 64
  shapes = [((B, T, H, K), jnp.bfloat16)] * 3 + [((B, T // 16, H, K), jnp.float32), ((B, T, H, V), jnp.bfloat16),
                                                  ((B, T, H), jnp.float32), ((B, T), jnp.int32)]
  args = [jax.ShapeDtypeStruct(*s) for s in shapes]
  for save in (True, False):
    f = functools.partial(fwd.intra_forward, scale=K ** -0.5, lower_bound=-5.0, solve="mosaic", save=save)
    assert "kda_intra_fwd_solve_mosaic" in cuda_module_text(monkeypatch, f, *args[:-1], None if save else args[-1])
  f = functools.partial(fwd.intra_forward, scale=K ** -0.5, lower_bound=-5.0, save=False, invert_diagonal=True)
  text = cuda_module_text(monkeypatch, f, *args)
  assert "kda_intra_fwd_solve_mosaic" in text and 'name = "kda_intra_fwd_key_tiles"' in text
  state_args = [jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16) for d in (K, V, K, K, 64)]
  state_args += [jax.ShapeDtypeStruct((B, T // 64, H, K), jnp.float32), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
  for save, segments in ((True, 1), (False, 2)):   # the states entering chunks and v_new; segments' starts
    f = functools.partial(fwd.state_forward, block_v=V, save=save, segments=segments)
    assert "kda_state_fwd_mosaic" in cuda_module_text(monkeypatch, f, *state_args)
  do, aqk, kd = (jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16) for d in (V, 64, K))
  f = functools.partial(bwd.state_backward, block_v=V)
  assert "kda_state_bwd_mosaic" in cuda_module_text(monkeypatch, f, do, aqk, kd, kd, kd, *state_args[5:])
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "1")
  x, _, _ = random_inputs(41, 1, 64, 1, 32, 32)
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, None, lower_bound=-5.0)
  with pytest.raises(ValueError, match="Mosaic GPU"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, None, scale=1.0, lower_bound=-5.0, solve="mosaic")


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("segments,start", [(1, True), (1, False), (2, True)])
def test_mosaic_state_pass_gives_the_triton_passes_outputs(segments, start, save):
  """The Mosaic GPU state pass (wgmma, interpret mode) against the Triton one on the same bf16 launches' outputs:
  o, the final state and, with `save`, the states entering each chunk and v_new; 4 chunks with documents, from a
  state or from zeros, in one segment and in two; and it is the default there."""
  from pallas_kernels.kda import state_mosaic
  B, T, H, K, V = 1, 256, 2, 64, 64
  x, _, _ = random_inputs(49, B, T, H, K, V, dtype=jnp.bfloat16)
  reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 70, 200])].set(1)
  w, u, qs, kd, aqk, decay, *_ = launches(x, reset, scale=K ** -0.5, lower_bound=-5.0)
  S0 = jax.random.normal(jax.random.PRNGKey(50), (B, H, K, V)) if start else None
  assert state_mosaic.available(jnp.bfloat16, K, V, V)
  run = lambda mosaic: fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=V, save=save, segments=segments,
                                         mosaic=mosaic)
  got, ref = run(True), run(False)
  assert len(got) == len(ref) == (4 if save else 2)
  for name, a, b in zip(("o", "S", "h", "v_new"), got, ref):
    chex.assert_equal_shape((a, b))
    assert rel_err(a, b) <= 1e-4, (name, rel_err(a, b))
  chex.assert_trees_all_equal(run(None), got)


def test_mosaic_backward_state_pass_gives_the_triton_passes_gradients():
  """The Mosaic GPU reverse pass (interpret mode) against the Triton one on the same bf16 operands: dv_new, the
  gradients w.r.t. the states entering each chunk and w.r.t. the initial state; and it is the default there."""
  B, T, H, K, V = 1, 256, 2, 64, 64
  x, _, _ = random_inputs(52, B, T, H, K, V, dtype=jnp.bfloat16)
  w, u, qs, kd, aqk, decay, *_ = launches(x, None, scale=K ** -0.5, lower_bound=-5.0)
  do = jax.random.normal(jax.random.PRNGKey(53), (B, T, H, V), jnp.bfloat16)
  dS_T = jax.random.normal(jax.random.PRNGKey(54), (B, H, K, V))
  run = lambda mosaic: bwd.state_backward(do, aqk, kd, qs, w, decay, dS_T, block_v=V, mosaic=mosaic)
  got, ref = run(True), run(False)
  for name, a, b in zip(("dv_new", "dh", "dS0"), got, ref):
    chex.assert_equal_shape((a, b))
    assert rel_err(a, b) <= 1e-4, (name, rel_err(a, b))
  chex.assert_trees_all_equal(run(None), got)


def test_bf16_with_the_mosaic_state_pass_matches_the_recurrence(monkeypatch):
  """The whole operator in bf16 with both state passes on Mosaic GPU (all of V in one program, the forward's in 3
  segments, interpret mode): outputs and every gradient against the recurrence within the bf16 tolerances,
  with packed documents, an initial state and T = 380; the forward's pass ran with and without the backward's
  residuals, and the reverse pass ran."""
  from pallas_kernels.kda import chunk, state_mosaic
  monkeypatch.setattr(chunk, "default_block_v", lambda B, H, V: V)
  monkeypatch.setattr(chunk, "default_segments", lambda B, H, N: 3)
  calls = []
  base = state_mosaic.state_forward
  monkeypatch.setattr(state_mosaic, "state_forward",
                      lambda *a, **kw: (calls.append(("forward", kw["save"])), base(*a, **kw))[1])
  base_bwd = state_mosaic.state_backward
  monkeypatch.setattr(state_mosaic, "state_backward", lambda *a: (calls.append(("reverse",)), base_bwd(*a))[1])
  x, S0, seg = random_inputs(51, 1, 380, 2, 64, 64, dtype=jnp.bfloat16, segments=True)
  _compare(x, S0, seg, BF16_TOL.get)
  assert ("forward", True) in calls and ("reverse",) in calls, calls   # else the Triton passes were compared
  _pallas(**x, initial_state=S0, segment_ids=seg)
  assert calls[-1] == ("forward", False), calls


def test_mosaic_state_pass_takes_only_what_it_can_run():
  """bf16 with K and V of 64 or 128 and all of V in one program takes the Mosaic state passes; fp32, K = 32,
  V = 256 or a narrower column block the Triton ones; asked for anyway, or given Triton's warps, they refuse before
  any compute."""
  from pallas_kernels.kda import state_mosaic
  assert state_mosaic.available(jnp.bfloat16, 128, 128, 128) and state_mosaic.available(jnp.bfloat16, 64, 128, 128)
  for dtype, K, V, block_v in ((jnp.float32, 128, 128, 128), (jnp.bfloat16, 32, 64, 64),
                               (jnp.bfloat16, 128, 256, 256), (jnp.bfloat16, 128, 128, 64)):
    assert not state_mosaic.available(dtype, K, V, block_v), (dtype, K, V, block_v)

  def args(dtype, K):   # w, u, qs, kd, aqk, decay and no start, one chunk, K = V
    x = jnp.ones((1, 64, 1, K), dtype)
    return x, x, x, x, jnp.ones((1, 64, 1, 64), dtype), jnp.ones((1, 1, 1, K)), None
  with pytest.raises(ValueError, match="bf16 with K, V in"):
    fwd.state_forward(*args(jnp.float32, 32), block_v=32, mosaic=True)
  with pytest.raises(ValueError, match="block_v=32"):
    fwd.state_forward(*args(jnp.bfloat16, 64), block_v=32, mosaic=True)
  with pytest.raises(ValueError, match="num_warps"):
    fwd.state_forward(*args(jnp.bfloat16, 64), block_v=64, num_warps=8)
  with pytest.raises(ValueError, match="block_v=32"):
    bwd.state_backward(*args(jnp.bfloat16, 64)[:6], jnp.ones((1, 1, 64, 64)), block_v=32, mosaic=True)
  with pytest.raises(ValueError, match="num_warps"):
    bwd.state_backward(*args(jnp.bfloat16, 64)[:6], jnp.ones((1, 1, 64, 64)), block_v=64, num_warps=8)


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
  with pytest.raises(ValueError, match="block_k"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, None, scale=1.0, lower_bound=-5.0, block_k=24)
  with pytest.raises(ValueError, match="solve"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, None, scale=1.0, lower_bound=-5.0, solve="fuse")
  with pytest.raises(ValueError, match="variant"):
    bwd.intra_backward(*([None] * 17), scale=1.0, lower_bound=-5.0, variant="v9")
  with pytest.raises(ValueError, match="cols_form"):
    bwd.intra_backward(*([None] * 17), scale=1.0, lower_bound=-5.0, cols_form="tiled")
