# %% [markdown]
# # 3. Attention residuals: Block AttnRes vs full AttnRes vs the pre-norm residual
#
# **Claim (K3 / AttnRes).** Replacing the fixed residual sum by a softmax over depth (each sub-layer reads a learned
# mixture of the embedding and earlier block sums) lowers the loss at equal compute; the reported 16-layer numbers
# are 1.766 (pre-norm) → 1.746 (Block AttnRes) → 1.737 (full AttnRes, every sub-layer its own source). Block
# AttnRes keeps most of the gain with a handful of sources.
#
# This notebook trains the same model three ways (`model.residual.mode` = "block", "full", "none"), compares the
# loss curves, and reads the learned depth weights from the trained models: for every sub-layer, the mean softmax
# weight it puts on each source (`experiments.ablations.residual.depth_weights`; zero-initialised pseudo-queries start
# uniform, so any structure is learned).
#
# **Scale.** `SCALE = "cpu"` is a smoke run (2 MLA layers, d = 64, 40 steps): it checks that the notebook runs; its
# numbers are not evidence. `SCALE = "gpu"` is the research setting (one H200: 8 layers of KDA and MLA 3:1, d = 384,
# 150 steps of 16K tokens, two seeds).

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
from experiments.ablations import notebook, residual, runs
from k3jax.data import pipeline

SCALE = notebook.scale("cpu")   # "cpu": smoke run, minutes on a CPU; "gpu": minutes on one H200; "research": hours
study = ablations.residual(SCALE)
session = notebook.Session("03_residual", study)   # prints the settings; turns the compilation cache on
OUT, WORKDIR, results = session.out, session.workdir, session.results

# %% [markdown]
# ## Loss curves
#
# Same seeds and batches for the three residual schemes; held-out loss at the end on the held-out split.

# %%
# The depth weights are read from seed 0's block and full models right after each trains (`measure`), averaged
# over the tokens of held-out rows; they are kept with the run's record, so a rerun needs no checkpoint.
rows = pipeline.Mixture(study.base.data, study.base.seq_len, pipeline.derive_seed(0, 0, "heldout"),
                        vocab_size=study.base.model.vocab_size, split="heldout")
batch = rows.rows(0, study.settings["depth_weight_rows"])


def measure(name, seed, directory):
  if name in ("block", "full") and seed == study.seeds[0]:
    _, model = runs.trained_model(directory)
    return {"depth_weights": residual.depth_weights(model, batch["tokens"], segment_ids_BT=batch["segment_ids"])}


# On a GPU every program of every run (inits, train steps, evaluations) first compiles side by side, one process
# per variant (minutes each otherwise; on a CPU of two cores that gains nothing). A run recorded under
# session.records (by an earlier run of this notebook, here or on another machine) is read, not trained again.
histories = runs.train_variants(study.configs(), WORKDIR, seeds=study.seeds,
                               precompile=notebook.precompile(SCALE), records=session.records, measure=measure)
training = results["training"] = runs.summarize(histories)
for name in training:
  s = training[name]["heldout_loss"]
  print(f"{name:<8} held-out loss {s['mean']:.4f} (min {s['min']:.4f}, max {s['max']:.4f}, {s['n']} seeds); "
        f"{training[name]['tokens_per_s']['mean']:,.0f} training tokens/s")
session.save()

# %%
fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
runs.plot_losses(training, ax, title="residual scheme")
fig.savefig(OUT / "03_residual_loss.png", dpi=120)
plt.show()

# %% [markdown]
# ## Learned depth weights
#
# Rows: the sub-layers in the order they run (each layer's token mixer, then its FFN, then the final read-out
# before the LM head). Columns: source 0 is the token embedding; in block mode the next are the completed block
# sums and the last the current block's partial sum; in full mode every earlier sub-layer output. Weights are
# averaged over the tokens of held-out rows (seed 0's model).

# %%
depth = {name: histories[name][0]["measured"]["depth_weights"] for name in ("block", "full")}
results["depth_weights"] = depth
session.save()

fig, axes = plt.subplots(1, len(depth), figsize=(6 * len(depth), 5), layout="constrained")
for ax, (name, readouts) in zip(np.atleast_1d(axes), depth.items()):
  width = max(len(r["weights"]) for r in readouts)
  grid = np.full((len(readouts), width), np.nan)
  for i, r in enumerate(readouts):
    grid[i, :len(r["weights"])] = r["weights"]
  image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
  ax.set(yticks=range(len(readouts)), yticklabels=[r["name"] for r in readouts], xticks=range(width),
         xlabel="source (0: the embedding)",
         title=f"{name} AttnRes: mean depth weight")
  fig.colorbar(image, ax=ax)
fig.savefig(OUT / "03_residual_depth_weights.png", dpi=120)
plt.show()
for name, readouts in depth.items():
  print(f"{name}: pseudo-query norms |w_l| " + ", ".join(f"{r['query_norm']:.2f}" for r in readouts))

# %%
session.save()
print(f"wrote {session.path}")
