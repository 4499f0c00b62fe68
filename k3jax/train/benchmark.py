"""Training throughput and scaling: the jitted train step of config variants (sequence length, layer pattern,
mesh), compiled ahead of time, one process per variant and all at once (a GPU train step of `small` takes ~5
minutes to compile), then measured one variant at a time on rows of the config's data mixture.

Compiling side by side has two forms: `side_by_side` traces and compiles each task in a process of its own
(tracing is Python under the GIL; `measure_in_turn` is it for train steps, the studies' `precompile_variants` for
their programs), and threads (`background.Background`; `compile_lowered` for programs already lowered, on a GPU;
the RL run's compile-ahead for its programs): XLA compiles outside the GIL."""
from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import gzip
import multiprocessing
import os
import queue as queue_lib
import time
import traceback
from typing import Any, Callable, Mapping, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config as config_lib
from k3jax.train import background, flops, profile, trainer, workdir as workdir_lib
from k3jax.train.stages import training_plan

PATTERNS = {"config": None, "mla": ("mla",), "kda": ("kda",)}
K = TypeVar("K")


def compile_lowered(lowered: Mapping[K, Any]) -> dict[K, tuple[Any, float]]:
  """{key: (compiled program, compile seconds)} of `lowered` ({key: a lowered program, or None}); None stays None (0
  seconds). On an accelerator all at once in threads (`background.Background`: XLA compiles outside the GIL); on a
  CPU one after another, since XLA:CPU's compile already spreads over the cores and threads beside it only contend
  for them (more CPU time in all, and the slowest program done later)."""
  def compile_one(program):
    start = time.perf_counter()
    return program and program.compile(), time.perf_counter() - start
  jobs = [functools.partial(compile_one, program) for program in lowered.values()]
  results = [job() for job in jobs] if jax.default_backend() == "cpu" else background.Background(jobs).wait()
  return dict(zip(lowered, results))


def parse_changes(text: str) -> tuple[str, dict[str, Any]]:
  """'NAME:FIELD=VALUE[,FIELD=VALUE...]' (FIELD dotted, e.g. model.remat) -> (NAME, {FIELD: VALUE}); a VALUE is read
  as a Python literal (3, 1e-3, True) and otherwise kept as a string (none, group). A ValueError for anything else."""
  name, sep, spec = text.partition(":")
  if not (name and sep and spec) or "/" in name:
    raise ValueError(f"{text!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE...] (NAME without '/')")
  changes = {}
  for item in spec.split(","):
    field, eq, value = item.partition("=")
    if not (field and eq and value):
      raise ValueError(f"{text!r}: {item!r} is not FIELD=VALUE")
    try:
      changes[field] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      changes[field] = value
  return name, changes


def variant(config, *, pattern: str = "config", seq_len: int | None = None, tokens_per_step: int | None = None,
            mesh: str | None = None, changes: Mapping[str, Any] | None = None):
  """A copy of `config` with every layer of the type `pattern` names ("config": the config's own pattern), one
  stage of `seq_len` × `tokens_per_step / seq_len` rows when `seq_len` is given, the mesh `mesh` if given, and each
  dotted field of `changes` set to its value (e.g. {"model.remat": "none"}; `parse_changes`; `workdir.override`),
  the model's config validated after."""
  if pattern not in PATTERNS:
    raise ValueError(f"pattern must be one of {sorted(PATTERNS)}, got {pattern!r}")
  c = copy.deepcopy(config)
  c.unlock()
  if seq_len is not None:
    if tokens_per_step is None or tokens_per_step % seq_len:
      raise ValueError(f"tokens_per_step={tokens_per_step} is not a multiple of seq_len={seq_len}")
    c.stages, c.seq_len, c.batch_size = (), seq_len, tokens_per_step // seq_len
  if PATTERNS[pattern] is not None:
    c.model.layer_pattern = PATTERNS[pattern]
    c.model.last_layer = PATTERNS[pattern][0]
  if mesh is not None:
    c.mesh = mesh
  c = workdir_lib.override(c, changes)
  config_lib.validate(c.model)   # a bad value fails here, before any variant compiles
  return c


def stage_lengths(config, seq_lens=None, tokens_per_step: int | None = None) -> list[tuple[int, int]]:
  """(seq_len, tokens per step) of each variant to measure: `seq_lens` at `tokens_per_step` (default: the config's
  tokens per step) when given, else the config's stages at their own tokens per step (or `tokens_per_step`)."""
  stages = training_plan(config).stages
  if seq_lens:
    return [(int(t), tokens_per_step or stages[0].seq_len * stages[0].batch_size) for t in seq_lens]
  return [(s.seq_len, tokens_per_step or s.seq_len * s.batch_size) for s in stages]


@dataclasses.dataclass
class CompiledRun:
  """A config's Run with its init and its first stage's train step compiled for that stage's batches; the step's
  seconds from tracing to compiled (`compile_s`, of which `lower_s` trace and lower) and the init's."""
  run: trainer.Run
  init: Callable[[], Any]
  step: Callable[[Any, dict], tuple[Any, dict]]
  compile_s: float
  lower_s: float = 0.0
  init_compile_s: float = 0.0
  compile_phases: list[dict] | None = None   # the step's XLA compile by phase (`profile.trace_compile`)

  @property
  def stage(self):
    return self.run.stages[0]

  def batch(self, i: int) -> dict:
    return self.run.batch(self.stage, i)


def compile_run(config, *, trace_phases: bool = False) -> CompiledRun:
  """Builds the config's Run and compiles its init and its first stage's train step ahead of time; with
  `trace_phases`, the step's XLA compile runs under the profiler and its phases are kept (`profile.trace_compile`)."""
  run = trainer.Run(config)
  start = time.perf_counter()
  init = functools.partial(run.init_program.lower(run.seed).compile(), run.seed)
  init_s = time.perf_counter() - start
  start = time.perf_counter()
  lowered = lower_step(run)
  lower_s = time.perf_counter() - start
  step, phases = profile.trace_compile(lowered.compile) if trace_phases else (lowered.compile(), None)
  seconds = time.perf_counter() - start
  print(f"compiled a variant's step in {seconds:.0f} s (trace and lower {lower_s:.0f} s; init {init_s:.0f} s)",
        flush=True)
  return CompiledRun(run, init, step, seconds, lower_s, init_s, phases)


def lower_step(run: trainer.Run):
  """The Run's first-stage train step traced and lowered on its abstract state and first batch (nothing compiled)."""
  return run.train_step.lower(run.abstract, run.batch(run.stages[0], 0))


class ProcessFailed(RuntimeError):
  """What `side_by_side` yields for a task whose process failed: its traceback's text."""


def side_by_side(tasks: Sequence, prepare: Callable, then: Callable | None = None, *, timeout_s: float = 3600.0,
                 workers: int | None = None):
  """Yields, for each of `tasks` in order, `then(prepare(task))`, or `prepare(task)` without `then`, each task in a
  process of its own, started at once (tracing and lowering are Python under the GIL, so threads would serialise
  them; at most `workers` at a time when there is no `then`). With `then`, every process first prepares (compiles),
  then they run `then` one at a time, so no timing overlaps another's compile; what `prepare` returns stays in its
  process. A task whose process fails yields a `ProcessFailed`. `prepare` and `then` must be picklable (module-level
  functions or partials of them), and so must what is yielded."""
  if then is not None and workers is not None:
    raise ValueError("side_by_side: `workers` limits processes that need no turn; with `then` all run at once")
  ctx = multiprocessing.get_context("spawn")
  # Each process allocates only what it uses, so the waiting ones leave the device to the one measuring.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  queue, turns = ctx.Queue(), [ctx.Event() for _ in tasks]
  procs = [ctx.Process(target=_side_by_side_child, args=(i, task, prepare, then, queue, turns[i]), daemon=True)
           for i, task in enumerate(tasks)]
  limit = len(procs) if workers is None else max(1, workers)
  pending, prepared, results = set(range(len(tasks))), set(), {}
  deadline = time.monotonic() + timeout_s

  def start_more():
    running = sum(1 for i in pending if procs[i].is_alive())
    for p in [p for p in procs if p.pid is None][:max(0, limit - running)]:
      p.start()

  def receive():
    """The next message; a process that died without one (killed, out of memory) is reported as failed."""
    while True:
      dead = [i for i in pending if procs[i].pid is not None and not procs[i].is_alive()]
      try:
        return queue.get(timeout=5.0)
      except queue_lib.Empty:
        if dead:
          return ("error", dead[0], f"process exited with code {procs[dead[0]].exitcode}")
        if time.monotonic() > deadline:
          raise TimeoutError(f"side_by_side: no result within {timeout_s:.0f} s") from None

  def record(kind, i, payload):
    if kind == "prepared":
      prepared.add(i)
    else:
      pending.discard(i)
      results.setdefault(i, payload if kind == "result" else ProcessFailed(payload))
      start_more()

  try:
    start_more()
    while not pending <= prepared:
      record(*receive())
    for i in range(len(tasks)):
      turns[i].set()
      while i not in results:
        record(*receive())
      yield results[i]
  finally:
    for p in procs:
      if p.pid is not None:
        p.join(timeout=30)
        if p.is_alive():
          p.kill()


def _side_by_side_child(index, task, prepare, then, queue, turn):
  try:
    prepared = prepare(task)
    if then is None:
      queue.put(("result", index, prepared))
      return
    queue.put(("prepared", index, None))
    turn.wait()
    queue.put(("result", index, then(prepared)))
  except BaseException:  # reported to the parent, which carries on with the other tasks
    queue.put(("error", index, traceback.format_exc(limit=-3)))


def measure_in_turn(configs, measure: Callable[[CompiledRun], dict], *, timeout_s: float = 3600.0,
                    trace_phases: bool = False):
  """Yields `measure(compiled run)` for each config, in order: each config traced and compiled in its own process,
  all at once, then measured one at a time (`side_by_side`). A config whose process fails yields {"error": ...}.
  `measure` must be picklable. `trace_phases`: each compile's phases are traced (`compile_run`)."""
  prepare = functools.partial(compile_run, trace_phases=trace_phases)
  for row in side_by_side(configs, prepare, measure, timeout_s=timeout_s):
    yield {"error": str(row)} if isinstance(row, ProcessFailed) else row


DOCUMENTS = ("data", "one")


def time_train_step(c: CompiledRun, *, steps: int, warmup: int, profile_steps: int = 0,
                    documents: str = "data") -> dict:
  """Tokens/s, MFU and peak memory of `steps` train steps after `warmup` untimed ones (two batches, alternated);
  with `profile_steps`, also "profile": the device time of that many more steps by kind of kernel
  (`profile.breakdown`) and every kernel, slowest first. `documents`: "data", the rows as the mixture packs them;
  "one", each row one document (segment ids all 1; tokens and targets unchanged), which is what attention costs at
  a context of the row's length."""
  if documents not in DOCUMENTS:
    raise ValueError(f"documents must be one of {DOCUMENTS}, got {documents!r}")
  stage = c.stage
  batches = [c.batch(i) for i in range(2)]
  if documents == "one":   # placed as the batch is: a host array would be copied in, and waited on, every step
    batches = [{**b, "segment_ids": jnp.ones_like(b["segment_ids"])} for b in batches]
  state = c.init()
  for i in range(warmup):
    state, m = c.step(state, batches[i % 2])
  jax.block_until_ready(state)
  start = time.perf_counter()
  for i in range(steps):
    state, m = c.step(state, batches[i % 2])
  loss = float(m["loss"])
  elapsed = time.perf_counter() - start
  traced = None
  if profile_steps:
    def run():
      nonlocal state
      for i in range(profile_steps):
        state, _ = c.step(state, batches[i % 2])
      return state
    kernels = profile.trace_kernels(run, calls=profile_steps, hlo_text=c.step.as_text())
    traced = {**profile.breakdown(kernels), "kernels": [dataclasses.asdict(k) for k in kernels]}
  del state
  tokens_per_s = steps * stage.batch_size * stage.seq_len / elapsed
  flops_token = flops.flops_per_token(c.run.config.model, stage.seq_len)
  devices = list(c.run.mesh.devices.flat)
  peak = [d.memory_stats().get("peak_bytes_in_use") for d in devices] if devices[0].memory_stats() else None
  mem = c.step.memory_analysis()
  # The process peak is a running maximum over every variant run so far; XLA's own count is this step's.
  step_bytes = mem and (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                        - mem.alias_size_in_bytes)
  return {"seq_len": stage.seq_len, "batch_size": stage.batch_size, "documents": documents,
          "step_ms": 1e3 * elapsed / steps,
          "tokens_per_s": tokens_per_s, "flops_per_token": flops_token,
          "model_tflops_per_s": tokens_per_s * flops_token / 1e12,
          "mfu": flops.mfu(tokens_per_s, flops_token, devices), "compile_s": c.compile_s, "lower_s": c.lower_s,
          "init_compile_s": c.init_compile_s, "loss": loss,
          "finite": bool(np.isfinite(loss)), "peak_gib": peak and max(peak) / 2 ** 30,
          "step_gib": step_bytes and step_bytes / 2 ** 30, **({"profile": traced} if traced else {}),
          **({"compile_phases": c.compile_phases} if c.compile_phases else {})}


def time_variants(config, *, patterns, seq_lens=None, tokens_per_step: int | None = None, steps: int, warmup: int,
                  profile_steps: int = 0, profile_compile: bool = False, changes=(("", {}),), documents=("data",),
                  on_row: Callable[[list[dict]], None] | None = None, hlo_dir: str | None = None):
  """`time_train_step` of `config` with each layer pattern of `patterns` and each of `changes` ((name, {dotted
  field: value}) pairs, as `parse_changes` gives; name "" with no changes is the config as it is) at each (seq_len,
  tokens per step) of `stage_lengths(config, seq_lens, tokens_per_step)`, every variant in its own process
  (`measure_in_turn`); prints each row (and its profiles: `profile_steps`, `profile_compile`) as it comes and calls
  `on_row(rows so far)` after each. Each variant's compiled step is timed on the rows of each of `documents` (as in
  `time_train_step`). Returns (the rows, each with "variant": its pattern, "/name" for named changes, "/documents"
  when several were; the (variant, seq_len) of the variants that failed). `hlo_dir`: each compiled step's optimized
  HLO is also written there, gzipped, as `<variant, '/' as '.'>.T<seq_len>.hlo.txt.gz` (what the profile's fusions
  hold: `profile.hlo_instructions` reads it)."""
  documents = tuple(documents)
  bad = [d for d in documents if d not in DOCUMENTS]
  if not documents or bad:
    raise ValueError(f"documents must be some of {DOCUMENTS}, got {documents}")
  changes = tuple(changes)
  if len({name for name, _ in changes}) != len(changes):
    raise ValueError(f"the changes' names must differ, got {[name for name, _ in changes]}")
  names = [(p + (f"/{name}" if name else ""), p, over, t, n) for p in patterns for name, over in changes
           for t, n in stage_lengths(config, seq_lens, tokens_per_step)]
  configs = [variant(config, pattern=p, seq_len=t, tokens_per_step=n, changes=over) for _, p, over, t, n in names]
  print(f"compiling {len(configs)} variants, one process each: "
        + ", ".join(f"{name} T={t} B={n // t}" for name, _, _, t, n in names), flush=True)
  measure = functools.partial(_time_on_each, documents=documents, steps=steps, warmup=warmup,
                              profile_steps=profile_steps, hlo=hlo_dir is not None)
  if hlo_dir is not None:
    os.makedirs(hlo_dir, exist_ok=True)
  rows, failed = [], []
  for (name, *_, seq_len, _), result in zip(names, measure_in_turn(configs, measure, trace_phases=profile_compile)):
    if "error" in result:
      failed.append((name, seq_len))
      print(f"{name} at T={seq_len} failed:\n{result['error']}", flush=True)
      continue
    if hlo_dir is not None:
      with gzip.open(os.path.join(hlo_dir, f"{name.replace('/', '.')}.T{seq_len}.hlo.txt.gz"), "wt") as f:
        f.write(result["hlo"])
    for row in result["rows"]:
      label = name + (f"/{row['documents']}" if len(documents) > 1 else "")
      rows.append({"variant": label, **row})
      print(format_table(rows[-1:]).splitlines()[-1], flush=True)
      if "profile" in row:
        kernels = [profile.Kernel(**k) for k in row["profile"]["kernels"]]
        print(f"profile of {label} at T={seq_len}, per step:\n{profile.format_breakdown(row['profile'], kernels)}",
              flush=True)
      if "compile_phases" in row and row is result["rows"][0]:   # one compile, however many row kinds
        print(f"compile of {name} at T={seq_len} by phase (summed over threads):\n"
              f"{profile.format_compile_phases(row['compile_phases'])}", flush=True)
      if on_row is not None:
        on_row(rows)
  return rows, failed


def _time_on_each(c: CompiledRun, *, documents, hlo: bool = False, **timing) -> dict:
  """{"rows": `time_train_step` of one compiled step on the rows of each of `documents`}, and with `hlo` its
  optimized HLO's text ("hlo")."""
  return {"rows": [time_train_step(c, documents=d, **timing) for d in documents],
          **({"hlo": c.step.as_text()} if hlo else {})}


def loss_curve(c: CompiledRun, *, steps: int, warmup: int = 5) -> dict:
  """The first `steps` losses of the first stage (the data and global batch do not depend on the mesh), and
  tokens/s over the steps after `warmup`."""
  stage = c.stage
  if not 0 < warmup < steps:
    raise ValueError(f"need 0 < warmup < steps, got warmup={warmup}, steps={steps}")
  if steps > stage.steps:
    raise ValueError(f"steps={steps} exceeds the first stage's {stage.steps} steps")
  state = c.init()
  metrics, start = [], None
  for i in range(steps):
    if i == warmup:
      jax.block_until_ready(state)
      start = time.perf_counter()
    state, m = c.step(state, c.batch(i))
    metrics.append({"loss": m["loss"], "grad_norm": m["grad_norm"]})
  jax.block_until_ready(state)
  elapsed = time.perf_counter() - start
  del state
  metrics = jax.device_get(metrics)
  return {"mesh": c.run.config.mesh, "devices": c.run.mesh.size, "seq_len": stage.seq_len,
          "batch_size": stage.batch_size, "compile_s": c.compile_s,
          "losses": [float(m["loss"]) for m in metrics], "grad_norms": [float(m["grad_norm"]) for m in metrics],
          "tokens_per_s": (steps - warmup) * stage.batch_size * stage.seq_len / elapsed,
          "step_ms": 1e3 * elapsed / (steps - warmup)}


def compare_curves(reference: dict, other: dict, *, tail: int = 50) -> dict:
  """How far `other`'s losses are from `reference`'s (same steps): max relative gap over all steps, mean relative
  gap and mean signed gap over the last `tail` steps, and the throughput scaling (1.0 = linear)."""
  a, b = np.asarray(reference["losses"]), np.asarray(other["losses"])
  if a.shape != b.shape:
    raise ValueError(f"the curves have {a.size} and {b.size} steps")
  rel = np.abs(b - a) / np.abs(a)
  return {"mesh": other["mesh"], "devices": other["devices"], "max_rel_gap": float(rel.max()),
          "tail_mean_rel_gap": float(rel[-tail:].mean()), "tail_mean_gap": float((b - a)[-tail:].mean()),
          "scaling": other["tokens_per_s"] / (reference["tokens_per_s"] * other["devices"] / reference["devices"])}


def format_table(rows: list[dict]) -> str:
  """The rows as a table; "loss" is the last timed step's (variants that change no arithmetic should agree to bf16
  roundoff, as the same seed and batches start them alike); "glue GB" what the glue kernels read and write a step
  (`profile.breakdown`)."""
  head = (f"{'variant':<18} {'T':>6} {'B':>4} {'step ms':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'step GiB':>9} {'peak GiB':>9} {'compile s':>9} {'glue':>6} {'glue GB':>8} {'loss':>8}")
  lines = [head]
  for r in rows:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
    step_gib = f"{r['step_gib']:.1f}" if r.get("step_gib") is not None else "-"
    glue = r.get("profile", {}).get("glue_share")
    glue = f"{glue:.0%}" if glue is not None else "-"
    glue_gb = r.get("profile", {}).get("glue_gb")
    glue_gb = f"{glue_gb:.1f}" if glue_gb else "-"
    lines.append(f"{r['variant']:<18} {r['seq_len']:>6} {r['batch_size']:>4} {r['step_ms']:>9.1f} "
                 f"{r['tokens_per_s']:>11,.0f} {r['model_tflops_per_s']:>8.2f} {mfu:>6} {step_gib:>9} {peak:>9} "
                 f"{r['compile_s']:>9.0f} {glue:>6} {glue_gb:>8} {r['loss']:>8.4f}")
  return "\n".join(lines)
