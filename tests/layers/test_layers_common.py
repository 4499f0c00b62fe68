"""The embedding lookup: the table's rows, and a gradient by one-hot product (no scatter-add) that equals autodiff
of `jnp.take` with many tokens per row, in fp32 and to bf16 rounding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers import common
from model_testing import primitives


def lookup_case(vocab, d=8, shape=(3, 40), seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  table = jax.random.normal(keys[0], (vocab, d))
  tokens = jax.random.randint(keys[1], shape, 0, vocab)  # ~ shape / vocab tokens per row: rows repeat
  return table, tokens, jax.random.normal(keys[2], (*shape, d))


def test_lookup_gradient_is_a_one_hot_product_equal_to_autodiff_of_take():
  table, tokens, dy = lookup_case(vocab=13)
  y, pullback = jax.vjp(lambda t: common.embed(t, tokens), table)
  y_ref, pullback_ref = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), table)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_allclose(pullback(dy)[0], pullback_ref(dy)[0], rtol=1e-6, atol=1e-6)
  assert "scatter-add" not in primitives(jax.grad(lambda t: jnp.sum(common.embed(t, tokens) * dy)), table)


def test_bfloat16_gradient_rounds_the_cotangent_once():
  table, tokens, dy = lookup_case(vocab=13, seed=1)
  grad = jax.vjp(lambda t: common.embed(t, tokens, jnp.bfloat16), table)[1](dy)[0]
  exact = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), table)[1](dy)[0]
  assert grad.dtype == jnp.float32
  np.testing.assert_allclose(grad, exact, rtol=2e-2, atol=2e-2)
  scale = np.abs(np.asarray(exact)).max()
  assert 0 < np.abs(np.asarray(grad - exact)).max() <= 2 ** -7 * scale  # rounded, and by bf16 rounding only


def test_large_vocabularies_keep_the_gather_and_its_scatter_add():
  table, tokens, dy = lookup_case(vocab=common.ONE_HOT_GRAD_MAX_VOCAB + 1, shape=(2, 8))
  assert "scatter-add" in primitives(jax.grad(lambda t: jnp.sum(common.embed(t, tokens) * dy)), table)


@pytest.mark.parametrize("bad", [-1, -14, 13])
def test_tokens_index_as_take_does_negative_from_the_end_and_out_of_range_to_nan(bad):
  table, tokens, dy = lookup_case(vocab=13)
  tokens = tokens.at[0, 0].set(bad)
  y, pullback = jax.vjp(lambda t: common.embed(t, tokens), table)
  y_ref, pullback_ref = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), table)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_allclose(pullback(dy)[0], pullback_ref(dy)[0], rtol=1e-6, atol=1e-6)
