"""Long-context generation: a chunked prefill with per-row lengths equals each row's full forward, decoding after
it is the argmax of full forwards, stop tokens / budgets / a full cache end rows, sampling is reproducible."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import generate_lib, sampling
from kda_testing import rel_err
from model_testing import T, shared_model

TOL = 1e-4   # fp32 roundoff over the layers (as tests/test_model.py)
full_forward = nnx.jit(lambda m, tokens: m(tokens)[0])
LENGTHS = [7, 3, T]


def _prompts(seed):
  """Three rows of T tokens: random tokens after each row's length too (garbage the prefill must ignore)."""
  return jax.random.randint(jax.random.PRNGKey(seed), (len(LENGTHS), T), 0, 64)


@pytest.mark.parametrize("chunk", [5, T])
def test_chunked_prefill_gives_each_rows_full_forward_logits(chunk):
  model = shared_model()
  tokens = _prompts(0)
  logits, cache = generate_lib.prefill_chunked(model, tokens, jnp.asarray(LENGTHS), chunk=chunk, max_len=T + 4)
  np.testing.assert_array_equal(cache.lengths_B, LENGTHS)
  for b, n in enumerate(LENGTHS):
    assert rel_err(logits[b], full_forward(model, tokens[b:b + 1, :n])[0, n - 1]) < TOL, b


def test_chunk_sizes_give_the_same_cache():
  model = shared_model()
  tokens = _prompts(1)
  caches = [generate_lib.prefill_chunked(model, tokens, jnp.asarray(LENGTHS), chunk=c, max_len=T)[1] for c in (4, T)]
  for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(caches[1])):
    assert rel_err(a, b) < TOL


def test_continuing_a_cache_equals_one_prefill():
  """Rows continued by a second prefill_chunked call (different lengths each time) equal one prefill of the whole."""
  model = shared_model()
  tokens = _prompts(2)
  first, second = [2, 1, 5], [3, 2, T - 5]
  _, cache = generate_lib.prefill_chunked(model, tokens, jnp.asarray(first), chunk=4, max_len=T)
  rest = jnp.stack([jnp.roll(tokens[b], -n) for b, n in enumerate(first)])
  logits, cache = generate_lib.prefill_chunked(model, rest, jnp.asarray(second), chunk=4, cache=cache)
  for b, (n, m) in enumerate(zip(first, second)):
    assert rel_err(logits[b], full_forward(model, tokens[b:b + 1, :n + m])[0, n + m - 1]) < TOL, b


def test_greedy_decode_after_a_chunked_prefill_is_the_argmax_of_full_forwards():
  model = shared_model()
  tokens = _prompts(3)
  steps = 5
  logits, cache = generate_lib.prefill_chunked(model, tokens, jnp.asarray(LENGTHS), chunk=5, max_len=T + steps)
  new, got, cache = generate_lib.decode_loop(model, cache, logits, jax.random.PRNGKey(0), max_new=steps)
  np.testing.assert_array_equal(got, [steps] * 3)
  np.testing.assert_array_equal(cache.lengths_B, np.asarray(LENGTHS) + steps - 1)   # the last token is not fed
  for b, n in enumerate(LENGTHS):
    seq = jnp.concatenate([tokens[b, :n], new[b]])[None]
    np.testing.assert_array_equal(new[b], jnp.argmax(full_forward(model, seq)[0, n - 1:n + steps - 1], -1))


def test_stop_tokens_budgets_and_a_full_cache_end_rows():
  model = shared_model()
  tokens = _prompts(4)
  prefill = lambda max_len: generate_lib.prefill_chunked(model, tokens, jnp.asarray(LENGTHS), chunk=6,
                                                         max_len=max_len)
  logits, cache = prefill(T + 8)
  free, _, _ = generate_lib.decode_loop(model, cache, logits, jax.random.PRNGKey(0), max_new=6)
  stop = int(free[0, 2])               # row 0's third greedy token
  options = sampling.SamplingOptions(stop_tokens=(stop,), pad_id=63)
  logits, cache = prefill(T + 8)
  new, got, _ = generate_lib.decode_loop(model, cache, logits, jax.random.PRNGKey(0), max_new=6,
                                         max_new_B=jnp.asarray([6, 2, 6]), options=options)
  for b in range(3):
    first_stop = next((i + 1 for i, t in enumerate(np.asarray(free[b])) if t == stop), 6)
    n = min(first_stop, 2 if b == 1 else 6)
    assert int(got[b]) == n, b
    np.testing.assert_array_equal(new[b, :n], free[b, :n])
    assert np.all(np.asarray(new[b, n:]) == 63), b
  # Row 2 fills its cache (T + 2 positions) after feeding 2 tokens: it gets 3, the others go on.
  logits, cache = prefill(T + 2)
  new, got, cache = generate_lib.decode_loop(model, cache, logits, jax.random.PRNGKey(0), max_new=6)
  np.testing.assert_array_equal(got, [6, 6, 3])
  np.testing.assert_array_equal(new[2, :3], free[2, :3])
  np.testing.assert_array_equal(cache.lengths_B, [LENGTHS[0] + 5, LENGTHS[1] + 5, T + 2])


def test_sampled_decoding_is_reproducible_and_depends_on_the_key():
  model = shared_model()
  tokens = _prompts(5)
  options = sampling.SamplingOptions(temperature=1.0, top_p=0.9)

  def run(seed):
    logits, cache = generate_lib.prefill_chunked(model, tokens, jnp.asarray(LENGTHS), chunk=T, max_len=T + 6)
    return generate_lib.decode_loop(model, cache, logits, jax.random.PRNGKey(seed), max_new=6, options=options)[0]
  a, b, c = run(7), run(7), run(8)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lengths=[0, 3, 3]), "lengths_B must be B=3 ints in \\[1, T=12\\]"),
    (dict(lengths=[3, 3, 13]), "lengths_B must be B=3 ints in \\[1, T=12\\]"),
    (dict(chunk=0), "chunk must be a positive int"),
    (dict(max_len=10), "the cache holds 10 positions; a row would reach 12"),
    (dict(max_len=None), "needs max_len"),
])
def test_prefill_rejects_bad_arguments(kwargs, match):
  args = dict(lengths=LENGTHS, chunk=4, max_len=T)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    generate_lib.prefill_chunked(shared_model(), _prompts(0), jnp.asarray(args["lengths"]), chunk=args["chunk"],
                                 max_len=args["max_len"])


def test_decode_loop_rejects_bad_budgets():
  model = shared_model()
  cache = generate_lib.init_cache(model, 3, T)
  logits = jnp.zeros((3, model.vocab_size))
  with pytest.raises(ValueError, match="max_new must be a positive int"):
    generate_lib.decode_loop(model, cache, logits, jax.random.PRNGKey(0), max_new=0)
  with pytest.raises(ValueError, match="max_new_B must be B=3 ints in \\[1, max_new=4\\]"):
    generate_lib.decode_loop(model, cache, logits, jax.random.PRNGKey(0), max_new=4, max_new_B=jnp.asarray([1, 5, 1]))
