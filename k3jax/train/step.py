"""The jitted train step (gradient accumulation over micro-batches, clipping, optimizer, balancer update) and the
evaluation step.

Batches are dicts of `[A, M, T]` arrays (A micro-batches of M rows): tokens, segment_ids, targets, weights.
The loss is the next-token cross-entropy on fp32 logits, summed over weighted positions and divided by the
step's total weight (so A micro-batches give exactly the gradient of one batch of A·M rows), plus the model's
z-loss and, with the aux-loss balancer, the MoE auxiliary loss (each averaged over micro-batches).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from k3jax import balancer as balancer_lib
from k3jax.train import state as state_lib


def token_losses(logits_BTV, targets_BT, weights_BT):
  """(Σ w·CE, Σ w·[argmax == target]) over positions, CE on fp32 logits."""
  logits = logits_BTV.astype(jnp.float32)
  lse_BT = jax.nn.logsumexp(logits, axis=-1)
  target_BT = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  correct_BT = (jnp.argmax(logits, axis=-1) == targets_BT).astype(jnp.float32)
  return jnp.sum((lse_BT - target_BT) * weights_BT), jnp.sum(correct_BT * weights_BT)


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_schedule, model_cfg):
  """`train_step(state, batch) -> (state, metrics)`, to be jitted."""
  moe = model_cfg.moe

  def loss_fn(params, state, mb, total_weight, num_micro):
    model = state_lib.merge(graphdef, state.replace(params=params))
    logits, aux = model(mb["tokens"], segment_ids_BT=mb["segment_ids"])
    with jax.named_scope("loss"):
      ce_sum, correct = token_losses(logits, mb["targets"], mb["weights"])
      moe_aux = sum((s.aux_loss for s in aux["moe"]), jnp.zeros((), jnp.float32))
      objective = ce_sum / total_weight + (aux["z_loss"] + moe_aux) / num_micro
    return objective, (ce_sum, correct, aux["moe"])

  def train_step(state: state_lib.TrainState, batch):
    num_micro = batch["tokens"].shape[0]
    with jax.named_scope("loss"):
      total_weight = jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    def micro(grads, mb):
      (objective, (ce_sum, correct, stats)), g = jax.value_and_grad(loss_fn, has_aux=True)(
          state.params, state, mb, total_weight, num_micro)
      with jax.named_scope("accumulate"):
        return jax.tree.map(jnp.add, grads, g), (objective, ce_sum, correct, stats)

    with jax.named_scope("accumulate"):
      zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (objectives, ce_sums, corrects, stats) = jax.lax.scan(micro, zeros, batch)
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      step = state.step + 1

    new_state = update_balancers(graphdef, state.replace(step=step, params=params, opt_state=opt_state), stats)
    with jax.named_scope("metrics"):
      metrics = {"loss": jnp.sum(ce_sums) / total_weight, "objective": jnp.sum(objectives),
                 "accuracy": jnp.sum(corrects) / total_weight, "grad_norm": optax.tree.norm(grads),
                 "lr": lr_schedule(state.step), "target_tokens": jnp.sum(batch["weights"]),
                 **moe_metrics(stats, moe.top_k), **cutoff_gap_metrics(graphdef, state, stats, moe.top_k),
                 **bias_metrics(graphdef, new_state, stats)}
    return new_state, metrics

  return train_step


@jax.named_scope("balancer")
def update_balancers(graphdef, state: state_lib.TrainState, stats) -> state_lib.TrainState:
  """The state with every MoE layer's balancer moved after an optimizer step; `stats[i]` holds layer i's MoEStats
  of the step's forward passes, stacked on a leading micro-batch axis."""
  model = state_lib.merge(graphdef, state)
  model.update_balance([[jax.tree.map(lambda x: x[a], s) for a in range(jax.tree.leaves(s)[0].shape[0])]
                        for s in stats])
  _, params, balancer, other = state_lib.split(model)
  return state.replace(params=params, balancer=balancer, other=other)


def moe_metrics(stats, top_k: int) -> dict:
  """Per MoE layer, the load's MaxVio and P90 over the step (stats stacked as for `update_balancers`), over the
  real tokens (padding counts in no load); {} without MoE."""
  if not stats:
    return {}
  real = lambda s: s.scores_TE[..., 0].size if s.weights_T is None else jnp.sum(s.weights_T)
  per_layer = [balancer_lib.load_metrics(jnp.sum(s.load_E, axis=0), top_k, real(s)) for s in stats]
  return {"moe_max_vio": jnp.stack([m["max_vio"] for m in per_layer]),
          "moe_load_p90": jnp.stack([m["p90"] for m in per_layer])}


def cutoff_gap_metrics(graphdef, state: state_lib.TrainState, stats, top_k: int) -> dict:
  """Per MoE layer, the cut-off gap of the step's routing (`balancer.cutoff_gap` of its scores under the bias they
  were routed with, `state`'s, over every micro-batch's real tokens): the article method's step unit, logged for
  every balancer; {} without MoE or where every expert takes every token."""
  if not stats or top_k >= stats[0].scores_TE.shape[-1]:
    return {}
  bias_LE = state_lib.merge(graphdef, state).balancer_biases()
  flat = lambda x: None if x is None else x.reshape(-1, *x.shape[2:])   # micro-batches' tokens as one axis
  return {"moe_cutoff_gap": jnp.stack([
      balancer_lib.cutoff_gap(flat(s.scores_TE), bias_LE[i], top_k=top_k, weights_T=flat(s.weights_T))
      for i, s in enumerate(stats)])}


def bias_metrics(graphdef, state: state_lib.TrainState, stats) -> dict:
  """Per MoE layer, the spread (max − min) of the balancer's bias after the step: how far the balancer has moved
  the experts apart, and whether a bounded method sits at its bound; {} without MoE."""
  if not stats:
    return {}
  bias_LE = state_lib.merge(graphdef, state).balancer_biases()
  return {"moe_bias_range": jnp.max(bias_LE, axis=-1) - jnp.min(bias_LE, axis=-1)}


def make_eval_step(graphdef):
  """`eval_step(state, batch) -> {ce_sum, correct, weight}` on `[N, T]` rows, to be jitted."""
  def eval_step(state, batch):
    logits, _ = state_lib.merge(graphdef, state)(batch["tokens"], segment_ids_BT=batch["segment_ids"])
    ce_sum, correct = token_losses(logits, batch["targets"], batch["weights"])
    return {"ce_sum": ce_sum, "correct": correct, "weight": jnp.sum(batch["weights"])}
  return eval_step
