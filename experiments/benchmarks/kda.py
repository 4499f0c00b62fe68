"""What the KDA benchmarks do (`bench_kda.py` and `bench_kda_launch.py` parse flags and call this): our paths and
FLA's `chunk_kda` (the anchor) timed side by side in one process, forward and forward+backward, on the layer's fused
operator (q/k L2 norm, bounded gate, β sigmoid, KDA); the checks of `k3jax.ops.kda.testing.check_case` with FLA's
errors beside ours; each Pallas kernel alone over its options; launch variants of the forward; and the tables.

Times are device time per call: CUDA events for FLA (`triton.testing.do_bench`), back-to-back calls for JAX
(`harness.pipelined_seconds`); `host_ms` is JAX's per-call host timer around `block_until_ready`, which adds the
launch and the synchronisation. PyTorch, Triton and FLA are imported only to run the anchor.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from k3jax.ops.kda import testing
from k3jax.ops.kda.api import FUSED_INPUTS, fused_kda
from k3jax.ops.kda.gate import fused_inputs, kda_gate, l2_normalize
from k3jax.ops.kda.naive import naive_recurrent_kda
from pallas_kernels import triton_launches
from pallas_kernels.kda import KDAKernelOptions, Launch, bwd, fwd, solve_mosaic, state_mosaic
from pallas_kernels.kda.chunk import default_block_v, default_segments
from pallas_kernels.kda.options import COLS_FORMS

LOWER_BOUND = -5.0
BAR_VS_FLA = 1.25   # every output and gradient within this factor of FLA's error
IMPLS = ("recurrent", "xla", "pallas", "fla")   # and pallas:FORM, FORM one of `options.COLS_FORMS`


@dataclasses.dataclass(frozen=True)
class Settings:
  """One benchmark run. `impls`: of IMPLS, or "pallas:FORM" (the Pallas path with the backward's column pass in
  that form, timed in `variant_modes`); `fla_modes`: FLA's modes if not `modes` (its first backward compile takes
  minutes); `check`: after timing, `testing.check_case` for `check_cases` (None: all); `per_kernel`: each Pallas
  kernel alone, over other launch parameters with `sweep`, only `kernels` if given; `profile`: each
  implementation's GPU kernels by name; `options`: the Pallas kernels' options for the whole op (None: defaults)."""
  shapes: tuple[str, ...]
  impls: tuple[str, ...]
  modes: tuple[str, ...] = ("fwd", "fwdbwd")
  fla_modes: tuple[str, ...] | None = None
  variant_modes: tuple[str, ...] = ("fwdbwd",)
  dtype: str = "bfloat16"
  repeats: int = 20
  warmup: int = 3
  check: bool = False
  check_cases: tuple[str, ...] | None = None
  per_kernel: bool = False
  sweep: bool = True
  kernels: tuple[str, ...] | None = None
  profile: bool = False
  options: KDAKernelOptions | None = None

  def __post_init__(self):
    bad = [i for i in self.impls if i not in IMPLS and not (i.startswith("pallas:") and i[7:] in COLS_FORMS)]
    if bad:
      raise ValueError(f"impls {bad}: each must be one of {IMPLS} or pallas:FORM with FORM in {COLS_FORMS}")
    bad_cases = set(self.check_cases or ()) - set(testing.CHECK_CASES)
    if bad_cases:
      raise ValueError(f"check_cases {sorted(bad_cases)}: each must be one of {testing.CHECK_CASES}")


def parse_shape(shape: str) -> tuple[int, int, int, int]:
  """'BxTxHxD' -> (B, T, H, D), K = V = D."""
  parts = shape.split("x")
  if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"shape {shape!r} is not BxTxHxD with positive integers")
  return tuple(int(p) for p in parts)


def jax_fns(impl, options=None):
  """(forward, forward+backward) jitted functions of (inputs, do) for one of our implementations on `raw_inputs`:
  "recurrent", "xla", "pallas" (with `options`) or "pallas:FORM"."""
  if impl.startswith("pallas:"):
    impl, options = "pallas", dataclasses.replace(options or KDAKernelOptions(), cols_form=impl.split(":", 1)[1])
  if impl == "recurrent":
    def run(x):
      g = kda_gate(x["g_raw"], x["A_log"], x["dt_bias"], lower_bound=LOWER_BOUND)
      beta = jax.nn.sigmoid(x["beta_logits"].astype(jnp.float32)).astype(x["v"].dtype)
      return naive_recurrent_kda(l2_normalize(x["q"]), l2_normalize(x["k"]), x["v"], g, beta)[0]
  else:
    def run(x):
      return fused_kda(**{n: x[n] for n in FUSED_INPUTS}, lower_bound=LOWER_BOUND, backend=impl,
                       kernel_options=options if impl == "pallas" else None)[0]

  def forward_backward(x, do):
    # The output stays live, as in training and in FLA's `o.backward(do)`: under `jax.grad` of a loss linear in o,
    # XLA drops the forward pass (only the backward's recompute remains), which runs 5 ms short at 8x4096.
    o, pullback = jax.vjp(run, x)
    return o, pullback(do.astype(o.dtype))
  return jax.jit(run), jax.jit(forward_backward)


def jax_temp_bytes(compiled):
  """Bytes XLA allocates for one call beyond its arguments (temporaries + outputs)."""
  stats = compiled.memory_analysis()
  return None if stats is None else stats.temp_size_in_bytes + stats.output_size_in_bytes


def fla_version() -> str | None:
  """The installed fla-core's version (the anchor `fla_runner` times), or None; without importing it (or torch)."""
  try:
    return importlib.metadata.version("fla-core")
  except importlib.metadata.PackageNotFoundError:
    return None


# FLA's two gates on its own kernels: the bounded one (`safe_gate`: 16-token diagonal tiles on the tensor cores) and
# the softplus one (`-e^{A_log} softplus(·)`, unbounded: the diagonal tiles computed position by position).
FLA_GATES = {"bounded": dict(safe_gate=True, lower_bound=LOWER_BOUND), "softplus": dict(safe_gate=False)}


def fla_runner(x, do, gate: str = "bounded"):
  """FLA's chunk_kda with the gate, L2 norm and β sigmoid fused, as ANCHORS.md runs it, on `raw_inputs` `x` and
  output cotangent `do`, with `gate` (FLA_GATES): a dict of timers ("fwd", "fwdbwd": median ms by
  `triton.testing.do_bench`), peak memory ("fwdbwd_mem"), kernel profiles ("kernels") and "outputs_and_grads" (S0 ->
  as `testing.kda_outputs_and_grads`, by our names: the anchor of `testing.check_case`); None if FLA is not
  importable."""
  if gate not in FLA_GATES:
    raise ValueError(f"gate must be one of {sorted(FLA_GATES)}, got {gate!r}")
  try:
    import torch
    import triton
    from fla.ops.kda import chunk_kda as fla_chunk_kda
  except ImportError as e:
    print(f"[bench_kda] FLA not importable ({e}); skipping the anchor")
    return None
  to_t = lambda a, grad=True: torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda().to(
      torch.bfloat16 if a.dtype == jnp.bfloat16 else torch.float32).requires_grad_(grad)
  H, D = x["q"].shape[2], x["q"].shape[3]
  t = {n: to_t(x[n]) for n in ("q", "k", "v", "g_raw", "beta_logits")}
  A_log = torch.from_numpy(np.asarray(x["A_log"])).cuda().requires_grad_()
  dt_bias = torch.from_numpy(np.asarray(x["dt_bias"]).reshape(H * D)).cuda().requires_grad_()
  do_t = to_t(do, grad=False)
  fused = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
               **FLA_GATES[gate])

  def fwd():
    return fla_chunk_kda(t["q"], t["k"], t["v"], t["g_raw"], t["beta_logits"], A_log=A_log, dt_bias=dt_bias,
                         **fused)[0]

  def fwdbwd():
    fwd().backward(do_t)

  def timed(fn, no_grad):
    with torch.no_grad() if no_grad else torch.enable_grad():
      return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")

  def peak_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base

  def kernel_times(fn, no_grad, reps=10):
    """FLA's GPU kernels in one call of `fn`, by name: (name, launches per call, ms per call), slowest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad() if no_grad else torch.enable_grad():
      fn()
      torch.cuda.synchronize()
      with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
          fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count / reps, e.self_device_time_total / reps / 1e3) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])

  def outputs_and_grads(S0, cot_seed=0):
    """As `kda_outputs_and_grads` on the fused entry: (o, final state, gradients by our names) of the same random
    functional, from S0, on fresh leaves of the same inputs (the timed calls leave gradients on theirs)."""
    leaves = {n: to_t(x[n]) for n in ("q", "k", "v", "g_raw", "beta_logits")}
    gate = {"A_log": torch.from_numpy(np.asarray(x["A_log"])).cuda().requires_grad_(),
            "dt_bias": torch.from_numpy(np.asarray(x["dt_bias"]).reshape(H * D)).cuda().requires_grad_()}
    s0 = torch.from_numpy(np.asarray(S0, np.float32)).cuda().requires_grad_()
    o, S = fla_chunk_kda(*leaves.values(), **gate, initial_state=s0, output_final_state=True, **fused)
    co, cs = (torch.from_numpy(np.asarray(c)).cuda()
              for c in testing.kda_cotangents(tuple(o.shape), tuple(S.shape), cot_seed))
    ((o.float() * co).sum() + (S.float() * cs).sum()).backward()
    host = lambda a: a.detach().float().cpu().numpy()
    grads = {**{n: host(t.grad) for n, t in leaves.items()}, "A_log": host(gate["A_log"].grad),
             "dt_bias": host(gate["dt_bias"].grad).reshape(H, D), "initial_state": host(s0.grad)}
    return host(o), host(S), grads

  return dict(fwd=lambda: timed(fwd, True), fwdbwd=lambda: timed(fwdbwd, False), fwdbwd_mem=lambda: peak_bytes(fwdbwd),
              kernels={"fwd": lambda: kernel_times(fwd, True), "fwdbwd": lambda: kernel_times(fwdbwd, False)},
              outputs_and_grads=outputs_and_grads)


def model_counts(B, T, H, D, mode):
  """FLOPs (docs/design.md, KDA: ~6KV + 3CK + C² per token and head forward; backward taken as twice that) and the
  fewest bytes: forward reads the five inputs and writes o; forward+backward reads the inputs and dO and writes the
  five input gradients."""
  C, el = 64, 2
  flops = B * T * H * (6 * D * D + 3 * C * D + C * C)
  io = B * T * H * el * (4 * D + 1)  # q, k, v, g_raw, beta_logits
  out = B * T * H * el * D
  if mode == "fwd":
    return flops, io + out
  return 3 * flops, 2 * io + out


def compile_timed(jitted, args):
  """(compiled program, seconds to compile): compiling apart from the timed calls, so a slow compile (a kernel XLA's
  Triton pipeline is slow on) and a hang read apart."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def run(settings: Settings, save: Callable[[list], None] = lambda rows: None) -> list[dict]:
  """Every shape: each implementation timed in its modes, then the checks and the per-kernel times; rows of kind
  "time", "check", "kernel", "kernel_profile" and "error" (a failing implementation is a row, not fatal), passed to
  `save` as they grow."""
  rows, fla_profiles = [], []
  dtype = jnp.dtype(settings.dtype)
  print(f"[bench_kda] backend={jax.default_backend()} devices={jax.devices()}", flush=True)
  if settings.options is not None:
    print(f"[bench_kda] pallas runs with {settings.options}", flush=True)
  for shape in settings.shapes:
    B, T, H, D = parse_shape(shape)
    x, do = testing.raw_inputs(B, T, H, D, dtype)
    fla = fla_runner(x, do) if "fla" in settings.impls else None
    for impl in settings.impls:
      if impl == "fla" and fla is None:
        continue
      fns = None if impl == "fla" else jax_fns(impl, settings.options)
      modes = ((settings.fla_modes or settings.modes) if impl == "fla" else
               settings.variant_modes if impl.startswith("pallas:") else settings.modes)
      for mode in modes:
        row = dict(kind="time", shape=shape, impl=impl, mode=mode)
        try:
          if impl == "fla":
            row["ms"] = fla[mode]()
            if mode == "fwdbwd":
              row["mem_bytes"] = fla["fwdbwd_mem"]()
          else:
            fn, args = (fns[0], (x,)) if mode == "fwd" else (fns[1], (x, do))
            compiled, row["compile_s"] = compile_timed(fn, args)
            print(f"[bench_kda] {shape} {impl} {mode}: compiled in {row['compile_s']:.1f} s", flush=True)
            row["ms"] = 1e3 * harness.pipelined_seconds(compiled, *args, repeats=settings.repeats,
                                                        warmup=settings.warmup)
            row["host_ms"] = 1e3 * harness.median_seconds(compiled, *args, repeats=settings.repeats, warmup=0)
            if mode == "fwdbwd":
              row["mem_bytes"] = jax_temp_bytes(compiled)
          flops, nbytes = model_counts(B, T, H, D, mode)
          row.update(tflops=flops / row["ms"] / 1e9, gbps=nbytes / row["ms"] / 1e6)
        except Exception as e:  # a failing implementation is reported, not fatal for the others
          row["error"] = repr(e)[:400]
        rows.append(row)
        print(row, flush=True)
        save(rows)
        if settings.profile and "error" not in row:
          if impl == "fla":  # last: torch's profiler keeps CUPTI, and JAX's then cannot subscribe
            fla_profiles.append((shape, mode, fla["kernels"][mode]))
          else:
            profile_rows(rows, shape, impl, mode, lambda: harness.device_kernel_times(compiled, *args))
          save(rows)
    if "pallas" in settings.impls and (settings.check or settings.per_kernel):
      try:
        if settings.check:
          rows += check_rows(x, shape, settings, fla)
        if settings.per_kernel:
          rows += per_kernel_times(x, do, shape, settings)
      except Exception as e:
        rows.append(dict(kind="error", shape=shape, error=repr(e)[:2000]))
        print(rows[-1], flush=True)
      save(rows)
  for shape, mode, kernel_times in fla_profiles:
    profile_rows(rows, shape, "fla", mode, kernel_times)
  save(rows)
  return rows


def check_rows(x, shape, settings, fla):
  """`testing.check_case` for each case, the Pallas path in the input dtype against the XLA path in fp32, with FLA's
  errors on the fused case when `fla` (a `fla_runner`) is given: rows of kind "check", printed."""
  rows = []
  for case in settings.check_cases or testing.CHECK_CASES:
    errs, ok, fla_errs = testing.check_case(x, case, lower_bound=LOWER_BOUND, kernel_options=settings.options,
                                            anchor=fla["outputs_and_grads"] if fla else None)
    verdict = ("PASS" if ok else "FAIL") if case in testing.GATED_CASES else "info"
    print(f"[check] {shape} {case} pallas-{settings.dtype} vs xla-fp32: {verdict} "
          + " ".join(f"{n}={e:.2e}" for n, e in errs.items()), flush=True)
    rows.append(dict(kind="check", shape=shape, case=case, impl="pallas", ok=ok, **errs))
    if fla_errs is not None:
      print(f"[check] {shape} {case} fla-{settings.dtype} vs xla-fp32: "
            + " ".join(f"{n}={e:.2e}" for n, e in fla_errs.items()), flush=True)
      rows.append(dict(kind="check", shape=shape, case=case, impl="fla", **fla_errs))
  return rows


def profile_rows(rows, shape, impl, mode, kernel_times):
  """Appends (and prints) one program's GPU kernels by name; a profiler failure is a row, not fatal."""
  try:
    for name, launches, ms in kernel_times():
      rows.append(dict(kind="kernel_profile", shape=shape, impl=impl, mode=mode, kernel=name, launches=launches, ms=ms))
      print(f"[profile] {shape} {impl} {mode} {ms:8.3f} ms  x{launches:g}  {name}", flush=True)
  except Exception as e:  # the profilers' APIs move; the timings stand without them
    rows.append(dict(kind="error", shape=shape, mode=mode, error=f"{impl} kernel profile: {e!r}"[:400]))
    print(rows[-1], flush=True)


def per_kernel_times(x, do, shape, settings):
  """Each Pallas kernel alone on the layer's inputs, at its defaults and, with `settings.sweep`, over other options
  (where the time goes): rows of kind "kernel", each with the options it ran with."""
  sweep = settings.sweep
  B, T, H, D = x["q"].shape
  scale, lb = D ** -0.5, LOWER_BOUND
  v = x["v"]
  S0 = jax.random.normal(jax.random.PRNGKey(1), (B, H, D, D), jnp.float32)
  bv = default_block_v(B, H, D)
  gate = (x["A_log"], x["dt_bias"])
  raw = (x["q"], x["k"], x["g_raw"], x["beta_logits"])
  opts = lambda **kw: KDAKernelOptions(**kw)
  cases = [("prepass", {}, lambda x: fused_inputs(*(x[n] for n in ("q", "k", "g_raw", "beta_logits", "A_log",
                                                                   "dt_bias")), lower_bound=lb), (x,))]
  cases += [("prepare", dict(save=save, num_warps=nw),
             lambda *a, s=save, o=opts(prepare=nw and Launch(nw, 1)): fwd.prepare(*a, gate, None, lower_bound=lb,
                                                                                save=s, options=o), raw)
            for save in (False, True) for nw in ((2, 4, 8) if sweep else (None,))]
  p = jax.jit(lambda *a: fwd.prepare(*a, gate, None, lower_bound=lb))(*raw)
  intra_args = (p.qe, p.kq, p.ke, p.tot, v, p.beta)
  variants = [dict(block_k=bk, num_warps=nw, solve="triton") for bk in (32, 64) for nw in (4, 8) if bk <= D]
  if solve_mosaic.available(v.dtype, D, D):   # then also B's diagonal blocks inverted in the key tiles
    variants += [dict(block_k=bk, num_warps=nw, solve="mosaic", invert_diagonal=inv)
                 for inv in (False, True) for bk, nw in ((16, 2), (32, 1), (32, 2), (32, 4), (64, 2))]
  for params in variants if sweep else [{}]:
    o = opts(key_tiles_block_k=params.get("block_k"), solve=params.get("solve"),
             intra_fwd_key_tiles=params.get("num_warps") and Launch(params["num_warps"], 3))
    cases.append(("intra_fwd", params, lambda *a, o=o, inv=params.get("invert_diagonal", False): fwd.intra_forward(
        *a, None, scale=scale, lower_bound=lb, save=False, invert_diagonal=inv, options=o), intra_args))
  rows = [run_case(shape, *case, settings) for case in cases if not settings.kernels or case[0] in settings.kernels]
  if settings.kernels and not set(settings.kernels) - {"prepass", "prepare", "intra_fwd"}:
    return rows
  intra = jax.jit(lambda *a: fwd.intra_forward(*a, None, scale=scale, lower_bound=lb))(*intra_args)
  w, u, qs, kd, aqk, decay = intra.w, intra.u, intra.qs, intra.kd, intra.aqk, intra.decay
  _, _, h, v_new = jax.jit(lambda *a: fwd.state_forward(*a, block_v=bv, save=True))(w, u, qs, kd, aqk, decay, S0)
  dv_new, dh, _ = jax.jit(lambda *a: bwd.state_backward(*a, block_v=bv))(do, aqk, kd, qs, w, decay, S0)
  dw, dqs, dkd, dd = jax.jit(bwd.state_grad_products)(h, dh, v_new, dv_new, do)
  state_args, reverse_args = (w, u, qs, kd, aqk, decay, S0), (do, aqk, kd, qs, w, decay, S0)
  cases = []
  for b in sorted({16, 32, 64, 128, bv}) if sweep else (bv,):
    for nw in ((4, 8) if b >= 64 else (4,)) if sweep else (None,):
      if b <= D:
        o_fwd = opts(state_pass="triton", state_fwd=nw and Launch(nw, 2))
        o_bwd = opts(state_pass="triton", state_bwd=nw and Launch(nw, 2))
        cases.append(("state_fwd", dict(block_v=b, num_warps=nw, mosaic=False),
                      lambda *a, b=b, o=o_fwd: fwd.state_forward(*a, block_v=b, options=o), state_args))
        cases.append(("state_bwd", dict(block_v=b, num_warps=nw, mosaic=False),
                      lambda *a, b=b, o=o_bwd: bwd.state_backward(*a, block_v=b, options=o), reverse_args))
  mosaic = lambda b: state_mosaic.available(v.dtype, D, D, b)   # the state pass the defaults run
  if mosaic(D):
    cases.append(("state_fwd", dict(block_v=D, mosaic=True), lambda *a: fwd.state_forward(*a, block_v=D), state_args))
    cases.append(("state_bwd", dict(block_v=D, mosaic=True), lambda *a: bwd.state_backward(*a, block_v=D),
                  reverse_args))
  N = T // 64
  for segments in (2, 4, 8, 16, 32) if sweep else ():
    for b in sorted({default_block_v(B * segments, H, D), 64}):
      if N % segments == 0 and N // segments >= 4:
        cases.append(("state_fwd", dict(block_v=b, segments=segments, mosaic=mosaic(b)),
                      lambda *a, b=b, s=segments: fwd.state_forward(*a, block_v=b, segments=s), state_args))
  segments = default_segments(B, H, N)
  if segments > 1 and not sweep:
    b = default_block_v(B * segments, H, D)
    cases.append(("state_fwd", dict(block_v=b, segments=segments, mosaic=mosaic(b)),
                  lambda *a: fwd.state_forward(*a, block_v=b, segments=segments), state_args))
  cases.append(("state_fwd_save", dict(block_v=bv, mosaic=mosaic(bv)),
                lambda *a: fwd.state_forward(*a, block_v=bv, save=True), state_args))
  cases.append(("state_grads", {}, bwd.state_grad_products, (h, dh, v_new, dv_new, do)))
  intra_bwd_inputs = dict(q=p.q, k=p.k, v=v, loc=p.loc, beta=p.beta, reset=None, u=u, w=w, kk=intra.kk,
                          minv=intra.minv, v_new=v_new, dv_new=dv_new, do=do, dw=dw, dqs=dqs, dkd=dkd, dd=dd)
  for form in COLS_FORMS if sweep else (None,):
    for nw in (4, 8, 16) if sweep else (None,):
      for bk in (32, 64) if sweep else (None,):
        params = {} if form is None else dict(cols_form=form, num_warps=nw, block_k=bk)
        o = opts(**({} if form is None else dict(cols_form=form, bwd_block_k=bk, intra_bwd_rows=Launch(nw, 1),
                                                 intra_bwd_cols=Launch(nw, 1))))
        cases.append(("intra_bwd", params, lambda kw, o=o: bwd.intra_backward(**kw, scale=scale, lower_bound=lb,
                                                                               options=o), (intra_bwd_inputs,)))
  return rows + [run_case(shape, *case, settings) for case in cases
                 if not settings.kernels or case[0] in settings.kernels]


def run_case(shape, name, params, fn, args, settings):
  """Compiles and times one kernel case; a failure is reported in its row, not raised."""
  try:
    compiled, compile_s = compile_timed(jax.jit(fn), args)
    ms = 1e3 * harness.pipelined_seconds(compiled, *args, repeats=settings.repeats, warmup=settings.warmup)
    row = dict(kind="kernel", shape=shape, kernel=name, ms=ms, compile_s=compile_s, **params)
  except Exception as e:
    row = dict(kind="kernel", shape=shape, kernel=name, error=repr(e)[:300], **params)
  print(row, flush=True)
  return row


def print_table(rows):
  times = [r for r in rows if r["kind"] == "time" and "ms" in r]
  ref = {(r["shape"], r["mode"]): r["ms"] for r in times if r["impl"] == "fla"}
  print(f"\n{'shape':>16} {'mode':>7} {'impl':>16} {'ms':>9} {'host ms':>8} {'x FLA':>7} {'TFLOP/s':>8} {'GB/s':>7} "
        f"{'mem MB':>8}")
  for r in times:
    anchor = ref.get((r["shape"], r["mode"]))
    ratio = f"{anchor / r['ms']:.2f}" if anchor else "-"
    mem = f"{r['mem_bytes'] / 2**20:.0f}" if r.get("mem_bytes") else "-"
    host = f"{r['host_ms']:.3f}" if "host_ms" in r else "-"
    print(f"{r['shape']:>16} {r['mode']:>7} {r['impl']:>16} {r['ms']:9.3f} {host:>8} {ratio:>7} {r['tflops']:8.1f} "
          f"{r['gbps']:7.0f} {mem:>8}")
  print("(x FLA = FLA's time / this time: above 1 is faster than FLA, measured in this run)")


def print_error_table(rows):
  """The fused case's errors against the fp32 XLA path, ours beside FLA's on the same inputs, per shape; a ratio
  above BAR_VS_FLA is marked."""
  checks = {(r["shape"], r["impl"]): r for r in rows if r["kind"] == "check" and r["case"] == "fused"}
  shapes = [s for s in dict.fromkeys(r["shape"] for r in rows if r["kind"] == "check") if (s, "fla") in checks]
  if not shapes:
    return
  names = ("o", "S", "q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias", "initial_state")
  print(f"\nerrors against the XLA path in fp32, fused case (ours / FLA, ratio; * above {BAR_VS_FLA}x FLA's)")
  print(f"{'':>14}" + "".join(f"{s:>30}" for s in shapes))
  worst = {}
  for n in names:
    cells = []
    for s in shapes:
      ours, theirs = checks[(s, "pallas")][n], checks[(s, "fla")][n]
      ratio = ours / theirs if theirs else float("inf")
      worst[s] = max(worst.get(s, 0.0), ratio)
      cells.append(f"{ours:.2e} / {theirs:.2e} {ratio:5.2f}{'*' if ratio > BAR_VS_FLA else ' '}")
    print(f"{n:>14}" + "".join(f"{c:>30}" for c in cells))
  print(f"{'worst ratio':>14}" + "".join(f"{worst[s]:>29.2f} " for s in shapes))


def parse_launch_variant(text):
  """'name:kernel.param=value,...' (PARAM num_warps or num_stages) -> (name, {kernel: {param: int}}); a ValueError
  for anything else."""
  name, sep, spec = text.partition(":")
  if not (name and sep and spec):
    raise ValueError(f"--variant {text!r}: expected NAME:KERNEL.PARAM=VALUE[,...]")
  over = {}
  params = ("num_warps", "num_stages")
  for item in spec.split(","):
    lhs, eq, value = item.partition("=")
    kernel, dot, param = lhs.rpartition(".")
    if not (eq and dot and kernel) or param not in params or not value.isdigit() or int(value) < 1:
      raise ValueError(f"--variant {text!r}: {item!r} is not KERNEL.PARAM=VALUE with PARAM in {params} and "
                       "VALUE a positive integer")
    over.setdefault(kernel, {})[param] = int(value)
  return name, over


def launch_options(x, over):
  """`KDAKernelOptions` with the forward's launches `over` ({kernel name: {param: int}}) over the defaults; a
  ValueError naming any kernel the forward on `x` does not launch (read from its traced program)."""
  launched = triton_launches(jax_fns("pallas")[0], x)
  unknown = sorted(set(over) - set(launched))
  if unknown:
    raise ValueError(f"no launch named {unknown} in the forward (it launches {sorted(launched)})")
  return KDAKernelOptions().with_launches(**{k.removeprefix("kda_"): params for k, params in over.items()})


def launch_variants(shape, variants):
  """{name: `KDAKernelOptions`} of the launch variants ({name: {kernel: {param: int}}}) at `shape`; a ValueError
  naming a kernel the forward does not launch there, before anything is compiled."""
  x, _ = jax.eval_shape(lambda: testing.raw_inputs(*parse_shape(shape), jnp.bfloat16))
  return {name: launch_options(x, over) for name, over in variants.items()}


def launch_rows(shape, variants, *, rounds, repeats, calls, warmup, profile):
  """The undifferentiated forward under each launch variant ({name: {kernel: {param: int}}}, "default" the shipped
  launches) and FLA's, interleaved: `rounds` rounds each timing every variant once (drift hits all alike); rows of
  kind "launch" with each variant's median, its rounds and its ratio to FLA's median."""
  options = launch_variants(shape, variants)
  B, T, H, D = parse_shape(shape)
  x, do = testing.raw_inputs(B, T, H, D, jnp.bfloat16)
  fla = fla_runner(x, do)
  compiled = {}
  for name in variants:
    compiled[name] = jax_fns("pallas", options[name])[0].lower(x).compile()
    jax.block_until_ready(compiled[name](x))
    print(f"[bench_kda_launch] {shape} {name}: compiled", flush=True)
  runs = {n: [] for n in (["fla"] if fla else []) + list(compiled)}
  for r in range(rounds):
    if fla:
      runs["fla"].append(fla["fwd"]())
    for name, fn in compiled.items():
      runs[name].append(1e3 * harness.pipelined_seconds(fn, x, repeats=repeats, calls=calls, warmup=warmup))
    print(f"[bench_kda_launch] {shape} round {r + 1}/{rounds}", flush=True)
  fla_ms = statistics.median(runs["fla"]) if fla else None
  rows = []
  for name, times in runs.items():
    ms = statistics.median(times)
    row = dict(kind="launch", shape=shape, variant=name, launches=variants.get(name), ms=ms, runs=times,
               x_fla=fla_ms / ms if fla_ms else None)
    if profile and name != "fla":
      row["kernels"] = harness.device_kernel_times(compiled[name], x)
    rows.append(row)
    ratio = f"  {row['x_fla']:.3f}x FLA" if fla_ms else ""
    print(f"[bench_kda_launch] {shape} {name:>12s} {ms:8.4f} ms{ratio}  rounds {[f'{t:.4f}' for t in times]}",
          flush=True)
    for kernel, _, kernel_ms in row.get("kernels", []):
      print(f"    {kernel_ms:8.4f} ms  {kernel}", flush=True)
  return rows
