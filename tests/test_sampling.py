"""Sampling: top-p keeps exactly the smallest nucleus, temperature → 0 is greedy, draws follow softmax(l/T) and are
deterministic given the key; stop tokens and budgets end rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import sampling


def _logits(seed, B=6, V=40, scale=2.0):
  return scale * jax.random.normal(jax.random.PRNGKey(seed), (B, V))


def test_top_p_keeps_exactly_the_smallest_set_with_mass_at_least_p():
  logits = _logits(0)
  probs = np.asarray(jax.nn.softmax(logits), np.float64)
  rng = np.random.default_rng(0)
  for _ in range(4):
    # p halfway between two consecutive cumulative masses, so the expected set size k is unambiguous per row.
    order = np.argsort(-probs, axis=-1, kind="stable")
    cum = np.cumsum(np.take_along_axis(probs, order, -1), -1)
    k = rng.integers(1, 12, size=probs.shape[0])
    p = np.array([(cum[b, k[b] - 2] if k[b] > 1 else 0.0) + cum[b, k[b] - 1] for b in range(len(k))]) / 2
    keep = np.asarray(sampling.top_p_mask(logits, jnp.asarray(p, jnp.float32)))
    for b in range(len(k)):
      assert keep[b].sum() == k[b]
      np.testing.assert_array_equal(np.sort(np.flatnonzero(keep[b])), np.sort(order[b, :k[b]]))
      assert probs[b, keep[b]].sum() >= p[b] and probs[b, order[b, :k[b] - 1]].sum() < p[b]
  assert np.asarray(sampling.top_p_mask(logits, 1.0)).all()
  np.testing.assert_array_equal(np.asarray(sampling.top_p_mask(logits, 1e-6)).sum(-1), 1)


def test_temperature_zero_and_near_zero_are_greedy():
  logits = _logits(1, B=32)
  greedy = np.asarray(jnp.argmax(logits, -1))
  np.testing.assert_array_equal(sampling.sample(logits, jax.random.PRNGKey(0)), greedy)
  for seed in range(3):
    got = sampling.sample(logits, jax.random.PRNGKey(seed), temperature=1e-6, top_p=0.9)
    np.testing.assert_array_equal(got, greedy)


def test_draws_follow_softmax_of_logits_over_temperature_within_the_nucleus():
  base = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
  logits = jnp.broadcast_to(base, (20000, base.shape[0]))
  for temperature, top_p in ((1.0, 1.0), (2.0, 1.0), (1.5, 0.8)):
    draws = np.asarray(sampling.sample(logits, jax.random.PRNGKey(3), temperature=temperature, top_p=top_p))
    keep = np.asarray(sampling.top_p_mask(base[None], top_p))[0]
    want = np.exp(np.asarray(base, np.float64) / temperature) * keep
    want /= want.sum()
    freq = np.bincount(draws, minlength=base.shape[0]) / draws.size
    assert np.all(freq[~keep] == 0)
    np.testing.assert_allclose(freq, want, atol=0.015)


def test_sampling_is_deterministic_given_the_key_and_per_row_options_apply_per_row():
  logits = _logits(2, B=16)
  a = sampling.sample(logits, jax.random.PRNGKey(5), temperature=1.0)
  b = jax.jit(lambda l, k: sampling.sample(l, k, temperature=1.0))(logits, jax.random.PRNGKey(5))
  c = sampling.sample(logits, jax.random.PRNGKey(6), temperature=1.0)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  temperature = jnp.where(jnp.arange(16) % 2 == 0, 0.0, 3.0)
  mixed = np.asarray(sampling.sample(logits, jax.random.PRNGKey(7), temperature=temperature))
  np.testing.assert_array_equal(mixed[::2], np.asarray(jnp.argmax(logits, -1))[::2])
  assert not np.array_equal(mixed[1::2], np.asarray(jnp.argmax(logits, -1))[1::2])


def test_finished_on_stop_tokens_budget_or_already_done():
  done = jnp.asarray([False, False, False, True])
  token = jnp.asarray([7, 3, 3, 3])
  generated = jnp.asarray([1, 4, 2, 1])
  max_new = jnp.asarray([10, 4, 10, 10])
  np.testing.assert_array_equal(sampling.finished(done, token, generated, max_new, (7, 9)),
                                [True, True, False, True])
  np.testing.assert_array_equal(sampling.finished(done, token, generated, max_new, ()), [False, True, False, True])


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must lie in"),
    (dict(top_p=1.5), "top_p must lie in"),
    (dict(stop_tokens=(-1,)), "stop_tokens must be non-negative ints"),
])
def test_bad_options_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampling.SamplingOptions(**kwargs)


def test_per_row_option_of_the_wrong_length_raises():
  with pytest.raises(ValueError, match="one value per row"):
    sampling.sample(_logits(0, B=3), jax.random.PRNGKey(0), temperature=jnp.ones((4,)))


def test_a_window_of_latest_tokens_ends_with_a_stop_sequence():
  recent = jnp.full((3, 3), -1, jnp.int32)
  for token in ([4, 1, 4], [5, 2, 5], [6, 6, 5]):
    recent = sampling.push(recent, jnp.asarray(token))
  np.testing.assert_array_equal(recent, [[4, 5, 6], [1, 2, 6], [4, 5, 5]])
  np.testing.assert_array_equal(sampling.ends_with(recent, ((5, 6), (9,))), [True, False, False])
  np.testing.assert_array_equal(sampling.ends_with(recent, ((4, 5, 5), (2, 6))), [False, True, True])
  np.testing.assert_array_equal(sampling.ends_with(recent, ()), [False, False, False])
  # A row with fewer tokens than a sequence never matches it (-1 before its first token).
  short = sampling.push(jnp.full((1, 3), -1, jnp.int32), jnp.asarray([6]))
  assert not bool(sampling.ends_with(short, ((5, 6),))[0]) and bool(sampling.ends_with(short, ((6,),))[0])
  assert sampling.push(jnp.zeros((2, 0), jnp.int32), jnp.asarray([1, 2])).shape == (2, 0)
  with pytest.raises(ValueError, match="longer than the window"):
    sampling.ends_with(recent, ((1, 2, 3, 4),))
  assert sampling.SamplingOptions(stop_sequences=((1, 2, 3), (4,))).stop_window == 3
