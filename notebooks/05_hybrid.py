# %% [markdown]
# # 5. Hybrid ratio: 3:1 KDA:MLA vs all-MLA, all-KDA and 7:1
#
# **Claim (the K3 article pairs KDA with gated MLA; the 3:1 ratio is Kimi Linear's).** Mixing three KDA layers per
# gated MLA layer keeps most of linear attention's speed at long context (KDA's cost per token does not grow with
# the length; MLA's attention does) while the few global-attention layers keep exact recall, which a pure
# linear-attention model loses.
#
# Four 8-layer models that differ only in `model.layer_pattern` (`3to1` = KKKM KKKM, `7to1` = KKKKKKKM, all KDA, all
# MLA): forward (prefill) tokens/s against the sequence length at a constant number of tokens per call, the training
# tokens/s at the training length, and multi-query associative recall (MQAR) accuracy after the same training.
#
# **Scale.** `SCALE = "cpu"` is a smoke run (d = 32, the pre-norm residual, 8 steps, prefill timed at one length,
# 256, without the 7:1 model): it checks that the notebook runs; its numbers are not evidence (on a CPU at these
# lengths attention is cheap, and nothing is learned in 8 steps). `SCALE = "gpu"` is the research setting (one H200:
# d = 256, Block AttnRes, 120 steps of 16K MQAR tokens, two seeds; prefill timed up to 32K).

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
from experiments.ablations import notebook, runs, throughput

SCALE = notebook.scale("cpu")   # "cpu": smoke run, minutes on a CPU; "gpu": minutes on one H200; "research": hours
study = ablations.hybrid(SCALE)
session = notebook.Session("05_hybrid", study)   # prints the settings; turns the compilation cache on
OUT, WORKDIR, results = session.out, session.workdir, session.results

# %% [markdown]
# ## Train each pattern on MQAR
#
# Same seeds and batches; accuracy on the answer tokens (the values to recall), chance 0.1.

# %%
# On a GPU every program of every run (inits, train steps, evaluations) first compiles side by side, one process
# per variant (minutes each otherwise; on a CPU of two cores that gains nothing). A run recorded under
# session.records (by an earlier run of this notebook, here or on another machine) is read, not trained again.
histories = runs.train_variants(study.configs(), WORKDIR, seeds=study.seeds,
                               precompile=notebook.precompile(SCALE), records=session.records)
training = results["training"] = runs.summarize(histories)
recall = results["recall"] = {}
for name in histories:
  recall[name] = {"accuracy": training[name]["accuracy"]}
  print(f"{name:<8} " + ", ".join(f"{k} {s['mean']:.3f} (min {s['min']:.3f}, max {s['max']:.3f})"
                                  for k, s in recall[name]["accuracy"].items())
        + f"; training {training[name]['tokens_per_s']['mean']:,.0f} tokens/s at T={study.base.seq_len}")
session.save()

# %% [markdown]
# ## Forward tokens/s against length
#
# Each pattern's model as initialised (dense layers take the same time whatever their weights, so the speeds need
# no checkpoint and are measured in one process), `tokens // T` rows of T tokens per call, median of several calls
# after one untimed call (every program compiles first, all at once).

# %%
timing = {k: study.settings[k] for k in ("throughput_lengths", "throughput_tokens", "repeats")}


def time_the_forwards():
  models = throughput.models_at_init(study.configs())
  return throughput.forward_tokens_per_s(models, timing["throughput_lengths"], tokens=timing["throughput_tokens"],
                                         repeats=timing["repeats"])


# Recorded once per kind of device with the models it timed: a rerun reads it.
speed = session.measured("forward_tokens_per_s", {**timing, "models": throughput.described(study.configs())},
                         time_the_forwards)
for name, rows in speed.items():
  print(f"{name:<8} " + ", ".join(f"T={r['seq_len']}: {r['tokens_per_s']:,.0f} tok/s" for r in rows))
results["forward_tokens_per_s"] = speed
session.save()

# %%
fig, (ax_speed, ax_acc) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
for name, rows in speed.items():
  ax_speed.plot([r["seq_len"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
names = list(recall)
keys = list(recall[names[0]]["accuracy"])
width = 0.8 / len(keys)
for i, key in enumerate(keys):
  ax_acc.bar(np.arange(len(names)) + i * width, [recall[n]["accuracy"][key]["mean"] for n in names], width,
             label=key)
ax_acc.axhline(0.1, color="gray", ls=":", lw=1, label="chance")
ax_speed.set(xlabel="sequence length", ylabel="forward tokens/s", xscale="log", yscale="log",
             title=f"prefill throughput ({results['platform']})")
ax_acc.set(xticks=np.arange(len(names)) + width * (len(keys) - 1) / 2, xticklabels=names, ylim=(0, 1.02),
           ylabel="MQAR answer accuracy", title="recall after equal training")
for ax in (ax_speed, ax_acc):
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
fig.savefig(OUT / "05_hybrid.png", dpi=120)
plt.show()

# %%
session.save()
print(f"wrote {session.path}")
