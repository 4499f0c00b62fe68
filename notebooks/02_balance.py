# %% [markdown]
# # 2. MoE load balancing: none, Switch aux loss, DeepSeek sign, the article's quantile balancing, the cut-off quantile
#
# **Claim (K3).** Quantile-based balancing (the article's §4.2: each expert's selection counts over recent steps,
# its deviation from the median load, a smooth bounded correction of its selection bias; no auxiliary loss) keeps
# every expert's load at its share, `MaxVio = max_j L_j − 1 ≈ 0`, without touching the training objective.
# Beside it, the project's own cut-off quantile (the bias that would give each expert exactly its share of the
# step's tokens, exact and in the histogram form a distributed run all-reduces). Baselines: no balancing, the
# Switch-style auxiliary loss, and DeepSeek-V3's sign update of the bias (at γ = 1e-2, which moves the biases within
# the study's steps; at its own 1e-3 they barely move).
#
# The data is deliberately skewed (an order-2 Markov chain over 8 letters, `experiments.ablations.balance`): with so few
# distinct inputs top-k routing piles onto a few experts, which is what a balancer must undo. MaxVio is measured on
# each step's batch before that step's balancer update; the loss is the cross-entropy alone.
#
# **Scale.** `SCALE = "cpu"` is a smoke run (one MoE layer of 8 experts, 40 steps): it checks that the notebook
# runs; its numbers are not evidence. `SCALE = "gpu"` is the research setting (one H200: 4 layers of d = 512, 64
# experts top-4 in the last three, 100 steps of 16K tokens, two seeds).

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

from experiments.configs import ablations
from experiments.ablations import balance, notebook

SCALE = notebook.scale("cpu")   # "cpu": smoke run, minutes on a CPU; "gpu": minutes on one H200; "research": hours
study = ablations.balance(SCALE)
session = notebook.Session("02_balance", study)   # prints the settings; turns the compilation cache on
OUT, WORKDIR, results = session.out, session.workdir, session.results

# %% [markdown]
# ## Train once per method and seed
#
# Every method starts from the same model and sees the same batches (same seed): step 1 runs before any balancer
# update, so its loss and MaxVio agree across methods.

# %%
# On a GPU every program of every run (inits, train steps, evaluations) first compiles side by side, one process
# per method (minutes each otherwise; on a CPU of two cores that gains nothing). A run recorded under
# session.records (by an earlier run of this notebook, here or on another machine) is read, not trained again.
table = balance.train_methods(study.configs(), WORKDIR, seeds=study.seeds, data_seed=study.settings["data_seed"],
                              precompile=notebook.precompile(SCALE), records=session.records)
print(balance.format_table(table))

# %%
fig = balance.plot(table, plt.figure(figsize=(11, 4), layout="constrained"))
fig.savefig(OUT / "02_balance.png", dpi=120)
plt.show()

# %% [markdown]
# ## Load per expert at the end
#
# MaxVio is one number per layer; the per-layer values of the last step show whether one layer carries the
# imbalance.

# %%
for name, r in table["methods"].items():
  last = [x["max_vio_per_layer"][-1] for x in r["runs"]]
  print(f"{name:<19} final MaxVio per MoE layer {table['moe_layers']}: "
        + "; ".join(", ".join(f"{v:.3f}" for v in seed) for seed in last))

# %%
results.update(table)
session.save()
print(f"wrote {session.path}")
