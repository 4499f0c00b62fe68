"""GRPO: advantages and the loss against numbers worked out by hand, token log-probs against NumPy, no gradient
from masked (prompt, tool-result, padding) positions, the policy gradient's value, and the clip at its edges."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.envs.episode import Outcome
from k3jax.rl import config as rl_config, grpo, rewards

EPS, BETA = 0.2, 0.04


def test_group_advantages_by_hand():
  got = grpo.group_advantages(np.array([1.0, 0.0, 0.5, 0.5, 3.0, 1.0, 2.0]), 7)  # one group of 7
  r = [1.0, 0.0, 0.5, 0.5, 3.0, 1.0, 2.0]
  mean = sum(r) / 7
  std = math.sqrt(sum((x - mean) ** 2 for x in r) / 6)   # ddof = 1
  np.testing.assert_allclose(got, [(x - mean) / (std + 1e-4) for x in r], rtol=1e-6)
  got = grpo.group_advantages(np.array([1.0, 0.0, 0.5, 0.5]), 2)
  # Group [1, 0]: mean 0.5, std sqrt(0.5); group [0.5, 0.5]: no spread, advantage 0.
  a = 0.5 / (math.sqrt(0.5) + 1e-4)
  np.testing.assert_allclose(got, [a, -a, 0.0, 0.0], rtol=1e-6)
  with pytest.raises(ValueError, match="group_size"):
    grpo.group_advantages(np.zeros(6), 4)
  with pytest.raises(ValueError, match="scale"):
    grpo.group_advantages(np.zeros(4), 2, scale="rank")


def test_unscaled_advantages_are_the_rewards_less_the_group_mean():
  got = grpo.group_advantages(np.array([1.0, 0.0, 0.0, 0.5, 0.5, 0.5]), 3, scale="none")
  np.testing.assert_allclose(got, [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], rtol=1e-6)


def test_by_default_length_alone_moves_a_group_less_than_success_does():
  """The default reward and advantage: in a group whose samples all succeed and differ only in length, no advantage
  is larger than the length term's own range, and it is several times smaller than a success difference's; the
  group std would make the two the same size (the failure rl_small showed: RL shortened the calculator's chains)."""
  r = rl_config.rl_config()
  cfg = rewards.RewardConfig(r.format_weight, r.length_weight)
  o = lambda correct: Outcome(correct, True, "answer", 2, 1, 0, 0)
  lengths = [40, 44, 48, 52, 56, 60, 64, 68]
  all_correct = rewards.group_rewards([o(True)] * 8, lengths, cfg)
  mixed = rewards.group_rewards([o(i % 2 == 0) for i in range(8)], [52] * 8, cfg)
  a_length = np.abs(grpo.group_advantages(all_correct, 8, r.advantage_scale))
  a_success = np.abs(grpo.group_advantages(mixed, 8, r.advantage_scale))
  assert a_length.max() <= r.length_weight + 1e-6
  assert a_success.min() >= 4 * a_length.max()
  a_length_std = np.abs(grpo.group_advantages(all_correct, 8, "std"))
  a_success_std = np.abs(grpo.group_advantages(mixed, 8, "std"))
  assert a_length_std.max() > a_success_std.min()


def test_grpo_loss_by_hand():
  new = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]], np.float32)
  old = np.array([[-1.3, -1.5, -0.5], [-0.3, -1.5, -9.0]], np.float32)
  ref = np.array([[-0.9, -2.5, -0.4], [-0.2, -1.4, -3.0]], np.float32)
  mask = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
  adv = np.array([1.5, -0.5], np.float32)
  loss, m = jax.jit(grpo.grpo_loss, static_argnums=5)(new, old, ref, adv, mask, grpo.LossConfig(EPS, BETA))
  # Token by token (the third column is masked):
  # (0,0) ratio e^0.3 = 1.3499 > 1.2 with A > 0: clipped, pg = −1.2·1.5 = −1.8
  # (0,1) ratio e^−0.5 = 0.6065 < 0.8 with A > 0: the unclipped term is smaller, pg = −0.6065·1.5
  # (1,0) ratio 1: pg = −1·(−0.5) = 0.5
  # (1,1) ratio e^0.3 > 1.2 with A < 0: the unclipped term is smaller, pg = 1.3499·0.5
  pg = [-1.8, -math.exp(-0.5) * 1.5, 0.5, math.exp(0.3) * 0.5]
  # k3: e^(ref−new) − (ref−new) − 1 with ref−new = 0.1, −0.5, 0.1, −0.2
  kl = [math.exp(d) - d - 1 for d in (0.1, -0.5, 0.1, -0.2)]
  np.testing.assert_allclose(m["pg_loss"], sum(pg) / 4, rtol=1e-5)
  np.testing.assert_allclose(m["kl"], sum(kl) / 4, rtol=1e-5)
  np.testing.assert_allclose(loss, sum(pg) / 4 + BETA * sum(kl) / 4, rtol=1e-5)
  assert float(m["clip_fraction"]) == 0.25 and float(m["tokens"]) == 4
  np.testing.assert_allclose(m["ratio_mean"], (math.exp(0.3) * 2 + math.exp(-0.5) + 1) / 4, rtol=1e-5)


def test_token_logprobs_match_numpy_log_softmax():
  logits = np.random.default_rng(0).standard_normal((2, 5, 11)).astype(np.float32) * 3
  targets = np.random.default_rng(1).integers(0, 11, (2, 5))
  for temperature in (1.0, 0.7):
    z = logits / temperature
    z = z - z.max(-1, keepdims=True)
    want = np.take_along_axis(z - np.log(np.exp(z).sum(-1, keepdims=True)), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(grpo.token_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature), want,
                               rtol=1e-5, atol=1e-6)


def test_no_gradient_flows_from_masked_positions():
  rng = np.random.default_rng(2)
  B, T, V = 3, 9, 13
  logits = jnp.asarray(rng.standard_normal((B, T, V)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)))
  # The model's tokens are scattered between prompt / tool-result / padding positions.
  mask = jnp.asarray(rng.random((B, T)) < 0.5, jnp.float32).at[:, 0].set(1.0)
  old = grpo.token_logprobs(logits + 0.3 * jnp.asarray(rng.standard_normal((B, T, V))), targets)
  ref = grpo.token_logprobs(logits + 0.3 * jnp.asarray(rng.standard_normal((B, T, V))), targets)
  # Garbage where the mask is 0 must not leak into the loss or the gradient.
  old, ref = jnp.where(mask > 0, old, 1e4), jnp.where(mask > 0, ref, -1e4)
  adv = jnp.asarray([1.0, -0.7, 0.4])

  def loss(lg):
    return grpo.grpo_loss(grpo.token_logprobs(lg, targets), old, ref, adv, mask)[0]
  value, g = jax.jit(jax.value_and_grad(loss))(logits)
  assert np.isfinite(value)
  g_norm = np.abs(np.asarray(g)).sum(-1)
  assert np.all(g_norm[np.asarray(mask) == 0] == 0.0)
  assert np.all(g_norm[np.asarray(mask) > 0] > 0.0)


def test_on_policy_gradient_is_the_advantage_weighted_score():
  rng = np.random.default_rng(3)
  logp = jnp.asarray(-rng.random((2, 4)) * 3, jnp.float32)
  mask = jnp.asarray([[1, 1, 0, 1], [0, 1, 1, 0]], jnp.float32)
  adv = jnp.asarray([0.8, -1.3])
  # Policy = rollout policy = reference: ratio 1, k3 KL 0 with zero gradient, so d loss / d logp = −A / N.
  g = jax.jit(jax.grad(lambda lp: grpo.grpo_loss(lp, logp, logp, adv, mask)[0]))(logp)
  np.testing.assert_allclose(g, -np.asarray(adv)[:, None] * np.asarray(mask) / 5, rtol=1e-6)


@pytest.mark.parametrize("adv,ratio,clipped", [
    (1.0, 1 + EPS - 1e-3, False), (1.0, 1 + EPS + 1e-3, True), (1.0, 1 - EPS - 1e-3, False),
    (-1.0, 1 - EPS + 1e-3, False), (-1.0, 1 - EPS - 1e-3, True), (-1.0, 1 + EPS + 1e-3, False),
])
def test_clip_stops_the_gradient_only_beyond_the_edge_the_advantage_pushes_to(adv, ratio, clipped):
  old = jnp.zeros((1, 1))
  mask, a = jnp.ones((1, 1)), jnp.asarray([adv])
  f = lambda lp: grpo.grpo_loss(lp, old, lp, a, mask, grpo.LossConfig(EPS, BETA))
  logp = jnp.full((1, 1), math.log(ratio))
  (value, m), g = jax.jit(jax.value_and_grad(f, has_aux=True))(logp)
  edge = 1 + EPS if ratio > 1 else 1 - EPS
  np.testing.assert_allclose(value, -(edge if clipped else ratio) * adv, rtol=1e-6)
  # The surrogate −ρA has gradient −ρA in log ρ; a clipped token has none.
  np.testing.assert_allclose(g, [[0.0 if clipped else -ratio * adv]], rtol=1e-5, atol=1e-7)
  assert float(m["clip_fraction"]) == float(clipped)


def test_loss_is_continuous_at_the_clip_edge():
  old, mask, a = jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.asarray([2.0])
  at = lambda r: float(grpo.grpo_loss(jnp.full((1, 1), math.log(r)), old, old, a, mask,
                                      grpo.LossConfig(EPS, 0.0))[0])
  np.testing.assert_allclose([at(1 + EPS - 1e-6), at(1 + EPS), at(1 + EPS + 1e-6)], -(1 + EPS) * 2.0, rtol=1e-5)
