"""Training pieces: schedules, weight-decay and Muon masks, mesh specs, stage validation, command-line config
overrides, the loss; a few train steps of the scanned model against the unrolled one. (The training loop is tested
in test_train_loop.py.)"""
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from experiments.configs import common, tiny
from k3jax import model, parallel
from k3jax.model import K3Model
from k3jax.numerics import rel_err
from k3jax.train import checkpoint, optimizer, stages as stages_lib, state as state_lib, step as step_lib
from model_testing import SCANNED, small_config

TINY = str(pathlib.Path(tiny.__file__))


def test_wsd_schedule_rises_holds_then_decays():
  lr = optimizer.wsd_schedule(1.0, 100, warmup_fraction=0.1, decay_fraction=0.2, final_fraction=0.1)
  values = np.array([float(lr(s)) for s in range(100)])
  np.testing.assert_allclose(values[:10], np.arange(1, 11) / 10, rtol=1e-6)
  np.testing.assert_allclose(values[10:80], 1.0)
  assert np.all(np.diff(values[80:]) < 0) and values[-1] == pytest.approx(1.0 - 0.9 * 19 / 20)


def test_stage_schedules_join_at_stage_starts():
  c = common.set_stages(common.base_config(), [dict(seq_len=64, steps=10, batch_size=8, lr=1.0),
                                               dict(seq_len=128, steps=10, batch_size=4, lr=0.5)])
  lr = stages_lib.training_plan(c).learning_rate
  first = optimizer.wsd_schedule(1.0, 10, c.optimizer.warmup_fraction, c.optimizer.decay_fraction,
                                 c.optimizer.final_lr_fraction)
  second = optimizer.wsd_schedule(0.5, 10, c.optimizer.warmup_fraction, c.optimizer.decay_fraction,
                                  c.optimizer.final_lr_fraction)
  np.testing.assert_allclose([float(lr(s)) for s in range(20)],
                             [float(first(s)) for s in range(10)] + [float(second(s)) for s in range(10)])


def _abstract_params(**changes):
  m = tiny.get_config().model
  for field, value in changes.items():
    m[field] = value
  model = nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0)))
  return state_lib.split(model)[1], model.plan


def _by_path(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_weight_decay_skips_vectors_and_the_kda_decay_parameters():
  params, _ = _abstract_params()
  mask, shapes = _by_path(optimizer.decay_mask(params)), {k: x.shape for k, x in _by_path(params).items()}
  for path, decays in mask.items():
    kda_decay = "A_log" in path or "dt_bias" in path
    assert decays == (len(shapes[path]) >= 2 and not kda_decay), path
  assert any(mask.values()) and any("dt_bias" in p for p in mask)


def test_scanned_layers_take_the_weight_decay_and_muon_dims_of_their_unrolled_copies():
  # Ten tiny layers, eight of them scanned (two groups of four): a stacked leaf `groups[j]...` decays as the layer
  # it stacks (`layers[i]...` unrolled) does, and Muon orthogonalises it over the same axes, one past the group's.
  (scanned, lp), (unrolled, _) = _abstract_params(num_layers=10), _abstract_params(num_layers=10, scan_layers=False)
  assert lp.num_groups == 2
  twin_of = lambda m: f"['layers'][{lp.position(int(m[1]))[0]}]"
  as_unrolled = lambda path: re.sub(r"^\['groups'\]\[(\d+)\]", twin_of, path)
  is_dims = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  dims = lambda p: {jax.tree_util.keystr(k): d for k, d in
                    jax.tree_util.tree_flatten_with_path(optimizer.muon_dims(p), is_leaf=is_dims)[0]}
  mask_u, mask_s, dims_u, dims_s = (_by_path(optimizer.decay_mask(unrolled)), _by_path(optimizer.decay_mask(scanned)),
                                    dims(unrolled), dims(scanned))
  stacked = [p for p in mask_s if p.startswith("['groups']")]
  assert stacked and len(mask_s) == len(dims_s)
  for path in stacked:
    twin = as_unrolled(path)
    assert mask_s[path] == mask_u[twin], path
    want = dims_u[twin] and optax.contrib.MuonDimensionNumbers(1, 2)
    assert dims_s[path] == want, path
  assert any(mask_s[p] for p in stacked) and not all(mask_s[p] for p in stacked)
  assert any(dims_s[p] is not None for p in stacked)


def test_muon_option_updates_every_parameter():
  c = tiny.get_config()
  c.optimizer.name = "muon"
  tx = optimizer.make_optimizer(c.optimizer, stages_lib.training_plan(c).learning_rate)
  params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), _abstract_params()[0])
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(x.size), x.shape), params)
  updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
  for u in jax.tree.leaves(updates):
    chex.assert_tree_all_finite(u)
    assert float(jnp.abs(u).max()) > 0
  dims = jax.tree.leaves(optimizer.muon_dims(params), is_leaf=lambda x: x is None or hasattr(x, "reduction_axis"))
  assert any(d is not None for d in dims) and any(d is None for d in dims)


def test_stages_keep_tokens_per_step_and_must_sum_to_steps():
  c = common.set_stages(common.base_config(), [(64, 5, 8), (128, 3, 4)])
  plan = stages_lib.training_plan(c)
  assert [(s.start, s.end, s.seq_len, s.batch_size) for s in plan.stages] == [(0, 5, 64, 8), (5, 8, 128, 4)]
  assert plan.steps == 8 and plan.tokens == 8 * 512   # 512 tokens a step in both stages
  single = stages_lib.training_plan(common.base_config()).stages
  assert len(single) == 1 and single[0].steps == common.base_config().steps
  bad = [((64, 5, 8), (128, 3, 8)), ((64, 5, 8), dict(seq_len=128, steps=3)), ((64, 0, 8),)]
  for stages, match in zip(bad, ("tokens per step", "missing", "positive")):
    with pytest.raises(ValueError, match=match):
      stages_lib.training_plan(common.set_stages(common.base_config(), stages))
  c.steps = 9
  with pytest.raises(ValueError, match="sum of the stages"):
    stages_lib.training_plan(c)
  c = common.base_config()
  c.micro_batches = 3
  with pytest.raises(ValueError, match="micro_batches"):
    stages_lib.training_plan(c)


def _parse(argv):
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config", flag_values=fv, lock_config=True, sys_argv=argv)
  fv(argv)
  return fv.config


def test_command_line_overrides_reach_the_config():
  c = _parse(["train", f"--config={TINY}", "--config.steps=7", "--config.optimizer.lr=0.25",
              "--config.mesh=data:1,expert:1", "--config.data.mix.mqar=0.5", "--config.eval.lengths=(64,128)",
              "--config.model.moe.top_k=3"])
  assert (c.steps, c.optimizer.lr, c.mesh, c.data.mix.mqar, c.eval.lengths, c.model.moe.top_k) == (
      7, 0.25, "data:1,expert:1", 0.5, (64, 128), 3)
  with pytest.raises(Exception, match="no_such_field"):
    _parse(["train", f"--config={TINY}", "--config.no_such_field=1"])


def test_token_losses_match_a_numpy_cross_entropy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 5)).astype(np.int32)
  weights = (rng.random((2, 5)) < 0.6).astype(np.float32)
  ce, correct = step_lib.token_losses(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = -(np.take_along_axis(logp, targets[..., None], -1)[..., 0] * weights).sum()
  assert float(ce) == pytest.approx(want, rel=1e-5)
  assert float(correct) == ((logits.argmax(-1) == targets) * weights).sum()


def _run_steps(model_cfg, steps: int, *, resume_at: int | None = None, directory=None):
  """Metrics of `steps` Muon train steps (2 micro-batches of 2 rows, packed documents) and the states: the initial
  one and after each step. With `resume_at`, the state after that step is also saved to a checkpoint under
  `directory`, restored, and trained on to the end: the last state of that resumed run is returned third."""
  c = common.base_config()
  c.model, c.steps, c.mesh, c.micro_batches = model_cfg, steps, "data:1,expert:1", 2
  c.optimizer.name, c.optimizer.lr = "muon", 1e-2
  lr = stages_lib.training_plan(c).learning_rate
  tx = optimizer.make_optimizer(c.optimizer, lr)
  graphdef, abstract, init = state_lib.abstract_state(c, tx, parallel.mesh_from_string(c.mesh))
  states = [jax.jit(init)(c.seed)]
  train_step = jax.jit(step_lib.make_train_step(graphdef, tx, lr, c.model))
  tokens = jax.random.randint(jax.random.PRNGKey(3), (steps, 2, 2, 13), 0, c.model.vocab_size)
  segment_ids = jnp.broadcast_to((jnp.arange(12) >= 5).astype(jnp.int32), (2, 2, 12))
  batch = lambda s: {"tokens": tokens[s, ..., :-1], "targets": tokens[s, ..., 1:], "segment_ids": segment_ids,
                     "weights": jnp.ones((2, 2, 12), jnp.float32)}
  metrics = []
  for s in range(steps):
    state, m = train_step(states[-1], batch(s))
    states.append(state)
    metrics.append(jax.device_get(m))
  if resume_at is None:
    return metrics, states
  ckpt = checkpoint.Checkpointer(directory, keep=1)
  ckpt.save(resume_at, states[resume_at], {})
  ckpt.wait()
  state, _ = ckpt.restore_latest(abstract)
  for s in range(resume_at, steps):
    state, _ = train_step(state, batch(s))
  return metrics, states, state


def test_scanned_train_steps_match_the_unrolled_ones(tmp_path):
  # Layer i draws from its own key, one by one or vmapped over a group position's keys, so both models start from
  # the same parameters. Muon orthogonalises the stacked matrices over their batch axis; quantile balancing updates
  # the stacked MoE layers from stacked micro-batch stats.
  # Rematerialised (the scanned groups' own recomputing VJP) under the scan over micro-batches.
  scanned_cfg = small_config(**SCANNED, remat="save_mixers")
  unrolled_cfg = small_config(**SCANNED, remat="save_mixers", scan_layers=False)
  (m1, s1), (m2, s2, resumed) = _run_steps(unrolled_cfg, 2), _run_steps(scanned_cfg, 2, resume_at=1,
                                                                         directory=tmp_path / "ckpt")
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(s2[2])):   # the stacked layout resumes exactly
    np.testing.assert_array_equal(a, b)
  to_scanned = jax.jit(lambda s: state_lib.TrainState(
      s.step, *(model.scanned_layout(x, scanned_cfg) for x in (s.params, s.opt_state, s.balancer, s.other))))
  first, second = to_scanned(s1[0]), to_scanned(s1[1])
  assert jax.tree.structure(first) == jax.tree.structure(s2[0])
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(s2[0])):
    np.testing.assert_array_equal(a, b)
  # The first step: same parameters.
  for key in ("loss", "grad_norm", "moe_max_vio", "moe_load_p90", "moe_cutoff_gap", "moe_bias_range"):
    np.testing.assert_allclose(m2[0][key], m1[0][key], rtol=1e-4, err_msg=key)
  per_moe_layer = (scanned_cfg.num_layers - 1,)
  assert m2[0]["moe_max_vio"].shape == m2[0]["moe_bias_range"].shape == m2[0]["moe_cutoff_gap"].shape == per_moe_layer
  assert np.all(np.asarray(m2[1]["moe_cutoff_gap"]) > 0)   # the second step routes under a moved bias
  # The bias range in layer order: the unrolled model's own layers, one by one (the ranges differ between layers).
  biases = {int(re.search(r"\[(\d+)\]", jax.tree_util.keystr(path)).group(1)): np.asarray(b)
            for path, b in jax.tree_util.tree_flatten_with_path(s1[1].balancer)[0]
            if "bias" in jax.tree_util.keystr(path)}
  own = [np.ptp(biases[k]) for k in sorted(biases)]
  np.testing.assert_allclose(m1[0]["moe_bias_range"], own, rtol=1e-6)
  assert len(set(np.round(own, 6))) > 1
  # Its update, leaf by leaf. Where a gradient is at the level of fp32 roundoff, AdamW's first step (the sign of
  # the gradient) may flip, moving that element by 2·lr; a misplaced layer or wrong Muon axes would move them all.
  params = jax.tree_util.tree_flatten_with_path(first.params)[0]
  for (path, p0), p1, q1 in zip(params, jax.tree.leaves(second.params), jax.tree.leaves(s2[1].params)):
    assert rel_err(q1 - p0, p1 - p0) < 1e-2, jax.tree_util.keystr(path)
  for a, b in zip(jax.tree.leaves(second.balancer), jax.tree.leaves(s2[1].balancer)):
    assert rel_err(b, a) < 1e-5 and float(np.abs(np.asarray(b)).max()) > 0
  np.testing.assert_allclose(m2[1]["loss"], m1[1]["loss"], rtol=1e-4)   # the loss after it


@pytest.mark.parametrize("field,value,match", [
    ("optimizer.lr", -1.0, r"must be > 0"),
    ("optimizer.lr", 0.0, r"must be > 0"),
    ("optimizer.lr", float("nan"), r"must be > 0"),
    ("optimizer.weight_decay", -0.1, r"config.optimizer.weight_decay must be >= 0"),
    ("optimizer.b2", 1.0, r"config.optimizer.b2 must be in \[0, 1\)"),
    ("optimizer.eps", 0.0, r"config.optimizer.eps must be > 0"),
    ("optimizer.final_lr_fraction", 1.5, r"config.optimizer.final_lr_fraction must be in \[0, 1\]"),
    ("optimizer.grad_clip", 0.0, r"config.optimizer.grad_clip must be > 0"),
    ("optimizer.warmup_fraction", 0.9, r"warmup_fraction and decay_fraction must be >= 0 with sum <= 1"),
    ("micro_batches", 0, r"config.micro_batches must be a positive int"),
])
def test_optimizer_and_schedule_values_out_of_range_are_rejected(field, value, match):
  c = tiny.get_config()
  node, name = (c.optimizer, field.split(".")[1]) if "." in field else (c, field)
  node[name] = value
  with pytest.raises(ValueError, match=match):
    stages_lib.training_plan(c)


def test_a_stage_with_a_non_positive_learning_rate_is_rejected():
  c = common.set_stages(common.base_config(), [dict(seq_len=64, steps=5, batch_size=8, lr=-1e-3)])
  with pytest.raises(ValueError, match=r"stage 0: the peak learning rate .* must be > 0"):
    stages_lib.training_plan(c)
