"""Config variants trained side by side, and what their runs logged.

`train_variants({"a": config_a, "b": config_b}, workdir, seeds=(0, 1))` trains each config once per seed with
`k3jax.train.trainer.Run`, in `workdir/<name>/seed_<s>/` (a run directory: config.json, metrics.jsonl, eval.jsonl,
checkpoints), and returns every run's history. Calling it again reuses the finished runs and continues unfinished
ones; a directory that holds a run of another config is an error, raised before anything trains. With `records`,
each finished run's history (and what `measure` took from its model) is also kept as one small JSON file
(`experiments.ablations.records`), which a later call, on this machine or another, reads instead of training.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import re
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import ml_collections
import numpy as np

from experiments.ablations import records as records_lib
from k3jax.data import pipeline
from k3jax.train import batches, benchmark, checkpoint, evaluate, metrics as metrics_lib
from k3jax.train import stages as stages_lib
from k3jax.train import state as state_lib
from k3jax.train import trainer
from k3jax.train import workdir as workdir_lib

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
override = workdir_lib.override   # a study's variants are overrides of its base config


@dataclasses.dataclass(frozen=True)
class Study:
  """One ablation at one scale: a base config, its variants as dotted overrides of it (e.g. {"softplus":
  {"model.kda.gate": "softplus"}}), the seeds, the study's own settings (timed shapes, lengths, ...), and `setup`,
  which writes what the configs read besides the built-in data (e.g. token shards), when they read such files."""
  name: str
  scale: str
  base: ml_collections.ConfigDict
  variants: Mapping[str, Mapping]
  seeds: tuple[int, ...] = (0,)
  settings: Mapping = dataclasses.field(default_factory=dict)
  setup: Callable[[], object] | None = None

  def configs(self) -> dict[str, ml_collections.ConfigDict]:
    """{variant: the base config with the variant's overrides}, ready to train (`setup` has run)."""
    if self.setup is not None:
      self.setup()
    return {name: override(self.base, dict(o)) for name, o in self.variants.items()}

  def describe(self, hours: Mapping[str, float | None] | None = None) -> str:
    """The study as text: the base model and training sizes, each variant's overrides and training tokens, and
    with `hours` ({variant: estimated hours of one run, or None}) those estimates and their total over seeds."""
    c, m = self.base, self.base.model
    lines = [f"{self.name} at scale {self.scale!r}, seeds {list(self.seeds)}",
             f"model: d={m.d_model}, {_layers(m)} {'/'.join(m.layer_pattern)} (last: {m.last_layer}), "
             f"MoE {'on' if m.moe.enabled else 'off'}, residual {m.residual.mode}, {m.dtype}",
             f"training: lr {c.optimizer.lr}, data mix {dict((k, v) for k, v in c.data.mix.items() if v)}"]
    for name, config in self.configs().items():
      stages = ", ".join(f"{s.seq_len}x{s.batch_size}x{s.steps}" for s in stages_lib.training_plan(config).stages)
      overrides = ", ".join(f"{k}={v}" for k, v in self.variants[name].items() if k not in ("stages", "steps"))
      estimate = "" if hours is None else \
          "; hours a run: " + ("not estimated" if hours.get(name) is None else f"≈ {hours[name]:.1f}")
      lines.append(f"  {name}: {overrides or 'the base config'}; stages (T x rows x steps) {stages}; "
                   f"{train_tokens(config):,} tokens{estimate}")
    if hours is not None:
      known = [h for h in hours.values() if h is not None]
      lines.append("  hours, every variant and seed: " + (
          f"≈ {len(self.seeds) * sum(known):.1f}" + ("" if len(known) == len(self.variants) else
                                                      " (the variants estimated only)") if known else
          "not estimated (no training throughput recorded at the GPU scale: run it there first)"))
    lines += [f"  {k}: {v}" for k, v in self.settings.items()]
    return "\n".join(lines)

  def summary(self) -> str:
    """One line for a results table: the model, steps and tokens per variant, seeds."""
    m, configs = self.base.model, self.configs().values()
    steps = "/".join(str(n) for n in sorted({c.steps for c in configs}))
    tokens = "/".join(f"{t / 1e6:.2f}M" if t >= 1e6 else f"{t:,}" for t in sorted({train_tokens(c) for c in configs}))
    moe = f", MoE {m.moe.num_experts} experts top-{m.moe.top_k}" if m.moe.enabled else ""
    per_step = "/".join(f"{t:,}" for t in sorted({s.seq_len * s.batch_size for c in configs
                                                  for s in stages_lib.training_plan(c).stages}))
    return (f"d={m.d_model}, {_layers(m)}{moe}, residual {m.residual.mode}, {m.dtype}; {steps} steps of "
            f"{per_step} tokens, {tokens} tokens per variant; seeds {', '.join(map(str, self.seeds))}")


def _layers(model_cfg) -> str:
  return f"{model_cfg.num_layers} layer" + ("" if model_cfg.num_layers == 1 else "s")


def train_tokens(config) -> int:
  """Tokens a config trains on: the sum over its stages of steps × rows × sequence length."""
  return stages_lib.training_plan(config).tokens


def run_dir(workdir, name: str, seed: int) -> pathlib.Path:
  return pathlib.Path(workdir) / name / f"seed_{seed}"


def with_seed(config, seed: int):
  c = copy.deepcopy(config)
  c.seed = seed
  return c


def train_variants(configs: Mapping, workdir, *, seeds: Sequence[int] = (0,), precompile: bool = False,
                   records=None, measure: Callable | None = None) -> dict[str, list[dict]]:
  """Trains every config of `configs` ({name: config}) once per seed (the seed replaces `config.seed`); returns
  {name: [history of each seed, in `seeds` order]}, each history as `read_history` gives it plus `wall_s` (the
  time spent on the run by this call, or by the call that recorded it; compilation included, small for a run found
  finished in its directory). `precompile`: first compile the unfinished variants' train steps all at once
  (`precompile_variants`; needs the persistent cache).
  `records`: a directory of finished runs' records (`experiments.ablations.records`); a run recorded there is not
  trained and its history is the record's, a run trained here is recorded as soon as it finishes. `measure(name,
  seed, run directory)`: what to take from a run's trained model (a JSON-able dict, or None) right after it trains,
  while its checkpoint is at hand; it goes into the history and the record as "measured"."""
  if not configs:
    raise ValueError("configs is empty")
  bad = [n for n in configs if not isinstance(n, str) or not _NAME.match(n)]
  if bad:
    raise ValueError(f"variant names must be directory names (letters, digits, _ . -), got {bad}")
  seeds = list(seeds)
  if not seeds or len(set(seeds)) != len(seeds) or not all(isinstance(s, int) and s >= 0 for s in seeds):
    raise ValueError(f"seeds must be distinct non-negative ints, got {seeds}")
  plan = [(name, s, run_dir(workdir, name, s), with_seed(c, s)) for name, c in configs.items() for s in seeds]
  for _, _, directory, c in plan:   # every check before anything trains
    workdir_lib.check_resume(directory, c)
  recorded = records_lib.load_plan(records, [(name, s, c) for name, s, _, c in plan])
  if precompile:   # every seed of a variant runs the same programs
    todo = {name: configs[name] for name, s, directory, c in plan
            if (name, s) not in recorded and not finished(directory, c)}
    if todo:
      print(f"precompiling {len(todo)} variants, one process each: {sorted(todo)}", flush=True)
      print(precompile_variants(todo), flush=True)
  out = {name: [] for name in configs}
  built = {}   # the variant's first Run: its seeds share its programs, traced and loaded once
  for name, s, directory, c in plan:
    if (name, s) in recorded:
      print(f"== {name}, seed {s}: recorded in {records_lib.path(records, name, s)}", flush=True)
      out[name].append(recorded[name, s])
      continue
    print(f"== {name}, seed {s}: {directory}", flush=True)
    start = time.perf_counter()
    run = built[name] = trainer.Run(c, programs=built.get(name))
    run.train(directory)
    history = {**read_history(directory), "wall_s": time.perf_counter() - start}
    if measure is not None:
      history["measured"] = records_lib.plain(measure(name, s, directory))
    if records is not None:
      records_lib.save(records, name, s, c, history)
    out[name].append(history)
  return out


def finished(directory, config) -> bool:
  """Whether `directory` holds a run of `config` that has evaluated its last stage."""
  directory = pathlib.Path(directory)
  if not (directory / workdir_lib.CONFIG).exists():
    return False
  workdir_lib.check_resume(directory, config)
  evals = metrics_lib.read_jsonl(directory / metrics_lib.EVALS)
  return bool(evals) and evals[-1]["step"] == stages_lib.training_plan(config).steps


def read_history(directory) -> dict:
  """{"metrics": {field: [value per logged step]}, "evals": [evaluation records]} of a run directory; a field
  missing from a record (e.g. MoE metrics of a dense model) reads as None there."""
  directory = pathlib.Path(directory)
  records = metrics_lib.read_jsonl(directory / metrics_lib.METRICS)
  if not records:
    raise FileNotFoundError(f"{directory / metrics_lib.METRICS} has no records: the run has not logged a step")
  fields = list(dict.fromkeys(k for r in records for k in r))
  return {"metrics": {k: [r.get(k) for r in records] for k in fields},
          "evals": metrics_lib.read_jsonl(directory / metrics_lib.EVALS)}


def trained_model(directory, *, stage: int | None = None, step: int | None = None, overrides: dict | None = None):
  """(config, model) of a run's checkpoint (default: the newest usable step of its last stage), as `k3jax.load`
  gives them but with `overrides` of the saved config (as in `trainer.restore`, e.g. {"model.remat": "full"}: the
  parameters do not depend on it); the model is on one device."""
  r = trainer.restore(directory, stage=stage, step=step, overrides=overrides, mesh="data:1,expert:1")
  return r.config, state_lib.merge(r.spec.graphdef, r.state)


def summarize(histories: Mapping[str, list[dict]]) -> dict[str, dict]:
  """Per variant of `train_variants`' result: its logged steps, every seed's loss curve and wall time, and over
  seeds the spread of the last evaluation's held-out loss (None where it was not measured) and task accuracies
  ({"task@length": spread}), of the mean training loss over the last 20% of the steps, and of the training
  tokens/s over the second half."""
  out = {}
  for name, hs in histories.items():
    final = [h["evals"][-1] if h["evals"] else {} for h in hs]
    heldout = [e.get("heldout_loss") for e in final]
    out[name] = {"step": hs[0]["metrics"]["step"], "loss": [h["metrics"]["loss"] for h in hs],
                 "heldout_loss": None if None in heldout else spread(heldout),
                 "accuracy": {k: spread(e["accuracy"][k] for e in final) for k in final[0].get("accuracy", {})},
                 "tail_loss": spread(tail_mean(h["metrics"]["loss"], 0.2) for h in hs),
                 "tokens_per_s": spread(tail_mean(h["metrics"]["tokens_per_s"], 0.5) for h in hs),
                 "wall_s": [h["wall_s"] for h in hs]}
  return out


def plot_losses(summary: Mapping[str, dict], ax, *, title: str):
  """The training loss against the step of each variant of `summarize`'s result (the mean over seeds) on `ax`."""
  for name, r in summary.items():
    ax.plot(r["step"], np.mean(r["loss"], axis=0), label=f"{name} (mean of {len(r['loss'])})", lw=1)
  ax.set(xlabel="step", ylabel="training loss (nats/token)", yscale="log", title=title)
  ax.legend()
  ax.grid(alpha=0.3)
  return ax


def spread(values) -> dict:
  """Mean, sample standard deviation (None for one value), min, max and count of a list of numbers."""
  x = np.asarray([float(v) for v in values])
  if x.size == 0:
    raise ValueError("spread of no values")
  return {"mean": float(x.mean()), "std": float(x.std(ddof=1)) if x.size > 1 else None,
          "min": float(x.min()), "max": float(x.max()), "n": int(x.size)}


def tail_mean(values, fraction: float = 0.5) -> float:
  """Mean of the last `fraction` of `values` (None entries dropped; the last ceil(n·fraction), at least one): a
  steadier end-of-run figure than the last value."""
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
  x = [float(v) for v in values if v is not None]
  if not x:
    raise ValueError("tail_mean of no values")
  return float(np.mean(x[min(int(len(x) * (1 - fraction)), len(x) - 1):]))


def precompile_variants(configs: Mapping, *, timeout_s: float = 3600.0,
                        workers: int | None = None) -> dict[str, float | str]:
  """Compiles every program that training `configs` ({name: config}) with `train_variants` runs, whatever the
  seed: the init (one program for every seed), every stage's train step and every evaluation program
  (`programs`), one process per config, all at once (at most `workers`, default one per CPU), into JAX's
  persistent compilation cache (which must be on: `jax_compilation_cache_dir`). `train_variants` then finds them
  compiled instead of compiling them one after another (a GPU train step takes minutes). Returns {name: compile
  seconds, or the error text of a config whose process failed (its run then compiles as usual)}."""
  cache_dir = jax.config.jax_compilation_cache_dir
  if not cache_dir:
    raise ValueError("precompile needs JAX's persistent compilation cache: set jax_compilation_cache_dir first "
                     "(experiments.harness.enable_compilation_cache)")
  names = list(configs)
  tasks = [configs[n] for n in names]
  # The processes read these at import: the cache, and (on a GPU) allocating only what each one uses.
  env = {"JAX_COMPILATION_CACHE_DIR": str(cache_dir), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  out = {}
  try:
    results = benchmark.side_by_side(tasks, _compile_programs, timeout_s=timeout_s,
                                     workers=min(len(names), workers or os.cpu_count() or 1))
    # A config whose process failed or did not finish in time is reported; its run then compiles as usual.
    for n, r in zip(names, results):
      out[n] = f"ProcessFailed: {r}" if isinstance(r, benchmark.ProcessFailed) else r
  except TimeoutError as e:
    out.update({n: f"TimeoutError: {e}" for n in names if n not in out})
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k)
      else:
        os.environ[k] = v
  return out


def programs(run: trainer.Run) -> list[tuple[str, object, tuple]]:
  """(label, jitted function, arguments to lower it with) of every program a run of `run.config` compiles after
  its init: each stage's train step on that stage's batches, and the evaluation step on each batch shape
  `evaluate.evaluate` feeds it at the end of the stage (held-out rows at the stage's length, each task at each
  evaluation length)."""
  config, e = run.config, run.config.eval
  sharding = batches.rows_sharding(run.mesh)
  out = []
  for stage in run.stages:
    out.append((f"train {stage.batch_size}x{stage.seq_len}", run.train_step, (run.abstract, run.batch(stage, 0))))
    shapes = []
    if e.batches:
      heldout = pipeline.Mixture(config.data, stage.seq_len, pipeline.derive_seed(config.seed, 0, "heldout"),
                                 vocab_size=config.model.vocab_size, split="heldout")
      shapes.append((f"eval heldout {e.batch_size}x{stage.seq_len}", heldout.rows(0, e.batch_size)))
    seed = pipeline.derive_seed(config.seed, 0, "tasks")
    for name in evaluate.eval_tasks(config) if e.examples else ():
      for length in evaluate.eval_lengths(config, stage.seq_len):
        shapes.append((f"eval {name} {e.batch_size}x{length}", evaluate.task_rows(name, seed, 0, e.batch_size,
                                                                                 length)))
    out += [(label, run.eval_step, (run.abstract, batches.to_device(rows, sharding))) for label, rows in shapes]
  return out


def _compile_programs(config) -> float:
  """Compiles the init, `programs` of `config` and the checkpoints' fingerprint of the state (in a process of
  `precompile_variants`)."""
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)   # keep every program, however quick
  start = time.perf_counter()
  run = trainer.Run(config)
  init = run.init_program.lower(run.seed).compile()   # one program for every seed
  checkpoint.fingerprint(init(run.seed))   # compiles what every checkpoint save runs on the state
  done = set()
  for _, fn, args in programs(run):
    key = (id(fn), str(jax.tree.map(lambda x: (x.shape, x.dtype), args[1])))
    if key not in done:   # tasks at the same length share the eval program
      done.add(key)
      fn.lower(*args).compile()
  seconds = time.perf_counter() - start
  print(f"compiled {len(done)} programs and the init in {seconds:.0f} s", flush=True)
  return seconds
