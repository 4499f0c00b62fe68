"""The chunked XLA path against the recurrence: outputs and every gradient, both gates, saturated and huge gates,
documents, any length, bf16."""
import chex
import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import pytest

from k3jax.numerics import rel_err
from k3jax.ops import kda
from k3jax.ops.kda.testing import kda_outputs_and_grads, numpy_recurrence, random_inputs

FWD_TOL, GRAD_TOL = 1e-5, 1e-4
LOWER = {"bounded": -5.0, "softplus": None}


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
