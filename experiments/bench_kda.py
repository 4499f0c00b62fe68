"""KDA benchmark: our paths and FLA's `chunk_kda` side by side in one process, forward and forward+backward.

  python -m experiments.bench_kda --shapes=8x4096x16x128,2x16384x16x128 --impls=pallas,xla,fla

Each implementation runs the layer's fused operator (q/k L2 norm, bounded gate, β sigmoid, KDA) in bf16.
`--check` then compares the Pallas kernels in bf16 with the XLA path in fp32 (outputs and every gradient), and with
`fla` among the impls FLA's on the same inputs against the same reference, one table of both at the end.
`pallas:FORM` (FORM in `bwd.COLS_FORMS`) is the Pallas path with the backward's column pass in that form.
Times are device time per call: CUDA events for FLA (`triton.testing.do_bench`), back-to-back calls for JAX
(`harness.pipelined_seconds`); `host_ms` is JAX's older per-call host timer around `block_until_ready`, which adds
the launch and the synchronisation.
"""
import functools
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and PyTorch share the GPU here


import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import harness
from k3jax.numerics import kda_cotangents, kda_outputs_and_grads, rel_err
from k3jax.ops import kda

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["1x512x4x64"], "BxTxHxD shapes (K = V = D).")
flags.DEFINE_list("impls", ["recurrent", "xla"], "Any of: recurrent, xla, pallas, pallas:FORM (the backward's "
                  "column pass in that form, bwd.COLS_FORMS), fla.")
flags.DEFINE_list("modes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd.")
flags.DEFINE_list("fla_modes", None, "Modes for FLA if not --modes (its first backward compile takes minutes).")
flags.DEFINE_list("variant_modes", ["fwdbwd"], "Modes for pallas:FORM (its forward is the default's).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Input dtype.")
flags.DEFINE_integer("repeats", 20, "Timed repetitions (median reported).")
flags.DEFINE_integer("warmup", 3, "Untimed runs first.")
flags.DEFINE_bool("check", False, "After timing, check Pallas against the XLA path in fp32 (see check_pallas).")
flags.DEFINE_list("check_cases", None, "With --check: only these cases (default all of CHECK_CASES).")
flags.DEFINE_bool("per_kernel", False, "Also time each Pallas kernel alone.")
flags.DEFINE_bool("sweep", True, "With --per_kernel: also other warps / V-block sizes than the defaults.")
flags.DEFINE_list("kernels", None, "With --per_kernel: only these kernels (e.g. intra_fwd,state_fwd); default all.")
flags.DEFINE_bool("profile", False, "Also each implementation's GPU kernels, by name, from a profiler (torch's for "
                  "FLA, JAX's for ours): where each program's time goes.")
flags.DEFINE_list("bwd_variants", ["v3", "v5"], "With --per_kernel: the intra_bwd variants timed.")
flags.DEFINE_string("intra_bwd", None, "Run the whole op (pallas rows, --check) with this intra_bwd variant, not "
                    "the default (e.g. v3).")
flags.DEFINE_enum("solve", None, ["triton", "mosaic"], "Run the whole op with this solve launch, not the default.")
flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "bench_kda.json") if os.environ.get("OUT") else "",
                    "JSON file for the rows (default $OUT/bench_kda.json when $OUT is set).")

LOWER_BOUND = -5.0
CHECK_TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2,
             "g_raw": 2e-2, "beta_logits": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}
ARG_NAMES = ("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias")
BAR_VS_FLA = 1.25   # issue 24: every output and gradient within this factor of FLA's error


def make_inputs(B, T, H, D, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  x = dict(q=jax.random.normal(ks[0], (B, T, H, D), dtype), k=jax.random.normal(ks[1], (B, T, H, D), dtype),
           v=jax.random.normal(ks[2], (B, T, H, D), dtype), g_raw=jax.random.normal(ks[3], (B, T, H, D), dtype),
           beta_logits=jax.random.normal(ks[4], (B, T, H), dtype),
           A_log=jnp.log(jax.random.uniform(ks[5], (H,), minval=1.0, maxval=16.0)),
           dt_bias=jax.random.normal(ks[6], (H, D)))
  return x, jax.random.normal(ks[7], (B, T, H, D), dtype)


def pallas_form(cols_form):
  """`fused_kda(..., backend="pallas")` with the backward's column pass in `cols_form` (the Pallas entry called
  directly: the public one has no such option)."""
  from pallas_kernels.kda import chunk_kda_pallas

  def run(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, initial_state=None, output_final_state=False,
          segment_ids=None):
    return chunk_kda_pallas(q, k, v, g_raw, beta_logits, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
                            output_final_state=output_final_state, segment_ids=segment_ids, lower_bound=LOWER_BOUND,
                            gate=(A_log, dt_bias), cols_form=cols_form)
  return run


def jax_fns(impl):
  """(forward, forward+backward) jitted functions of (inputs, do) for one of our implementations."""
  if impl.startswith("pallas:"):
    fused = pallas_form(impl.split(":", 1)[1])
    run = lambda x: fused(*(x[n] for n in ARG_NAMES))[0]
  elif impl == "recurrent":
    def run(x):
      g = kda.kda_gate(x["g_raw"], x["A_log"], x["dt_bias"], lower_bound=LOWER_BOUND)
      beta = jax.nn.sigmoid(x["beta_logits"].astype(jnp.float32)).astype(x["v"].dtype)
      return kda.naive_recurrent_kda(kda.l2_normalize(x["q"]), kda.l2_normalize(x["k"]), x["v"], g, beta)[0]
  else:
    def run(x):
      return kda.fused_kda(*(x[n] for n in ARG_NAMES), lower_bound=LOWER_BOUND, backend=impl)[0]

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


def fla_runner(x, do):
  """FLA's chunk_kda with the gate, L2 norm and β sigmoid fused, as ANCHORS.md runs it; None if not importable."""
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

  def fwd():
    return fla_chunk_kda(t["q"], t["k"], t["v"], t["g_raw"], t["beta_logits"], A_log=A_log, dt_bias=dt_bias,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=LOWER_BOUND)[0]

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
    o, S = fla_chunk_kda(*leaves.values(), **gate, initial_state=s0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=LOWER_BOUND)
    co, cs = (torch.from_numpy(np.asarray(c)).cuda() for c in kda_cotangents(tuple(o.shape), tuple(S.shape), cot_seed))
    ((o.float() * co).sum() + (S.float() * cs).sum()).backward()
    host = lambda a: a.detach().float().cpu().numpy()
    grads = {**{n: host(t.grad) for n, t in leaves.items()}, "A_log": host(gate["A_log"].grad),
             "dt_bias": host(gate["dt_bias"].grad).reshape(H, D), "initial_state": host(s0.grad)}
    return host(o), host(S), grads

  return dict(fwd=lambda: timed(fwd, True), fwdbwd=lambda: timed(fwdbwd, False), fwdbwd_mem=lambda: peak_bytes(fwdbwd),
              kernels={"fwd": lambda: kernel_times(fwd, True), "fwdbwd": lambda: kernel_times(fwdbwd, False)},
              outputs_and_grads=outputs_and_grads)


CHECK_CASES = ("random", "gates_at_bound", "fused", "packed", "repeated_keys")
# The tolerances (docs/design.md, tolerances) hold for random inputs; repeated keys are reported, not held to them.
GATED_CASES = ("random", "gates_at_bound", "fused", "packed")


def fused_inputs(x):
  """The fused entry's pre-pass on the benchmark's raw inputs: (q, k, g, β) as the kernels take them."""
  return kda.fused_inputs(x["q"], x["k"], x["g_raw"], x["beta_logits"], x["A_log"], x["dt_bias"],
                          lower_bound=LOWER_BOUND)


def check_pallas(x, case, fla=None):
  """The Pallas kernels in the input dtype against the XLA path in fp32 on the same (upcast) inputs: o, the final
  state and every gradient: (errors, within CHECK_TOL, FLA's errors against the same reference on the fused case
  with `fla`, a `fla_runner`, else None). The q/k L2 norm, gate and β sigmoid are applied first, as the layer does.
  Cases: random gates; every gate at the bound; the fused entry on the raw projections (the kernels' own norm, gate
  and sigmoid, and the gradients through them to A_log and dt_bias); packed documents (about 300 tokens each, starts
  anywhere in a tile, one always mid-tile); one key repeated through the sequence with β ≈ 1 and no decay (I + A_kk
  is then as far from the identity as it gets). The fused and packed cases also check the undifferentiated forward
  (no residuals). The bounds: docs/design.md, tolerances."""
  B, T, H, K = x["q"].shape
  S0 = jax.random.normal(jax.random.PRNGKey(3), (B, H, K, x["v"].shape[-1]), jnp.float32)
  seg = None
  if case == "fused":
    inputs = {n: x[n] for n in ARG_NAMES}
    run = lambda backend: lambda **kw: kda.fused_kda(**kw, lower_bound=LOWER_BOUND, backend=backend)
  else:
    q, k, g, beta = fused_inputs(x)
    if case == "gates_at_bound":
      g = jnp.full_like(g, LOWER_BOUND)
    elif case == "repeated_keys":
      k = jnp.broadcast_to(k[:, :1], k.shape)
      g, beta = jnp.full_like(g, -1e-3), jnp.full_like(beta, 0.99)
    elif case == "packed":
      starts = jax.random.bernoulli(jax.random.PRNGKey(4), 1 / 300, (B, T)).at[:, min(T - 1, T // 2 + 7)].set(True)
      seg = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    inputs = dict(q=q, k=k, v=x["v"], g=g, beta=beta)
    run = lambda backend: lambda **kw: kda.chunk_kda(**kw, lower_bound=LOWER_BOUND, backend=backend)
  o, S, grads = kda_outputs_and_grads(run("pallas"), inputs, S0, seg)
  f32 = {n: a.astype(jnp.float32) for n, a in inputs.items()}
  o_ref, S_ref, grads_ref = kda_outputs_and_grads(run("xla"), f32, S0, seg)
  errors = lambda o, S, grads: {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref),
                                **{n: rel_err(grads[n], grads_ref[n]) for n in grads_ref}}
  errs = errors(o, S, grads)
  if case in ("fused", "packed"):  # undifferentiated, the forward writes no residuals (save=False): check it too
    o_fwd, S_fwd = jax.jit(lambda x, S0: run("pallas")(**x, initial_state=S0, output_final_state=True,
                                                        segment_ids=seg))(inputs, S0)
    errs.update(o_fwd=rel_err(o_fwd, o_ref), S_fwd=rel_err(S_fwd, S_ref))
  fla_errs = errors(*fla["outputs_and_grads"](S0)) if fla is not None and case == "fused" else None
  return errs, all(e <= CHECK_TOL[n.removesuffix("_fwd")] for n, e in errs.items()), fla_errs


def model_counts(B, T, H, D, mode):
  """FLOPs (docs/design.md, KDA: ~6KV + 3CK + C² per token and head forward; backward taken as twice that) and the
  fewest bytes: forward reads the five inputs and writes o; forward+backward reads the inputs and dO and writes the five
  input gradients."""
  C, el = 64, 2
  flops = B * T * H * (6 * D * D + 3 * C * D + C * C)
  io = B * T * H * el * (4 * D + 1)  # q, k, v, g_raw, beta_logits
  out = B * T * H * el * D
  if mode == "fwd":
    return flops, io + out
  return 3 * flops, 2 * io + out


def main(argv):
  harness.check_argv(argv)
  dtype = jnp.dtype(FLAGS.dtype)
  rows = []
  save = lambda rows: harness.write_json(FLAGS.out, rows)

  fla_profiles = []
  print(f"[bench_kda] backend={jax.default_backend()} devices={jax.devices()}", flush=True)
  from pallas_kernels.kda.bwd import COLS_FORMS
  unknown = [i for i in FLAGS.impls if i.startswith("pallas:") and i.split(":", 1)[1] not in COLS_FORMS]
  if unknown:
    raise app.UsageError(f"--impls: {unknown} name no column-pass form of {COLS_FORMS}")
  use_variants(FLAGS.intra_bwd, FLAGS.solve)
  for shape in FLAGS.shapes:
    B, T, H, D = (int(s) for s in shape.split("x"))
    x, do = make_inputs(B, T, H, D, dtype)
    fla = fla_runner(x, do) if "fla" in FLAGS.impls else None
    for impl in FLAGS.impls:
      if impl == "fla" and fla is None:
        continue
      fns = None if impl == "fla" else jax_fns(impl)
      modes = ((FLAGS.fla_modes or FLAGS.modes) if impl == "fla" else
               FLAGS.variant_modes if impl.startswith("pallas:") else FLAGS.modes)
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
            row["ms"] = 1e3 * harness.pipelined_seconds(compiled, *args, repeats=FLAGS.repeats, warmup=FLAGS.warmup)
            row["host_ms"] = 1e3 * harness.median_seconds(compiled, *args, repeats=FLAGS.repeats, warmup=0)
            if mode == "fwdbwd":
              row["mem_bytes"] = jax_temp_bytes(compiled)
          flops, nbytes = model_counts(B, T, H, D, mode)
          row.update(tflops=flops / row["ms"] / 1e9, gbps=nbytes / row["ms"] / 1e6)
        except Exception as e:  # a failing implementation is reported, not fatal for the others
          row["error"] = repr(e)[:400]
        rows.append(row)
        print(row, flush=True)
        save(rows)
        if FLAGS.profile and "error" not in row:
          if impl == "fla":  # last: torch's profiler keeps CUPTI, and JAX's then cannot subscribe
            fla_profiles.append((shape, mode, fla["kernels"][mode]))
          else:
            profile_rows(rows, shape, impl, mode, lambda: harness.device_kernel_times(compiled, *args))
          save(rows)
    if "pallas" in FLAGS.impls and (FLAGS.check or FLAGS.per_kernel):
      try:
        if FLAGS.check:
          for case in FLAGS.check_cases or CHECK_CASES:
            errs, ok, fla_errs = check_pallas(x, case, fla)
            verdict = ("PASS" if ok else "FAIL") if case in GATED_CASES else "info"
            print(f"[check] {shape} {case} pallas-{FLAGS.dtype} vs xla-fp32: {verdict} "
                  + " ".join(f"{n}={e:.2e}" for n, e in errs.items()), flush=True)
            rows.append(dict(kind="check", shape=shape, case=case, impl="pallas", ok=ok, **errs))
            if fla_errs is not None:
              print(f"[check] {shape} {case} fla-{FLAGS.dtype} vs xla-fp32: "
                    + " ".join(f"{n}={e:.2e}" for n, e in fla_errs.items()), flush=True)
              rows.append(dict(kind="check", shape=shape, case=case, impl="fla", **fla_errs))
        if FLAGS.per_kernel:
          rows += per_kernel_times(x, do, shape)
      except Exception as e:
        rows.append(dict(kind="error", shape=shape, error=repr(e)[:2000]))
        print(rows[-1], flush=True)
      save(rows)
  for shape, mode, kernel_times in fla_profiles:
    profile_rows(rows, shape, "fla", mode, kernel_times)
  save(rows)
  print_table(rows)
  print_error_table(rows)


def profile_rows(rows, shape, impl, mode, kernel_times):
  """Appends (and prints) one program's GPU kernels by name; a profiler failure is a row, not fatal."""
  try:
    for name, launches, ms in kernel_times():
      rows.append(dict(kind="kernel_profile", shape=shape, impl=impl, mode=mode, kernel=name, launches=launches, ms=ms))
      print(f"[profile] {shape} {impl} {mode} {ms:8.3f} ms  x{launches:g}  {name}", flush=True)
  except Exception as e:  # the profilers' APIs move; the timings stand without them
    rows.append(dict(kind="error", shape=shape, mode=mode, error=f"{impl} kernel profile: {e!r}"[:400]))
    print(rows[-1], flush=True)


def use_variants(intra_bwd, solve):
  """Makes the whole op (`chunk_kda(..., backend="pallas")`) use this backward variant and this solve launch in this
  process: candidates are timed end to end before they become defaults."""
  from pallas_kernels.kda import bwd, fwd
  if intra_bwd:
    bwd.intra_backward = functools.partial(bwd.intra_backward, variant=intra_bwd)
  if solve:
    fwd.intra_forward = functools.partial(fwd.intra_forward, solve=solve)
  if intra_bwd or solve:
    print(f"[bench_kda] pallas uses intra_bwd {intra_bwd or 'default'}, solve {solve or 'default'}", flush=True)


def per_kernel_times(x, do, shape):
  """Each Pallas kernel alone on the layer's inputs, over a few launch parameters (where the time goes)."""
  from pallas_kernels.kda import bwd, fwd, solve_mosaic, state_mosaic
  from pallas_kernels.kda.chunk import default_block_v, default_segments
  B, T, H, D = x["q"].shape
  scale, lb = D ** -0.5, LOWER_BOUND
  v = x["v"]
  S0 = jax.random.normal(jax.random.PRNGKey(1), (B, H, D, D), jnp.float32)
  bv = default_block_v(B, H, D)
  gate = (x["A_log"], x["dt_bias"])
  raw = (x["q"], x["k"], x["g_raw"], x["beta_logits"])
  cases = [("prepass", {}, fused_inputs, (x,))]
  cases += [("prepare", dict(save=save, num_warps=nw),
             lambda *a, s=save, nw=nw: fwd.prepare(*a, gate, None, lower_bound=lb, save=s, num_warps=nw), raw)
            for save in (False, True) for nw in ((2, 4, 8) if FLAGS.sweep else (None,))]
  p = jax.jit(lambda *a: fwd.prepare(*a, gate, None, lower_bound=lb))(*raw)
  intra_args = (p.qe, p.kq, p.ke, p.tot, v, p.beta)
  sweep = [dict(block_k=bk, num_warps=nw, solve="triton") for bk in (32, 64) for nw in (4, 8) if bk <= D]
  if solve_mosaic.available(v.dtype, D, D):   # then also B's diagonal blocks inverted in the key tiles
    sweep += [dict(block_k=bk, num_warps=nw, solve="mosaic", invert_diagonal=inv)
              for inv in (False, True) for bk, nw in ((16, 2), (32, 1), (32, 2), (32, 4), (64, 2))]
  for params in sweep if FLAGS.sweep else [{}]:
    cases.append(("intra_fwd", params, lambda *a, p=params: fwd.intra_forward(
        *a, None, scale=scale, lower_bound=lb, save=False, **p), intra_args))
  rows = [run_case(shape, *case) for case in cases if not FLAGS.kernels or case[0] in FLAGS.kernels]
  if FLAGS.kernels and not set(FLAGS.kernels) - {"prepass", "prepare", "intra_fwd"}:
    return rows
  w, u, qs, kd, aqk, decay, kk, minv = jax.jit(
      lambda *a: fwd.intra_forward(*a, None, scale=scale, lower_bound=lb))(*intra_args)
  _, _, h, v_new = jax.jit(lambda *a: fwd.state_forward(*a, block_v=bv, save=True))(w, u, qs, kd, aqk, decay, S0)
  dv_new, dh, _ = jax.jit(lambda *a: bwd.state_backward(*a, block_v=bv))(do, aqk, kd, qs, w, decay, S0)
  dw, dqs, dkd, dd = jax.jit(bwd.state_grad_products)(h, dh, v_new, dv_new, do)
  cases = []
  for b in sorted({16, 32, 64, 128, bv}) if FLAGS.sweep else (bv,):
    for nw in ((4, 8) if b >= 64 else (4,)) if FLAGS.sweep else (None,):
      if b <= D:
        cases.append(("state_fwd", dict(block_v=b, num_warps=nw, mosaic=False),
                      lambda *a, b=b, nw=nw: fwd.state_forward(*a, block_v=b, num_warps=nw, mosaic=False),
                      (w, u, qs, kd, aqk, decay, S0)))
        cases.append(("state_bwd", dict(block_v=b, num_warps=nw, mosaic=False),
                      lambda *a, b=b, nw=nw: bwd.state_backward(*a, block_v=b, num_warps=nw, mosaic=False),
                      (do, aqk, kd, qs, w, decay, S0)))
  mosaic = lambda b: state_mosaic.available(v.dtype, D, D, b)   # the state pass the defaults run
  if mosaic(D):
    cases.append(("state_fwd", dict(block_v=D, mosaic=True), lambda *a: fwd.state_forward(*a, block_v=D),
                  (w, u, qs, kd, aqk, decay, S0)))
    cases.append(("state_bwd", dict(block_v=D, mosaic=True), lambda *a: bwd.state_backward(*a, block_v=D),
                  (do, aqk, kd, qs, w, decay, S0)))
  N = T // 64
  for segments in (2, 4, 8, 16, 32) if FLAGS.sweep else ():
    for b in sorted({default_block_v(B * segments, H, D), 64}):
      if N % segments == 0 and N // segments >= 4:
        cases.append(("state_fwd", dict(block_v=b, segments=segments, mosaic=mosaic(b)),
                      lambda *a, b=b, s=segments: fwd.state_forward(*a, block_v=b, segments=s),
                      (w, u, qs, kd, aqk, decay, S0)))
  segments = default_segments(B, H, N)
  if segments > 1 and not FLAGS.sweep:
    b = default_block_v(B * segments, H, D)
    cases.append(("state_fwd", dict(block_v=b, segments=segments, mosaic=mosaic(b)),
                  lambda *a: fwd.state_forward(*a, block_v=b, segments=segments), (w, u, qs, kd, aqk, decay, S0)))
  cases.append(("state_fwd_save", dict(block_v=bv, mosaic=mosaic(bv)),
                lambda *a: fwd.state_forward(*a, block_v=bv, save=True), (w, u, qs, kd, aqk, decay, S0)))
  cases.append(("state_grads", {}, bwd.state_grad_products, (h, dh, v_new, dv_new, do)))
  split = (32, 64) if FLAGS.sweep else (32,)
  bwd_blocks = {"v3": (None,), "v5": split}
  for variant, block_ks in ((v, bwd_blocks[v]) for v in FLAGS.bwd_variants):
    for nw in (4, 8, 16) if FLAGS.sweep else (8,):
      for bk in block_ks:
        extra = {} if bk is None else dict(block_k=bk)
        cases.append(("intra_bwd", dict(variant=variant, num_warps=nw, **extra),
                      lambda *a, nw=nw, variant=variant, extra=extra: bwd.intra_backward(
                          *a, scale=scale, lower_bound=lb, num_warps=nw, variant=variant, **extra),
                      (p.q, p.k, v, p.loc, p.beta, None, u, w, kk, minv, v_new, dv_new, do, dw, dqs, dkd, dd)))
  return rows + [run_case(shape, *case) for case in cases if not FLAGS.kernels or case[0] in FLAGS.kernels]


def compile_timed(jitted, args):
  """(compiled program, seconds to compile): compiling apart from the timed calls, so a slow compile (a kernel XLA's
  Triton pipeline is slow on) and a hang read apart."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def run_case(shape, name, params, fn, args):
  """Compiles and times one kernel case; a failure is reported in its row, not raised."""
  try:
    compiled, compile_s = compile_timed(jax.jit(fn), args)
    ms = 1e3 * harness.pipelined_seconds(compiled, *args, repeats=FLAGS.repeats, warmup=FLAGS.warmup)
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
  names = [n for n in ("o", "S", "q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias", "initial_state")]
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


if __name__ == "__main__":
  app.run(main)
