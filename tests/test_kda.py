"""KDA operator: recurrence vs float64, chunked XLA path vs recurrence (outputs and every gradient), decode, errors."""
import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda
from k3jax.numerics import kda_outputs_and_grads
from kda_testing import numpy_recurrence, random_inputs, rel_err

FWD_TOL, GRAD_TOL = 1e-5, 1e-4
LOWER = {"bounded": -5.0, "softplus": None}


def test_naive_recurrence_matches_float64_loop():
  x, S0, seg = random_inputs(0, 2, 37, 3, 16, 8, segments=True)
  o, S = kda.naive_recurrent_kda(**x, initial_state=S0, output_final_state=True, segment_ids=seg)
  o_ref, S_ref = numpy_recurrence(**x, S0=S0, seg=seg)
  assert rel_err(o, o_ref) < FWD_TOL and rel_err(S, S_ref) < FWD_TOL


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("T,segments", [(64, False), (150, True), (7, False)])
def test_chunk_matches_recurrence_outputs_and_grads(gate, T, segments):
  x, S0, seg = random_inputs(T, 2, T, 2, 32, 16, gate=gate, segments=segments)
  chunk = lambda **kw: kda.chunk_kda(**kw, lower_bound=LOWER[gate], backend="xla")
  o, S, grads = kda_outputs_and_grads(chunk, x, S0, seg, cot_seed=1)
  o_ref, S_ref, grads_ref = kda_outputs_and_grads(kda.naive_recurrent_kda, x, S0, seg, cot_seed=1)
  assert rel_err(o, o_ref) < FWD_TOL and rel_err(S, S_ref) < FWD_TOL
  for name in grads_ref:
    assert rel_err(grads[name], grads_ref[name]) < GRAD_TOL, name


@pytest.mark.parametrize("value", [-5.0, 0.0, -5.5])
def test_saturated_bounded_gate_is_finite_and_exact(value):
  x, S0, _ = random_inputs(3, 1, 80, 2, 32, 16, saturate=value)
  o, S = kda.chunk_kda(**x, initial_state=S0, output_final_state=True, lower_bound=min(value, -5.0), backend="xla")
  o_ref, S_ref = numpy_recurrence(**x, S0=S0)
  chex.assert_tree_all_finite((o, S))
  assert rel_err(o, o_ref) < FWD_TOL and rel_err(S, S_ref) < FWD_TOL


def test_softplus_gate_with_huge_steps_does_not_overflow():
  x, S0, _ = random_inputs(4, 1, 70, 2, 16, 16, gate="softplus")
  x["g"] = x["g"] * 40.0  # steps of −1000 and below: e^{±G} would overflow if factorised
  o, S = kda.chunk_kda(**x, initial_state=S0, output_final_state=True, backend="xla")
  o_ref, S_ref = numpy_recurrence(**x, S0=S0)
  assert rel_err(o, o_ref) < FWD_TOL and rel_err(S, S_ref) < FWD_TOL


def test_segments_equal_documents_run_alone():
  x, S0, _ = random_inputs(5, 1, 90, 2, 16, 8)
  seg = jnp.array([[0] * 30 + [1] * 45 + [2] * 15], jnp.int32)
  o, _ = kda.chunk_kda(**x, initial_state=S0, segment_ids=seg, lower_bound=-5.0, backend="xla")
  for lo, hi in ((0, 30), (30, 75), (75, 90)):
    part = {n: a[:, lo:hi] for n, a in x.items()}
    o_doc, _ = kda.chunk_kda(**part, initial_state=S0 if lo == 0 else None, lower_bound=-5.0, backend="xla")
    assert rel_err(o[:, lo:hi], o_doc) < FWD_TOL


def test_decode_steps_continue_a_prefill():
  x, S0, _ = random_inputs(6, 2, 40, 2, 16, 8)
  o_full, S_full = kda.chunk_kda(**x, initial_state=S0, output_final_state=True, lower_bound=-5.0)
  _, S = kda.chunk_kda(**{n: a[:, :33] for n, a in x.items()}, initial_state=S0, output_final_state=True,
                       lower_bound=-5.0)
  for t in range(33, 40):
    o_t, S = kda.kda_decode_step(*(x[n][:, t] for n in ("q", "k", "v", "g", "beta")), S)
    assert rel_err(o_t, o_full[:, t]) < FWD_TOL
  assert rel_err(S, S_full) < FWD_TOL
  o_t4, _ = kda.kda_decode_step(*(x[n][:, 33:34] for n in ("q", "k", "v", "g", "beta")), S0)
  chex.assert_shape(o_t4, (2, 1, 2, 8))


def test_bf16_inputs_give_fp32_state_and_close_outputs():
  x, S0, _ = random_inputs(7, 1, 100, 2, 32, 32, dtype=jnp.bfloat16)
  o, S = kda.chunk_kda(**x, initial_state=S0, output_final_state=True, lower_bound=-5.0)
  chex.assert_type(o, jnp.bfloat16)
  chex.assert_type(S, jnp.float32)
  o_ref, S_ref = numpy_recurrence(**x, S0=S0)
  assert rel_err(o, o_ref) < 5e-3 and rel_err(S, S_ref) < 1e-5


@hypothesis.settings(deadline=None, max_examples=6, derandomize=True)
@hypothesis.given(T=st.integers(1, 140), gate=st.sampled_from(["bounded", "softplus"]), seed=st.integers(0, 999))
def test_chunk_equals_recurrence_for_any_length(T, gate, seed):
  x, S0, seg = random_inputs(seed, 1, T, 1, 16, 16, gate=gate, segments=True)
  o, S = kda.chunk_kda(**x, initial_state=S0, output_final_state=True, segment_ids=seg, lower_bound=LOWER[gate],
                       backend="xla")
  o_ref, S_ref = numpy_recurrence(**x, S0=S0, seg=seg)
  assert rel_err(o, o_ref) < FWD_TOL and rel_err(S, S_ref) < FWD_TOL


def test_gate_formulas():
  g_raw = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 2, 4))
  A_log, dt_bias = jnp.array([0.3, -0.2]), jax.random.normal(jax.random.PRNGKey(1), (2, 4))
  z = np.asarray(g_raw, np.float64) + np.asarray(dt_bias, np.float64)
  a = np.exp(np.asarray(A_log, np.float64))[:, None]
  np.testing.assert_allclose(kda.kda_gate(g_raw, A_log, dt_bias), -5.0 / (1 + np.exp(-a * z)), rtol=1e-5)
  np.testing.assert_allclose(kda.kda_gate(g_raw, A_log, dt_bias, lower_bound=None), -a * np.log1p(np.exp(z)),
                             rtol=1e-5)


def _valid():
  x, S0, _ = random_inputs(8, 1, 8, 2, 4, 4)
  return x, S0


@pytest.mark.parametrize("change,match", [
    (lambda x, kw: x.update(k=x["k"][..., :3]), "k must have shape"),
    (lambda x, kw: x.update(v=x["v"][:, :5]), "v must have shape"),
    (lambda x, kw: x.update(beta=x["beta"][..., None]), "beta must have shape"),
    (lambda x, kw: x.update(q=x["q"][0]), "q must have rank 4"),
    (lambda x, kw: x.update(g=x["g"].astype(jnp.int32)), "g must be a floating-point"),
    (lambda x, kw: kw.update(initial_state=jnp.zeros((1, 2, 4, 5))), "initial_state must have shape"),
    (lambda x, kw: kw.update(segment_ids=jnp.zeros((1, 8), jnp.float32)), "segment_ids must be an integer"),
    (lambda x, kw: kw.update(segment_ids=jnp.zeros((1, 7), jnp.int32)), "segment_ids must have shape"),
    (lambda x, kw: kw.update(lower_bound=0.5), "lower_bound must be negative"),
    (lambda x, kw: kw.update(lower_bound=-8.0, backend="pallas"), "needs a bounded gate"),
    (lambda x, kw: kw.update(lower_bound=None, backend="pallas"), "needs a bounded gate"),
    (lambda x, kw: kw.update(backend="cuda"), "backend must be one of"),
    (lambda x, kw: kw.update(lower_bound=-5.0, backend="pallas"), "needs head dims"),
])
def test_bad_input_raises_clear_value_error(change, match):
  x, S0 = _valid()
  kw = dict(initial_state=S0)
  change(x, kw)
  with pytest.raises(ValueError, match=match):
    kda.chunk_kda(**x, **kw)


def test_bad_gate_and_decode_inputs_raise():
  with pytest.raises(ValueError, match="dt_bias must have shape"):
    kda.kda_gate(jnp.zeros((1, 2, 3, 4)), jnp.zeros(3), jnp.zeros((3, 5)))
  with pytest.raises(ValueError, match="A_log must have shape"):
    kda.kda_gate(jnp.zeros((1, 2, 3, 4)), jnp.zeros(2), jnp.zeros((3, 4)))
  x, S0 = _valid()
  one = [x[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
  with pytest.raises(ValueError, match="state must have shape"):
    kda.kda_decode_step(*one, S0[..., :3])
  with pytest.raises(ValueError, match="takes one token"):
    kda.kda_decode_step(*(x[n][:, :2] for n in ("q", "k", "v", "g", "beta")), S0)
