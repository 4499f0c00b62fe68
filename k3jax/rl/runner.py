"""The RL pipeline: supervised training on the solvers' demonstrations (the ordinary trainer), then GRPO
iterations from its final checkpoint, resumable.

Layout of a work directory:
    sft/                            the trainer's run (config.json, checkpoints/stage_<i>/, metrics.jsonl, ...)
    rl/config.json                  the run's config
    rl/checkpoints/<iteration>/     the policy's train state (orbax, with k3jax.train.checkpoint's fingerprints)
    rl/metrics.jsonl, rl/eval.jsonl one record per iteration / per held-out evaluation (step 0: the SFT policy)
    rl/tensorboard/

An iteration samples `prompts` problems (`group_size` episodes each) with the current policy, scores them, and
takes `minibatches` optimizer steps on the GRPO loss, each on a consecutive slice of the episodes; the rollout
policy's and the reference's log-probs are computed for all slices before the first step. Everything an
iteration draws (its problems, its sampling keys) is a function of the seed and the iteration, and the
reference is the SFT checkpoint, so a resumed run repeats exactly what the uninterrupted one would have done.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.data import pipeline
from k3jax.rl import config as rl_config_lib
from k3jax.rl import envs, evaluate, grpo, rewards, rollout, sampler as sampler_lib, step as rl_step_lib
from k3jax.train import batches, checkpoint, metrics as metrics_lib, optimizer, stages as stages_lib
from k3jax.train import state as state_lib, trainer


class RLRun:
  """A config made runnable: its SFT run, the RL optimizer and compiled steps (reusable across work directories)."""

  def __init__(self, config):
    rl_config_lib.validate(config.rl)
    self.config, r = config, config.rl
    self.sft = trainer.Run(config)
    self.mesh = self.sft.mesh
    episodes = r.prompts * r.group_size
    if (episodes // r.minibatches) % self.mesh.size or r.eval_batch % self.mesh.size:
      raise ValueError(f"config.rl: the {episodes // r.minibatches} episodes of a minibatch and eval_batch="
                       f"{r.eval_batch} must divide by the {self.mesh.size} mesh devices")
    self.stage = stages_lib.Stage(len(self.sft.stages), r.length, episodes, r.iterations, 0, r.lr,
                                  r.warmup_fraction, 0.0)
    self.tx, self.lr = optimizer.make_optimizer(
        config, [dataclasses.replace(self.stage, steps=r.iterations * r.minibatches)])
    self.graphdef, self.abstract, _ = state_lib.abstract_state(config, self.tx, self.mesh)
    shardings = state_lib.shardings_of(self.abstract)
    self.start_state = jax.jit(lambda s: state_lib.TrainState(jnp.zeros((), jnp.int32), s.params,
                                                              self.tx.init(s.params), s.balancer, s.other),
                               out_shardings=shardings)
    loss_cfg = grpo.LossConfig(clip_eps=r.clip_eps, kl_coef=r.kl_coef)
    self.rl_step = jax.jit(rl_step_lib.make_rl_step(self.graphdef, self.tx, self.lr, config.model, loss_cfg,
                                                    r.temperature),
                           donate_argnums=0, out_shardings=(shardings, NamedSharding(self.mesh, P())))
    self.logprobs = jax.jit(rl_step_lib.make_logprob_fn(self.graphdef, r.temperature))
    self.rollout_cfg = rollout.RolloutConfig(r.length, r.max_turns, r.turn_tokens)
    self.reward_cfg = rewards.RewardConfig(r.format_weight, r.length_weight)
    self.sampling = sampler_lib.SamplingOptions(temperature=r.temperature, top_p=r.top_p)
    self.greedy = sampler_lib.SamplingOptions(temperature=0.0)
    self.env_names = sorted(n for n, w in dict(r.envs).items() if w > 0)
    weights = np.array([r.envs[n] for n in self.env_names], np.float64)
    self.env_probs = weights / weights.sum()
    self.train_seed = pipeline.derive_seed(config.seed, self.stage.index, "train")
    self.heldout_seed = pipeline.derive_seed(config.seed, self.stage.index, "heldout")

  # -- the pieces of an iteration --------------------------------------------------------------------------------

  def sampler(self, state, options) -> sampler_lib.ReprefillSampler:
    return sampler_lib.ReprefillSampler(self.graphdef, (state.params, state.balancer, state.other), options,
                                        prefill_bucket=self.config.rl.prefill_bucket)

  def problems(self, iteration: int) -> list[tuple[str, int]]:
    """(environment, problem index) of the iteration's problems."""
    out = []
    for j in range(self.config.rl.prompts):
      index = iteration * self.config.rl.prompts + j
      pick = np.random.default_rng([self.train_seed, zlib.crc32(b"rl-mixture"), index]).choice(
          len(self.env_names), p=self.env_probs)
      out.append((self.env_names[int(pick)], index))
    return out

  def collect(self, state, iteration: int):
    """The iteration's episodes played by the policy: (episodes, trajectories, rewards `[R]`)."""
    r = self.config.rl
    episodes = [envs.reset(name, self.train_seed, index, r.length, max_turns=r.max_turns)
                for name, index in self.problems(iteration) for _ in range(r.group_size)]
    session = self.sampler(state, self.sampling).open([ep.prompt_tokens for ep in episodes], r.length)
    key = jax.random.fold_in(jax.random.PRNGKey(self.config.seed), iteration)
    trajectories = rollout.play(session, episodes, self.rollout_cfg, key)
    reward_R = np.concatenate([
        rewards.group_rewards([ep.outcome() for ep in episodes[g:g + r.group_size]],
                              [t.response_tokens for t in trajectories[g:g + r.group_size]], self.reward_cfg)
        for g in range(0, len(episodes), r.group_size)])
    return episodes, trajectories, reward_R

  def update(self, state, ref, trajectories, reward_R):
    """The iteration's optimizer steps; returns (state, metrics averaged over them)."""
    r = self.config.rl
    rows = rollout.episode_batch(trajectories, r.length)
    rows["advantages"] = np.asarray(grpo.group_advantages(reward_R, r.group_size))
    size = len(trajectories) // r.minibatches
    sharding = batches.rows_sharding(self.mesh)
    minibatches = []
    for k in range(r.minibatches):
      mb = batches.to_device({n: v[k * size:(k + 1) * size] for n, v in rows.items()}, sharding)
      minibatches.append(dict(mb, logp_old=self.logprobs(state, mb), logp_ref=self.logprobs(ref, mb)))
    steps = []
    for mb in minibatches:
      state, m = self.rl_step(state, mb)
      steps.append(m)
    steps = jax.device_get(steps)
    return state, {k: np.mean([m[k] for m in steps], axis=0) for k in steps[0]}

  def iteration(self, state, ref, iteration: int):
    """One rollout + update; returns (state, the metrics record)."""
    start = time.perf_counter()
    episodes, trajectories, reward_R = self.collect(state, iteration)
    rolled = time.perf_counter()
    state, m = self.update(state, ref, trajectories, reward_R)
    jax.block_until_ready(state)
    done = time.perf_counter()
    generated = sum(t.response_tokens for t in trajectories)
    std = reward_R.reshape(-1, self.config.rl.group_size).std(axis=1)
    record = {"step": iteration + 1, "reward_mean": float(reward_R.mean()),
              **evaluate.episode_stats(episodes, trajectories), **m,
              "groups_with_signal": float(np.mean(std > 0)), "rollout_s": rolled - start, "update_s": done - rolled,
              "rollout_tokens_per_s": generated / (rolled - start)}
    return state, record

  # -- the run ---------------------------------------------------------------------------------------------------

  def evaluate(self, state) -> dict:
    r = self.config.rl
    return evaluate.heldout(self.sampler(state, self.greedy), rl_config_lib.eval_points(r), self.heldout_seed,
                            examples=r.eval_examples, batch=r.eval_batch, max_turns=r.max_turns,
                            turn_tokens=r.turn_tokens)

  def sft_state(self, workdir):
    """The final train state of the SFT run in `workdir/sft` (training it first if needed)."""
    self.sft.train(pathlib.Path(workdir) / "sft")
    last = self.sft.stages[-1]
    with self.sft.checkpointer(pathlib.Path(workdir) / "sft", last.index) as ckpt:
      restored = ckpt.restore_latest(self.sft.abstract, at=last.end)
    if restored is None:
      raise FileNotFoundError(f"no usable final SFT checkpoint (step {last.end}) under {workdir}/sft")
    return restored[0]

  def run(self, workdir, *, until: int | None = None) -> dict:
    """SFT (if not done), then RL iterations up to `until` (default: all); returns {"before", "after"}: the
    held-out evaluations of the SFT policy and of the last one (None until the run is complete)."""
    r = self.config.rl
    workdir = pathlib.Path(workdir)
    until = r.iterations if until is None else min(until, r.iterations)
    sft_state = self.sft_state(workdir)
    ref = jax.tree.map(lambda x: x.copy(), sft_state.replace(opt_state=None))  # frozen; never donated
    rl_dir = workdir / "rl"
    if jax.process_index() == 0:
      rl_dir.mkdir(parents=True, exist_ok=True)
      (rl_dir / "config.json").write_text(self.config.to_json_best_effort(indent=2) + "\n")
    with checkpoint.Checkpointer(rl_dir / "checkpoints", keep=r.keep_checkpoints) as ckpt:
      restored = ckpt.restore_latest(self.abstract)
      state = self.start_state(sft_state) if restored is None else restored[0]
      first = 0 if restored is None else restored[1]["iteration"]
      if restored is not None:
        print(f"rl: resuming from iteration {first} ({ckpt.directory})", flush=True)
      log = metrics_lib.RunLog(rl_dir, first)
      try:
        if first == 0 and until > 0 and self._evaluations(rl_dir).get(0) is None:
          log.evaluation({"step": 0, **self.evaluate(state)})
        state = self._iterations(state, ref, first, until, ckpt, log)
        if until == r.iterations and first < until:
          log.evaluation({"step": r.iterations, **self.evaluate(state)})
      finally:
        log.close()
    return self.summary(rl_dir)

  def _iterations(self, state, ref, first, until, ckpt, log):
    r = self.config.rl
    progress = metrics_lib.Progress(self.stage, first)
    for it in range(first, until):
      state, record = self.iteration(state, ref, it)
      done = it + 1
      if done % r.log_every == 0 or done == until:
        log.metrics(record)
      progress.update(1, record["loss"], record["rollout_tokens_per_s"])
      if r.eval_every and done % r.eval_every == 0 and done < r.iterations:
        log.evaluation({"step": done, **self.evaluate(state)})
      if done % r.checkpoint_every == 0 or done == until:
        ckpt.save(done, state, {"iteration": done, "config": json.loads(self.config.to_json_best_effort())})
    progress.close()
    ckpt.wait()
    return state

  @staticmethod
  def _evaluations(rl_dir) -> dict[int, dict]:
    """The held-out evaluations logged in `rl_dir`, by step."""
    path = pathlib.Path(rl_dir) / "eval.jsonl"
    records = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
    return {x["step"]: {k: v for k, v in x.items() if k != "step"} for x in records}

  def summary(self, rl_dir) -> dict:
    """{"before": the step-0 evaluation, "after": the final one (None if not reached)}, printed as a table."""
    evaluations = self._evaluations(rl_dir)
    before, after = evaluations.get(0), evaluations.get(self.config.rl.iterations)
    if before is not None and after is not None:
      print(evaluate.format_table(before, after, self.config.rl.length), flush=True)
    return {"before": before, "after": after}
