"""experiments.ablations.gate at small shapes: saturated inputs sit where the gates saturate; the timed function is the
fused op's forward and backward; at saturation both gates stay finite on their own paths and match the
recurrence, while the softplus gate through the factorised tiles overflows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.ablations import gate
from k3jax.ops import kda


def test_saturated_inputs_put_the_bounded_gate_at_its_bound_and_the_softplus_gate_far_below():
  x, do = gate.raw_inputs(1, 16, 2, 16, dtype=jnp.float32, saturated=True)
  assert do.shape == x["v"].shape == (1, 16, 2, 16) and x["A_log"].shape == (2,) and x["dt_bias"].shape == (2, 16)
  bounded = kda.kda_gate(x["g_raw"], x["A_log"], x["dt_bias"], lower_bound=-5.0)
  softplus = kda.kda_gate(x["g_raw"], x["A_log"], x["dt_bias"], lower_bound=None)
  np.testing.assert_allclose(bounded, -5.0, rtol=1e-6)
  assert float(jnp.max(softplus)) < -20.0
  fresh, _ = gate.raw_inputs(1, 16, 2, 16, dtype=jnp.float32)
  assert -5.0 < float(jnp.mean(kda.kda_gate(fresh["g_raw"], fresh["A_log"], fresh["dt_bias"]))) < -0.5


def test_timed_function_is_the_fused_ops_forward_and_backward():
  x, do = gate.raw_inputs(1, 40, 2, 16, dtype=jnp.float32, seed=1)
  for name, lower_bound in gate.GATES.items():
    o, grads = gate.fused_fwd_bwd(name, "xla")(x, do)
    run = lambda x: kda.fused_kda(**{n: x[n] for n in kda.FUSED_INPUTS}, lower_bound=lower_bound, backend="xla")[0]
    want_o, pullback = jax.vjp(run, x)
    want = pullback(do)[0]
    np.testing.assert_allclose(o, want_o, rtol=1e-6, atol=1e-6)
    assert set(grads) == set(kda.FUSED_INPUTS)
    for n in kda.FUSED_INPUTS:
      np.testing.assert_allclose(grads[n], want[n], rtol=1e-5, atol=1e-6, err_msg=n)
  with pytest.raises(ValueError, match="gate must be"):
    gate.fused_fwd_bwd("sigmoid")


def test_timed_variants_are_the_kernels_and_both_xla_paths_on_gpu_and_the_xla_paths_elsewhere():
  assert [(v["gate"], v["backend"]) for v in gate.timed_variants("gpu")] == [
      ("bounded", "auto"), ("bounded", "xla"), ("softplus", "xla")]
  assert [(v["gate"], v["backend"]) for v in gate.timed_variants("cpu")] == [("bounded", "xla"), ("softplus", "xla")]


def test_saturated_gates_are_finite_on_their_own_paths_and_overflow_the_factorised_tiles_without_the_bound():
  bounded, softplus, forced = gate.finiteness(1, 80, 1, 16, dtype=jnp.float32, backend="xla")
  for row in (bounded, softplus):
    assert row["finite_o"] and row["finite_state"] and all(row["finite_grads"].values()), row["case"]
    assert row["rel_err_o"] < 1e-5, row["case"]
  assert bounded["g_min"] == pytest.approx(-5.0) and softplus["g_max"] < -20.0
  assert forced["g_max"] == softplus["g_max"] and not forced["finite_o"] and forced["rel_err_o"] == float("inf")


def test_compiled_variants_are_the_timed_pairs_at_every_shape_and_compute_the_fused_op():
  rows = gate.compiled_variants([(1, 32, 2, 16), (1, 48, 1, 16)], dtype=jnp.float32, platform="cpu")
  assert [(r["shape"], r["gate"], r["backend"]) for r in rows] == [
      ("1x32x2x16", "bounded", "xla"), ("1x32x2x16", "softplus", "xla"),
      ("1x48x1x16", "bounded", "xla"), ("1x48x1x16", "softplus", "xla")]
  for r in rows:
    o, grads = r["fn"](*r["args"])
    want_o, want = gate.fused_fwd_bwd(r["gate"], "xla")(*r["args"])
    np.testing.assert_allclose(o, want_o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads["q"], want["q"], rtol=1e-6, atol=1e-6)
