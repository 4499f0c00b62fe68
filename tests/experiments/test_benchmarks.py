"""The GPU benchmark scripts run end to end on the CPU at tiny shapes (so a device call never finds them broken):
each prints its table, writes its JSON and exits 0 only when its own checks pass."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_script(module, *flags, out_dir):
  env = dict(os.environ, OUT=str(out_dir), JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # one device; the fast compile conftest.py sets
  return subprocess.run([sys.executable, "-m", module, *flags], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=900)


@pytest.mark.xdist_group("benchmarks")
def test_bench_kda_times_compiles_and_checks_at_a_tiny_shape(tmp_path):
  done = run_script("experiments.bench_kda", "--impls=xla,pallas,pallas:unrolled", "--shapes=1x128x2x32",
                    "--repeats=1", "--warmup=1", "--check", "--check_cases=fused,packed", "--profile", "--per_kernel",
                    "--sweep=false", "--kernels=intra_fwd", out_dir=tmp_path)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = json.loads((tmp_path / "bench_kda.json").read_text())
  times = [r for r in rows if r["kind"] == "time"]
  assert {(r["impl"], r["mode"]) for r in times} == {(i, m) for i in ("xla", "pallas") for m in ("fwd", "fwdbwd")} | {
      ("pallas:unrolled", "fwdbwd")}   # a column-pass form times its backward only
  assert all(r["ms"] > 0 and r["compile_s"] > 0 for r in times)
  assert not [r for r in rows if r["kind"] == "error"]  # the profile pass ran (it finds no GPU kernels here)
  kernels = [r for r in rows if r["kind"] == "kernel"]
  assert [r["kernel"] for r in kernels] == ["intra_fwd"] and kernels[0]["ms"] > 0 and kernels[0]["compile_s"] > 0
  checks = [r for r in rows if r["kind"] == "check"]
  # The cases that take the script's other branches (the fused entry; segments, and the forward without residuals);
  # every case's kernels are checked in tests/pallas_kernels/kda.
  assert {r["case"] for r in checks} == {"fused", "packed"} and all(r["ok"] for r in checks)


def test_bench_kda_error_table_puts_fla_beside_ours_and_marks_ratios_past_the_bar(capsys):
  from experiments.benchmarks import kda as kda_benchmark
  names = ("o", "S", "q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias", "initial_state")
  check = lambda impl, **errs: dict(kind="check", shape="1x64x1x16", case="fused", impl=impl,
                                    **{n: errs.get(n, 4e-3) for n in names})
  kda_benchmark.print_error_table([check("pallas", g_raw=6e-3), check("fla", g_raw=4e-3), dict(kind="time")])
  table = capsys.readouterr().out
  assert "6.00e-03 / 4.00e-03  1.50*" in table and "4.00e-03 / 4.00e-03  1.00 " in table, table
  assert table.splitlines()[-1].split()[-1] == "1.50", table
  kda_benchmark.print_error_table([check("pallas")])                 # no FLA rows (FLA not importable): no table
  assert capsys.readouterr().out == ""


@pytest.mark.xdist_group("benchmarks")
def test_bench_kda_launch_times_each_variant_and_refuses_unknown_kernels(tmp_path):
  """Each launch variant (and the defaults) gets its rounds' median; a kernel the forward does not launch, or a
  parameter other than warps and stages, is an error, not an ignored setting."""
  flags = ("--shapes=1x128x2x32", "--rounds=2", "--repeats=1", "--calls=1", "--warmup=1")
  done = run_script("experiments.bench_kda_launch", *flags,
                    "--variant=w4s3:kda_prepare.num_warps=4,kda_intra_fwd_key_tiles.num_stages=3", out_dir=tmp_path)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = json.loads((tmp_path / "bench_kda.json").read_text())
  assert [r["variant"] for r in rows] == ["default", "w4s3"]
  assert rows[1]["launches"] == {"kda_prepare": {"num_warps": 4}, "kda_intra_fwd_key_tiles": {"num_stages": 3}}
  assert all(len(r["runs"]) == 2 and r["ms"] > 0 for r in rows)
  for bad, says in (("x:kda_prepar.num_warps=4", "no launch named ['kda_prepar']"),
                    ("x:kda_prepare.warps=4", "is not KERNEL.PARAM=VALUE")):
    done = run_script("experiments.bench_kda_launch", *flags, f"--variant={bad}", out_dir=tmp_path)
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]


@pytest.mark.xdist_group("benchmarks")
def test_bench_moe_small_runs_its_sections_and_checks(tmp_path):
  done = run_script("experiments.bench_moe", "--small", out_dir=tmp_path)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads((tmp_path / "bench_moe.json").read_text())
  assert not result["errors"]
  for experts in (8, 16):
    entry = result[f"E{experts}"]
    assert set(entry["gate_up"]) >= {"check", "times", "vs_ragged_dot"} and entry["layer"]["moe"] > 0
  dispatch = result["E8"]["dispatch"]
  assert all(dispatch[run][impl][mode] > 0 for run in ("experts", "movement") for impl in ("custom_vjp", "autodiff")
             for mode in ("fwd", "fwd_bwd"))
  assert max(dispatch["errors"].values()) < 2e-2  # the two dispatches agree to bf16 rounding
  glu = result["E8"]["glu"]   # on the CPU the GLU runs between the products only
  assert not glu["applies"] and set(glu["ms"]) == {"between"} and glu["ms"]["between"] > 0
  assert 0 < glu["errors"]["between"] < 2e-2


@pytest.mark.xdist_group("benchmarks")
def test_bench_generate_small_runs_both_patterns_and_checks(tmp_path):
  """Both layer patterns, B = 1 and 2, a prompt that no chunk divides: every row has its prefill and decode
  speeds and cache bytes, the chunked prefill matched the full forward, the table and the bars are printed, and the
  decode loop is profiled at the first context."""
  done = run_script("experiments.bench_generate", "--small", "--profile", out_dir=tmp_path)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = json.loads((tmp_path / "bench_generate.json").read_text())
  assert {(r["pattern"], r["B"], r["L"]) for r in rows} == {(p, b, n) for p in ("config", "mla") for b in (1, 2)
                                                             for n in (64, 160)}
  assert all(r["decode_tok_s_per_seq"] > 0 and r["prefill_est_tok_s"] > 0 and r["cache_gib"] > 0 for r in rows)
  assert all("prefill_tok_s" in r for r in rows if r["B"] == 1)             # the real prefill ran at B = 1
  assert [r["check_ok"] for r in rows if "check_ok" in r] == [True, True]
  per_row = {p: {r["L"]: r["cache_bytes_per_token"] * r["L"] for r in rows if r["pattern"] == p and r["B"] == 1}
             for p in ("config", "mla")}
  slope = {p: (b[160] - b[64]) / 96 for p, b in per_row.items()}   # bytes per added token: the MLA layers' latents
  assert slope["config"] * 4 == pytest.approx(slope["mla"])       # tiny: 1 MLA layer of 4 against 4 of 4
  assert "cache bytes/token at the longest context" in done.stdout and "decode L=160 B=2" in done.stdout
  profiled = [r for r in rows if "decode_profile" in r]
  assert {(r["pattern"], r["B"], r["L"]) for r in profiled} == {(p, b, 64) for p in ("config", "mla") for b in (1, 2)}
  assert all(r["decode_profile"]["launches"] > 0 and r["decode_profile"]["total_ms"] > 0 for r in profiled)
  assert "decode profile of config B=1 at L=64, per token" in done.stdout


@pytest.mark.xdist_group("benchmarks")
def test_bench_mla_decode_small_checks_every_implementation(tmp_path):
  done = run_script("experiments.bench_mla_decode", "--small", out_dir=tmp_path)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = json.loads((tmp_path / "bench_mla_decode.json").read_text())
  ours = [r for r in rows if r["impl"] == "pallas"]
  assert len(ours) == 6 and all(r["ok"] and r["us"] > 0 for r in ours)
  assert all(r["ok"] for r in rows if r["impl"] == "xla")
  assert any(r["impl"] == "jax_mqa" and r.get("ok") for r in rows)   # JAX's kernel runs where L suits it


@pytest.mark.xdist_group("benchmarks")
def test_bench_short_conv_small_checks_the_kernel_against_the_fused_backward(tmp_path):
  done = run_script("experiments.bench_short_conv", "--small", out_dir=tmp_path)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = json.loads((tmp_path / "bench_short_conv.json").read_text())
  kernels = tuple(f"kernel (8, 128, 16, 4, '{form}')" for form in ("stored", "recomputed"))
  assert {(r["impl"], r["documents"]) for r in rows} == {(i, d) for i in ("fused", *kernels) for d in (False, True)}
  assert all(r["ok"] for r in rows) and all(0 < r["rel_errs"][0] < 4e-3 for r in rows if r["impl"] != "fused")


@pytest.mark.xdist_group("benchmarks")
def test_bench_attnres_small_checks_the_op_and_the_summary_against_fp32_autodiff(tmp_path):
  done = run_script("experiments.bench_attnres", "--small", out_dir=tmp_path)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = json.loads((tmp_path / "bench_attnres.json").read_text())
  buffered = ("scanned group", "scanned group, 8 read-outs")
  assert {(r["case"], r["impl"]) for r in rows} == (
      {(c, i) for c in buffered for i in ("op", "autodiff", "summary")}
      | {("unrolled layer", i) for i in ("op", "autodiff")})
  assert all(r["max_rel_err"] < 1e-5 for r in rows if r["impl"] in ("op", "summary"))
