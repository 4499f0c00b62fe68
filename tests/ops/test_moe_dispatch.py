"""MoE dispatch: the plan against numpy, dispatch and combine against numpy and their gradients against autodiff of
the gather/scatter reference; the backward has no scatter and the slots are sorted once."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import parallel
from k3jax.layers.moe import expert_ffn
from k3jax.ops import moe_dispatch
from pallas_kernels.grouped_gemm import GroupedGemmOptions
from model_testing import primitives

T, K, E, L = 13, 3, 7, 5


def routed_ids(key, t=T, k=K, e=E, experts=None):
  """Each token's k distinct experts (as top-k picks them), drawn from `experts` (all E when None)."""
  pool = np.arange(e) if experts is None else np.asarray(experts)
  rng = np.random.default_rng(key)
  return jnp.asarray(np.stack([rng.permutation(pool)[:k] for _ in range(t)]), jnp.int32)


def numpy_dispatch(z, ids):
  """Slots in expert order (stable), each its token's row; and the order itself."""
  order = np.argsort(np.asarray(ids).reshape(-1), kind="stable")
  return np.asarray(z)[order // ids.shape[1]], order


def numpy_combine(y_sorted, w, ids):
  """Σ_j w[t, j] · (the output of slot (t, j)), with the slots in `numpy_dispatch`'s order."""
  _, order = numpy_dispatch(np.zeros((ids.shape[0], 1)), ids)
  y_slots = np.zeros_like(np.asarray(y_sorted, np.float64))
  y_slots[order] = y_sorted
  return np.einsum("tkl,tk->tl", y_slots.reshape(*ids.shape, -1), np.asarray(w, np.float64))


def test_plan_sorts_the_slots_stably_by_expert_with_its_inverse_and_group_sizes():
  ids = routed_ids(0, experts=[0, 2, 3, 5, 6])  # experts 1 and 4 get nothing
  p = moe_dispatch.plan(ids, E)
  flat = np.asarray(ids).reshape(-1)
  np.testing.assert_array_equal(p.order_M, np.argsort(flat, kind="stable"))
  np.testing.assert_array_equal(np.asarray(p.inverse_TK).reshape(-1)[p.order_M], np.arange(T * K))
  np.testing.assert_array_equal(p.group_sizes_E, np.bincount(flat, minlength=E))
  assert p.group_sizes_E[1] == p.group_sizes_E[4] == 0


@pytest.mark.parametrize("experts", [None, [1, 3, 4]], ids=["all", "empty_experts"])
def test_dispatch_and_combine_match_numpy_and_their_gradients_match_autodiff_of_the_reference(experts):
  ids = routed_ids(1, experts=experts)
  keys = jax.random.split(jax.random.key(2), 5)
  z, y = jax.random.normal(keys[0], (T, L)), jax.random.normal(keys[1], (T * K, L))
  w = jax.random.uniform(keys[2], (T, K), minval=0.1, maxval=1.0)
  p = moe_dispatch.plan(ids, E)

  x, x_vjp = jax.vjp(lambda z: moe_dispatch.dispatch(z, p), z)
  x_ref, x_ref_vjp = jax.vjp(lambda z: moe_dispatch.dispatch_reference(z, p), z)
  np.testing.assert_array_equal(x, numpy_dispatch(z, ids)[0])
  dx = jax.random.normal(keys[3], x.shape)
  np.testing.assert_allclose(x_vjp(dx)[0], x_ref_vjp(dx)[0], rtol=1e-6, atol=1e-6)

  u, u_vjp = jax.vjp(lambda y, w: moe_dispatch.combine(y, w, p), y, w)
  u_ref, u_ref_vjp = jax.vjp(lambda y, w: moe_dispatch.combine_reference(y, w, p), y, w)
  np.testing.assert_allclose(u, numpy_combine(y, w, ids), rtol=1e-5, atol=1e-6)
  du = jax.random.normal(keys[4], u.shape)
  for got, want in zip(u_vjp(du), u_ref_vjp(du)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bfloat16_combine_accumulates_in_float32_and_rounds_once():
  ids = routed_ids(3)
  keys = jax.random.split(jax.random.key(4), 3)
  y = jax.random.normal(keys[0], (T * K, L), jnp.bfloat16)
  w = jax.random.uniform(keys[1], (T, K), minval=0.1, maxval=1.0)
  p = moe_dispatch.plan(ids, E)
  u = moe_dispatch.combine(y, w, p)
  assert u.dtype == jnp.bfloat16 and moe_dispatch.combine(y, w, p, jnp.float32).dtype == jnp.float32
  exact = numpy_combine(np.asarray(y, np.float64), w, ids)
  np.testing.assert_allclose(np.asarray(u, np.float64), exact, rtol=2 ** -8, atol=1e-6)
  du = jax.random.normal(keys[2], (T, L), jnp.bfloat16)
  dy, dw = jax.vjp(lambda y, w: moe_dispatch.combine(y, w, p), y, w)[1](du)
  dy_ref, dw_ref = jax.vjp(lambda y, w: moe_dispatch.combine_reference(y, w, p), y.astype(jnp.float32), w)[1](
      du.astype(jnp.float32))
  assert dy.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(dy, np.float32), dy_ref, rtol=2 ** -8, atol=1e-6)
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


def routed(dispatch, combine, z, w, w_gate_up, w_down, ids):
  """The routed part of the MoE layer with the given dispatch and combine (fp32, XLA grouped GEMMs)."""
  p = moe_dispatch.plan(ids, E)
  y = expert_ffn(dispatch(z, p), p.group_sizes_E, w_gate_up, w_down, options=GroupedGemmOptions("xla"))
  return combine(y, w, p)


def routed_inputs(key, t=T, hidden=4):
  keys = jax.random.split(key, 4)
  return (jax.random.normal(keys[0], (t, L)), jax.random.uniform(keys[1], (t, K), minval=0.1, maxval=1.0),
          jax.random.normal(keys[2], (E, L, 2 * hidden)) * L ** -0.5,
          jax.random.normal(keys[3], (E, hidden, L)) * hidden ** -0.5)


def test_routed_experts_equal_the_old_scatter_path_outputs_and_gradients():
  """The new dispatch inside `parallel.local_routed_outputs` against the argsort / gather / scatter / einsum path it
  replaces (fp32, ≤ 1e-5), with two experts empty."""
  ids = routed_ids(5, experts=[0, 1, 2, 4, 6])
  args = routed_inputs(jax.random.key(6))
  new = lambda z, w, wg, wd: parallel.local_routed_outputs(
      z, ids, w, (wg, wd), num_experts=E, expert_fn=functools.partial(expert_ffn, options=GroupedGemmOptions("xla")))
  old = lambda z, w, wg, wd: routed(moe_dispatch.dispatch_reference, moe_dispatch.combine_reference, z, w, wg, wd,
                                    ids)
  cot = jax.random.normal(jax.random.key(7), (T, L))
  (u, grads), (u_old, grads_old) = (jax.vjp(f, *args) for f in (new, old))
  np.testing.assert_allclose(u, u_old, rtol=1e-5, atol=1e-6)
  for g, g_old in zip(grads(cot), grads_old(cot)):
    np.testing.assert_allclose(g, g_old, rtol=1e-5, atol=1e-6)


def test_backward_gathers_by_the_inverse_permutation_and_never_scatter_adds():
  ids = routed_ids(8)
  args = routed_inputs(jax.random.key(9))
  loss = lambda dispatch, combine: jax.grad(
      lambda *a: jnp.sum(routed(dispatch, combine, *a, ids) ** 2), argnums=(0, 1, 2, 3))
  new = primitives(loss(moe_dispatch.dispatch, moe_dispatch.combine), *args)
  old = primitives(loss(moe_dispatch.dispatch_reference, moe_dispatch.combine_reference), *args)
  assert "scatter-add" in old and "scatter-add" not in new
  assert new.count("scatter") == 1  # the plan's inverse permutation (unique indices), in the forward only
  assert new.count("sort") == 1


def test_rematerialised_backward_does_not_sort_again():
  ids = routed_ids(10)
  args = routed_inputs(jax.random.key(11))
  f = jax.checkpoint(lambda *a: jnp.sum(routed(moe_dispatch.dispatch, moe_dispatch.combine, *a, ids) ** 2),
                     policy=jax.checkpoint_policies.nothing_saveable)
  hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3))).lower(*args).as_text()
  assert hlo.count("stablehlo.sort") == 1


def test_bad_ids_and_rows_that_do_not_fit_the_plan_are_value_errors():
  with pytest.raises(ValueError, match="integer"):
    moe_dispatch.plan(jnp.zeros((4, 2)), E)
  with pytest.raises(ValueError, match=r"\[T, k\]"):
    moe_dispatch.plan(jnp.zeros((8,), jnp.int32), E)
  p = moe_dispatch.plan(routed_ids(12), E)
  with pytest.raises(ValueError, match=rf"z must be \[{T}, L\]"):
    moe_dispatch.dispatch(jnp.ones((T + 1, L)), p)
  with pytest.raises(ValueError, match=rf"y must be \[{T * K}, L\]"):
    moe_dispatch.combine(jnp.ones((T * K + 2, L)), jnp.ones((T, K)), p)
  with pytest.raises(ValueError, match="weights must be"):
    moe_dispatch.combine(jnp.ones((T * K, L)), jnp.ones((T, K + 1)), p)
