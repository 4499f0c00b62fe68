# %% [markdown]
# # 4. Staged context extension vs direct training at the final length
#
# **Claim (K3).** Training in stages of growing sequence length (K3: 8K → 64K → 256K → 1M), each stage continuing
# from the last one's checkpoint at constant tokens per step, is cheaper than training at the final length from the
# start and loses nothing: the staged model reaches the same loss and retrieves as well at (and beyond) the final
# length. NoPE MLA needs no positional surgery between stages.
#
# Both variants see the same number of tokens (same tokens per step, same number of steps); the staged one spends
# most of its steps at short lengths. Both train on a mix of Python source, multi-query associative recall (MQAR)
# and passkey retrieval, and are evaluated on MQAR and passkey at the final training length and at 2× and 4× it.
#
# **Scale.** `SCALE = "cpu"` is a smoke run (128 → 256 tokens, a 2-layer model, 20 steps): it checks that the
# notebook runs; its numbers are not evidence (a model this small does not learn retrieval in 20 steps).
# `SCALE = "gpu"` is the research setting: 1K → 4K → 16K on one H200 (4 layers of d = 512, 150 steps of 16K tokens,
# evaluated up to 64K, two seeds).

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
import matplotlib.pyplot as plt
import numpy as np

from experiments.configs import ablations
from experiments.ablations import notebook, runs

SCALE = notebook.scale("cpu")   # "cpu": smoke run, minutes on a CPU; "gpu": minutes on one H200; "research": hours
study = ablations.context(SCALE)
session = notebook.Session("04_context", study)   # prints the settings; turns the compilation cache on
OUT, WORKDIR, results = session.out, session.workdir, session.results

# %% [markdown]
# ## Train both
#
# The staged run evaluates at the end of every stage; its last evaluation and the direct run's one are the
# comparison (same tokens, same final length).

# %%
# On a GPU every program of every run (inits, train steps, evaluations) first compiles side by side, one process
# per variant (minutes each otherwise; on a CPU of two cores that gains nothing). A run recorded under
# session.records (by an earlier run of this notebook, here or on another machine) is read, not trained again.
histories = runs.train_variants(study.configs(), WORKDIR, seeds=study.seeds,
                               precompile=notebook.precompile(SCALE), records=session.records)
tasks = study.base.eval.tasks
lengths = study.settings["eval_lengths"]
final_length = lengths[0]
summary = results["summary"] = runs.summarize(histories)
for name, hs in histories.items():
  summary[name].update(
      chance=hs[0]["evals"][-1]["chance"], seq_len=hs[0]["metrics"]["seq_len"],
      stage_evals=[[{"stage": e["stage"], "seq_len": e["seq_len"], "heldout_loss": e["heldout_loss"],
                     "accuracy": e["accuracy"]} for e in h["evals"]] for h in hs])
session.save()
print(f"{'variant':<8} {'held-out':>9} " + " ".join(f"{f'{t}@{n}':>14}" for t in tasks for n in lengths))
for name, s in summary.items():
  print(f"{name:<8} {s['heldout_loss']['mean']:9.4f} "
        + " ".join(f"{s['accuracy'][f'{t}@{n}']['mean']:14.3f}" for t in tasks for n in lengths))
print("chance: " + ", ".join(f"{t} {p:.3f}" for t, p in summary["direct"]["chance"].items())
      + f"; trained at {final_length}, evaluated up to {lengths[-1]}")

# %%
fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
for name, s in summary.items():
  config = study.configs()[name]
  tokens = np.asarray(s["step"]) * (runs.train_tokens(config) // config.steps)   # constant tokens per step
  ax_loss.plot(tokens, np.mean(s["loss"], axis=0), label=name, lw=1)
  for task, marker in zip(tasks, "os"):
    ax_acc.plot(lengths, [s["accuracy"][f"{task}@{n}"]["mean"] for n in lengths], marker=marker,
                label=f"{name} {task}")
for task, p in summary["direct"]["chance"].items():
  ax_acc.axhline(p, color="gray", ls=":", lw=1)
ax_acc.axvline(final_length, color="gray", ls="--", lw=1, label="final training length")
ax_loss.set(xlabel="training tokens", ylabel="training loss (nats/token)", yscale="log",
            title="loss at equal tokens (staged: the length grows)")
ax_acc.set(xlabel="evaluation length (tokens)", ylabel="answer-token accuracy", xscale="log", ylim=(0, 1.02),
           title="retrieval at and beyond the training length")
for ax in (ax_loss, ax_acc):
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
fig.savefig(OUT / "04_context.png", dpi=120)
plt.show()

# %%
session.save()
print(f"wrote {session.path}")
