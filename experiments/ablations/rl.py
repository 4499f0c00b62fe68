"""The RL notebook's runs: SFT then GRPO (`k3jax.rl.runner`) once per seed of a study, what they logged, and its
plots.

Each seed's run lives in `runs.run_dir(workdir, variant, seed)` (`sft/` and `rl/`, the runner's layout); calling
`train` again reuses the finished stages and continues an interrupted one, as the runner does. With `records`, each
finished run's result is also kept as one small JSON file (`experiments.ablations.records`), which a later call, on
this machine or another, reads instead of running it again.
"""
from __future__ import annotations

import pathlib
import time

import numpy as np

from experiments.ablations import records as records_lib
from experiments.ablations import runs, verdicts
from k3jax.rl import config as rl_config_lib, evaluate, runner
from k3jax.train import workdir as workdir_lib

# The RL iterations' logged fields the notebook keeps (metrics.jsonl has more: timing, tool calls, ...).
CURVES = ("reward_mean", "success_rate", "kl", "loss", "groups_with_signal", "groups_mixed_success",
          "response_tokens")


def describe(config) -> str:
  """The RL stage of a config in a line: iterations, problems x samples, length, environments."""
  r = config.rl
  return (f"{r.iterations} RL iterations of {r.prompts} problems x {r.group_size} samples at {r.length} tokens, "
          f"envs {dict(r.envs)}")


def train(study, workdir, *, records=None) -> dict:
  """Runs SFT then RL for every (variant, seed) of `study` (the RL notebook's: one variant) under `workdir`, each
  one recorded under `records` when given (and not run when recorded there). Returns {"rl_run" (`describe`),
  "train_length", "eval_examples", "points": ["env@length", ...], "runs": [{"variant", "seed", "before", "after"
  (the held-out evaluations of the SFT and final policies), "sft": {"step", "loss"}, "rl": {"step", and each of
  CURVES}, "wall_s"}], "success": {"env@length": {"before": spread, "after": spread}} over the runs}."""
  plan = [(variant, seed, runs.with_seed(config, seed)) for variant, config in study.configs().items()
          for seed in study.seeds]
  recorded = records_lib.load_plan(records, plan)
  out_runs = []
  for variant, seed, config_s in plan:
    if (variant, seed) in recorded:
      print(f"== {variant}, seed {seed}: recorded in {records_lib.path(records, variant, seed)}", flush=True)
      out_runs.append(recorded[variant, seed])
      continue
    directory = runs.run_dir(workdir, variant, seed)
    print(f"== {variant}, seed {seed}: {directory}", flush=True)
    start = time.perf_counter()
    runner.RLRun(config_s).run(directory)
    run = finished_run(config_s, directory, variant=variant, seed=seed, wall_s=time.perf_counter() - start)
    if records is not None:
      records_lib.save(records, variant, seed, config_s, run)
    out_runs.append(run)
  r = study.base.rl
  points = list(out_runs[0]["after"])
  success = {p: {when: runs.spread(x[when][p]["success_rate"] for x in out_runs) for when in ("before", "after")}
             for p in points}
  return {"rl_run": describe(study.base), "train_length": r.length, "eval_examples": r.eval_examples,
          "points": points, "runs": out_runs, "success": success}


def finished_run(config, directory, *, variant: str, seed: int, wall_s: float | None) -> dict:
  """The entry of `train`'s "runs" for the finished SFT → RL run of `config` in `directory` (the runner's layout),
  read from its logs alone (no checkpoint needed). `wall_s`: the run's time, None where it is not known."""
  directory = pathlib.Path(directory)
  evaluations = runner.RLRun.evaluations(directory / "rl")
  before, after = evaluations.get(0), evaluations.get(config.rl.iterations)
  if before is None or after is None:
    raise ValueError(f"{directory} holds no finished run: its rl/eval.jsonl has the evaluations of steps "
                     f"{sorted(evaluations)}, not 0 and {config.rl.iterations}")
  return records_lib.plain({"variant": variant, "seed": seed, "before": before, "after": after,
                            "sft": _curves(directory / "sft", ("loss",)), "rl": _curves(directory / "rl", CURVES),
                            "wall_s": wall_s})


def record_run(study, directory, records, *, seed: int, commit: str, device: str) -> pathlib.Path:
  """Records the finished run in `directory` (e.g. `python -m experiments.rl` on a GPU machine, its logs copied
  back) as the study's run of `seed`, made at `commit` on `device`, so that the notebook reads it instead of
  training it. Refused before anything is written: FileExistsError (before anything is read) where that record
  exists, `ConfigChanged` unless the directory's SFT and RL configs are the study's config of that seed; ValueError
  if the run has not finished. Returns the record's path."""
  ((variant, config),) = study.configs().items()
  if records_lib.path(records, variant, seed).exists():
    raise FileExistsError(f"{records_lib.path(records, variant, seed)} exists: delete it to record this run instead")
  config = runs.with_seed(config, seed)
  directory = pathlib.Path(directory)
  for part, ran in (("sft", rl_config_lib.sft_config(config)), ("rl", config)):
    saved = workdir_lib.remembered(directory / part)
    if saved is None:
      raise FileNotFoundError(f"{directory / part} has no config.json: not a run directory of experiments.rl")
    records_lib.refuse_differences(f"{directory / part} ran another config than study {study.name!r} at scale "
                                   f"{study.scale!r}, seed {seed}", records_lib.differences(saved, ran))
  run = finished_run(config, directory, variant=variant, seed=seed, wall_s=None)
  return records_lib.save(records, variant, seed, config, run, commit=commit, device=device)


NOTEBOOK = "06_rl"


def record_for_notebook(results, scale: str, directory, *, commit: str, device: str,
                        seed: int | None = None) -> pathlib.Path:
  """`record_run` into the RL notebook's records at `scale` under the results directory `results`, as the study's
  run of `seed` (default: its first)."""
  from experiments.ablations import notebook
  from experiments.configs import ablations   # here, not at the top: that module imports this one
  study = ablations.NOTEBOOKS[NOTEBOOK](scale)
  seed = study.seeds[0] if seed is None else seed
  if seed not in study.seeds:
    raise ValueError(f"seed {seed} is not one of the study's seeds {list(study.seeds)}")
  records = notebook.records_dir(pathlib.Path(results) / scale, NOTEBOOK)
  return record_run(study, directory, records, seed=seed, commit=commit, device=device)


def _curves(directory: pathlib.Path, fields) -> dict:
  logged = runs.read_history(directory)["metrics"]
  return {k: logged.get(k, [None] * len(logged["step"])) for k in ("step", *fields)}


def format_table(result: dict) -> str:
  """Held-out success before and after RL per evaluation point (mean over seeds), the change and its noise (the
  problems paired, `k3jax.rl.evaluate.paired_change`)."""
  lines = [f"held-out success ({result['eval_examples']} problems per point)   before   after   change   noise"]
  for p, s in result["success"].items():
    times = int(p.split("@")[1]) // result["train_length"]
    where = "  (the trained length)" if times == 1 else f"  ({times}x the trained length)"
    delta, noise = evaluate.paired_change(*(verdicts.heldout_outcomes(result["runs"], when, [p])
                                            for when in ("before", "after")))
    lines.append(f"{p:<44} {s['before']['mean']:6.3f} {s['after']['mean']:7.3f} {delta:+8.3f} {noise:7.3f}{where}")
  return "\n".join(lines)


def plot(result: dict, fig):
  """Four panels on `fig`: the SFT loss; held-out success before vs after RL per point (two standard errors of the
  problems' count as error bars); the reward and success of the rollouts per RL iteration; the KL to the SFT
  policy per iteration. Returns `fig`."""
  from matplotlib import ticker
  ax_sft, ax_success, ax_reward, ax_kl = fig.subplots(1, 4)
  for x in result["runs"]:
    label = f"seed {x['seed']}"
    ax_sft.plot(x["sft"]["step"], x["sft"]["loss"], lw=1, label=label)
    ax_reward.plot(x["rl"]["step"], x["rl"]["reward_mean"], marker=".", label=f"reward, {label}")
    ax_reward.plot(x["rl"]["step"], x["rl"]["success_rate"], marker=".", ls="--", label=f"success, {label}")
    ax_kl.plot(x["rl"]["step"], x["rl"]["kl"], marker=".", label=label)
  ax_sft.set(xlabel="SFT step", ylabel="training loss (nats/token)", yscale="log", title="SFT on demonstrations")
  n = result["eval_examples"] * len(result["runs"])
  width, positions = 0.38, np.arange(len(result["points"]))
  for k, when in enumerate(("before", "after")):
    p = np.array([result["success"][q][when]["mean"] for q in result["points"]])
    ax_success.bar(positions + (k - 0.5) * width, p, width, yerr=verdicts.success_error(p, n), capsize=3,
                   label="SFT policy" if when == "before" else "after RL")
  ax_success.set(xticks=positions, ylim=(0, 1), ylabel="held-out success (greedy)", title="before vs after RL")
  ax_success.set_xticklabels(result["points"], rotation=20)
  ax_reward.set(xlabel="RL iteration", ylabel="rollouts (sampled)", title="reward and success per iteration")
  ax_kl.set(xlabel="RL iteration", ylabel="KL to the SFT policy (k3)", title="KL per iteration")
  for ax in (ax_reward, ax_kl):
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  for ax in (ax_sft, ax_success, ax_reward, ax_kl):
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  return fig
