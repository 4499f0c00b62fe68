"""Held-out evaluation of a policy: greedy episodes on problems no training step saw, per environment and context
length (the trained length and beyond it), and the summary statistics of a batch of episodes."""
from __future__ import annotations

import jax
import numpy as np

from k3jax import envs
from k3jax.envs.episode import Episode
from k3jax.envs.trajectory import Trajectory
from k3jax.rl import rollout


def episode_stats(episodes: list[Episode], trajectories: list[Trajectory]) -> dict[str, float]:
  """Means over episodes: success_rate, answered, response_tokens, tool_calls, invalid_calls, tool_errors, turns,
  and the share ended by the token or turn budget."""
  outcomes = [ep.outcome() for ep in episodes]
  mean = lambda xs: float(np.mean(xs))
  return {"success_rate": mean([o.correct for o in outcomes]), "answered": mean([o.answered for o in outcomes]),
          "response_tokens": mean([t.response_tokens for t in trajectories]),
          "tool_calls": mean([o.tool_calls for o in outcomes]),
          "invalid_calls": mean([o.invalid_calls for o in outcomes]),
          "tool_errors": mean([o.tool_errors for o in outcomes]), "turns": mean([o.turns for o in outcomes]),
          "ended_by_tokens": mean([o.ended_by == "tokens" for o in outcomes]),
          "ended_by_turns": mean([o.ended_by == "turns" for o in outcomes])}


def success_by_links(episodes: list[Episode], links: list[int]) -> dict[str, dict]:
  """{str(n): {"success_rate", "episodes"}} over the episodes whose problem's chain has n links (`links`, one per
  episode: the tool calls the scripted solver makes): where success falls off with the chain's length."""
  out = {}
  for n in sorted(set(links)):
    correct = [ep.outcome().correct for ep, k in zip(episodes, links) if k == n]
    out[str(n)] = {"success_rate": float(np.mean(correct)), "episodes": len(correct)}
  return out


def heldout(sampler, points, seed: int, *, examples: int, batch: int, max_turns: int, turn_tokens: int,
            interrupt=None) -> dict:
  """{"name@length": {success_rate, ..., "success_by_links"}} over problems 0..examples-1 of each (environment,
  length) point, played greedily (the sampler's options) `batch` episodes at a time; `interrupt()` before each
  batch (it raises to stop)."""
  result = {}
  for name, length in points:
    cfg = rollout.RolloutConfig(length, max_turns, turn_tokens)
    eps, trajs = [], []
    for start in range(0, examples, batch):
      if interrupt is not None:
        interrupt()
      chunk = [envs.reset(name, seed, i, length, max_turns=max_turns) for i in range(start, start + batch)]
      session = sampler.open([ep.prompt_tokens for ep in chunk], length)
      trajs += rollout.play(session, chunk, cfg, jax.random.PRNGKey(start))
      eps += chunk
    links = [envs.get(name).links(ep.problem) for ep in eps]
    result[f"{name}@{length}"] = {**episode_stats(eps, trajs), "success_by_links": success_by_links(eps, links)} \
        if eps else {}
  return result


def format_table(before: dict, after: dict, train_length: int) -> str:
  """Held-out success before and after RL, one line per environment and length."""
  lines = ["held-out success   before   after"]
  for key in after:
    beyond = f"  ({int(key.split('@')[1]) // train_length}x the trained length)" if (
        int(key.split("@")[1]) > train_length) else ""
    b = before.get(key, {}).get("success_rate", float("nan"))
    lines.append(f"{key:<16} {b:8.3f} {after[key]['success_rate']:7.3f}{beyond}")
    by_before = before.get(key, {}).get("success_by_links", {})
    for n, a in after[key].get("success_by_links", {}).items():
      b = by_before.get(n, {}).get("success_rate", float("nan"))
      label = f"  {n} link" + ("s" if n != "1" else "")
      lines.append(f"{label:<16} {b:8.3f} {a['success_rate']:7.3f}  ({a['episodes']} problems)")
  return "\n".join(lines)
