"""The entry points' contract: decode continues a prefill, and bad input is refused (or warned of) before any compute,
with an error that says what to pass."""
import warnings

import chex
import jax
import jax.numpy as jnp
import pytest

from k3jax.numerics import rel_err
from k3jax.ops import kda
from k3jax.ops.kda.testing import random_inputs
from pallas_kernels.kda import KDAKernelOptions

FWD_TOL = 1e-5
ARGS = ("q", "k", "v", "g", "beta")


def test_decode_steps_continue_a_prefill():
  x, S0, _ = random_inputs(6, 2, 40, 2, 16, 8)
  o_full, S_full = kda.chunk_kda(**x, initial_state=S0, output_final_state=True, lower_bound=-5.0)
  _, S = kda.chunk_kda(**{n: a[:, :33] for n, a in x.items()}, initial_state=S0, output_final_state=True,
                       lower_bound=-5.0)
  for t in range(33, 40):
    o_t, S = kda.kda_decode_step(*(x[n][:, t] for n in ARGS), S)
    assert rel_err(o_t, o_full[:, t]) < FWD_TOL
  assert rel_err(S, S_full) < FWD_TOL
  o_t4, _ = kda.kda_decode_step(*(x[n][:, 33:34] for n in ARGS), S0)
  chex.assert_shape(o_t4, (2, 1, 2, 8))


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
    # The gate's raw projection passed as g (about half its entries positive: the state grows without bound).
    (lambda x, kw: x.update(g=jax.random.normal(jax.random.PRNGKey(0), x["g"].shape)), "must be a log-decay"),
    (lambda x, kw: x.update(g=jnp.full_like(x["g"], 0.25)), "must be a log-decay"),
    (lambda x, kw: x.update(g=x["g"].at[0, 3, 1, 2].set(jnp.nan)), "must be a log-decay"),
    (lambda x, kw: (x.update(g=x["g"].at[0, 5].set(-7.0)), kw.update(lower_bound=-5.0)), "below the declared"),
    (lambda x, kw: kw.update(kernel_options=KDAKernelOptions(), backend="xla"), "kernel_options set the Pallas kernels"),
])
def test_bad_input_raises_clear_value_error(change, match):
  x, S0 = _valid()
  kw = dict(initial_state=S0)
  change(x, kw)
  with pytest.raises(ValueError, match=match):
    kda.chunk_kda(**x, **kw)


def test_gate_values_are_checked_only_where_they_are_known():
  """Under `jax.jit` g's values are unknown until the run: the check (a reduction and a host read) is for eager
  calls; traced calls keep the promise unchecked, as the layers make it (kda_gate's outputs lie in the bound)."""
  x, S0 = _valid()
  x["g"] = jnp.full_like(x["g"], 0.25)
  o, _ = jax.jit(lambda x: kda.chunk_kda(**x, initial_state=S0, backend="xla"))(x)
  chex.assert_shape(o, x["v"].shape)


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_kda", "naive_recurrent_kda", "kda_decode_step"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_integer_q_k_v_are_refused_by_every_entry(entry, name):
  x, S0 = _valid()
  x[name] = jnp.round(10 * x[name]).astype(jnp.int32)
  if entry == "kda_decode_step":
    call = lambda: kda.kda_decode_step(*(x[n][:, 0] for n in ARGS), S0)
  elif entry == "fused_kda":
    call = lambda: kda.fused_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], jnp.zeros(2), jnp.zeros((2, 4)))
  else:
    call = lambda: getattr(kda, entry)(**x)
  with pytest.raises(ValueError, match=f"{name} must be a floating-point array"):
    call()


def test_decode_step_refuses_a_missing_state_and_a_positive_gate():
  x, S0 = _valid()
  one = [x[n][:, 0] for n in ARGS]
  with pytest.raises(ValueError, match="needs the state"):
    kda.kda_decode_step(*one, None)
  with pytest.raises(ValueError, match="must be a log-decay"):
    kda.kda_decode_step(*one[:3], jnp.abs(one[3]) + 0.1, one[4], S0)
  with pytest.raises(ValueError, match="state must have shape"):
    kda.kda_decode_step(*one, S0[..., :3])
  with pytest.raises(ValueError, match="takes one token"):
    kda.kda_decode_step(*(x[n][:, :2] for n in ARGS), S0)


def test_heads_before_time_is_warned_of():
  """Inputs laid out [B,H,T,K] (a PyTorch habit) are read as T = H tokens of H = T heads. When fewer tokens than
  heads come in, that is the likely cause: a warning names the layout; the intended layout does not warn."""
  x, S0, _ = random_inputs(9, 1, 16, 4, 8, 8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    kda.chunk_kda(**x, initial_state=S0, lower_bound=-5.0)
  heads_first = {n: jnp.swapaxes(a, 1, 2) for n, a in x.items()}
  with pytest.warns(UserWarning, match=r"\[B,T,H,K\] \(time before heads\)"):
    kda.chunk_kda(**heads_first, lower_bound=-5.0)
