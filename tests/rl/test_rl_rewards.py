"""RL rewards (k3jax/rl/rewards.py): the Kimi length penalty by hand; with the default weights a shorter correct
episode earns more and no wrong one beats a correct one."""
import numpy as np

from k3jax.envs.episode import Outcome
from k3jax.rl import config as rl_config, rewards


def test_kimi_length_penalty_by_hand():
  lengths, correct = [10, 20, 30, 40, 50], [True, True, False, False, True]
  # λ = 0.5 − (len − 10) / 40: 0.5, 0.25, 0, −0.25, −0.5; wrong episodes keep min(0, λ).
  np.testing.assert_allclose(rewards.length_penalty(lengths, correct), [0.5, 0.25, 0.0, -0.25, -0.5])
  np.testing.assert_allclose(rewards.length_penalty([7, 7], [True, False]), [0.0, 0.0])
  o = lambda correct, invalid: Outcome(correct, True, "answer", 2, 1, invalid, 0)
  got = rewards.group_rewards([o(True, 0), o(False, 0), o(True, 1)], [10, 30, 20],
                              rewards.RewardConfig(format_weight=0.2, length_weight=0.5))
  # correct + 0.2 · well-formed + 0.5 · λ' with λ = 0.5, −0.5, 0 (the wrong one keeps −0.5).
  np.testing.assert_allclose(got, [1 + 0.2 + 0.25, 0 + 0.2 - 0.25, 1 + 0 + 0.0], rtol=1e-6)


def test_by_default_a_shorter_correct_episode_earns_more_and_no_wrong_one_beats_a_correct_one():
  r = rl_config.rl_config()
  cfg = rewards.RewardConfig(r.format_weight, r.length_weight)
  o = lambda correct: Outcome(correct, True, "answer", 2, 1, 0, 0)
  short, long_, wrong_short = rewards.group_rewards([o(True), o(True), o(False)], [12, 40, 5], cfg)
  assert short > long_ > wrong_short
