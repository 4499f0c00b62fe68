"""Episode rewards, given once at the end: exact-match correctness, an optional format term and Kimi k1.5's length
penalty, which compares the episodes of one group (the samples of one problem).

    r = 1[correct] + format_weight · 1[well formed] + length_weight · λ',
    λ = 0.5 − (len − min len) / (max len − min len) over the group (0 when all lengths are equal),
    λ' = λ for a correct episode, min(0, λ) for a wrong one,

with len the episode's response tokens (the model's own).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  format_weight: float = 0.0
  length_weight: float = 0.0


def length_penalty(lengths_G, correct_G) -> np.ndarray:
  """Kimi k1.5's λ' per episode of one group."""
  lengths = np.asarray(lengths_G, np.float64)
  lo, hi = lengths.min(), lengths.max()
  lam = np.zeros_like(lengths) if hi == lo else 0.5 - (lengths - lo) / (hi - lo)
  return np.where(np.asarray(correct_G, bool), lam, np.minimum(0.0, lam))


def group_rewards(outcomes, response_tokens, cfg: RewardConfig) -> np.ndarray:
  """float32 rewards `[G]` of one group's outcomes (`k3jax.envs.episode.Outcome`) and response lengths."""
  correct = np.array([o.correct for o in outcomes], bool)
  formatted = np.array([o.well_formed for o in outcomes], np.float64)
  r = correct.astype(np.float64) + cfg.format_weight * formatted
  if cfg.length_weight:
    r = r + cfg.length_weight * length_penalty(response_tokens, correct)
  return r.astype(np.float32)
