"""The RL pipeline: supervised training on the solvers' demonstrations (the ordinary trainer), then GRPO
iterations from its final checkpoint, resumable.

Layout of a work directory:
    sft/                            the trainer's run of the config without `rl` (`k3jax.train.trainer`)
    rl/config.json                  the whole config (`k3jax.train.workdir`: a resumed run must match it)
    rl/checkpoints/stage_<i>/<n>/   the policy's train state after iteration n (i: the stage after SFT's)
    rl/metrics.jsonl                one record per iteration (`step` = iterations done)
    rl/eval.jsonl                   held-out evaluations (step 0: the SFT policy), rl/tensorboard/

An iteration samples `prompts` problems (`group_size` episodes each) with the current policy, scores them, and
takes `minibatches` optimizer steps on the GRPO loss, each on a consecutive slice of the episodes; the rollout
policy's and the reference's log-probs are computed for all slices before the first step. Everything an
iteration draws (its problems, its sampling keys) is a function of the seed and the iteration, and the
reference is the SFT checkpoint, so a resumed run repeats exactly what the uninterrupted one would have done.
SIGINT / SIGTERM stop after the current iteration with a checkpoint of it (`interrupt.Interrupted`); a non-finite
loss or gradient norm stops the run before anything of that iteration is saved (`trainer.Diverged`).

While the SFT stage trains, background threads compile the RL programs (`compile_ahead`: each lowered for the
shapes and shardings of its calls and compiled, never run), so on a GPU their compilation overlaps SFT instead of
following it.
"""
from __future__ import annotations

import math
import pathlib
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import envs, generate_lib, parallel
from k3jax.data import pipeline, tokenizer as tok
from k3jax.envs.trajectory import Trajectory
from k3jax.rl import config as rl_config_lib
from k3jax.rl import evaluate, grpo, rewards, rollout, sampler as sampler_lib, step as rl_step_lib
from k3jax.train import background, batches, checkpoint, interrupt, loop, metrics as metrics_lib, optimizer
from k3jax.train import state as state_lib, trainer, workdir as workdir_lib


class RLRun:
  """A config made runnable: its SFT run, the RL optimizer and compiled steps (reusable across work directories)."""

  def __init__(self, config):
    rl_config_lib.validate(config.rl)
    self.config, r = config, config.rl
    self.sft = trainer.Run(rl_config_lib.sft_config(config))
    self.mesh = self.sft.mesh
    if self.mesh.size != 1:
      raise ValueError(f"config.mesh={config.mesh!r}: the RL stage runs on one device for now (its rollouts are "
                       f"not sharded); use data:1,expert:1")
    index = len(self.sft.stages)
    self.stage = rl_config_lib.rl_stage(config, index)
    self.lr = rl_config_lib.optimizer_schedule(config)
    self.tx = optimizer.make_optimizer(config.optimizer, self.lr)
    self.graphdef, self.abstract, _ = state_lib.abstract_state(config, self.tx, self.mesh)
    shardings = state_lib.shardings_of(self.abstract)
    options = parallel.compiler_options(self.mesh)
    self.start_state = jax.jit(lambda s: state_lib.TrainState(jnp.zeros((), jnp.int32), s.params,
                                                              self.tx.init(s.params), s.balancer, s.other),
                               out_shardings=shardings, compiler_options=options)
    loss_cfg = grpo.LossConfig(clip_eps=r.clip_eps, kl_coef=r.kl_coef)
    self.rl_step = jax.jit(rl_step_lib.make_rl_step(self.graphdef, self.tx, self.lr, config.model, loss_cfg,
                                                    r.temperature),
                           donate_argnums=0, out_shardings=(shardings, NamedSharding(self.mesh, P())),
                           compiler_options=options)
    self.logprobs = jax.jit(rl_step_lib.make_logprob_fn(self.graphdef, r.temperature), compiler_options=options)
    self.rollout_cfg = rollout.RolloutConfig(r.length, r.max_turns, r.turn_tokens)
    self.reward_cfg = rewards.RewardConfig(r.format_weight, r.length_weight)
    self.sampling = sampler_lib.rollout_options(r.temperature, r.top_p)
    self.greedy = sampler_lib.rollout_options(0.0)
    self.env_names = sorted(n for n, w in dict(r.envs).items() if w > 0)
    weights = np.array([r.envs[n] for n in self.env_names], np.float64)
    self.env_probs = weights / weights.sum()
    self.train_seed = pipeline.derive_seed(config.seed, index, "train")
    self.heldout_seed = pipeline.derive_seed(config.seed, index, "heldout")

  # -- the pieces of an iteration --------------------------------------------------------------------------------

  def sampler(self, state, options) -> sampler_lib.Sampler:
    r = self.config.rl
    return sampler_lib.Sampler(state_lib.merge(self.graphdef, state), options, turn_tokens=r.turn_tokens,
                               prefill_chunk=r.prefill_chunk, append_chunk=r.append_chunk)

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
    """The iteration's episodes played by the policy: (episodes, trajectories, rewards `[R]`, the session's
    `sampler.Timing`)."""
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
    return episodes, trajectories, reward_R, session.timing

  def minibatches(self, trajectories, reward_R) -> list[dict[str, np.ndarray]]:
    """The iteration's episodes as host rows (`rollout.episode_batch` and the advantages), cut into `minibatches`
    consecutive slices."""
    r = self.config.rl
    rows = rollout.episode_batch(trajectories, r.length)
    rows["advantages"] = np.asarray(grpo.group_advantages(reward_R, r.group_size, r.advantage_scale))
    size = len(trajectories) // r.minibatches
    return [{n: v[k * size:(k + 1) * size] for n, v in rows.items()} for k in range(r.minibatches)]

  def update(self, state, ref, trajectories, reward_R):
    """The iteration's optimizer steps (`ref`: the reference's `model_variables`); returns (state, metrics averaged
    over them)."""
    sharding = batches.rows_sharding(self.mesh)
    minibatches = []
    for rows in self.minibatches(trajectories, reward_R):
      mb = batches.to_device(rows, sharding)
      minibatches.append(dict(mb, logp_old=self.logprobs(rl_step_lib.model_variables(state), mb),
                              logp_ref=self.logprobs(ref, mb)))
    steps = []
    for mb in minibatches:
      state, m = self.rl_step(state, mb)
      steps.append(m)
    steps = jax.device_get(steps)
    return state, {k: np.mean([m[k] for m in steps], axis=0) for k in steps[0]}

  def iteration(self, state, ref, iteration: int):
    """One rollout + update; returns (state, the metrics record)."""
    start = time.perf_counter()
    episodes, trajectories, reward_R, timing = self.collect(state, iteration)
    rolled = time.perf_counter()
    state, m = self.update(state, ref, trajectories, reward_R)
    jax.block_until_ready(state)
    done = time.perf_counter()
    generated = sum(t.response_tokens for t in trajectories)
    group_size = self.config.rl.group_size
    std = reward_R.reshape(-1, group_size).std(axis=1)
    correct_NG = np.array([ep.outcome().correct for ep in episodes]).reshape(-1, group_size)
    record = {"step": iteration + 1, "reward_mean": float(reward_R.mean()),
              **evaluate.episode_stats(episodes, trajectories), **m,
              "groups_with_signal": float(np.mean(std > 0)),
              "groups_mixed_success": float(np.mean(correct_NG.any(axis=1) & ~correct_NG.all(axis=1))),
              "rollout_s": rolled - start, "update_s": done - rolled,
              "rollout_share": (rolled - start) / (done - start), "rollout_tokens_per_s": generated / (rolled - start),
              **timing.rates()}
    return state, record

  # -- the run ---------------------------------------------------------------------------------------------------

  def evaluate(self, state, stop: interrupt.StopSignals | None = None, step: int = 0) -> dict:
    """Held-out success of a policy (greedy) at every evaluation point; a requested stop raises at `step`."""
    r = self.config.rl
    return evaluate.heldout(self.sampler(state, self.greedy), rl_config_lib.eval_points(r), self.heldout_seed,
                            examples=r.eval_examples, batch=r.eval_batch, max_turns=r.max_turns,
                            turn_tokens=r.turn_tokens, interrupt=None if stop is None else lambda: stop.check(step))

  def compile_ahead(self) -> background.Background:
    """Compiles every program of the RL iterations and evaluations in background threads, each lowered for the
    shapes and shardings of its calls and compiled, never run (a program run from a second thread beside the SFT
    step failed on the H200 with `cudaErrorInvalidDevice`): one thread for the update (log-probs and GRPO step), one
    per (rows, length) of the rollout and evaluation sessions (the prompt's and the tool result's chunk steps, the
    decode loop for each sampling). The calls that follow in this process find them in jit's caches; a later
    process, in the persistent compilation cache if it is on."""
    r = self.config.rl
    episodes = r.prompts * r.group_size
    model = state_lib.merge(self.graphdef, self.abstract)   # shapes and shardings only

    def update():
      fake = Trajectory()
      fake.add([tok.BOS], model=False)
      fake.add([tok.PAD], model=True)
      sharding = batches.rows_sharding(self.mesh)
      mb = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            for n, v in self.minibatches([fake] * episodes, np.zeros(episodes, np.float32))[0].items()}
      logp = self.logprobs.lower(rl_step_lib.model_variables(self.abstract), mb).compile().out_info
      self.rl_step.lower(self.abstract, dict(mb, logp_old=logp, logp_ref=logp)).compile()

    def sessions(rows, length, options):
      generate_lib.lower_prefill(model, rows, length, chunk=r.prefill_chunk).compile()
      generate_lib.lower_prefill(model, rows, length, chunk=r.append_chunk).compile()
      for o in options:
        generate_lib.lower_decode(model, rows, length, max_new=r.turn_tokens, options=o).compile()

    shapes = {(episodes, r.length): [self.sampling]}
    for _, n in rl_config_lib.eval_points(r):
      shapes.setdefault((r.eval_batch, n), []).append(self.greedy)
    jobs = [update] + [lambda k=k, o=o: sessions(*k, list(dict.fromkeys(o))) for k, o in shapes.items()]
    return background.Background(jobs)

  def sft_state(self, workdir, **train_flags):
    """The final train state of the SFT run in `workdir/sft` (training it first if needed; `train_flags` go to
    `trainer.Run.train`)."""
    self.sft.train(pathlib.Path(workdir) / "sft", **train_flags)
    last = self.sft.stages[-1]
    with self.sft.checkpointer(pathlib.Path(workdir) / "sft", last.index) as ckpt:
      restored = ckpt.restore_latest(self.sft.abstract, at=last.end)
    if restored is None:
      raise FileNotFoundError(f"no usable final SFT checkpoint (step {last.end}) under {workdir}/sft")
    return restored[0]

  def checkpointer(self, rl_dir) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(workdir_lib.stage_directory(rl_dir, self.stage.index),
                                   keep=self.config.rl.keep_checkpoints)

  def run(self, workdir, *, until: int | None = None, allow_config_change: bool = False,
          allow_missing_metrics: bool = False, compile_ahead: bool = True) -> dict:
    """SFT (if not done), then RL iterations up to `until` (default: all); returns {"before", "after"}: the
    held-out evaluations of the SFT policy and of the last one (None until the run is complete).

    Both directories' guards run before anything is written: a config that changes what the run computes is
    refused (`workdir.ConfigChanged`) unless `allow_config_change`; a resume without the metrics.jsonl of the
    earlier iterations is refused unless `allow_missing_metrics`. `compile_ahead`: compile the RL programs while
    SFT trains (`compile_ahead`; also with `until=0`, for the persistent compilation cache of a later call).
    """
    r = self.config.rl
    workdir = pathlib.Path(workdir)
    rl_dir = workdir / "rl"
    if until is not None and until < 0:
      raise ValueError(f"until must be >= 0 (0: only the SFT stage), got {until}")
    until = r.iterations if until is None else min(until, r.iterations)
    change = workdir_lib.check_resume(rl_dir, self.config, allow_change=allow_config_change,
                                      rules=rl_config_lib.RESUME_RULES)
    complete = workdir_lib.latest_step(rl_dir) >= r.iterations and r.iterations in self.evaluations(rl_dir)
    # Also before an SFT-only call (until=0): the programs then wait in the persistent compilation cache, if on.
    ahead = self.compile_ahead() if compile_ahead and not complete else None
    sft_state = self.sft_state(workdir, allow_config_change=allow_config_change,
                               allow_missing_metrics=allow_missing_metrics)
    if ahead is not None:
      start = time.perf_counter()
      ahead.wait()
      print(f"rl: the RL programs compiled (waited {time.perf_counter() - start:.0f} s after SFT)", flush=True)
    ref = jax.tree.map(lambda x: x.copy(), rl_step_lib.model_variables(sft_state))  # frozen; never donated
    with self.checkpointer(rl_dir) as ckpt, interrupt.StopSignals() as stop:
      restored = ckpt.restore_latest(self.abstract)
      if restored is None and ckpt.steps():
        raise trainer.UnusableCheckpoints(f"no RL checkpoint in {ckpt.directory} is usable; refusing to start RL "
                                          f"over (move the directory away to start afresh)")
      state = self.start_state(sft_state) if restored is None else restored[0]
      first = 0 if restored is None else restored[1]["iteration"]
      if restored is not None:
        print(f"rl: resuming from iteration {first} ({ckpt.directory})", flush=True)
      metrics_lib.check_continuation(rl_dir, first, allow_missing=allow_missing_metrics)
      workdir_lib.commit(rl_dir, self.config, change)
      log = metrics_lib.RunLog(rl_dir, first)
      try:
        if until > 0 and 0 not in self.evaluations(rl_dir):
          log.evaluation({"step": 0, **self.evaluate(state, stop, 0)})
        state = self._iterations(state, ref, first, until, ckpt, log, stop)
        if until == r.iterations and r.iterations not in self.evaluations(rl_dir):
          log.evaluation({"step": r.iterations, **self.evaluate(state, stop, r.iterations)})
      finally:
        log.close()
    return self.summary(rl_dir)

  def _iterations(self, state, ref, first, until, ckpt, log, stop):
    """Iterations `first` to `until` (`loop.run_steps`, the trainer's loop): log every `log_every`, evaluate every
    `eval_every`, checkpoint every `checkpoint_every`, at `until` and when a stop is requested."""
    r = self.config.rl
    progress = metrics_lib.Progress(self.stage, first, tokens_per_step=self.stage.batch_size * r.length)

    def advance(state, it):
      state, record = self.iteration(state, ref, it)
      done = it + 1
      if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
        log.metrics(record)
        raise trainer.Diverged(
            f"RL diverged at iteration {done}: loss {record['loss']}, gradient norm {record['grad_norm']}. "
            f"Nothing of this iteration was saved. Lower config.rl.lr (now {r.lr:g}) or raise "
            f"config.rl.kl_coef, then start a new run or resume with --allow_config_change")
      if done % r.log_every == 0 or done == until:
        log.metrics(record)
      seconds = record["rollout_s"] + record["update_s"]
      progress.update(1, record["loss"], self.stage.batch_size * r.length / seconds,
                      extra={"reward": record["reward_mean"], "success": record["success_rate"]})
      if r.eval_every and done % r.eval_every == 0 and done < r.iterations:
        log.evaluation({"step": done, **self.evaluate(state, stop, done)})
      return state

    return loop.run_steps(state, range(first, until), advance, ckpt=ckpt, stop=stop,
                          checkpoint_every=r.checkpoint_every, progress=progress,
                          save_meta=lambda done: {"iteration": done, "stage": self.stage.index,
                                                  "config": workdir_lib.as_json(self.config)})

  @staticmethod
  def evaluations(rl_dir) -> dict[int, dict]:
    """The held-out evaluations logged in `rl_dir`, by step."""
    return {x["step"]: {k: v for k, v in x.items() if k != "step"}
            for x in metrics_lib.read_jsonl(pathlib.Path(rl_dir) / metrics_lib.EVALS)}

  def summary(self, rl_dir) -> dict:
    """{"before": the step-0 evaluation, "after": the final one (None if not reached)}, printed as a table with
    the run's time split between generation and training."""
    evaluations = self.evaluations(rl_dir)
    before, after = evaluations.get(0), evaluations.get(self.config.rl.iterations)
    if before is not None and after is not None:
      logged = metrics_lib.read_jsonl(pathlib.Path(rl_dir) / metrics_lib.METRICS)
      rollout_s, update_s = (sum(x[k] for x in logged) for k in ("rollout_s", "update_s"))
      print(evaluate.format_table(before, after, self.config.rl.length), flush=True)
      if logged:
        print(f"rl: {len(logged)} logged iterations, {rollout_s + update_s:.0f} s: generation "
              f"{rollout_s / (rollout_s + update_s):.0%}, training {update_s / (rollout_s + update_s):.0%}; "
              f"{np.mean([x['rollout_tokens_per_s'] for x in logged]):,.0f} sampled tokens/s (prefill "
              f"{np.mean([x['prefill_tokens_per_s'] for x in logged]):,.0f}, decode "
              f"{np.mean([x['decode_tokens_per_s'] for x in logged]):,.0f} tokens/s)", flush=True)
    return {"before": before, "after": after}
