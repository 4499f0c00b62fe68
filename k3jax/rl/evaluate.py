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
  """{"name@length": {success_rate, ..., "success_by_links", "correct"}} over problems 0..examples-1 of each
  (environment, length) point, played greedily (the sampler's options) `batch` episodes at a time; "correct" is
  each problem's outcome (0 / 1) in problem order, so two policies' evaluations pair up (`paired_change`).
  `interrupt()` before each batch (it raises to stop)."""
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
    result[f"{name}@{length}"] = {**episode_stats(eps, trajs), "success_by_links": success_by_links(eps, links),
                                  "correct": [int(ep.outcome().correct) for ep in eps]} if eps else {}
  return result


def paired_change(before_PN, after_PN) -> tuple[float, float]:
  """(change, noise) of the held-out success from `before` to `after`, each `[P, N]` outcomes (0 / 1) of the same
  N problems at P points (a list of lists, or one list for P = 1), averaged over the points.

  The noise is twice the change's standard error with the problems paired: with `d_n` problem n's change averaged
  over the points, `2·sqrt(Σ_n d_n² + 1) / N`, the error under no effect (each problem's change as likely either
  way; for one point, McNemar's: the problems whose outcome changed). Problems solved or failed by both policies
  add nothing, so it is far smaller than two independent rates' errors; the +1 is one more changed problem, so
  that a change of every problem the same way is not error-free."""
  b_PN, a_PN = np.atleast_2d(np.asarray(before_PN, np.float64)), np.atleast_2d(np.asarray(after_PN, np.float64))
  if b_PN.shape != a_PN.shape or b_PN.shape[1] == 0:
    raise ValueError(f"before and after must be outcomes of the same problems, got {b_PN.shape} and {a_PN.shape}")
  d_N = np.mean(a_PN - b_PN, axis=0)
  return float(np.mean(d_N)), float(2 * np.sqrt(np.sum(d_N ** 2) + 1) / d_N.size)


def format_table(before: dict, after: dict, train_length: int) -> str:
  """Held-out success before and after RL, one line per environment and length, with the change and its noise
  (`paired_change`; "—" where an evaluation kept no per-problem outcomes) and "*" where the change is beyond it;
  then by the problems' chain length."""
  lines = ["held-out success   before   after   change   noise"]
  for key in after:
    beyond = f"  ({int(key.split('@')[1]) // train_length}x the trained length)" if (
        int(key.split("@")[1]) > train_length) else ""
    b = before.get(key, {}).get("success_rate", float("nan"))
    change = f"{'—':>8} {'—':>7} "
    if "correct" in before.get(key, {}) and "correct" in after[key]:
      delta, noise = paired_change(before[key]["correct"], after[key]["correct"])
      change = f"{delta:+8.3f} {noise:7.3f}{'*' if abs(delta) > noise else ' '}"
    lines.append(f"{key:<16} {b:8.3f} {after[key]['success_rate']:7.3f} {change}{beyond}")
    by_before = before.get(key, {}).get("success_by_links", {})
    for n, a in after[key].get("success_by_links", {}).items():
      b = by_before.get(n, {}).get("success_rate", float("nan"))
      label = f"  {n} link" + ("s" if n != "1" else "")
      lines.append(f"{label:<16} {b:8.3f} {a['success_rate']:7.3f}  ({a['episodes']} problems)")
  lines.append("noise: twice the change's standard error over the same problems (paired); *: beyond it")
  return "\n".join(lines)
