# %% [markdown]
# # 1. KDA's bounded decay gate vs the softplus gate
#
# **Claim (the K3 article).** Parameterising KDA's log-decay as `g = γ_min·σ(·)` with `γ_min = −5` (instead of Kimi Linear's
# unbounded `−e^A·softplus(·)`) keeps `e^{±G}` inside a 16-token tile within the bf16/fp32 range, so every
# diagonal tile of the chunked algorithm is one matrix product on tensor cores: faster kernels, no fallback branch,
# no overflow at any length, and (the claim implies) no loss in model quality.
#
# This notebook measures three things:
# 1. **Speed** of the KDA op (forward + backward, the layer's fused entry) with each gate. The claim is judged like
#    with like on FLA's GPU kernels, which implement both gates: the bounded one with `safe_gate` (16-token diagonal
#    tiles on the tensor cores) and the softplus one position by position. Ours are timed beside them: the bounded
#    gate on the Pallas kernels and on the XLA path, the softplus gate on the XLA path (our kernels refuse unbounded
#    gates).
# 2. **Training loss** at equal steps, the same model with `model.kda.gate = "bounded"` or `"softplus"`.
# 3. **Finiteness at long T** with saturated gates: o, the final state and every gradient, for both gates, and for
#    the softplus gate pushed through the factorised tiles (what the bound protects against).
#
# **Scale.** `SCALE = "cpu"` is a smoke run (one KDA layer for 40 steps, the XLA path only): it checks that the
# notebook runs, and its numbers are not evidence for or against the claim. `SCALE = "gpu"` is the research setting
# (one H200: 4 layers of d = 512, 150 steps of 16K tokens, two seeds; the op timed at 8×4096×16×128, finiteness at
# T = 65,536); `docs/results.md` holds the table.

# %%
# Installs k3jax where it is not importable (Colab, a fresh VM). The repository has no public URL yet: set
# K3JAX_REPO to its git URL, e.g. "https://github.com/<owner>/k3jax.git".
K3JAX_REPO = "https://github.com/OWNER/k3jax.git"

import importlib.util
import shutil
import subprocess
import sys

if importlib.util.find_spec("k3jax") is None:
  if "OWNER" in K3JAX_REPO:
    raise RuntimeError("k3jax is not installed: set K3JAX_REPO in this cell to the repository's git URL")
  extras = "[gpu]" if shutil.which("nvidia-smi") else ""
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", f"k3jax{extras} @ git+{K3JAX_REPO}"])

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from experiments import harness
from experiments.benchmarks import kda as kda_benchmark
from experiments.configs import ablations
from experiments.ablations import gate, notebook, runs

SCALE = notebook.scale("cpu")   # "cpu": smoke run, minutes on a CPU; "gpu": minutes on one H200; "research": hours
study = ablations.gate(SCALE)
session = notebook.Session("01_gate", study)   # prints the settings; turns the compilation cache on
OUT, WORKDIR, results = session.out, session.workdir, session.results

# %% [markdown]
# ## 1. Speed of the KDA op, forward + backward
#
# Device time per call (back-to-back calls, `harness.pipelined_seconds`; FLA's by `triton.testing.do_bench`, the
# median), the inputs fresh normal draws, the same for every variant. On a GPU with fla-core installed FLA's kernels
# run both gates; the verdict compares those two. On a CPU only the XLA path exists: the cell times it (factorised
# vs pairwise diagonal tiles on the same path), which says nothing about the GPU kernels the claim is about.

# %%
dtype = jnp.dtype(study.settings["timed_dtype"])


def time_the_op():
  speed, start = [], time.perf_counter()
  elapsed = lambda: f"{time.perf_counter() - start:.0f} s"
  variants = gate.compiled_variants(study.settings["timed_shapes"], dtype=dtype)   # all compiled at once, first
  print(f"compiled {len(variants)} programs ({elapsed()})", flush=True)
  for v in variants:
    fn, args = v.pop("fn"), v.pop("args")
    speed.append({**v, "ms": 1e3 * harness.pipelined_seconds(fn, *args, repeats=study.settings["repeats"])})
    print(f"timed {v['gate']} on {v['path']} at {v['shape']} ({elapsed()})", flush=True)
  if jax.default_backend() == "gpu":   # FLA's kernels with each gate, on the same inputs
    for B, T, H, D in study.settings["timed_shapes"]:
      x, do = gate.raw_inputs(B, T, H, D, dtype=dtype)
      for g, path in gate.FLA_PATHS.items():
        fla = kda_benchmark.fla_runner(x, do, gate=g)
        if fla is None:
          print("fla-core is not installed: FLA's kernels are not timed", flush=True)
          break
        print(f"FLA, {g} gate at {B}x{T}x{H}x{D}: autotuning and timing ...", flush=True)
        speed.append({"gate": g, "backend": "fla", "path": path, "shape": f"{B}x{T}x{H}x{D}", "dtype": dtype.name,
                      "ms": fla["fwdbwd"]()})
        print(f"FLA, {g} gate timed ({elapsed()})", flush=True)
  return speed


# Recorded once per kind of device (FLA's autotuning alone takes minutes on a fresh GPU): a rerun reads it.
timing = {k: study.settings[k] for k in ("timed_shapes", "timed_dtype", "repeats")}
speed = session.measured("speed", {**timing, "fla": kda_benchmark.fla_version()}, time_the_op)
for r in speed:
  print(f"{r['shape']} {r['gate']:<9} {r['path']:<32} {r['ms']:9.3f} ms")
results["speed"] = speed
session.save()
if jax.default_backend() != "gpu":
  print("\nCPU: the XLA path only; the kernels the claim is about need a GPU (SCALE='gpu' on one).")

# %%
shapes = list(dict.fromkeys(r["shape"] for r in speed))
paths = list(dict.fromkeys((r["gate"], r["path"]) for r in speed))
fig, ax = plt.subplots(figsize=(8, 3.5), layout="constrained")
width = 0.8 / len(paths)
for i, (g, path) in enumerate(paths):
  ms = [next(r["ms"] for r in speed if r["shape"] == s and r["path"] == path) for s in shapes]
  ax.bar(np.arange(len(shapes)) + i * width, ms, width, label=f"{g}: {path}")
ax.set(xticks=np.arange(len(shapes)) + width * (len(paths) - 1) / 2, xticklabels=shapes, ylabel="ms per call",
       title=f"KDA forward + backward ({dtype.name}, {jax.default_backend()})")
ax.legend(fontsize=8)
fig.savefig(OUT / "01_gate_speed.png", dpi=120)
plt.show()

# %% [markdown]
# ## 2. Training loss at equal steps
#
# The same model, seeds and batches; only `model.kda.gate` differs. Both gates start at the same decay (the layer
# initialises `dt_bias` so that `g` agrees at `z = 0`).

# %%
# On a GPU every program of every run (inits, train steps, evaluations) first compiles side by side, one process
# per variant (minutes each otherwise; on a CPU of two cores that gains nothing). A run recorded under
# session.records (by an earlier run of this notebook, here or on another machine) is read, not trained again.
histories = runs.train_variants(study.configs(), WORKDIR, seeds=study.seeds,
                               precompile=notebook.precompile(SCALE), records=session.records)
training = results["training"] = runs.summarize(histories)
session.save()
for name, r in training.items():
  print(f"{name:<9} held-out loss {r['heldout_loss']['mean']:.4f} (min {r['heldout_loss']['min']:.4f}, "
        f"max {r['heldout_loss']['max']:.4f}, {r['heldout_loss']['n']} seeds); last 20% train loss "
        f"{r['tail_loss']['mean']:.4f}; {r['tokens_per_s']['mean']:,.0f} tokens/s")

# %%
fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
runs.plot_losses(training, ax, title="bounded vs softplus gate")
fig.savefig(OUT / "01_gate_loss.png", dpi=120)
plt.show()

# %% [markdown]
# ## 3. Finite at long T, saturated gates
#
# Every gate pre-activation is pushed to +30: the bounded gate then decays by `e^{−5}` per step, the softplus gate
# by `e^{−30}` to `e^{−480}`. `rel_err_o` is o against the fp32 recurrence. The third row feeds the softplus gate
# to the factorised tiles (`lower_bound = −5` promised, and broken): within a tile `e^{−G}` then overflows.

# %%
B, T, H, D = study.settings["long_shape"]
finite = gate.finiteness(B, T, H, D, dtype=jnp.dtype(study.settings["long_dtype"]))
results["finiteness"] = finite
session.save()
for r in finite:
  grads = "all finite" if all(r["finite_grads"].values()) else \
      "non-finite: " + ", ".join(n for n, ok in r["finite_grads"].items() if not ok)
  print(f"{r['case']:<47} T={r['T']} g in [{r['g_min']:.0f}, {r['g_max']:.0f}]  o finite {r['finite_o']}, "
        f"state finite {r['finite_state']}, grads {grads}; rel_err_o {r['rel_err_o']:.2e}")

# %%
session.save()
print(f"wrote {session.path}")
