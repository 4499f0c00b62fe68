"""Multi-turn rollouts with a scripted session (the `Session` interface replaying given turns): the solver's
turns give back its demonstrations token for token; the token and turn budgets end episodes; every context is
its trajectory; episode batches weigh exactly the model's own tokens."""
import jax
import numpy as np

from k3jax import envs
from k3jax.data import tokenizer as tok
from k3jax.envs import protocol
from k3jax.rl import rollout


class ScriptedSession:
  """Rows generate the next of their scripted turns (cut to the budget, as a sampler would); records budgets."""

  def __init__(self, prompts, turns, max_len):
    self.contexts = [np.asarray(p, np.int32) for p in prompts]
    self.turns, self.max_len, self.asked = [list(t) for t in turns], max_len, []

  def context(self, row):
    return self.contexts[row]

  def append(self, row, tokens):
    self.contexts[row] = np.concatenate([self.contexts[row], tokens])
    assert len(self.contexts[row]) <= self.max_len

  def generate(self, rows, max_new, rng):
    out = []
    for row, n in zip(rows, max_new):
      assert 1 <= n and len(self.contexts[row]) + n <= self.max_len
      self.asked.append((row, n))
      new = tok.encode(self.turns[row].pop(0))[:n] if self.turns[row] else tok.encode("x" * n)
      self.contexts[row] = np.concatenate([self.contexts[row], new])
      out.append(new)
    return out


def _solver_turns(name, seed, index, length):
  ep = envs.reset(name, seed, index, length, max_turns=6)
  env = envs.get(name)
  turns = []
  while not ep.done:
    turns.append(env.solver_turn(ep.problem, ep.outputs))
    ep.step(turns[-1])
  return turns


def test_solver_turns_replay_into_the_demonstrations():
  length, cases = 512, [("lookup", i) for i in range(3)] + [("calc", i) for i in range(3)]
  episodes = [envs.reset(name, 1, i, length, max_turns=6) for name, i in cases]
  session = ScriptedSession([ep.prompt_tokens for ep in episodes], [_solver_turns(n, 1, i, length) for n, i in cases],
                            length)
  trajectories = rollout.play(session, episodes, rollout.RolloutConfig(length, 6, 48), jax.random.PRNGKey(0))
  for (name, i), ep, traj, row in zip(cases, episodes, trajectories, range(len(cases))):
    demo = envs.demonstrate(name, envs.reset(name, 1, i, length, max_turns=6))
    np.testing.assert_array_equal(traj.tokens, demo.tokens)
    np.testing.assert_array_equal(traj.loss_mask, demo.loss_mask)
    np.testing.assert_array_equal(session.context(row), traj.tokens)
    assert ep.outcome().correct and ep.outcome().ended_by == "answer"


def test_token_and_turn_budgets_end_episodes():
  length, max_turns, turn_tokens = 512, 4, 48
  episodes = [envs.reset(name, 0, 0, length, max_turns=max_turns) for name in ("lookup", "calc")]
  prompt = len(episodes[0].prompt_tokens)
  # Row 0 rambles (each turn fills its budget, no call) past the lookup document's room; row 1 makes short
  # malformed turns after a short calculator problem.
  turns = [["y" * 200] * 99, ["<search>abc"] * 9]
  session = ScriptedSession([ep.prompt_tokens for ep in episodes], turns, length)
  trajs = rollout.play(session, episodes, rollout.RolloutConfig(length, max_turns, turn_tokens),
                       jax.random.PRNGKey(0))
  o0, o1 = episodes[0].outcome(), episodes[1].outcome()
  assert o0.ended_by == "tokens" and not o0.correct and length - turn_tokens < len(trajs[0]) <= length
  assert max(n for r, n in session.asked if r == 0) == turn_tokens and prompt + turn_tokens < length
  assert o1.ended_by == "turns" and o1.turns == max_turns and o1.invalid_calls == max_turns
  # Row 1: prompt, then turn / error result pairs, the last turn without a result.
  kinds = [m for _, m in trajs[1].chunks]
  assert kinds == [False] + [True, False] * (max_turns - 1) + [True]
  assert tok.decode(trajs[1].chunks[2][0]) == protocol.error("unterminated <search>")


def test_episode_batch_weighs_the_next_token_when_the_model_wrote_it():
  trajs = [envs.demonstration(name, envs.problem_rng(name, 2, 0), 400) for name in ("lookup", "calc")]
  batch = rollout.episode_batch(trajs, 400)
  for row, traj in enumerate(trajs):
    n = len(traj)
    np.testing.assert_array_equal(batch["tokens"][row, :n], traj.tokens)
    assert np.all(batch["tokens"][row, n:] == tok.PAD) and np.all(batch["segment_ids"][row, n:] == 0)
    np.testing.assert_array_equal(batch["targets"][row, :n - 1], traj.tokens[1:])
    np.testing.assert_array_equal(batch["weights"][row, :n - 1], traj.loss_mask[1:])
    assert np.all(batch["weights"][row, n - 1:] == 0)
