"""The RL pipeline on the tiny config cut to two layers: SFT on demonstrations, then GRPO iterations that log
finite metrics and held-out evaluations before and after; a run stopped by SIGTERM saves the iteration it reached
and resumes into exactly the records of the uninterrupted run; a resumed run must keep its config; the GRPO step
moves the policy toward the rewarded answer and away from the penalised one, and moves the balancer; the programs
compiled ahead are the ones the iterations and evaluations call."""
import json
import os
import pathlib
import shutil
import signal

import jax
import ml_collections
import numpy as np
import pytest

from experiments.configs import tiny
from k3jax import envs
from k3jax.data import tokenizer as tok
from k3jax.envs.trajectory import Trajectory
from k3jax.rl import rollout, runner, step as rl_step_lib
from k3jax.rl import config as rl_config_lib
from k3jax.rl.config import rl_config
from k3jax.train import batches, interrupt, workdir as workdir_lib
from model_testing import compiled_programs

pytestmark = pytest.mark.xdist_group("rl_loop")
LENGTH, ITERATIONS, EVAL_EXAMPLES = 240, 3, 4
REQUIRED = ("step", "reward_mean", "success_rate", "kl", "response_tokens", "tool_calls", "invalid_calls",
            "groups_with_signal", "groups_mixed_success")
TIMING = ("rollout_s", "update_s", "rollout_share", "rollout_tokens_per_s", "prefill_tokens_per_s",
          "decode_tokens_per_s")


def make_config():
  c = tiny.get_config()
  c.model.num_layers = 2   # layer 0: KDA + dense FFN, layer 1: MLA + LatentMoE
  c.mesh = "data:1,expert:1"
  c.steps, c.seq_len, c.batch_size = 2, LENGTH, 4
  c.data.mix = ml_collections.ConfigDict({"lookup": 1.0})
  c.data.task_length = LENGTH
  c.eval.batches, c.eval.examples = 0, 0
  with c.unlocked():
    c.rl = rl_config()
  r = c.rl
  r.envs = ml_collections.ConfigDict({"lookup": 1.0})
  r.length, r.iterations, r.prompts, r.group_size, r.minibatches = LENGTH, ITERATIONS, 2, 2, 2
  r.max_turns, r.turn_tokens, r.lr, r.length_weight = 3, 16, 1e-3, 0.5
  r.checkpoint_every, r.eval_at, r.eval_examples, r.eval_batch = 2, (f"lookup@{LENGTH}",), EVAL_EXAMPLES, 4
  return c


@pytest.fixture(scope="module")
def rl_run():
  return runner.RLRun(make_config())


@pytest.fixture(scope="module")
def finished(rl_run, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("rl_full")
  summary = rl_run.run(workdir)
  return workdir, summary


def records(path):
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def test_iterations_log_finite_metrics_and_evaluations_before_and_after(finished):
  workdir, summary = finished
  logged = records(workdir / "rl" / "metrics.jsonl")
  assert [r["step"] for r in logged] == list(range(1, ITERATIONS + 1))
  for r in logged:
    assert set(REQUIRED) <= set(r)
    values = [np.asarray(v, np.float64) for v in r.values()]
    assert all(np.all(np.isfinite(v)) for v in values), r
    assert 0.0 <= r["success_rate"] <= 1.0 and r["response_tokens"] > 0
    # A group of mixed success has a reward spread; a spread may come from the length term alone.
    assert 0.0 <= r["groups_mixed_success"] <= r["groups_with_signal"] <= 1.0
  assert [r["step"] for r in records(workdir / "rl" / "eval.jsonl")] == [0, ITERATIONS]
  assert set(summary["before"]) == set(summary["after"]) == {f"lookup@{LENGTH}"}
  for evaluation in summary.values():   # success by chain length, over the same held-out problems
    point = evaluation[f"lookup@{LENGTH}"]
    by_links = point["success_by_links"]
    assert set(by_links) <= {"1", "2"} and sum(x["episodes"] for x in by_links.values()) == EVAL_EXAMPLES
    assert sum(x["success_rate"] * x["episodes"] for x in by_links.values()) / EVAL_EXAMPLES == \
        pytest.approx(point["success_rate"])
    assert len(point["correct"]) == EVAL_EXAMPLES and np.mean(point["correct"]) == pytest.approx(point["success_rate"])
  assert workdir_lib.checkpointed_stages(workdir / "rl") == {1: [2, 3]}   # the stage after SFT's one
  assert (workdir / "sft" / "checkpoints" / "stage_0").exists()
  assert "rl" not in json.loads((workdir / "sft" / "config.json").read_text())
  assert json.loads((workdir / "rl" / "config.json").read_text())["rl"]["iterations"] == ITERATIONS


def strip(rs):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]


def test_sigterm_saves_the_iteration_reached_and_the_run_continues_exactly(finished, rl_run, tmp_path, monkeypatch):
  workdir, _ = finished
  shutil.copytree(workdir / "sft", tmp_path / "sft")
  collect = rl_run.collect

  def collect_then_sigterm(state, iteration):  # the signal arrives during the first iteration's rollouts
    if iteration == 0:
      os.kill(os.getpid(), signal.SIGTERM)
    return collect(state, iteration)

  monkeypatch.setattr(rl_run, "collect", collect_then_sigterm)
  with pytest.raises(interrupt.Interrupted) as stopped:
    rl_run.run(tmp_path)
  assert (stopped.value.signum, stopped.value.step) == (signal.SIGTERM, 1)
  assert workdir_lib.checkpointed_stages(tmp_path / "rl") == {1: [1]}   # saved on the signal, not on schedule
  assert [r["step"] for r in records(tmp_path / "rl" / "metrics.jsonl")] == [1]
  monkeypatch.undo()
  assert rl_run.run(tmp_path)["after"] is not None
  assert strip(records(tmp_path / "rl" / "metrics.jsonl")) == strip(records(workdir / "rl" / "metrics.jsonl"))
  assert records(tmp_path / "rl" / "eval.jsonl") == records(workdir / "rl" / "eval.jsonl")


def test_until_zero_trains_only_the_sft_stage(finished, rl_run, tmp_path):
  workdir, _ = finished
  shutil.copytree(workdir / "sft", tmp_path / "sft")
  assert rl_run.run(tmp_path, until=0) == {"before": None, "after": None}
  assert workdir_lib.checkpointed_stages(tmp_path / "rl") == {} and not (tmp_path / "rl" / "metrics.jsonl").exists()
  assert (tmp_path / "rl" / "config.json").exists()   # a later call must bring the same config


def test_a_resumed_run_must_keep_what_its_iterations_compute(finished, tmp_path):
  workdir, _ = finished
  shutil.copytree(workdir, tmp_path / "run")
  changed = make_config()
  changed.rl.kl_coef = 0.1
  with pytest.raises(workdir_lib.ConfigChanged, match="rl.kl_coef: 0.04 -> 0.1"):
    runner.RLRun(changed).run(tmp_path / "run")
  faster = make_config()
  faster.rl.lr = 2e-3
  with pytest.raises(workdir_lib.ConfigChanged, match="changes the learning rate of steps already taken"):
    runner.RLRun(faster).run(tmp_path / "run", allow_config_change=True)
  assert not (tmp_path / "run" / "rl" / "config_changes.jsonl").exists()
  # More iterations with the same warmup keep the learning rate of those taken: allowed, and recorded.
  longer = make_config()
  longer.rl.iterations = ITERATIONS + 2
  record = workdir_lib.check_resume(tmp_path / "run" / "rl", longer, allow_change=True,
                                    rules=rl_config_lib.RESUME_RULES)
  assert record["allowed"] and record["changes"] == {"rl.iterations": [ITERATIONS, ITERATIONS + 2]}
  # How often it logs, saves and evaluates may change freely.
  observed = make_config()
  observed.rl.eval_every, observed.rl.checkpoint_every = 1, 1
  record = workdir_lib.check_resume(tmp_path / "run" / "rl", observed, rules=rl_config_lib.RESUME_RULES)
  assert not record["allowed"] and set(record["changes"]) == {"rl.eval_every", "rl.checkpoint_every"}


def test_grpo_step_moves_the_policy_toward_the_rewarded_answer(finished, rl_run):
  workdir, _ = finished
  sft_state = rl_run.sft_state(workdir)
  ep = envs.reset("lookup", 0, 0, LENGTH, max_turns=3)
  good = envs.demonstrate("lookup", ep)
  answer = ep.problem.answer
  wrong = "".join(chr((ord(c) - 97 + 13) % 26 + 97) for c in answer)
  bad = Trajectory(good.chunks[:-1])
  bad.add(tok.encode(f"<answer>{wrong}</answer>"), model=True)
  rows = dict(rollout.episode_batch([good, bad], LENGTH), advantages=np.array([1.0, -1.0], np.float32))
  batch = batches.to_device(rows, batches.rows_sharding(rl_run.mesh))   # placed as the run places its episodes
  state = rl_run.start_state(sft_state)
  before = rl_run.logprobs(rl_step_lib.model_variables(state), batch)
  batch.update(logp_old=before, logp_ref=before)
  balancer = jax.tree.map(np.asarray, state.balancer)
  for _ in range(3):
    state, m = rl_run.rl_step(state, batch)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.device_get(m).values())
  after = rl_run.logprobs(rl_step_lib.model_variables(state), batch)
  # The answer's key: the last model turn's tokens between "<answer>" and "</answer>" (predicted one position
  # earlier: the weights sit on the predicting positions).
  n = len(good)
  key = slice(n - len(f"{answer}</answer>") - 1, n - len("</answer>") - 1)
  gain = np.asarray(after - before)[:, key].sum(1)
  assert gain[0] > 0 > gain[1], gain
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(balancer), jax.tree.leaves(state.balancer)))


def test_padding_feeds_neither_the_balancer_nor_max_vio(finished, rl_run):
  """Episodes padded to the context length: replacing the padding's tokens by random ones changes neither the
  balancer's update of a GRPO step nor its MaxVio (the padding routes through the MoE but counts in no statistic)."""
  workdir, _ = finished
  ep = envs.reset("lookup", 0, 1, LENGTH, max_turns=3)
  demo = envs.demonstrate("lookup", ep)
  rows = dict(rollout.episode_batch([demo, demo], LENGTH), advantages=np.array([1.0, -1.0], np.float32))
  pad = rows["segment_ids"] == 0
  assert 0.2 < pad.mean() < 1
  noise = np.random.default_rng(0).integers(0, tok.VOCAB_SIZE, pad.shape).astype(rows["tokens"].dtype)
  results = []
  for r in (rows, dict(rows, tokens=np.where(pad, noise, rows["tokens"]))):
    state = rl_run.start_state(rl_run.sft_state(workdir))
    start = jax.tree.map(np.asarray, state.balancer)
    batch = batches.to_device(r, batches.rows_sharding(rl_run.mesh))
    logp = rl_run.logprobs(rl_step_lib.model_variables(state), batch)
    batch.update(logp_old=logp, logp_ref=logp)
    state, m = rl_run.rl_step(state, batch)
    results.append((jax.tree.map(np.asarray, state.balancer), np.asarray(m["moe_max_vio"])))
  (bal, vio), (bal_noisy, vio_noisy) = results
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(bal)))
  for a, b in zip(jax.tree.leaves(bal), jax.tree.leaves(bal_noisy)):
    np.testing.assert_allclose(b, a, atol=1e-6)
  np.testing.assert_allclose(vio_noisy, vio, atol=1e-6)


def test_compile_ahead_compiles_what_the_iterations_and_evaluations_call(finished, tmp_path):
  """Compiled ahead (lowered and compiled, never run: nothing executes off the main thread), the prefill steps,
  decode loops, log-probs and GRPO step are not compiled again by an iteration and an evaluation. The config's
  lengths and rows are this test's own, so no other test compiled these programs first."""
  workdir, _ = finished
  config = make_config()
  config.rl.length, config.rl.eval_batch, config.rl.eval_examples = LENGTH + 16, 2, 2
  config.rl.eval_at = (f"lookup@{LENGTH + 16}",)
  run = runner.RLRun(config)
  programs = {"_prefill_step", "_decode_loop", "logprobs", "rl_step"}
  with compiled_programs() as ahead:
    run.compile_ahead().wait()
  assert programs <= set(ahead)
  sft_state = run.sft_state(workdir)   # the same SFT config: already trained
  state = run.start_state(sft_state)
  with compiled_programs() as again:
    state, record = run.iteration(state, rl_step_lib.model_variables(sft_state), 0)
    run.evaluate(state)
  assert record["response_tokens"] > 0
  assert not programs & set(again), again


def test_a_mesh_of_several_devices_is_refused_before_anything_runs():
  c = make_config()
  c.mesh = "data:2,expert:1"
  with pytest.raises(ValueError, match="runs on one device"):
    runner.RLRun(c)
