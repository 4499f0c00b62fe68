"""The rollout sampler's sessions on generate_lib: greedy turns of rows with different lengths, continued from the
cache after tool results are appended (rows sitting turns out), equal the argmax of full forwards over each whole
context (fp32), and so does every model token of greedy episodes played by `rollout.play`; stop strings and stop
tokens cut turns exactly; sampling is reproducible; bad calls raise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import sampling
from k3jax.data import tokenizer as tok
from k3jax.envs import protocol
from k3jax.envs.episode import Episode, Problem
from k3jax.rl import rollout, sampler as sampler_lib
from model_testing import MODEL, shared_model

MAX_LEN, TURN = 192, 12
CHANGES = tuple({**MODEL, "vocab_size": tok.VOCAB_SIZE, "num_layers": 2}.items())  # KDA dense, MLA + MoE
full_logits = nnx.jit(lambda m, t: m(t)[0])


def _greedy_reference(model, context, max_new, stops=(), stop_tokens=()):
  """The next tokens by full forwards (the model is causal: right padding does not change earlier logits)."""
  context, new = list(context), []
  while len(new) < max_new:
    buf = np.full((1, MAX_LEN), tok.PAD, np.int32)
    buf[0, :len(context)] = context
    t = int(np.argmax(full_logits(model, jnp.asarray(buf))[0, len(context) - 1]))
    context.append(t)
    new.append(t)
    if t in stop_tokens or any(len(new) >= len(s) and tuple(new[-len(s):]) == s for s in stops):
      break
  return new


def _prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, n).astype(np.int32) for n in (37, 45, 40)]


def _session(options, prompts=None):
  sampler = sampler_lib.Sampler(shared_model(CHANGES), options, turn_tokens=TURN, prefill_chunk=16, append_chunk=8)
  return sampler.open(_prompts() if prompts is None else prompts, MAX_LEN)


def test_greedy_turns_continue_after_tool_results_as_full_forwards_do():
  model, prompts = shared_model(CHANGES), _prompts()
  session = _session(sampling.SamplingOptions(pad_id=tok.PAD))
  first = session.generate([0, 2], [9, 12], jax.random.PRNGKey(0))   # row 1 sits the first turn out
  for new, row, n in zip(first, (0, 2), (9, 12)):
    assert new.tolist() == _greedy_reference(model, prompts[row], n)
  results = {0: tok.encode("<result>ab</result>"), 2: tok.encode("<result>x</result>")}
  for row, r in results.items():
    session.append(row, r)
  second = session.generate([2, 1, 0], [6, 5, 8], jax.random.PRNGKey(1))
  contexts = {0: np.concatenate([prompts[0], first[0], results[0]]), 1: prompts[1],
              2: np.concatenate([prompts[2], first[1], results[2]])}
  for new, row, n in zip(second, (2, 1, 0), (6, 5, 8)):
    assert new.tolist() == _greedy_reference(model, contexts[row], n), row
    np.testing.assert_array_equal(session.context(row), np.concatenate([contexts[row], new]))
  # A third turn straight after the second (no result in between) continues from the last sampled token.
  third = session.generate([1], [7], jax.random.PRNGKey(2))
  context = np.concatenate([prompts[1], second[1]])
  assert third[0].tolist() == _greedy_reference(model, context, 7)


def test_greedy_episodes_continued_after_tool_results_equal_a_full_forward_over_each_episode():
  model = shared_model(CHANGES)
  prompts = ["records:\nabc=xyz\nxyz=abc\nquestion: which key is 1 link from abc?\n", "what is 2+3?\n", "hi\n"]
  episodes = [Episode(Problem(p, "xyz", None), {"search": lambda key: f"{key}=xyz"}, max_turns=3) for p in prompts]
  session = _session(sampler_lib.rollout_options(0.0), [ep.prompt_tokens for ep in episodes])
  trajectories = rollout.play(session, episodes, rollout.RolloutConfig(MAX_LEN, 3, TURN), jax.random.PRNGKey(0))
  buf = np.full((len(episodes), MAX_LEN), tok.PAD, np.int32)
  for row, traj in enumerate(trajectories):
    buf[row, :len(traj)] = traj.tokens
  greedy = np.asarray(jnp.argmax(full_logits(model, jnp.asarray(buf)), -1))
  for row, traj in enumerate(trajectories):
    kinds = [m for _, m in traj.chunks]
    assert kinds[:4] == [False, True, False, True], kinds   # a tool result between the first two turns
    own = np.flatnonzero(traj.loss_mask)
    np.testing.assert_array_equal(traj.tokens[own], greedy[row, own - 1])


def test_timing_counts_the_real_tokens_prefilled_and_sampled():
  """Prompts and appended results count as prefill (their real tokens, not the chunks' padding); the sampled tokens
  of the rows asked count as decode; both with positive seconds."""
  prompts = _prompts()
  session = _session(sampling.SamplingOptions(pad_id=tok.PAD))
  assert session.timing.prefill_tokens == sum(len(p) for p in prompts) and session.timing.decode_tokens == 0
  first = session.generate([0, 2], [9, 12], jax.random.PRNGKey(0))
  result = tok.encode("<result>ab</result>")
  session.append(0, result)
  second = session.generate([0], [5], jax.random.PRNGKey(1))
  t = session.timing
  assert t.decode_tokens == sum(len(n) for n in first + second)
  # before the second turn: row 0's last sampled token and its result, row 2's last sampled token
  assert t.prefill_tokens == sum(len(p) for p in prompts) + 1 + len(result) + 1
  rates = t.rates()
  assert t.prefill_s > 0 and t.decode_s > 0 and rates["prefill_tokens_per_s"] > 0 and rates["decode_tokens_per_s"] > 0


def test_turns_stop_after_a_stop_string_or_a_stop_token():
  model, prompts = shared_model(CHANGES), _prompts()
  free = [_greedy_reference(model, p, TURN) for p in prompts]
  # A stop string from what row 0 generates, a stop token from row 1's output that row 0 does not produce before it.
  pair = tuple(free[0][3:5])
  stop_token = next(t for t in free[1][2:] if t not in free[0][:5])
  options = sampling.SamplingOptions(stop_tokens=(stop_token,), stop_sequences=(pair,), pad_id=tok.PAD)
  got = _session(options).generate([0, 1, 2], [TURN] * 3, jax.random.PRNGKey(0))
  for row, p in enumerate(prompts):
    assert got[row].tolist() == _greedy_reference(model, p, TURN, (pair,), (stop_token,))
  assert len(got[0]) <= 5 and tuple(got[0][-2:]) == pair
  assert len(got[1]) < TURN and (got[1][-1] == stop_token or tuple(got[1][-2:]) == pair)


def test_rollout_options_stop_at_the_end_of_every_call_and_at_eos():
  options = sampler_lib.rollout_options(0.7, 0.9)
  assert options.stop_tokens == (tok.EOS,) and options.temperature == 0.7 and options.top_p == 0.9
  assert {tok.decode(np.asarray(s)) for s in options.stop_sequences} == set(protocol.STOP_STRINGS)


def test_sampling_is_reproducible_and_top_p_near_zero_is_greedy():
  hot = sampling.SamplingOptions(temperature=1.0)
  a, b, c = (_session(hot).generate([0, 1, 2], [10] * 3, jax.random.PRNGKey(k)) for k in (3, 3, 4))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))
  x = _session(sampling.SamplingOptions(temperature=1.0, top_p=1e-6)).generate([0, 1, 2], [8] * 3,
                                                                               jax.random.PRNGKey(5))
  y = _session(sampling.SamplingOptions()).generate([0, 1, 2], [8] * 3, jax.random.PRNGKey(5))
  assert all(np.array_equal(u, v) for u, v in zip(x, y))


def test_bad_calls_raise_before_any_compute():
  session = _session(sampling.SamplingOptions())
  with pytest.raises(ValueError, match="max_new"):
    session.generate([0], [TURN + 1], jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="distinct"):
    session.generate([0, 0], [1, 1], jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="exceed max_len"):
    session.append(0, np.zeros(MAX_LEN, np.int32))
  with pytest.raises(ValueError, match="at most max_len"):
    _session(sampling.SamplingOptions(), [np.zeros(MAX_LEN + 1, np.int32)])
  with pytest.raises(ValueError, match="turn_tokens"):
    sampler_lib.Sampler(shared_model(CHANGES), sampling.SamplingOptions(), turn_tokens=0)
