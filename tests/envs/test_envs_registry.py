"""The environments by name (k3jax/envs/registry.py): problems are a function of (name, seed, index, length); the
scripted solvers succeed on every problem and their episodes fit the length; the episode API (tool results, errors,
budgets, outcomes); demonstrations as a data source whose weights lie on the model's turns only."""
import re

import ml_collections
import numpy as np
import pytest

from k3jax import envs
from k3jax.data import pipeline, tasks
from k3jax.data import tokenizer as tok
from k3jax.envs import protocol
from k3jax.envs.episode import Outcome


@pytest.mark.parametrize("name", sorted(envs.ENVS))
def test_problems_are_a_function_of_name_seed_index_and_length(name):
  n = 1024
  a, b = (envs.reset(name, 3, 7, n, max_turns=6) for _ in range(2))
  assert a.problem.prompt == b.problem.prompt and a.problem.answer == b.problem.answer
  np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
  others = [envs.reset(name, s, i, n, max_turns=6).problem.prompt for s, i in ((3, 8), (4, 7))]
  assert a.problem.prompt not in others
  assert a.prompt_tokens[0] == tok.BOS


@pytest.mark.parametrize("name", sorted(envs.ENVS))
def test_solver_succeeds_on_every_problem_within_the_length(name):
  env = envs.get(name)
  for length in (env.min_length, 1024, 4096):
    for index in range(40):
      traj = envs.demonstration(name, envs.problem_rng(name, 0, index), length)  # raises unless correct and fitting
      assert len(traj) <= length
      kinds = [m for _, m in traj.chunks]
      assert kinds[0] is False and kinds[-1] is True   # prompt first, the answer turn last
      assert kinds[1::2] == [True] * len(kinds[1::2]) and kinds[2::2] == [False] * len(kinds[2::2])


@pytest.mark.parametrize("short,long", [("lookup", "lookup_deep"), ("calc", "calc_long")])
def test_the_long_chain_environments_pose_up_to_four_calls_where_the_short_ones_stop_at_two(short, long):
  calls = {name: set() for name in (short, long)}
  for name in calls:
    for index in range(60):
      traj = envs.demonstration(name, envs.problem_rng(name, 0, index), 1024)
      calls[name].add(sum(model for _, model in traj.chunks) - 1)   # the model's turns but the answer
  assert calls[short] == {1, 2} and calls[long] == {1, 2, 3, 4}


@pytest.mark.parametrize("name", sorted(envs.ENVS))
def test_links_is_the_number_of_tool_calls_the_solver_makes(name):
  env, seen = envs.get(name), set()
  for index in range(40):
    ep = envs.reset(name, 0, index, 1024, max_turns=env.max_solver_turns)
    envs.demonstrate(name, ep)
    assert env.links(ep.problem) == ep.outcome().tool_calls
    seen.add(ep.outcome().tool_calls)
  assert len(seen) > 1   # the problems differ in length


def test_lookup_document_fills_the_context_up_to_64k_and_chains_hops():
  env = envs.get("lookup")
  for length in (1024, 65536):
    ep = envs.reset("lookup", 1, 0, length, max_turns=6)
    prompt = len(ep.prompt_tokens)
    assert length - env.response_tokens - env.record_len < prompt <= length - env.response_tokens
    traj = envs.demonstration("lookup", envs.problem_rng("lookup", 1, 0), length)
    assert len(traj) <= length
  # Follow the chain by reading the document as text: the answer is `hops` links from the start.
  ep = envs.reset("lookup", 2, 5, 2048, max_turns=6)
  records = dict(line.split("=") for line in ep.problem.prompt.splitlines()[1:-1])
  data = ep.problem.data
  key = data.start
  for _ in range(data.hops):
    key = records[key]
  assert key == ep.problem.answer
  assert f"{data.hops} link" in ep.problem.prompt and f"from {data.start}?" in ep.problem.prompt


def test_episode_answers_tool_calls_reports_errors_and_goes_on():
  ep = envs.reset("lookup", 0, 0, 1024, max_turns=5)
  start, first = ep.problem.data.start, ep.problem.data.values[ep.problem.data.start]
  step = ep.step(f"<search>{start}</search>")
  assert step == type(step)(protocol.result(f"{start}={first}"), False, {"call": "search", "invalid": False,
                                                                             "tool_error": False})
  step = ep.step("<search>nope</search>")
  assert step.result == protocol.error("no record 'nope'") and step.info["tool_error"] and not step.done
  step = ep.step("<calc>1+1</calc>")
  assert step.info["invalid"] and "no tool 'calc' here" in step.result and not step.done
  step = ep.step("<search>abc")
  assert step.result == protocol.error("unterminated <search>") and not step.done
  step = ep.step("<answer>wrong</answer>")
  assert step.done and step.result is None
  assert ep.outcome() == Outcome(correct=False, answered=True, ended_by="answer", turns=5, tool_calls=2,
                                 invalid_calls=2, tool_errors=1)
  with pytest.raises(RuntimeError, match="over"):
    ep.step("<answer>x</answer>")


def test_turn_and_token_budgets_end_an_episode():
  ep = envs.reset("calc", 0, 0, 1024, max_turns=4)
  for _ in range(3):
    assert not ep.step("<calc>1+1</calc>").done
  step = ep.step("<calc>1+1</calc>")
  assert step.done and step.result is None and ep.outcome().ended_by == "turns" and not ep.outcome().correct
  ep = envs.reset("calc", 0, 1, 1024, max_turns=4)
  ep.end("tokens")
  assert ep.done and ep.outcome().ended_by == "tokens"
  with pytest.raises(ValueError, match="fewer than"):
    envs.reset("calc", 0, 0, 1024, max_turns=2)
  with pytest.raises(ValueError, match="needs length"):
    envs.reset("lookup", 0, 0, 100, max_turns=6)


def test_demonstrations_as_a_data_source_weigh_only_the_model_turns():
  length = 512
  cfg = ml_collections.ConfigDict({"mix": {"lookup": 1.0, "calc": 1.0}, "task_length": length, "shards": "",
                                   "heldout_shards": "", "cache_dir": ""})
  mix = pipeline.Mixture(cfg, length, seed=5, vocab_size=tok.VOCAB_SIZE)
  rows = mix.rows(0, 6)
  for r in range(6):
    row = mix.row(r)
    ex_tokens = row.tokens[row.segment_ids == 1]
    assert ex_tokens[0] == tok.BOS and ex_tokens[-1] == tok.EOS
    weighted = rows["targets"][r][rows["weights"][r] > 0]
    # The weighted targets are exactly the calls the solver wrote, in order; nothing of the prompt or results.
    calls = re.findall(r"<(?:search|calc|answer)>[^<>]*</(?:search|calc|answer)>", tok.decode(ex_tokens))
    assert calls and tok.decode(weighted) == "".join(calls)
  assert tasks.TASKS["lookup"].min_length == envs.get("lookup").min_length + 1
