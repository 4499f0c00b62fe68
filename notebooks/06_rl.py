# %% [markdown]
# # 6. Agentic RL: held-out success before and after RL
#
# **Claim (K3 / Kimi).** Reinforcement learning on tool-use episodes raises the success of a policy that supervised
# fine-tuning on demonstrations (SFT) produced, on problems no training step saw, also at a longer context than the
# one it was trained at.
#
# Two environments with scripted solvers (`k3jax.rl`): *lookup*, a document of `key=value` records filling the
# context and a question such as `which key is 2 links from abc?`, answered by calling `<search>abc</search>` and then
# `<answer>...</answer>`; *calc*, a word problem answered with `<calc>12+3*4</calc>` calls. The model is first trained
# on the solvers' episodes (SFT, the ordinary trainer), then by GRPO from that checkpoint: each iteration samples a
# group of episodes per problem on the model's own cache, turn by turn, scores them (1 for a right answer), and
# steps on the clipped policy-gradient loss with a KL penalty to the SFT policy. Held-out success is measured
# greedily on the same problems before RL (the SFT policy) and after.
#
# **Scale.** `SCALE = "cpu"` is a smoke run (two layers of d = 64, KDA then MLA; 12 SFT steps, 4 RL iterations of 8
# episodes at 320 tokens, 8 held-out problems per point, at the trained length only): it checks that the notebook
# runs; its numbers are not evidence (an SFT policy this brief solves nothing, so the rewards carry no signal).
# `SCALE = "gpu"` is the research setting (`experiments/configs/rl_small.py` on one H200: the small model, ~100M
# activated parameters, 300 SFT steps of 64 episodes at 1K tokens, mostly chains of one or two links / operations,
# then 40 GRPO iterations of 16 problems × 8 samples at 4K on chains of up to four; 128 held-out problems per point
# of the longer chains, lookup also at 16K, 4× the RL length).

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
from experiments.ablations import notebook, rl

SCALE = notebook.scale("cpu")   # "cpu": smoke run, a minute or two on a CPU; "gpu": one H200; "research": hours
study = ablations.rl(SCALE)
session = notebook.Session("06_rl", study)   # prints the settings; turns the compilation cache on
OUT, WORKDIR, results = session.out, session.workdir, session.results

# %% [markdown]
# ## SFT, then GRPO
#
# `k3jax.rl.runner.RLRun.run` trains the SFT stage (`<run>/sft`), evaluates that policy on the held-out problems,
# runs the RL iterations from its final checkpoint (`<run>/rl`: a checkpoint every few iterations, metrics.jsonl,
# eval.jsonl) and evaluates the final policy. The RL programs compile in background threads while SFT trains.
# Running this cell again reuses what finished and continues an interrupted run where it stopped; a run recorded
# under session.records (by an earlier run of this notebook, here or on another machine) is read, not run again.

# %%
results.update(rl.train(study, WORKDIR, records=session.records))
session.save()
print(rl.format_table(results))

# %% [markdown]
# ## Success, reward and KL
#
# Left to right: the SFT loss; held-out success of the SFT policy and after RL at each evaluation point (error bars:
# two standard errors from the number of problems); the mean reward and success of each iteration's sampled
# rollouts; the KL of the policy to the SFT one (the penalised k3 estimate, on the rollouts' tokens).

# %%
fig = rl.plot(results, plt.figure(figsize=(17, 4), layout="constrained"))
fig.savefig(OUT / "06_rl.png", dpi=120)
plt.show()

# %%
session.save()
print(f"wrote {session.path}")
