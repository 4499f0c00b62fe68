"""Batched multi-turn rollouts: episodes played by a sampler's session, turn by turn, and the batch of their
tokens that the GRPO step trains on.

Each turn, every unfinished episode's row generates until the end of a call (or its turn's token budget); the
environment's reply is appended to the row's context and the next turn continues from there. An episode that
would outgrow `length` tokens (its context length) is ended by the token budget.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from k3jax.data import pipeline, tasks
from k3jax.data import tokenizer as tok
from k3jax.envs.episode import Episode
from k3jax.envs.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  length: int           # the episode's token budget: prompt, turns and results
  max_turns: int = 6
  turn_tokens: int = 48  # the most tokens one model turn may take

  def __post_init__(self):
    if min(self.length, self.max_turns, self.turn_tokens) < 1:
      raise ValueError(f"length, max_turns and turn_tokens must be >= 1, got {self}")


def play(session, episodes: list[Episode], cfg: RolloutConfig, rng) -> list[Trajectory]:
  """Plays `episodes` (fresh, one per session row, each row's context its prompt) to their ends; returns each
  episode's trajectory."""
  trajectories = []
  for row, ep in enumerate(episodes):
    trajectories.append(Trajectory())
    trajectories[-1].add(session.context(row), model=False)
  for turn in range(cfg.max_turns):
    rows = []
    for row, ep in enumerate(episodes):
      if not ep.done and len(trajectories[row]) >= cfg.length:
        ep.end("tokens")
      if not ep.done:
        rows.append(row)
    if not rows:
      break
    budgets = [min(cfg.turn_tokens, cfg.length - len(trajectories[r])) for r in rows]
    for row, new in zip(rows, session.generate(rows, budgets, jax.random.fold_in(rng, turn))):
      trajectories[row].add(new, model=True)
      step = episodes[row].step(tok.decode(new))
      if step.done:
        continue
      reply = tok.encode(step.result)
      if len(trajectories[row]) + len(reply) >= cfg.length:  # no room for the reply and a turn after it
        episodes[row].end("tokens")
        continue
      trajectories[row].add(reply, model=False)
      session.append(row, reply)
  for ep in episodes:
    ep.end("turns")  # no-op for the finished ones
  return trajectories


def episode_batch(trajectories: list[Trajectory], length: int) -> dict[str, np.ndarray]:
  """`[R, length]` arrays, one episode per row: tokens, segment_ids, targets and weights (1 where the next token
  is the model's own: the loss mask)."""
  return pipeline.stack_rows([pipeline.pack([tasks.Example(t.tokens, t.loss_mask)], length) for t in trajectories])
