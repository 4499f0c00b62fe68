"""The RL stage's configuration (`config.rl`): every field with its default (`rl_config`), its checks, its
optimizer schedule and what a resumed RL run may change.

The stage before it is ordinary training (the top-level fields, `k3jax.train.trainer`) on the environments'
demonstrations (`config.data.mix` naming the environments); RL starts from its final checkpoint. The SFT run gets
the config without `rl` (`sft_config`), so its directory's guard ignores RL fields.
"""
from __future__ import annotations

import ml_collections
import optax

from k3jax import envs
from k3jax.rl import grpo
from k3jax.train import optimizer, stages as stages_lib, workdir


def rl_config() -> ml_collections.ConfigDict:
  r = ml_collections.ConfigDict()
  r.envs = ml_collections.ConfigDict({"lookup": 0.5, "calc": 0.5})  # share of the problems from each environment
  r.length = 1024                # an episode's token budget: its context length (prompt, turns, results)
  r.iterations = 100             # rollout -> GRPO updates, each one "step" of the RL logs
  r.prompts = 8                  # problems per iteration
  r.group_size = 4               # samples per problem (G)
  r.max_turns = 6                # model turns per episode
  r.turn_tokens = 48             # tokens one model turn may take
  r.temperature = 1.0            # rollouts (held-out evaluation is greedy)
  r.top_p = 1.0
  r.clip_eps = 0.2
  r.kl_coef = 0.04               # β of the k3 KL to the frozen reference (the SFT policy)
  r.format_weight = 0.0          # reward for an episode that answers without invalid calls
  r.length_weight = 0.1          # Kimi k1.5's length penalty (the article's path efficiency): a shorter correct
                                 # episode of a group earns up to +0.05, a longer one down to -0.05
  r.advantage_scale = "none"     # "none": reward − group mean, so the length term stays ±0.05 beside success's
                                 # ±0.5; "std" (GRPO) divides by the group's std, which makes an all-correct group's
                                 # length differences full-sized advantages (k3jax.rl.grpo.group_advantages)
  r.lr = 1e-4                    # peak learning rate (warmup, then constant); the optimizer is config.optimizer's
  r.warmup_fraction = 0.1
  r.minibatches = 2              # optimizer steps per iteration, each on a consecutive slice of the episodes
  r.prefill_chunk = 256          # prompt tokens per prefill step of the rollout sampler
  r.append_chunk = 64            # tool-result tokens per prefill step (a turn continues the cache)
  r.log_every = 1
  r.checkpoint_every = 10
  r.keep_checkpoints = 3
  r.eval_examples = 32           # held-out problems per environment and length
  r.eval_batch = 16              # episodes per held-out rollout
  r.eval_at = ()                 # ("lookup@1024", ...); (): every environment at length and 4 × length
  r.eval_every = 0               # iterations between held-out evaluations (0: only before and after RL)
  return r


def eval_points(r) -> list[tuple[str, int]]:
  """(environment, length) pairs of the held-out evaluation."""
  if not r.eval_at:
    return [(name, n) for name in sorted(r.envs) for n in (r.length, 4 * r.length)]
  points = []
  for spec in r.eval_at:
    name, _, n = str(spec).partition("@")
    if name not in envs.ENVS or not n.isdigit():
      raise ValueError(f"config.rl.eval_at entries look like 'lookup@1024' (environments {sorted(envs.ENVS)}), "
                       f"got {spec!r}")
    points.append((name, int(n)))
  return points


def validate(r) -> None:
  """ValueErrors naming the first bad field of `config.rl`."""
  for name, w in dict(r.envs).items():
    if name not in envs.ENVS or not w >= 0:
      raise ValueError(f"config.rl.envs: {name!r}={w}; expected weights >= 0 of {sorted(envs.ENVS)}")
  if sum(dict(r.envs).values()) <= 0:
    raise ValueError("config.rl.envs needs a positive total weight")
  for field in ("length", "iterations", "prompts", "max_turns", "turn_tokens", "minibatches", "prefill_chunk",
                "append_chunk", "log_every", "checkpoint_every", "keep_checkpoints", "eval_batch"):
    if not isinstance(r[field], int) or r[field] < 1:
      raise ValueError(f"config.rl.{field} must be a positive int, got {r[field]!r}")
  if r.advantage_scale not in grpo.ADVANTAGE_SCALES:
    raise ValueError(f"config.rl.advantage_scale must be one of {grpo.ADVANTAGE_SCALES}, got {r.advantage_scale!r}")
  if r.group_size < 2:
    raise ValueError(f"config.rl.group_size must be >= 2 (advantages compare a group's samples), got {r.group_size}")
  if (r.prompts * r.group_size) % r.minibatches:
    raise ValueError(f"config.rl.minibatches={r.minibatches} must divide the {r.prompts * r.group_size} episodes "
                     f"of an iteration")
  if r.eval_examples < 0 or r.eval_examples % r.eval_batch or r.eval_every < 0:
    raise ValueError(f"config.rl.eval_batch={r.eval_batch} must divide eval_examples={r.eval_examples} (>= 0); "
                     f"eval_every must be >= 0")
  for name, n in [(name, r.length) for name in r.envs] + eval_points(r):
    env = envs.get(name)
    if n < env.min_length:
      raise ValueError(f"config.rl: environment {name!r} needs lengths >= {env.min_length}, got {n}")
    if r.max_turns < env.max_solver_turns:
      raise ValueError(f"config.rl.max_turns={r.max_turns}: {name!r} may need {env.max_solver_turns} turns")
  if not r.clip_eps > 0 or r.kl_coef < 0 or not r.lr > 0 or not 0 <= r.warmup_fraction <= 1:
    raise ValueError(f"config.rl: clip_eps must be > 0, kl_coef >= 0, lr > 0, warmup_fraction in [0, 1]; got "
                     f"{r.clip_eps}, {r.kl_coef}, {r.lr}, {r.warmup_fraction}")


def sft_config(config) -> ml_collections.ConfigDict:
  """The config of the SFT stage: `config` without its `rl` section (locked)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    del c["rl"]
  return c.lock()


def rl_stage(config, index: int) -> stages_lib.Stage:
  """The RL stage after the SFT stages (`index`), counted in iterations: each of `rl.length` tokens per episode,
  `prompts × group_size` episodes, at `rl.lr` (its schedule over optimizer steps: `optimizer_schedule`)."""
  r = config.rl
  return stages_lib.Stage(index=index, seq_len=r.length, batch_size=r.prompts * r.group_size, steps=r.iterations,
                          start=0, lr=r.lr, warmup_fraction=r.warmup_fraction, decay_fraction=0.0)


def optimizer_schedule(config) -> optax.Schedule:
  """The RL learning rate over optimizer steps (`minibatches` per iteration): a linear warmup over
  `warmup_fraction` of them to `rl.lr`, then constant."""
  r = config.rl
  return optimizer.wsd_schedule(r.lr, r.iterations * r.minibatches, r.warmup_fraction, 0.0, 1.0)


def learning_rate(config):
  """The RL learning rate at each iteration's first optimizer step, over iterations (what the resume guard keeps
  for the iterations taken)."""
  schedule = optimizer_schedule(config)
  return lambda iteration: schedule(iteration * config.rl.minibatches)


# A resumed RL run may change how it is observed and stored; a change of its schedule must keep the learning rate
# of the iterations taken. Everything else changes what the iterations compute.
RESUME_RULES = workdir.ResumeRules(
    resumable=workdir.RESUMABLE + tuple(f"rl.{f}" for f in ("log_every", "checkpoint_every", "keep_checkpoints",
                                                           "eval_examples", "eval_batch", "eval_at", "eval_every")),
    schedule=("rl.iterations", "rl.lr", "rl.warmup_fraction", "rl.minibatches"), learning_rate=learning_rate)
