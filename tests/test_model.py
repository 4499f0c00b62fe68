"""K3Model: shapes and dtypes, decode == full forward with MoE, packed documents, residual modes, remat, z-loss; the
scanned layer groups equal the unrolled layers (loss, gradients, MoE stats, balancer updates, decoding); the AttnRes
read-out op equals its formula inside the model."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import config as config_lib
from k3jax.balancer import BalancerState
from k3jax.config import RESIDUAL_READOUTS
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.moe import LatentMoE, MoEStats
from k3jax.model import K3Model, ModelCache, scanned_layout, z_loss
from k3jax.numerics import rel_err
from k3jax.ops import attnres as attnres_ops
from pallas_testing import kernel_launches, scan_bodies
from model_testing import (MODEL, SCANNED, T, T0, abstract, random_module, segments, shared_model,
                           small_config)

# fp32 roundoff compounded over layers (chunked vs recurrent KDA, standard vs absorbed MLA) on random weights
# stays near 1e-5; a wrong cache or mask gives errors of order one.
TOL = 1e-4
model_forward = nnx.jit(lambda m, tokens, seg: m(tokens, segment_ids_BT=seg))
model_prefill = nnx.jit(lambda m, tokens, max_len: m.prefill(tokens, max_len), static_argnums=2)
model_decode = nnx.jit(lambda m, token, cache: m.decode(token, cache))


def _tokens(seed, shape, vocab=64):
  return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, vocab)


def test_shapes_and_dtypes_bf16():
  cfg = small_config(dtype="bfloat16", z_loss_coef=1e-4, **MODEL)
  tokens = jax.ShapeDtypeStruct((2, T), jnp.int32)
  logits, aux = abstract(lambda rngs: K3Model(cfg, rngs=rngs), lambda m, t: m(t), tokens)
  chex.assert_shape(logits, (2, T, cfg.vocab_size))
  chex.assert_type(logits, jnp.float32)
  assert len(aux["moe"]) == cfg.num_layers - 1 and isinstance(aux["moe"][0], MoEStats)
  chex.assert_shape([aux["moe"][0].scores_TE, aux["moe"][0].load_E, aux["z_loss"]], [(2 * T, 4), (4,), ()])
  step = lambda m, t: m.decode(t[:, 0], m.prefill(t, T + 3)[1])
  logits1, cache = abstract(lambda rngs: K3Model(cfg, rngs=rngs), step, tokens)
  chex.assert_shape(logits1, (2, cfg.vocab_size))
  chex.assert_type(logits1, jnp.float32)
  assert [type(c).__name__ for c in cache.layers] == ["KDACache", "KDACache", "MLACache"]
  chex.assert_shape(cache.layers[2].ckv_BLR, (2, T + 3, cfg.mla.kv_lora_rank))
  chex.assert_type([cache.layers[0].conv_BWC, cache.layers[2].ckv_BLR], [jnp.bfloat16, jnp.bfloat16])


def test_decode_matches_full_forward_with_moe():
  model = shared_model()
  tokens = _tokens(1, (2, T))
  full, aux = model_forward(model, tokens, None)
  assert len(aux["moe"]) == 2 and [m is l.ffn for m, l in zip(model.moe_layers(), model.layers[1:])] == [True] * 2
  assert all(isinstance(m, LatentMoE) for m in model.moe_layers()) and isinstance(model.layers[0].ffn, SiTUGLU)
  assert [float(s.load_E.sum()) for s in aux["moe"]] == [2 * T * 2] * 2        # every token reaches its k experts
  logits, cache = model_prefill(model, tokens[:, :T0], T)
  assert rel_err(logits, full[:, T0 - 1]) < TOL
  for t in range(T0, T):
    logits, cache = model_decode(model, tokens[:, t], cache)
    assert rel_err(logits, full[:, t]) < TOL, t
  assert int(cache.pos) == T


def test_packed_sequence_equals_documents_run_alone():
  model = shared_model()
  tokens = _tokens(2, (2, T))
  packed, _ = model_forward(model, tokens, segments(2, (T0, T - T0)))
  alone = [model_forward(model, tokens[:, s], None)[0] for s in (slice(0, T0), slice(T0, T))]
  assert rel_err(packed[:, :T0], alone[0]) < TOL
  assert rel_err(packed[:, T0:], alone[1]) < TOL


def test_block_structure_of_the_residual():
  model = shared_model()
  assert model.closes == ((False, False), (False, True), (False, False))   # (mixer, FFN) of each layer
  assert [layer.kind for layer in model.layers] == ["kda", "kda", "mla"]
  none = nnx.eval_shape(lambda: K3Model(small_config(**{"residual.mode": "none"}), rngs=nnx.Rngs(0)))
  assert none.final_res is None and all(l.mixer_res is None and l.ffn_res is None for l in none.layers)
  assert none.closes == ((False, False),) * 4
  full = nnx.eval_shape(lambda: K3Model(small_config(**{"residual.mode": "full"}), rngs=nnx.Rngs(0)))
  assert full.closes == ((True, True),) * 4


def test_remat_gives_the_same_loss_and_gradients():
  # One MLA layer with a MoE FFN and full AttnRes: remat must pass the stream and the MoE stats through, with the
  # gradient taken w.r.t. the parameters only (the balancer state outside its trace), as the train step does.
  changes = {**MODEL, "num_layers": 1, "layer_pattern": ("mla",), "moe.first_dense_layers": 0,
             "residual.mode": "full", "z_loss_coef": 1e-3}
  plain = random_module(lambda rngs: K3Model(small_config(**changes), rngs=rngs), seed=3)
  remat = random_module(lambda rngs: K3Model(small_config(remat="save_mixers", **changes), rngs=rngs), seed=3)
  tokens = _tokens(4, (2, T))

  def loss_and_grads(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, rest):
      def loss(p):
        logits, aux = nnx.merge(graphdef, p, rest)(tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux["z_loss"]
      return jax.value_and_grad(loss)(params)
    return run(params, rest)

  (l1, g1), (l2, g2) = loss_and_grads(plain), loss_and_grads(remat)
  assert rel_err(l2, l1) < TOL
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    assert rel_err(b, a) < 1e-4
  assert float(jnp.max(jnp.abs(g1["layers"][0]["ffn_res"]["query"][...]))) > 0    # gradients reach the queries


def _abstract_gradient(cfg):
  """(the abstract model of `cfg`, the traced program of its loss's gradient on one row of 64 tokens)."""
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(jnp.zeros((1, 64), jnp.int32))[0])
  return model, jax.make_jaxpr(jax.grad(loss))(params)


def test_kda_intra_kernel_runs_once_per_layer_and_once_more_unless_remat_keeps_its_residuals(monkeypatch):
  # The kernels' VJP keeps the intra pass's outputs, so without remat the backward does not rerun it; "full" reruns
  # the layer's forward, kernels and all, and "save_mixers" keeps the kernels' residuals, so the intra pass runs
  # once. Counted where the traced program launches it (each call of a shared program counted): unrolled, each of
  # the two layers launches it; scanned (two groups of one layer), the group's body launches it once.
  changes = {**MODEL, "num_layers": 2, "layer_pattern": ("kda",), "last_layer": "kda", "moe.enabled": False,
             "kda.backend": "pallas"}
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0")   # the kernels as the GPU runs them (traced, not run)
  counts = {}
  for scan in (False, True):
    for remat in ("none", "full", "save_mixers"):
      model, gradient = _abstract_gradient(small_config(remat=remat, scan_layers=scan, **changes))
      assert model.plan.num_groups == (2 if scan else 0)
      counts.setdefault(scan, []).append(kernel_launches(gradient, "kda_intra_fwd_key_tiles"))
  assert counts == {False: [2, 4, 2], True: [1, 2, 1]}, counts


def test_remat_unrolled_sets_the_policy_of_the_layers_outside_the_scan(monkeypatch):
  # Layer 0 (KDA, dense FFN) unrolled, layers 1-2 (KDA, MoE) two scanned groups of one layer. Launches of the KDA intra
  # kernel in the gradient's program, (unrolled layer, scanned body): 1 without recomputation, 2 with it.
  changes = {**MODEL, "layer_pattern": ("kda",), "last_layer": "kda", "moe.first_dense_layers": 1,
             "kda.backend": "pallas"}
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0")   # the kernels as the GPU runs them (traced, not run)
  counts = {}
  for remat, unrolled in (("full", None), ("full", "none"), ("none", "full"), ("save_attention", "none")):
    model, gradient = _abstract_gradient(small_config(remat=remat, remat_unrolled=unrolled, **changes))
    assert model.plan.unrolled == (0,) and model.plan.num_groups == 2
    scanned = sum(kernel_launches(body, "kda_intra_fwd_key_tiles") for body in scan_bodies(gradient))
    counts[remat, unrolled] = (kernel_launches(gradient, "kda_intra_fwd_key_tiles") - scanned, scanned)
  assert counts == {("full", None): (2, 2), ("full", "none"): (1, 2), ("none", "full"): (2, 1),
                    ("save_attention", "none"): (1, 2)}, counts


SCAN_CASES = {  # with the layers of SCANNED: (KDA, MLA) twice under the scan, after two unrolled layers
    # Rematerialised: the KDA and MLA positions keep their VJPs' residuals ("save_mixers", each keeping the KDA
    # output), or the KDA ones only their inputs ("save_attention"; on the CPU the MLA ones keep nothing either).
    "blocks_straddle_groups": small_config(**{**SCANNED, "remat": "save_mixers"}),
    "full": small_config(**{**SCANNED, "residual.mode": "full", "residual.source_dtype": "bfloat16",   # bf16 sources
                            "remat": "save_attention"}),
    "none": small_config(**{**SCANNED, "residual.mode": "none", "remat": "full"}),
}


def _scanned_and_unrolled(cfg, seed=0):
  """The scanned model of `cfg` and an unrolled one (`scan_layers=False`, random parameters) whose state
  `scanned_layout` converts to the scanned one's. Both rematerialise alike (remat alone changes fp32 roundoff)."""
  unrolled_cfg = cfg.copy_and_resolve_references()
  unrolled_cfg.scan_layers = False
  unrolled = random_module(lambda rngs: K3Model(unrolled_cfg, rngs=rngs), seed)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, scanned_layout(nnx.state(unrolled), cfg)), unrolled


def _loss_grads_and_stats(model, tokens, seg):
  # The batch is an argument, not a constant of the program: tests that build the same model on other tokens read
  # this program back from the persistent compilation cache (conftest) instead of compiling it again.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def run(params, rest, tokens, seg):
    def loss(p):
      logits, aux = nnx.merge(graphdef, p, rest)(tokens, segment_ids_BT=seg)
      scores = sum(jnp.mean(jnp.square(s.scores_TE)) for s in aux["moe"])  # gradients through the MoE stats too
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux["z_loss"] + scores, aux["moe"]
    return jax.value_and_grad(loss, has_aux=True)(params)
  (loss, stats), grads = run(params, rest, tokens, seg)
  return loss, grads, stats


def _assert_scanned_matches_unrolled(cfg, scanned, unrolled, tokens, seg):
  """The scanned model's loss, gradients and MoE scores are the unrolled one's (fp32 roundoff); returns the two
  models' MoE stats."""
  (l1, g1, s1), (l2, g2, s2) = (_loss_grads_and_stats(m, tokens, seg) for m in (unrolled, scanned))
  assert rel_err(l2, l1) < 1e-5
  g1 = scanned_layout(g1, cfg)
  assert jax.tree.structure(g1) == jax.tree.structure(g2)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  # fp32 summation order: XLA:CPU's threaded reductions moved the whole gradient by 2.1e-5 in one of several runs.
  # Sources stored in bf16 have bf16 cotangents, rounded at every read-out and summed in bf16, in another order
  # through the scan than unrolled: one bf16 rounding (2^-8) bounds them (one machine's XLA:CPU orders gave 5.8e-4
  # and 1.1e-3 on the whole gradient, up to 2.2e-3 on a leaf; with fp32 sources the same case gives 1.1e-5). A
  # misplaced source or layer moves them by O(1).
  bf16_sources = config_lib.residual_source_dtype(cfg) == jnp.bfloat16
  assert rel_err(flat(g2), flat(g1)) < (2 ** -8 if bf16_sources else 5e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
    # Leaf by leaf the fp32 summation order shows more in sums of many cancelling terms (AttnRes queries over the 13
    # sources of "full", a KDA dt_bias): in "full", remat alone moves the unrolled model's leaves by up to 1.5e-4.
    assert rel_err(b, a) < (2 * 2 ** -8 if bf16_sources else 1e-4), jax.tree_util.keystr(path)
  assert len(s1) == len(s2) == len(cfg.moe.enabled and scanned.moe_ids)
  for a, b in zip(s1, s2):  # per MoE layer, in layer order
    assert rel_err(b.scores_TE, a.scores_TE) < 1e-5
  return s1, s2


@pytest.mark.parametrize("case", SCAN_CASES)
def test_scanned_groups_give_the_unrolled_loss_gradients_stats_and_balancer_updates(case):
  cfg = SCAN_CASES[case]
  scanned, unrolled = _scanned_and_unrolled(cfg)
  assert scanned.plan.num_groups == 2 and unrolled.plan.num_groups == 0
  # Per group position, the set of its FFN close flags over the groups: two members make the flag a traced one.
  flags = [{scanned.closes[i][1] for i in scanned.plan.position(j)} for j in range(scanned.plan.group_size)]
  assert flags == {"blocks_straddle_groups": [{True, False}, {True, False}], "full": [{True}, {True}],
                   "none": [{False}, {False}]}[case]
  s1, s2 = _assert_scanned_matches_unrolled(cfg, scanned, unrolled, _tokens(6, (2, T)), segments(2, (5, T - 5)))
  update_balance = nnx.jit(lambda model, stats: model.update_balance(stats))   # one program, not op by op
  for model, stats in ((unrolled, s1), (scanned, s2)):
    update_balance(model, [[s] for s in stats])
  b1, b2 = scanned_layout(nnx.state(unrolled, BalancerState), cfg), nnx.state(scanned, BalancerState)
  assert jax.tree.structure(b1) == jax.tree.structure(b2)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(b1)[0], jax.tree.leaves(b2)):
    if "bias" in jax.tree_util.keystr(path):     # the cut-off method moves the bias; the decayed load is the article's
      assert float(jnp.abs(a).max()) > 0
    # The bias moves by differences of router scores (cancellation): scores 5e-7 apart gave biases 1.0e-5 apart.
    assert rel_err(b, a) < 5e-5 if float(jnp.abs(a).max()) > 0 else float(jnp.abs(b).max()) == 0


def test_the_read_out_op_gives_the_formula_s_loss_and_gradients(monkeypatch):
  """The scanned model with every AttnRes read-out left to autodiff of its formula (`readout_reference`) in place of
  the op with its own backward pass: the same loss, gradients and MoE scores (the op's VJP under remat and inside the
  scan's own VJP; the read-outs' operands are tests/layers/test_layers_attnres.py's). The unrolled model with the op
  equals this scanned one (the scanned-groups test above), so it equals the formula too."""
  cfg = SCAN_CASES["blocks_straddle_groups"]
  model = random_module(lambda rngs: K3Model(cfg, rngs=rngs), 3)
  tokens, seg = _tokens(8, (2, T)), segments(2, (7, T - 7))
  l1, g1, s1 = _loss_grads_and_stats(model, tokens, seg)
  monkeypatch.setattr(attnres_ops, "readout",   # `backward` shapes the op's backward pass; the formula has none
                      lambda *a, backward, **k: attnres_ops.readout_reference(*a, **k))
  jax.clear_caches()   # the layers' jitted forward would otherwise keep the op's trace
  l2, g2, s2 = _loss_grads_and_stats(model, tokens, seg)
  jax.clear_caches()
  # fp32 roundoff only: the op sums in another order, which moved the loss by up to 3e-6 and the gradient by up to
  # 9e-5 (leaves by up to 2.5e-4, as remat alone moves them); 10% off in one term of the op's backward pass fails it.
  assert rel_err(l2, l1) < 1e-5
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  assert rel_err(flat(g2), flat(g1)) < 2e-4
  for a, b in zip(s1, s2):
    assert rel_err(b.scores_TE, a.scores_TE) < 1e-5


def test_the_backward_option_reaches_every_read_out_s_op(monkeypatch):
  """`residual.backward` changes how the read-outs' backward pass runs, not what it computes (the op's tests check
  every setting against the formula, tests/ops/test_ops_attnres.py): "barrier" puts its barriers in the scanned
  model's gradient program beside remat's own, one or more for each read-out the program traces."""
  traced = []
  readout = attnres_ops.readout
  monkeypatch.setattr(attnres_ops, "readout", lambda *a, **k: traced.append(1) or readout(*a, **k))
  programs = {}
  for backward in ("fused", "barrier"):
    jax.clear_caches()   # the layers' jitted forward would otherwise keep an earlier trace
    traced.clear()
    programs[backward] = _gradient_program(backward=backward)
  jax.clear_caches()
  extra = programs["barrier"].count("optimization_barrier") - programs["fused"].count("optimization_barrier")
  assert extra >= len(traced) > 0


def _read_out_case(**residual):
  """The scanned case whose AttnRes blocks straddle its groups, its read-outs' passes set as `residual` says, on
  B·T = 32 tokens: (loss of the parameters, the parameters)."""
  cfg = SCAN_CASES["blocks_straddle_groups"].copy_and_resolve_references()
  for field, value in residual.items():
    cfg.residual[field] = value
  tokens, seg = _tokens(8, (2, 16)), segments(2, (7, 9))
  graphdef, params, rest = nnx.split(random_module(lambda rngs: K3Model(cfg, rngs=rngs), 3), nnx.Param, ...)
  return lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(tokens, segment_ids_BT=seg)[0]), params


def _gradient_program(**residual) -> str:
  loss, params = _read_out_case(**residual)
  return str(jax.make_jaxpr(jax.grad(loss))(params))


GROUP_READOUT_CASES = {   # block mode under the recomputing scan (remat); full mode under the plain scan (autodiff)
    "blocks_straddle_groups": SCAN_CASES["blocks_straddle_groups"],
    # fp32 sources: in bf16 each read-out rounds its share of their cotangent, and the per-read-out and the per-group
    # read-outs round different sums (gradients 5e-3 apart), which would hide the summation order this compares.
    "full": small_config(**{**SCANNED, "residual.mode": "full"}),
}


@pytest.mark.parametrize("case", GROUP_READOUT_CASES)
def test_group_summaries_of_the_buffer_give_the_per_read_out_loss_and_gradients(case, monkeypatch):
  """`residual.readout="group"` (each scanned group reads its buffer once, `attnres.summarize`) against "layer" (each
  read-out reads it): the same loss, gradients and MoE scores on the same parameters, and the summaries are read."""
  cfg = GROUP_READOUT_CASES[case].copy_and_resolve_references()
  per_layer = random_module(lambda rngs: K3Model(cfg, rngs=rngs), 5)
  cfg.residual.readout = "group"
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
  per_group = nnx.merge(graphdef, nnx.state(per_layer))
  assert per_group.plan.num_groups == 2 and per_group.summarize_groups and not per_layer.summarize_groups
  calls = []
  merge = attnres_ops.readout_from_summary
  monkeypatch.setattr(attnres_ops, "readout_from_summary", lambda *a, **k: calls.append(1) or merge(*a, **k))
  tokens, seg = _tokens(9, (2, T)), segments(2, (6, T - 6))
  jax.clear_caches()   # the layers' jitted forward would otherwise keep an earlier trace
  l1, g1, s1 = _loss_grads_and_stats(per_layer, tokens, seg)
  assert not calls
  l2, g2, s2 = _loss_grads_and_stats(per_group, tokens, seg)
  assert calls   # every scanned read-out went through its summary (traced at least once each)
  jax.clear_caches()
  # fp32 roundoff only (another summation order, as the read-out op against its formula above).
  assert rel_err(l2, l1) < 1e-5
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  assert rel_err(flat(g2), flat(g1)) < 2e-4
  queries = lambda g: [x for path, x in jax.tree_util.tree_flatten_with_path(g)[0]
                       if "groups" in jax.tree_util.keystr(path) and "query" in jax.tree_util.keystr(path)]
  for a, b in zip(queries(g1), queries(g2), strict=True):   # the summaries' own gradient path
    assert float(jnp.abs(a).max()) > 0 and rel_err(b, a) < 2e-4
  for a, b in zip(s1, s2):
    assert rel_err(b.scores_TE, a.scores_TE) < 1e-5


def test_decode_with_group_summaries_matches_the_full_forward():
  model = shared_model(tuple({**SCANNED, "residual.readout": "group"}.items()))
  assert model.plan.num_groups == 2 and model.summarize_groups
  tokens = _tokens(10, (2, T))
  full, _ = model_forward(model, tokens, None)
  logits, cache = model_prefill(model, tokens[:, :T0], T)
  assert rel_err(logits, full[:, T0 - 1]) < TOL
  for t in range(T0, T):
    logits, cache = model_decode(model, tokens[:, t], cache)
    assert rel_err(logits, full[:, t]) < TOL, t


@pytest.mark.parametrize("readout", RESIDUAL_READOUTS)
def test_the_scanned_backward_keeps_the_source_buffer_once_not_per_group(readout):
  # Rematerialised, each layer keeps its input for the backward pass. Unrolled, the AttnRes sources are arrays of
  # their own, kept once; scanned, they live in a buffer the scan carries, which a scan's own VJP would keep at
  # every group (and "group" read-outs' summaries of it, which the backward pass computes again instead). Kept
  # here: the arrays with a token axis (activations) of jax.vjp's residuals, traced only.
  T_ = 200
  def kept_bytes(scan):
    cfg = small_config(**{**SCANNED, "remat": "full", "scan_layers": scan, "residual.readout": readout})
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(jnp.zeros((2, T_), jnp.int32))[0])
    residuals = jax.eval_shape(lambda p: jax.tree.leaves(jax.vjp(loss, p)[1]), params)
    return sum(x.size * x.dtype.itemsize for x in residuals if T_ in x.shape)
  buffer = 3 * 2 * T_ * 32 * 4    # x_0 and the two blocks' sums, fp32 [B, T, D]
  unrolled, scanned = kept_bytes(False), kept_bytes(True)
  # At most the final buffer, and the zero slots the scan's first buffer is padded with (a constant), over the
  # unrolled model's sources.
  assert unrolled <= scanned <= unrolled + 2 * buffer, (unrolled, scanned)


@pytest.mark.parametrize("case", ["blocks_straddle_groups", "full"])
def test_scanned_read_outs_see_only_the_sources_present_when_the_last_group_starts(case, monkeypatch):
  # The sums the last group closes are only returned: its flush writes them to buffer slots no read-out passes over,
  # forward or backward. Blocks of three: x_0 and the block closed at layer 2 are read, the one closed at layer 5 (the
  # last group's last layer) is not. "full": x_0 and layers 0-3's eight sub-layers are read, layers 4-5's four not.
  readable = {"blocks_straddle_groups": 2, "full": 9}[case]
  sizes = []
  readout = attnres_ops.readout
  monkeypatch.setattr(attnres_ops, "readout", lambda q, g, buffer, *a, **k: sizes.append(buffer.shape[0]) or
                      readout(q, g, buffer, *a, **k))
  model = nnx.eval_shape(lambda: K3Model(SCAN_CASES[case], rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(jnp.zeros((2, 16), jnp.int32))[0])
  jax.clear_caches()   # the layers' jitted forward would otherwise keep an earlier trace
  jax.make_jaxpr(jax.grad(loss))(params)
  jax.clear_caches()
  assert set(sizes) == {0, readable}, sizes   # the unrolled layers read `Stream`s, which have no buffer


def test_the_init_traces_a_group_position_once_however_many_groups():
  """A scanned group position's layers are built in one vmapped program: the init of 4 groups traces to as many
  equations as that of 2 (the unrolled init, a layer's build per layer, grows with them); each layer still draws
  values of its own."""
  def init(num_layers, scan=True):
    cfg = small_config(**{**SCANNED, "num_layers": num_layers, "scan_layers": scan})
    assert nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))).plan.num_groups == (num_layers - 2) // 2 * scan
    return lambda: nnx.state(K3Model(cfg, rngs=nnx.Rngs(0)))
  equations = lambda num_layers, scan=True: len(jax.make_jaxpr(init(num_layers, scan))().eqns)
  assert equations(6) == equations(10) and equations(6, scan=False) < equations(10, scan=False)
  stacked = [x for x in jax.tree.leaves(jax.jit(init(10))()["groups"]) if x.ndim >= 3]   # the stacked matrices
  assert stacked and all(x.shape[0] == 4 and not np.array_equal(x[0], x[g]) for x in stacked for g in range(1, 4))


def test_decode_with_scanned_groups_matches_the_full_forward():
  model = shared_model(tuple(SCANNED.items()))
  assert model.plan.num_groups == 2
  tokens = _tokens(7, (2, T))
  full, _ = model_forward(model, tokens, None)
  logits, cache = model_prefill(model, tokens[:, :T0], T)
  assert [type(c).__name__ for c in cache.groups] == ["KDACache", "MLACache"]
  chex.assert_shape(cache.groups[1].ckv_BLR, (2, 2, T, 16))   # [groups, B, max_len, r_kv]
  assert rel_err(logits, full[:, T0 - 1]) < TOL
  for t in range(T0, T):
    logits, cache = model_decode(model, tokens[:, t], cache)
    assert rel_err(logits, full[:, t]) < TOL, t


def test_tied_head_shares_the_embedding():
  count = lambda cfg: sum(x.size for x in jax.tree.leaves(nnx.state(
      nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))), nnx.Param)))
  cfg = small_config()
  assert count(cfg) - count(small_config(tie_embeddings=True)) == cfg.d_model * cfg.vocab_size


def test_z_loss_is_the_mean_squared_logsumexp():
  logits = 3.0 * jax.random.normal(jax.random.PRNGKey(5), (2, 4, 7))
  lse = np.log(np.sum(np.exp(np.asarray(logits, np.float64)), -1))
  mask = jnp.array([[1, 1, 0, 1], [0, 1, 1, 1]], bool)
  np.testing.assert_allclose(z_loss(logits, 0.1), 0.1 * np.mean(lse ** 2), rtol=1e-5)
  np.testing.assert_allclose(z_loss(logits, 0.1, mask), 0.1 * np.mean(lse[np.asarray(mask)] ** 2), rtol=1e-5)
  assert float(z_loss(logits, 0.0)) == 0.0


def test_bad_inputs_raise_clear_errors():
  model = shared_model()
  with pytest.raises(ValueError, match="tokens_BT must be an integer array"):
    model(jnp.zeros((2, 3), jnp.float32))
  with pytest.raises(ValueError, match="segment_ids_BT must be an integer array shaped like tokens"):
    model(jnp.zeros((2, 3), jnp.int32), segment_ids_BT=jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="token_B must be an integer array of shape"):
    model.decode(jnp.zeros((2, 1), jnp.int32), None)
  with pytest.raises(ValueError, match="max_len=2 is shorter than the prompt"):
    model.prefill(jnp.zeros((2, 3), jnp.int32), 2)
  with pytest.raises(ValueError, match="the cache is full: position 5 >= max_len=5"):
    model.decode(jnp.zeros((2,), jnp.int32), ModelCache((), None, jnp.asarray(5, jnp.int32), 5))
