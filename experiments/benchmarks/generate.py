"""What the generation benchmark does (`bench_generate.py` parses flags and calls `run`): chunked prefill and
batched decode of a config with its own layer pattern and with every layer MLA, at several contexts and batch sizes.

Weights are random (speed does not depend on them), matrices in bf16 for inference. Per (pattern, batch) one cache
of the largest context that fits plus the decode steps, one compiled prefill chunk step and one compiled decode
loop, all compiled (`benchmark.compile_lowered`) before anything is timed; per context:
- prefill (`Settings.prefill`; off: the decode loop alone is compiled and timed): the chunk step timed at the
  first chunk and at the last (start L − chunk); a chunk's time is affine in its start (the MLA attention over the
  prefix grows linearly, the rest is constant), so the whole prefill takes n·(t_first + t_last)/2 ("est"). Where
  that estimate fits `Settings.prefill_budget_s` (and B = 1), the real chunked prefill runs ("run") and gives the
  cache decoding starts from; else the cache holds the context's length of arbitrary latents and states (decode
  speed does not depend on their values).
- decode: `decode_loop` for `Settings.decode_steps` tokens per row, greedy, no stop (timed after one untimed loop),
  each row from logits of its own (`first_logits`): rows that fed the same tokens would route to the same experts,
  and the MoE would read a few experts' weights where a real batch reads nearly all.
- profile (`Settings.profile`): at the first context, the decode loop traced once more, its device time per token by
  kind of kernel and the slowest kernels (`k3jax/train/profile.py`).
- cache: bytes of the KDA states and MLA latents at the context (per row: fixed + per-token), bytes per token;
  est. peak = parameters + the cache at this context + the compiled programs' largest working memory.
- check: at the first context, B = 1, the chunked prefill's logits after the prompt held to the anchor's error: both
  it and the full (training) forward in bf16 against the fp32 full forward of the same weights ("highest" products);
  the chunked prefill passes within `CHECK_FACTOR` times the full forward's error plus `CHECK_FLOOR`. (Two bf16 runs
  of a random-init MoE model are not comparable with each other: a rounding difference flips an expert choice and
  moves that token's output by O(1), so the full bf16 forward is itself ~0.6 away from fp32 there.)
Device times: host timer around `block_until_ready`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import generate_lib
from k3jax.model import K3Model
from k3jax.numerics import rel_err
from k3jax.train import benchmark, profile

CHECK_FACTOR, CHECK_FLOOR = 2.0, 1e-3   # the chunked prefill's error: <= factor x the full forward's + floor


@dataclasses.dataclass(frozen=True)
class Settings:
  """One run: the layer patterns (`benchmark.PATTERNS`), prompt lengths and batch sizes, the prefill tokens per chunk
  step (all rows together: chunk = chunk_tokens / B), the tokens decoded per row, the budget under which the real
  prefill runs (B = 1), the share of device memory a cache may take, whether to check the chunked prefill and
  whether to profile the decode loop."""
  patterns: tuple[str, ...]
  contexts: tuple[int, ...]
  batches: tuple[int, ...]
  chunk_tokens: int
  decode_steps: int
  prefill_budget_s: float
  memory_fraction: float
  check: bool
  profile: bool = False
  prefill: bool = True

  def __post_init__(self):
    if self.check and not self.prefill:
      raise ValueError("the check compares the chunked prefill with the full forward: it needs prefill on")
    if self.decode_steps < 2:
      raise ValueError(f"decode_steps must be >= 2 (the first token comes from the prefill), got {self.decode_steps}")
    bad = [p for p in self.patterns if p not in benchmark.PATTERNS]
    if bad:
      raise ValueError(f"patterns {bad}: each must be one of {sorted(benchmark.PATTERNS)}")


# The tiny config's sizes for a CPU run (`experiments/configs/tiny.py`): a prompt no chunk divides, B = 1 and 2.
SMALL = dict(contexts=(64, 160), batches=(1, 2), chunk_tokens=64, decode_steps=4)


@dataclasses.dataclass
class Programs:
  """One (pattern, batch): the model (bf16 matrices), the contexts it runs, its cache length, chunk and compiled
  calls (`step` None: decode only)."""
  pattern: str
  model_cfg: object
  B: int
  chunk: int
  max_len: int
  contexts: list
  model: object
  step: object = None
  loop: object = None
  forward: object = None          # the full forward at the first context (B = 1, for the check)
  reference: object = None        # the same in fp32 on the same weights (`fp32_twin`), "highest" products
  compile_s: float = 0.0
  work_bytes: int = 0


KEEP_FP32 = ("A_log", "dt_bias")   # the KDA gate's parameters, kept as trained


def inference_model(model_cfg, seed: int = 0):
  """A random-init K3Model with its matrices in bf16 (`with_bf16_matrices`)."""
  return with_bf16_matrices(nnx.jit(lambda: K3Model(model_cfg, rngs=nnx.Rngs(seed)))())


def with_bf16_matrices(module):
  """`module` with its matrices in bf16; vectors, norms and the KDA gate's parameters (KEEP_FP32) stay as they are."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  keep = lambda path: any(getattr(k, "key", None) in KEEP_FP32 for k in path)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x if x.ndim < 2 or keep(path) else x.astype(jnp.bfloat16), params)
  return nnx.merge(graphdef, params, rest)


def fp32_twin(model, model_cfg):
  """A model of `model_cfg`'s layout computing in fp32 on `model`'s weights (its bf16 matrices cast up)."""
  cfg = model_cfg.copy_and_resolve_references()
  cfg.unlock()
  cfg.dtype = "float32"
  twin = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(twin)
  state = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                       nnx.state(model))
  return nnx.merge(graphdef, state)


def cache_line(model) -> tuple[int, int]:
  """(fixed bytes per row, bytes per token per row) of the generation cache: bytes(L) = B·(fixed + L·per_token)."""
  size = lambda L: generate_lib.cache_bytes(jax.eval_shape(lambda: generate_lib.init_cache(model, 1, L)))
  per_token = size(2) - size(1)
  return size(1) - per_token, per_token


def memory_stat(name: str) -> int | None:
  """The first device's memory statistic `name` (None where the backend keeps none, e.g. a CPU)."""
  stats = jax.devices()[0].memory_stats()
  return stats and stats.get(name)


def plan(model, model_cfg, pattern, B, contexts, chunk_tokens, steps, memory_fraction) -> tuple[Programs, list]:
  """`pattern`'s Programs at batch B over the contexts whose cache fits, and a row for each skipped one."""
  fixed, per_token = cache_line(model)
  limit, params = memory_stat("bytes_limit"), generate_lib.cache_bytes(nnx.state(model))
  fits, skipped = [], []
  for L in contexts:
    need = B * (fixed + (L + steps) * per_token)
    if limit and need + params > memory_fraction * limit:
      skipped.append({"pattern": pattern, "B": B, "L": L, "skipped": f"cache {need / 2 ** 30:.0f} GiB"})
    else:
      fits.append(L)
  chunk = max(1, min(chunk_tokens // B, max(fits, default=1)))
  return Programs(pattern, model_cfg, B, chunk, max(fits, default=0) + steps, fits, model), skipped


def compile_all(programs: list[Programs], steps: int, check: bool, prefill: bool = True) -> None:
  """Lowers every program (tracing is Python: one after another), then compiles them all
  (`benchmark.compile_lowered`); without `prefill` the decode loops alone."""
  lowered = []
  for p in programs:
    start = time.perf_counter()
    calls = generate_lib.lower(p.model, p.B, p.max_len, chunk=p.chunk if prefill else None, max_new=steps)
    forward = reference = None
    if check and p.B == 1:
      tokens = jax.ShapeDtypeStruct((1, p.contexts[0]), jnp.int32)
      forward = full_last_logits.lower(*nnx.split(p.model), tokens)
      with jax.default_matmul_precision("highest"):
        reference = full_last_logits.lower(*nnx.split(fp32_twin(p.model, p.model_cfg)), tokens)
    lowered.append((p, (*calls, forward, reference), time.perf_counter() - start))

  roles = ("step", "loop", "forward", "reference")
  compiled = benchmark.compile_lowered({(i, role): program for i, (_, calls, _) in enumerate(lowered)
                                           for role, program in zip(roles, calls)})
  for i, (p, _, trace_s) in enumerate(lowered):
    p.step, p.loop, p.forward, p.reference = (compiled[(i, role)][0] for role in roles)
    p.compile_s = trace_s + max(compiled[(i, role)][1] for role in roles)
    p.work_bytes = max(_temp_bytes(p.step) if p.step else 0, _temp_bytes(p.loop))
    print(f"compiled {p.pattern} B={p.B} in {p.compile_s:.0f} s", flush=True)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def full_last_logits(graphdef, state, tokens_BT):
  """The full (training) forward's logits at the last position."""
  return nnx.merge(graphdef, state)(tokens_BT)[0][:, -1]


def _temp_bytes(compiled) -> int:
  mem = compiled.memory_analysis()
  return 0 if mem is None else int(mem.temp_size_in_bytes)


def tokens_for(B, L, seed=0):
  """Random byte-range tokens `[B, L]` (their values do not change the speed)."""
  return jax.random.randint(jax.random.PRNGKey(seed), (B, L), 0, 256, jnp.int32)


def at_length(cache, L: int):
  """The cache with every row's length set to L (its contents left as they are)."""
  return dataclasses.replace(cache, lengths_B=jnp.full(cache.lengths_B.shape, L, jnp.int32))


def time_chunk(p: Programs, cache, start: int):
  """(seconds of one chunk step with every row's cache at `start` tokens, the cache after it)."""
  cache = jax.block_until_ready(at_length(cache, start))
  t0 = time.perf_counter()
  logits, cache = generate_lib.prefill_chunked(p.model, tokens_for(p.B, p.chunk, start), chunk=p.chunk, cache=cache,
                                               step=p.step)
  jax.block_until_ready(logits)
  return time.perf_counter() - t0, cache


def decode(p: Programs, logits_BV, cache, steps: int):
  """`p`'s compiled decode loop, `steps` tokens per row from the cache as it is: (tokens, tokens per row, the
  cache)."""
  return generate_lib.decode_loop(p.model, logits_BV, cache, jax.random.PRNGKey(0), max_new=steps, loop=p.loop)


def first_logits(p: Programs):
  """Random logits, a row of its own for each row: the rows then sample different first tokens, and differ after."""
  return jax.random.normal(jax.random.PRNGKey(1), (p.B, p.model.vocab_size), jnp.float32)


def time_decode(p: Programs, cache, L: int, steps: int):
  """(seconds of a decode loop of `steps` tokens per row from length L, after an untimed one; the cache)."""
  logits = first_logits(p)
  for _ in range(2):
    cache = jax.block_until_ready(at_length(cache, L))
    t0 = time.perf_counter()
    out, got, cache = decode(p, logits, cache, steps)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    if int(got.min()) != steps:
      raise RuntimeError(f"decode stopped early: {np.asarray(got)}")
  return seconds, cache


def profile_decode(p: Programs, cache, L: int, steps: int):
  """(the decode loop's device time per token by kind of kernel, `profile.breakdown` plus its slowest kernels; the
  cache), traced over one loop of `steps` tokens from length L."""
  logits, cache = first_logits(p), jax.block_until_ready(at_length(cache, L))
  outputs = []          # the cache is donated: the loop's new one is kept from inside the trace

  def run():
    outputs.append(decode(p, logits, cache, steps))
    return outputs[0]
  kernels = profile.trace_kernels(run, calls=steps - 1, hlo_text=p.loop.as_text())
  return {**profile.breakdown(kernels), "kernels": [dataclasses.asdict(k) for k in kernels[:25]]}, outputs[0][2]


def measure(p: Programs, steps: int, budget_s: float, trace: bool = False) -> list[dict]:
  """A row per context of `p` (see the module docstring), each printed as a table line as it comes; an error at
  one context (out of memory) is that row's "error"."""
  fixed, per_token = cache_line(p.model)
  params = generate_lib.cache_bytes(nnx.state(p.model))
  rows = []
  cache = generate_lib.init_cache(p.model, p.B, p.max_len)
  for i, L in enumerate(p.contexts):
    row = {"pattern": p.pattern, "B": p.B, "L": L, "chunk": p.chunk, "compile_s": p.compile_s}
    try:
      if p.step is not None:
        cache = measure_prefill(p, cache, L, budget_s, row, check_here=i == 0)
      seconds, cache = time_decode(p, cache, L, steps)
      ms = 1e3 * seconds / (steps - 1)                           # the first token comes from the prefill's logits
      row.update(decode_ms_per_step=ms, decode_tok_s_per_seq=1e3 / ms, decode_tok_s=p.B * 1e3 / ms)
      if trace and i == 0:
        row["decode_profile"], cache = profile_decode(p, cache, L, steps)
        kernels = [profile.Kernel(**k) for k in row["decode_profile"]["kernels"]]
        print(f"decode profile of {p.pattern} B={p.B} at L={L}, per token:\n"
              f"{profile.format_breakdown(row['decode_profile'], kernels)}", flush=True)
    except Exception as e:  # noqa: BLE001 (out of memory at one context is a row, not the end of the run)
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      traceback.print_exc()
      cache = generate_lib.init_cache(p.model, p.B, p.max_len)
    cache_b = p.B * (fixed + L * per_token)
    row.update(cache_gib=cache_b / 2 ** 30, cache_bytes_per_token=cache_b / (p.B * L),
               est_peak_gib=(params + p.B * (fixed + L * per_token) + p.work_bytes) / 2 ** 30,
               process_peak_gib=(memory_stat("peak_bytes_in_use") or 0) / 2 ** 30)
    rows.append(row)
    print(format_table(rows[-1:]).splitlines()[-1], flush=True)
  return rows


def measure_prefill(p: Programs, cache, L: int, budget_s: float, row: dict, check_here: bool):
  """The prefill's fields of `row` at context L (the estimate; the real prefill at B = 1 within `budget_s`, checked
  when `check_here` and compiled for it); returns the cache to decode from."""
  _, cache = time_chunk(p, cache, 0)                         # warm
  t_first, cache = time_chunk(p, cache, 0)
  t_last, cache = time_chunk(p, cache, max(0, L - p.chunk))
  estimate = -(-L // p.chunk) * (t_first + t_last) / 2
  row.update(prefill_est_s=estimate, prefill_est_tok_s=p.B * L / estimate, chunk_first_ms=1e3 * t_first,
             chunk_last_ms=1e3 * t_last)
  if p.B != 1 or estimate > budget_s:
    return cache
  del cache
  tokens = tokens_for(p.B, L, seed=L)
  say = lambda done, total: (done == total or done % (8 * p.chunk) == 0) and print(
      f"  prefill {p.pattern} B={p.B}: {done}/{total} dispatched", flush=True)
  t0 = time.perf_counter()
  logits, cache = generate_lib.prefill_chunked(p.model, tokens, chunk=p.chunk, max_len=p.max_len, progress=say,
                                               step=p.step)
  jax.block_until_ready(logits)
  seconds = time.perf_counter() - t0
  row.update(prefill_s=seconds, prefill_tok_s=p.B * L / seconds)
  if p.forward is not None and check_here:
    row.update(check(logits, p.forward(nnx.state(p.model), tokens),
                     p.reference(nnx.state(fp32_twin(p.model, p.model_cfg)), tokens)))
  return cache


def check(chunked_BV, full_BV, reference_BV) -> dict:
  """The check's fields: the chunked prefill's and the full forward's errors against the fp32 reference, and
  whether the chunked one is within CHECK_FACTOR × the full one's + CHECK_FLOOR."""
  ours, anchor = rel_err(chunked_BV, reference_BV), rel_err(full_BV, reference_BV)
  return {"check_rel_err": ours, "check_anchor_err": anchor, "check_ok": ours <= CHECK_FACTOR * anchor + CHECK_FLOOR}


def format_table(rows) -> str:
  """The rows as a table: prefill tokens/s ("run" or "est"), decode, the cache and the estimated peak."""
  head = (f"{'pattern':<7} {'L':>8} {'B':>3} {'prefill tok/s':>14} {'how':>4} {'decode ms':>9} {'tok/s/seq':>9} "
          f"{'cache GiB':>9} {'B/token':>8} {'peak GiB':>8}")
  lines = [head]
  for r in rows:
    if "skipped" in r:
      lines.append(f"{r['pattern']:<7} {r['L']:>8} {r['B']:>3}  skipped: {r['skipped']}")
      continue
    if "error" in r and "decode_ms_per_step" not in r:
      lines.append(f"{r['pattern']:<7} {r['L']:>8} {r['B']:>3}  error: {r['error'][:70]}")
      continue
    run = "prefill_tok_s" in r
    tok_s = r["prefill_tok_s"] if run else r.get("prefill_est_tok_s", float("nan"))
    how = "run" if run else "est" if "prefill_est_tok_s" in r else "-"
    lines.append(f"{r['pattern']:<7} {r['L']:>8} {r['B']:>3} {tok_s:>14,.0f} {how:>4} "
                 f"{r['decode_ms_per_step']:>9.3f} {r['decode_tok_s_per_seq']:>9.1f} {r['cache_gib']:>9.3f} "
                 f"{r['cache_bytes_per_token']:>8.0f} {r['est_peak_gib']:>8.1f}")
  return "\n".join(lines)


def summary(rows) -> list[str]:
  """The issue's bars, from the rows: cache bytes per token, decode ratios, the mix's 1M prefill."""
  ok = {(r["pattern"], r["L"], r["B"]): r for r in rows if "decode_ms_per_step" in r}
  lines = []
  longest = {p: max((r for (q, _, _), r in ok.items() if q == p), key=lambda r: r["L"], default=None)
             for p in ("config", "mla")}
  if longest["config"] and longest["mla"]:
    a, b = (longest[p]["cache_bytes_per_token"] for p in ("config", "mla"))
    lines.append(f"cache bytes/token at the longest context: mix {a:.0f}, all-MLA {b:.0f}: {a / b:.1%} (bar <= 30%)")
  for (p, L, B), r in sorted(ok.items()):
    if p == "config" and ("mla", L, B) in ok:
      ratio = ok[("mla", L, B)]["decode_ms_per_step"] / r["decode_ms_per_step"]
      bar = " (bar >= 3x at 256K)" if L == 262144 else ""
      lines.append(f"decode L={L} B={B}: mix {ratio:.2f}x all-MLA's tokens/s{bar}")
  Ls = sorted({L for (p, L, _) in ok if p == "config"})
  for B in sorted({B for (_, _, B) in ok}):
    if len(Ls) > 1 and ("config", Ls[0], B) in ok and ("config", Ls[-1], B) in ok:
      slow = ok[("config", Ls[-1], B)]["decode_ms_per_step"] / ok[("config", Ls[0], B)]["decode_ms_per_step"]
      lines.append(f"mix decode B={B}: {Ls[-1]} is {slow:.2f}x slower per step than {Ls[0]} (bar <= 2x at 1M vs 8K)")
  runs = [r for r in rows if r["pattern"] == "config" and "prefill_tok_s" in r]
  if runs:
    r = max(runs, key=lambda r: r["L"])
    lines.append(f"mix: longest real prefill {r['L']} tokens in {r['prefill_s']:.1f} s, then decoded")
  for r in rows:
    if "check_ok" in r:
      lines.append(f"check {r['pattern']}: vs the fp32 forward, chunked prefill rel err {r['check_rel_err']:.1e}, bf16 "
                   f"full forward {r['check_anchor_err']:.1e} ({'ok' if r['check_ok'] else 'FAILED'})")
  return lines


def run(config, settings: Settings, save: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Every (pattern, batch, context) row of `config` under `settings`, sorted by (pattern, B, L); `save(rows so
  far)` after each (pattern, batch)."""
  print(f"devices: {jax.devices()}", flush=True)
  programs, rows = [], []
  for pattern in settings.patterns:
    model_cfg = benchmark.variant(config, pattern=pattern).model
    model = inference_model(model_cfg)
    for B in settings.batches:
      p, skipped = plan(model, model_cfg, pattern, B, sorted(settings.contexts), settings.chunk_tokens,
                        settings.decode_steps, settings.memory_fraction)
      rows += skipped
      if p.contexts:
        programs.append(p)
  start = time.perf_counter()
  compile_all(programs, settings.decode_steps, settings.check, settings.prefill)
  print(f"compiled {len(programs)} (pattern, batch) pairs in {time.perf_counter() - start:.0f} s", flush=True)
  for p in programs:
    rows += measure(p, settings.decode_steps, settings.prefill_budget_s, settings.profile)
    if save is not None:
      save(rows)
    p.model = p.step = p.loop = p.forward = None                 # free the device memory before the next
  rows.sort(key=lambda r: (r["pattern"], r["B"], r["L"]))
  if save is not None:
    save(rows)
  return rows


def failed_rows(rows) -> list[dict]:
  """The rows whose check failed or that hold an error."""
  return [r for r in rows if r.get("check_ok") is False or ("error" in r)]
