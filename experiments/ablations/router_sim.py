"""The article balancer's step on synthetic routers, no model: how its step size meets the spread of the scores.

A router of E experts whose logits for a token are `μ_j + noise`, both of scale σ (μ fixed per router, the noise
fresh per token): at small σ the scores are nearly equal, at large σ most are near 0 or 1. Each step draws a fresh
batch, measures MaxVio under the current bias, then updates the bias; halfway the preferences reverse (μ → −μ).
Two steps are compared: the step in cut-off gaps (`balancer.update`, `method="article"`, the library's) and a fixed
step in score units (the first form of the method), each at a given rate and load unit (`article_correction`),
everything else the same.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from k3jax import balancer


def fixed_step_update(state: balancer.State, scores_TE, *, top_k: int, rate: float, unit: float) -> balancer.State:
  """The article update with a fixed step of `rate` score units (no cut-off gap), for comparison."""
  load_E = balancer.expert_load(balancer.select(scores_TE, state.bias, top_k=top_k)[1], scores_TE.shape[1])
  return balancer.article_step(state, load_E, scores_TE.shape[0], top_k=top_k, step=rate, decay=0.5, bound=1.0,
                               load_unit=unit)


def run(spread: float, *, step: str, rate: float, experts: int, top_k: int, tokens: int, steps: int,
        unit: float = balancer.LOAD_UNIT, seed: int = 0) -> list[float]:
  """MaxVio at each step (before that step's update) of one router; `step` is "gap" or "fixed", `unit` the load
  unit of its correction."""
  if step not in ("gap", "fixed"):
    raise ValueError(f"step must be 'gap' or 'fixed', got {step!r}")
  if step == "gap":
    update = jax.jit(lambda st, s: balancer.update(st, s, top_k=top_k, method="article", rate=rate, load_unit=unit))
  else:
    update = jax.jit(lambda st, s: fixed_step_update(st, s, top_k=top_k, rate=rate, unit=unit))
  mu_E = spread * jax.random.normal(jax.random.key(seed), (experts,))
  state, vios = balancer.State(bias=jnp.zeros(experts), load_E=jnp.ones(experts)), []
  for i in range(steps):
    sign = 1.0 if i < steps // 2 else -1.0
    key = jax.random.fold_in(jax.random.key(seed + 1), i)
    scores_TE = jax.nn.sigmoid(sign * mu_E + spread * jax.random.normal(key, (tokens, experts)))
    load_E = balancer.expert_load(balancer.select(scores_TE, state.bias, top_k=top_k)[1], experts)
    vios.append(float(balancer.load_metrics(load_E, top_k, tokens)["max_vio"]))
    state = update(state, scores_TE)
  return vios


def study(spreads: Sequence[float], forms: Sequence[tuple[str, float, float]], *, experts: int, top_k: int,
          tokens: int, steps: int) -> list[dict]:
  """One row per form (step, rate, load unit) and spread: MaxVio's largest value over the ten steps before the
  reversal and over the last ten, and the first step with MaxVio below 0.5 (None: never)."""
  rows = []
  for step, rate, unit in forms:
    for spread in spreads:
      vios = run(spread, step=step, rate=rate, unit=unit, experts=experts, top_k=top_k, tokens=tokens, steps=steps)
      half = steps // 2
      rows.append({"step": step, "rate": rate, "unit": unit, "spread": spread,
                   "max_vio_before_reversal": max(vios[half - 10:half]),
                   "max_vio_last": max(vios[-10:]), "first_below_half": next(
                       (i for i, v in enumerate(vios) if v < 0.5), None)})
  return rows


def format_table(rows: list[dict]) -> str:
  lines = ["step     rate   unit   spread   MaxVio before reversal   MaxVio at the end   first step < 0.5"]
  for r in rows:
    first = "never" if r["first_below_half"] is None else str(r["first_below_half"])
    lines.append(f"{r['step']:<6} {r['rate']:6.3f} {r['unit']:6.1f} {r['spread']:8.2f} "
                 f"{r['max_vio_before_reversal']:24.2f} {r['max_vio_last']:19.2f} {first:>18}")
  return "\n".join(lines)
