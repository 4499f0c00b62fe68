"""The jitted pieces of an RL iteration: per-token log-probs of a batch of episodes under a model state (the
policy, the rollout policy, the frozen reference), and the GRPO update step.

Batches are dicts of `[R, T]` arrays, one episode per row (`k3jax.rl.rollout.episode_batch`): tokens,
segment_ids, targets, weights (the loss mask at prediction positions), and for the update logp_old, logp_ref
and advantages `[R]`. Log-probs are taken at the rollout temperature, teacher-forced over the whole episode.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3jax.rl import grpo
from k3jax.train import state as state_lib
from k3jax.train import step as step_lib


def model_variables(state: state_lib.TrainState) -> tuple:
  """(params, balancer, other): what a forward needs of a train state (the policy's or the frozen reference's, which
  keeps no optimizer state), so both share one compiled log-prob program."""
  return state.params, state.balancer, state.other


def make_logprob_fn(graphdef, temperature: float):
  """`logprobs(variables, batch) -> [R, T]`: log p(target) at every position under the model of `variables`
  (`model_variables`), to be jitted."""
  def logprobs(variables, batch):
    logits, _ = nnx.merge(graphdef, *variables)(batch["tokens"], segment_ids_BT=batch["segment_ids"])
    return grpo.token_logprobs(logits, batch["targets"], temperature)
  return logprobs


def make_rl_step(graphdef, tx: optax.GradientTransformation, lr_schedule, model_cfg, loss_cfg: grpo.LossConfig,
                 temperature: float):
  """`rl_step(state, batch) -> (state, metrics)`: one optimizer step on the GRPO loss (plus the model's z-loss
  and MoE auxiliary loss, as in training), then the balancer update from this forward's router scores."""

  def loss_fn(params, state, batch):
    logits, aux = state_lib.merge(graphdef, state.replace(params=params))(
        batch["tokens"], segment_ids_BT=batch["segment_ids"])
    logp = grpo.token_logprobs(logits, batch["targets"], temperature)
    loss, metrics = grpo.grpo_loss(logp, batch["logp_old"], batch["logp_ref"], batch["advantages"],
                                   batch["weights"], loss_cfg)
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    entropy_BT = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    metrics["entropy"] = jnp.sum(entropy_BT * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)
    moe_aux = sum((s.aux_loss for s in aux["moe"]), jnp.zeros((), jnp.float32))
    return loss + aux["z_loss"] + moe_aux, (metrics, aux["moe"])

  def rl_step(state: state_lib.TrainState, batch):
    (objective, (metrics, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    stats = [jax.tree.map(lambda x: x[None], s) for s in stats]   # one forward: a micro-batch axis of 1
    new_state = step_lib.update_balancers(graphdef, state.replace(step=state.step + 1, params=params,
                                                                  opt_state=opt_state), stats)
    metrics = {**metrics, "loss": objective, "grad_norm": optax.tree.norm(grads), "lr": lr_schedule(state.step),
               **step_lib.moe_metrics(stats, model_cfg.moe.top_k)}
    return new_state, metrics

  return rl_step
