"""The reference rollout sampler: greedy turns of rows with different lengths, continued after tool results are
appended, equal the argmax of full forwards over each whole context (fp32), with stop strings, stop tokens and
per-row budgets cut exactly where they should; sampling is reproducible; top-p keeps the nucleus only."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.data import tokenizer as tok
from k3jax.rl import sampler as sampler_lib
from model_testing import MODEL, shared_model

MAX_LEN = 80
CHANGES = tuple({**MODEL, "vocab_size": tok.VOCAB_SIZE, "num_layers": 2}.items())  # KDA dense, MLA + MoE
full_logits = nnx.jit(lambda m, t: m(t)[0])


def _model():
  return shared_model(CHANGES)


def _greedy_reference(model, context, max_new, stops, stop_tokens):
  """The next tokens by full forwards (the model is causal: right padding does not change earlier logits)."""
  context, new = list(context), []
  while len(new) < max_new:
    buf = np.full((1, MAX_LEN), tok.PAD, np.int32)
    buf[0, :len(context)] = context
    t = int(np.argmax(full_logits(model, jnp.asarray(buf))[0, len(context) - 1]))
    context.append(t)
    new.append(t)
    if t in stop_tokens or any(len(new) >= len(s) and new[-len(s):] == list(tok.encode(s)) for s in stops):
      break
  return new


def _prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, n).astype(np.int32) for n in (37, 45, 40)]


def _session(options, prompts):
  graphdef, state = nnx.split(_model())
  return sampler_lib.ReprefillSampler(graphdef, (state,), options, prefill_bucket=16).open(prompts, MAX_LEN)


def test_greedy_turns_continue_after_tool_results_as_full_forwards_do():
  options = sampler_lib.SamplingOptions(temperature=0.0, stop_strings=("\x00\x00\x00\x00",), stop_tokens=())
  prompts = _prompts()
  session = _session(options, prompts)
  model = _model()
  first = session.generate([0, 1, 2], [9, 5, 12], jax.random.PRNGKey(0))
  for row, (p, n) in enumerate(zip(prompts, (9, 5, 12))):
    assert first[row].tolist() == _greedy_reference(model, p, n, options.stop_strings, ())
  results = {0: tok.encode("<result>ab</result>"), 2: tok.encode("<result>x</result>")}
  for row, r in results.items():
    session.append(row, r)
  second = session.generate([2, 0], [6, 8], jax.random.PRNGKey(1))
  for new, row, n in zip(second, (2, 0), (6, 8)):
    context = np.concatenate([prompts[row], first[row], results[row]])
    assert new.tolist() == _greedy_reference(model, context, n, options.stop_strings, ())
    np.testing.assert_array_equal(session.context(row), np.concatenate([context, new]))
  np.testing.assert_array_equal(session.context(1), np.concatenate([prompts[1], first[1]]))


def test_rows_stop_after_a_stop_string_or_a_stop_token():
  model, prompts = _model(), _prompts()
  free = [_greedy_reference(model, p, 16, (), ()) for p in prompts]
  # A stop string from what row 0 generates (two ASCII bytes, so a str), a stop token from row 1's output that
  # row 0 does not produce before that string.
  at = next(i for i in range(2, 15) if free[0][i] < 128 and free[0][i + 1] < 128)
  pair = free[0][at:at + 2]
  stop_token = next(t for t in free[1][2:] if t not in free[0][:at + 2])
  options = sampler_lib.SamplingOptions(temperature=0.0, stop_strings=(tok.decode(pair),), stop_tokens=(stop_token,))
  got = _session(options, prompts).generate([0, 1, 2], [16, 16, 16], jax.random.PRNGKey(0))
  for row, p in enumerate(prompts):
    assert got[row].tolist() == _greedy_reference(model, p, 16, options.stop_strings, (stop_token,))
  assert len(got[0]) <= at + 2 and got[0][-2:].tolist() == pair
  assert len(got[1]) < 16 and (got[1][-1] == stop_token or got[1][-2:].tolist() == pair)


def test_sampling_is_reproducible_and_top_p_near_zero_is_greedy():
  prompts = _prompts()
  hot = sampler_lib.SamplingOptions(temperature=1.0)
  a, b, c = (_session(hot, prompts).generate([0, 1, 2], [10] * 3, jax.random.PRNGKey(k)) for k in (3, 3, 4))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))
  nucleus = sampler_lib.SamplingOptions(temperature=1.0, top_p=1e-6, stop_strings=("\x00" * 4,), stop_tokens=())
  greedy = sampler_lib.SamplingOptions(temperature=0.0, stop_strings=("\x00" * 4,), stop_tokens=())
  x = _session(nucleus, prompts).generate([0, 1, 2], [8] * 3, jax.random.PRNGKey(5))
  y = _session(greedy, prompts).generate([0, 1, 2], [8] * 3, jax.random.PRNGKey(5))
  assert all(np.array_equal(u, v) for u, v in zip(x, y))


def test_top_p_samples_only_the_nucleus_in_proportion():
  logits = jnp.log(jnp.asarray([[0.05, 0.5, 0.15, 0.3]]))
  draws = jax.jit(jax.vmap(lambda k: sampler_lib.sample(logits, k, 1.0, 0.7)[0]))(
      jax.random.split(jax.random.PRNGKey(0), 4000))
  counts = np.bincount(np.asarray(draws), minlength=4)
  assert counts[0] == 0 and counts[2] == 0               # outside the smallest set holding 0.7: {0.5, 0.3}
  np.testing.assert_allclose(counts[1] / counts.sum(), 0.5 / 0.8, atol=0.03)


@pytest.mark.parametrize("kwargs,match", [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                          (dict(stop_strings=("",)), "stop_strings")])
def test_bad_options_and_budgets_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampler_lib.SamplingOptions(**kwargs)
  session = _session(sampler_lib.SamplingOptions(), _prompts())
  with pytest.raises(ValueError, match="max_new"):
    session.generate([0], [MAX_LEN], jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="exceed max_len"):
    session.append(0, np.zeros(MAX_LEN, np.int32))
