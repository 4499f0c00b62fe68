"""LatentMoE layer against a dense all-experts reference; stats, balancer state and config errors."""
import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from k3jax import balancer, parallel
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.moe import LatentMoE, MoEStats, dense_routed_outputs, expert_ffn
from k3jax.ops import moe_dispatch
from pallas_kernels.grouped_gemm import GroupedGemmOptions
from model_testing import equations
from moe_testing import (D, base, base_output_and_grads, forward, moe_config, output_and_grads,  # noqa: F401
                         rel, tokens, variant)


def dense_reference(layer, x_BTD):
  """Every expert on every token, combined with the routing weights: docs/design.md, LatentMoE, written out directly."""
  cfg = layer.cfg
  x = x_BTD.reshape(-1, D)
  s = jax.nn.sigmoid(x @ layer.router.w[...])
  _, ids = jax.lax.top_k(s + layer.balancer.get_value().bias, cfg.top_k)
  p = jnp.take_along_axis(s, ids, 1)
  p = p / p.sum(1, keepdims=True) * cfg.routed_scaling
  dense_p = jnp.sum(jax.nn.one_hot(ids, cfg.num_experts) * p[..., None], axis=1)        # [T, E]
  z = x @ layer.latent_down.w[...]
  ab = jnp.einsum("tl,elgh->tegh", z, layer.w_gate_up[...])
  a, b = ab[:, :, 0], ab[:, :, 1]
  h = 4.0 * jnp.tanh(a / 4.0) * jax.nn.sigmoid(a) * 25.0 * jnp.tanh(b / 25.0)                # SiTU-GLU
  y_e = jnp.einsum("teh,ehl->tel", h, layer.w_down[...])
  u = jnp.einsum("te,tel->tl", dense_p, y_e)
  u = u * jax.lax.rsqrt(jnp.mean(u ** 2, -1, keepdims=True) + 1e-6) * layer.norm.weight[...]
  return (u @ layer.latent_up.w[...]).reshape(x_BTD.shape) + layer.shared(x_BTD)


def test_layer_matches_dense_all_experts_reference_outputs_and_gradients(base):
  x = tokens(jax.random.key(2))
  (y, (dp, dx)), (y_ref, (dp_ref, dx_ref)) = base_output_and_grads(2), output_and_grads(base, x, dense_reference)
  assert rel(y, y_ref) <= 1e-5 and rel(dx, dx_ref) <= 1e-5
  for g, g_ref in zip(jax.tree.leaves(dp), jax.tree.leaves(dp_ref)):
    assert rel(g, g_ref) <= 1e-5


def old_scatter_routed_outputs(z_TL, ids_TK, weights_TK, experts, *, num_experts, expert_fn):
  """The routed part as the layer computed it before `moe_dispatch`: autodiff of a gather, an unsort scatter and an
  fp32 einsum (its backward scatter-adds duplicate rows)."""
  p = moe_dispatch.plan(ids_TK, num_experts)
  y = expert_fn(moe_dispatch.dispatch_reference(z_TL, p), p.group_sizes_E, *experts)
  return moe_dispatch.combine_reference(y, weights_TK, p)


def test_layer_with_the_new_dispatch_equals_the_old_scatter_path(base, monkeypatch):
  x = tokens(jax.random.key(2))
  y, (dp, dx) = base_output_and_grads(2)
  monkeypatch.setattr(parallel, "local_routed_outputs", old_scatter_routed_outputs)
  y_old, (dp_old, dx_old) = output_and_grads(base, x, lambda m, x: m(x)[0])
  assert rel(y, y_old) <= 1e-5 and rel(dx, dx_old) <= 1e-5
  for g, g_old in zip(jax.tree.leaves(dp), jax.tree.leaves(dp_old)):
    assert rel(g, g_old) <= 1e-5


def test_every_token_reaches_all_its_experts(base):
  """Dropless: the loads add up to T·k whatever the skew (here a bias that sends every token to expert 0)."""
  skewed = variant(base)
  skewed.balancer.set_value(balancer.State(bias=jnp.zeros(8).at[0].set(5.0)))
  x = tokens(jax.random.key(3))
  y, stats = forward(skewed, x, lambda m, x: m(x))
  assert float(stats.load_E[0]) == 32.0 and float(stats.load_E.sum()) == 64.0
  assert rel(y, forward(skewed, x, dense_reference)) <= 1e-5


def test_fused_shared_experts_equal_the_sum_of_separate_ones():
  """Why one SiTU-GLU of width n·h stands for n shared experts: a sum of GLUs is a GLU over the joint units."""
  a, b = (SiTUGLU(D, 6, rngs=nnx.Rngs(i), dtype=jnp.float32) for i in (1, 2))
  fused = SiTUGLU(D, 12, rngs=nnx.Rngs(3), dtype=jnp.float32)
  fused.w_gate_up.set_value(jnp.concatenate([a.w_gate_up[...], b.w_gate_up[...]], axis=-1))
  fused.w_down.set_value(jnp.concatenate([a.w_down[...], b.w_down[...]], axis=0))
  x = tokens(jax.random.key(4))
  chex.assert_trees_all_close(fused(x), a(x) + b(x), atol=1e-5)


def test_stats_report_scores_loads_and_no_aux_loss_for_quantile(base):
  _, stats = forward(base, tokens(jax.random.key(5)), lambda m, x: m(x))
  assert isinstance(stats, MoEStats)
  chex.assert_shape(stats.scores_TE, (32, 8))
  chex.assert_type([stats.scores_TE, stats.load_E], jnp.float32)
  assert float(stats.load_E.sum()) == 32 * 2 and float(stats.aux_loss) == 0.0
  assert bool(jnp.all((stats.scores_TE > 0) & (stats.scores_TE < 1)))


def test_aux_loss_balancer_adds_a_loss_that_trains_the_router(base):
  layer = variant(base, balancer="aux_loss")
  x = tokens(jax.random.key(6))
  _, stats = layer(x)
  _, ids = balancer.select(stats.scores_TE, layer.balancer.get_value().bias, top_k=2)
  chex.assert_trees_all_close(stats.aux_loss, 1e-2 * balancer.switch_aux_loss(stats.scores_TE, ids), rtol=1e-6)
  _, (dp, _) = output_and_grads(layer, x, lambda m, x: m(x)[1].aux_loss * jnp.ones_like(x))
  assert float(jnp.abs(dp["router"]["w"][...]).max()) > 0.0


def test_balancer_state_is_not_a_param_and_update_balance_runs_in_jit(base):
  layer = variant(base)
  graph, params, bal, rest = nnx.split(layer, nnx.Param, balancer.BalancerState, ...)
  assert "balancer" not in params and "balancer" in bal
  x1, x2 = tokens(jax.random.key(8)), tokens(jax.random.key(9))

  @jax.jit
  def step(params, bal, rest):
    m = nnx.merge(graph, params, bal, rest)
    stats = [m(x1)[1], m(x2)[1]]
    m.update_balance(stats)
    return nnx.split(m, nnx.Param, balancer.BalancerState, ...)[1:]
  new_params, new_bal, _ = step(params, bal, rest)
  chex.assert_trees_all_equal(new_params, params)
  scores = jnp.concatenate([layer(x1)[1].scores_TE, layer(x2)[1].scores_TE])
  expected = balancer.update(layer.balancer.get_value(), scores, top_k=2)
  chex.assert_trees_all_close(new_bal["balancer"].get_value().bias, expected.bias, atol=1e-6)


@pytest.mark.parametrize("cfg, method", [
    (dict(balancer="none"), None), (dict(balancer="aux_loss"), None), (dict(balancer="sign"), "sign"),
    (dict(balancer_method="exact"), "exact"), (dict(balancer_method="histogram"), "histogram"),
    (dict(balancer_method="article"), "article"),
])
def test_update_balance_follows_the_configured_method(base, cfg, method):
  layer = variant(base, **cfg)
  old = layer.balancer.get_value()
  stats = layer(tokens(jax.random.key(10)))[1]
  layer.update_balance(stats)
  new = layer.balancer.get_value().bias
  if method is None:
    chex.assert_trees_all_equal(new, old.bias)
  else:
    expected = balancer.update(old, stats.scores_TE, top_k=2, method=method)
    chex.assert_trees_all_close(new, expected.bias, atol=1e-7)
    assert float(jnp.abs(new - old.bias).max()) > 0.0


def test_padding_tokens_count_in_no_statistic(base):
  """A batch with a padded tail (valid_BT false) gives the load, aux loss and balancer update of its real tokens."""
  layer = variant(base, balancer="aux_loss")
  x = tokens(jax.random.key(11))
  B, T_ = x.shape[:2]
  valid = jnp.arange(T_)[None] < jnp.asarray([T_, T_ // 3])[:B, None]
  _, stats = layer(x, valid)
  real = valid.reshape(-1)
  ids = balancer.select(stats.scores_TE, layer.balancer.get_value().bias, top_k=2)[1]
  chex.assert_trees_all_equal(stats.load_E, balancer.expert_load(ids[real], layer.cfg.num_experts))
  chex.assert_trees_all_close(stats.aux_loss, 1e-2 * balancer.switch_aux_loss(stats.scores_TE[real], ids[real]),
                              rtol=1e-6)
  exact = variant(base, balancer_method="exact")
  old = exact.balancer.get_value()
  stats = exact(x, valid)[1]
  exact.update_balance(stats)
  want = balancer.update(old, stats.scores_TE[real], top_k=2).bias
  chex.assert_trees_all_close(exact.balancer.get_value().bias, want, atol=1e-7)


def test_bfloat16_layer_is_close_to_float32(base):
  x = tokens(jax.random.key(11))
  assert rel(forward(variant(base, dtype=jnp.bfloat16), x).astype(jnp.float32), forward(base, x)) <= 3e-2


@pytest.mark.parametrize("overrides, match", [
    (dict(latent_dim=None), "moe.latent_dim must be set"),
    (dict(expert_hidden=None), "moe.expert_hidden must be set"),
    (dict(top_k=9), "top_k=9 exceeds"),
    (dict(num_experts=0), "num_experts must be a positive int"),
    (dict(num_shared_experts=1, shared_hidden=0), "shared_hidden"),
    (dict(balancer="loss_free"), "moe.balancer must be one of"),
    (dict(balancer_method="median"), "balancer_method"),
    (dict(routing="gathered"), "moe.routing must be one of"),
    (dict(glu_epilogue="yes"), "moe.glu_epilogue must be a bool"),
])
def test_bad_configs_raise_value_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    nnx.eval_shape(lambda: LatentMoE(D, moe_config(**overrides), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("t", [1, 3, 16])
def test_dense_routing_equals_the_sorted_path_outputs_and_gradients(base, t):
  """Every expert on every token, the unchosen weighted 0, is the dropless sorted path's function, gradients too (a
  skewed bias sends several of a token's slots' neighbours to one expert)."""
  x = tokens(jax.random.key(12), b=1, t=t)
  y, (dp, dx) = output_and_grads(variant(base, routing="sorted"), x, lambda m, x: m(x)[0])
  y_dense, (dp_dense, dx_dense) = output_and_grads(variant(base, routing="dense"), x, lambda m, x: m(x)[0])
  assert rel(y_dense, y) <= 1e-6 and rel(dx_dense, dx) <= 1e-6
  for g, g_dense in zip(jax.tree.leaves(dp), jax.tree.leaves(dp_dense)):
    assert rel(g_dense, g) <= 1e-6


def test_dense_routing_ignores_non_finite_outputs_of_unchosen_experts():
  """An expert no token chose may produce anything (here inf): the combine masks it rather than weighting it by 0."""
  z = jax.random.normal(jax.random.key(0), (2, 4))
  ids, w = jnp.array([[0], [0]]), jnp.ones((2, 1))
  w_gate_up = jax.random.normal(jax.random.key(1), (2, 4, 6)).at[1].set(jnp.inf)
  u = dense_routed_outputs(z, ids, w, w_gate_up, jax.random.normal(jax.random.key(2), (2, 3, 4)))
  assert bool(jnp.all(jnp.isfinite(u)))


@pytest.mark.parametrize("routing, t, dense", [("auto", 1, False), ("auto", 4, True), ("auto", 8, True),
                                               ("auto", 9, False), ("dense", 16, True), ("sorted", 4, False)])
def test_routing_runs_dense_as_configured(base, routing, t, dense):
  """"auto" (E = 8, top-2): dense for T <= E <= T·k, i.e. 4..8 tokens; the sorted path (the dispatch's sort of
  the slots in the program) otherwise. "dense" and "sorted" whatever the tokens."""
  layer = variant(base, routing=routing)
  graph, state = nnx.split(layer)
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graph, s)(x)[0])(state, tokens(jax.random.key(0), b=1, t=t))
  sorts = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "sort"]
  assert (not sorts) == dense


def _selects_over_expert_rows(fn, *args, rows):
  """The `select_n` equations of fn's jaxpr (nested ones included) over `[rows, ·]` activations."""
  return [e for e in equations(fn, *args) if e.primitive.name == "select_n" and e.outvars[0].aval.ndim == 2
          and e.outvars[0].aval.shape[0] == rows and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)]


def test_rows_past_the_groups_are_zeroed_only_where_expert_parallelism_leaves_some(base):
  """Without expert parallelism the T·k sorted slots are exactly the groups' rows: no select over them."""
  x = tokens(jax.random.key(4))
  rows = x.shape[0] * x.shape[1] * base.cfg.top_k
  graphdef, state = nnx.split(base)
  assert not _selects_over_expert_rows(lambda s, x: nnx.merge(graphdef, s)(x)[0], state, x, rows=rows)
  e, l, _, h = base.w_gate_up.shape
  args = (jnp.ones((rows, l)), jnp.full((e,), rows // e), jnp.ones((e, l, 2 * h)), jnp.ones((e, h, l)))
  assert len(_selects_over_expert_rows(expert_ffn, *args, rows=rows)) == 1
  assert not _selects_over_expert_rows(lambda *a: expert_ffn(*a, rows_past_groups=False), *args, rows=rows)


def test_the_glu_runs_in_the_grouped_gemms_epilogues_only_as_configured_and_with_every_row_a_groups(monkeypatch):
  """`expert_ffn` hands the whole expert to `GroupedGemmOptions.glu_ffn` (the kernels' epilogues) where the options
  fuse it and no row lies past the groups; `moe.glu_epilogue=False` keeps the unit between the products."""
  calls = []
  monkeypatch.setattr(GroupedGemmOptions, "fuses_glu", lambda self, k, h, dtype: self.glu_tiles is not None)
  monkeypatch.setattr(GroupedGemmOptions, "glu_ffn",
                      lambda self, x, w, wd, gs, unit: calls.append(w.shape) or jnp.zeros_like(x))
  e, l, h, rows = 4, 8, 6, 32
  args = (jnp.ones((rows, l)), jnp.full((e,), rows // e), jnp.ones((e, l, 2 * h)), jnp.ones((e, h, l)))
  expert_ffn(*args, rows_past_groups=False)
  assert calls == [(e, l, 2, h)]
  expert_ffn(*args)
  expert_ffn(*args, options=GroupedGemmOptions(glu_tiles=None), rows_past_groups=False)
  assert len(calls) == 1
  build = lambda **o: nnx.eval_shape(lambda: LatentMoE(D, moe_config(**o), rngs=nnx.Rngs(0)))
  assert build(glu_epilogue=True).grouped_gemm.glu_tiles is not None
  assert build(glu_epilogue=False).grouped_gemm.glu_tiles is None
  assert build().grouped_gemm.glu_tiles is not None   # on unless turned off
