"""GRPO as pure functions over arrays: group-relative advantages, per-token log-probs, the clipped loss.

    A_i     = (r_i − mean_g r) / (std_g r + eps)                 scale "std": std with ddof=1, eps = 1e-4 (as tunix)
    A_i     =  r_i − mean_g r                                    scale "none": the group mean as the baseline
                                                                 (Kimi k1.5; Dr. GRPO)
    ρ_t     = exp(logp_t − logp_old_t)                           per token, against the rollout policy
    pg_t    = −min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A)             PPO clip, ε = 0.2
    kl_t    = exp(logp_ref_t − logp_t) − (logp_ref_t − logp_t) − 1   the k3 estimator of KL(π ‖ π_ref)
    loss    = Σ_t mask_t (pg_t + β kl_t) / Σ_t mask_t             β = 0.04

Normalisation is the global token mean over the batch (tunix's "grpo" loss, verl's "token-mean"): every model
token weighs the same, so long episodes are not diluted as they are with a per-sequence mean. `mask` marks the
positions whose next token is the model's own (`k3jax.data.pipeline.next_token_targets` of the loss mask);
elsewhere the inputs are ignored and no gradient flows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossConfig:
  clip_eps: float = 0.2
  kl_coef: float = 0.04


ADVANTAGE_SCALES = ("std", "none")


def group_advantages(rewards_B, group_size: int, scale: str = "std", eps: float = 1e-4):
  """`[B]` advantages of rewards in consecutive groups of `group_size` (the samples of one prompt), each less its
  group's mean and, with `scale="std"`, divided by the group's std.

  The std makes a group's advantages unit-sized whatever its spread: a group whose samples differ only by a small
  shaping term (all correct, different lengths) then pushes as hard as one that differs in success. With "none"
  every term keeps the weight the reward gives it."""
  if group_size < 2 or rewards_B.shape[0] % group_size:
    raise ValueError(f"group_size must be >= 2 and divide the {rewards_B.shape[0]} rewards, got {group_size}")
  if scale not in ADVANTAGE_SCALES:
    raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
  r_NG = jnp.asarray(rewards_B, jnp.float32).reshape(-1, group_size)
  a_NG = r_NG - r_NG.mean(axis=1, keepdims=True)
  if scale == "std":
    a_NG = a_NG / (r_NG.std(axis=1, ddof=1, keepdims=True) + eps)
  return a_NG.reshape(-1)


def token_logprobs(logits_BTV, targets_BT, temperature: float = 1.0):
  """`[B,T]` log-probabilities of `targets` under softmax(logits / temperature), in fp32."""
  logits = logits_BTV.astype(jnp.float32) / temperature
  target_BT = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  return target_BT - jax.nn.logsumexp(logits, axis=-1)


def grpo_loss(logp_new_BT, logp_old_BT, logp_ref_BT, advantages_B, mask_BT, cfg: LossConfig = LossConfig()):
  """(loss, metrics): the token-mean GRPO objective to minimise and its parts (pg_loss, kl, clip_fraction,
  ratio_mean, tokens)."""
  mask = mask_BT > 0
  new = jnp.where(mask, logp_new_BT, 0.0)
  old = jnp.where(mask, jax.lax.stop_gradient(logp_old_BT), 0.0)
  ref = jnp.where(mask, jax.lax.stop_gradient(logp_ref_BT), 0.0)
  adv_B1 = jax.lax.stop_gradient(advantages_B)[:, None]
  ratio = jnp.exp(new - old)
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
  pg = -jnp.minimum(ratio * adv_B1, clipped * adv_B1)
  kl = jnp.exp(ref - new) - (ref - new) - 1.0
  tokens = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)

  def mean(x):
    return jnp.sum(jnp.where(mask, x, 0.0)) / tokens
  # The clip removes a token's gradient when the ratio has left the interval on the side its advantage pushes to.
  is_clipped = ((ratio > 1.0 + cfg.clip_eps) & (adv_B1 > 0)) | ((ratio < 1.0 - cfg.clip_eps) & (adv_B1 < 0))
  pg_loss, kl_mean = mean(pg), mean(kl)
  metrics = {"pg_loss": pg_loss, "kl": kl_mean, "clip_fraction": mean(is_clipped.astype(jnp.float32)),
             "ratio_mean": mean(ratio), "tokens": jnp.sum(mask).astype(jnp.float32)}
  return pg_loss + cfg.kl_coef * kl_mean, metrics
