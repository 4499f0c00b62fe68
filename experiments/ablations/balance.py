"""MoE balancing ablation: one model trained on skewed data once per balancer; MaxVio and loss per step.

Skewed data: an order-2 Markov chain over the 8 letters a–h (transition rows drawn from Dirichlet(0.2), so each
context has one or two likely successors), fed as a token shard. With 8 byte values out of the vocabulary, every MoE
layer sees few distinct inputs, and top-k routing piles onto a few experts: without balancing, MaxVio comes close to
its bound E/k − 1 within a few steps. The router keeps its ordinary init: the data alone gives the balancers work.
The chain's own loss on its held-out stream (`optimal_loss`) is the floor a model can reach.

Each method trains as a `runs.train_variants` variant (`workdir/<method>/seed_<s>/`), every method from the same
seed, hence the same initial model and batches. MaxVio is measured on each step's batch under the bias the step ran
with (before its balancer update); the loss is the cross-entropy alone (the aux-loss run's objective adds its
auxiliary loss).
"""
from __future__ import annotations

import copy
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from k3jax import spec as spec_lib
from experiments.ablations import runs
from k3jax.train import workdir as workdir_lib

ALPHABET = b"abcdefgh"
CHAIN_ORDER = 2
CHAIN_CONCENTRATION = 0.2
TRAIN_TOKENS, HELDOUT_TOKENS = 2 ** 18, 2 ** 14
# Each method sets the balancer and its method (model.moe.balancer, model.moe.balancer_method): the baselines, the
# K3 article's quantile balancing, and the project's cut-off quantile (exact, and its histogram form). The sign
# update at DeepSeek-V3's γ = 1e-3 moves a bias by at most 0.1 in 100 steps; the study's γ moves it by up to 1.
METHODS = {
    "none": {"model.moe.balancer": "none"},
    "aux_loss": {"model.moe.balancer": "aux_loss"},
    "sign": {"model.moe.balancer": "sign", "model.moe.sign_update_rate": 1e-2},
    "article": {"model.moe.balancer": "quantile", "model.moe.balancer_method": "article"},
    "cutoff": {"model.moe.balancer": "quantile", "model.moe.balancer_method": "exact"},
    "cutoff_histogram": {"model.moe.balancer": "quantile", "model.moe.balancer_method": "histogram"},
}
SUMMARY = ("mean_max_vio_last_half", "final_max_vio", "final_loss", "mean_loss_last_half", "heldout_loss",
           "final_bias_range")


def ablation_config(base):
  """A copy of `base` (an MoE config) set up for the ablation: the skewed shards only, every step logged, one
  checkpoint at the end, held-out loss only (no task evaluation)."""
  c = copy.deepcopy(base)
  if not c.model.moe.enabled:
    raise ValueError("the balancing ablation needs a config with model.moe.enabled")
  c.log_every = 1
  c.checkpoint_every = 10 ** 9    # the run saves at its end anyway
  c.keep_checkpoints = 1
  for name in c.data.mix:
    c.data.mix[name] = 1.0 if name == "shards" else 0.0
  c.eval.examples = 0
  return c


def markov_tokens(seed: int) -> tuple[np.ndarray, np.ndarray, float]:
  """(train tokens, held-out tokens, the chain's own loss in nats/token on the held-out tokens) of the order-2
  chain drawn from `seed`; both streams come from the same chain."""
  a = len(ALPHABET)
  chain_rng, train_rng, heldout_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
  probs_CA = chain_rng.dirichlet(np.full(a, CHAIN_CONCENTRATION), size=a ** CHAIN_ORDER)
  cum_CA = np.cumsum(probs_CA, axis=1)

  def sample(rng, n):
    x = np.zeros(n, np.int64)
    u = rng.random(n)
    for i in range(CHAIN_ORDER, n):
      x[i] = min(np.searchsorted(cum_CA[x[i - 2] * a + x[i - 1]], u[i], side="right"), a - 1)
    return x

  train, heldout = sample(train_rng, TRAIN_TOKENS), sample(heldout_rng, HELDOUT_TOKENS)
  optimal = float(-np.mean(np.log(probs_CA[heldout[:-2] * a + heldout[1:-1], heldout[2:]])))
  letters = np.frombuffer(ALPHABET, np.uint8).astype(np.int32)
  return letters[train], letters[heldout], optimal


def method_configs(config, methods: Sequence[str], steps: int) -> dict:
  """{method: `config` with that method's balancer settings and `steps` steps}."""
  unknown = [m for m in methods if m not in METHODS]
  if unknown or not methods or len(set(methods)) != len(methods):
    raise ValueError(f"methods must be distinct names from {sorted(METHODS)}, got {list(methods)}")
  out = {}
  for m in methods:
    c = runs.override(config, METHODS[m])
    c.steps = steps
    out[m] = c
  return out


def summarize_run(history: dict, steps: int) -> dict:
  """Per logged step loss and MaxVio (max over MoE layers, and per layer) of one run, and its summary."""
  m = history["metrics"]
  step, loss, per_layer = m["step"], m["loss"], m["moe_max_vio"]
  max_vio = [max(v) for v in per_layer]
  last_half = [i for i, s in enumerate(step) if s > steps / 2]
  evals = history["evals"]
  summary = {"mean_max_vio_last_half": float(np.mean([max_vio[i] for i in last_half])),
             "final_max_vio": max_vio[-1], "final_loss": loss[-1],
             "mean_loss_last_half": float(np.mean([loss[i] for i in last_half])),
             "heldout_loss": evals[-1]["heldout_loss"] if evals else None,
             # The largest spread of a layer's bias at the end (None for runs logged before it was).
             "final_bias_range": max(m["moe_bias_range"][-1]) if m.get("moe_bias_range") else None}
  return {"step": step, "loss": loss, "max_vio": max_vio, "max_vio_per_layer": per_layer, "summary": summary,
          "wall_s": history["wall_s"]}


def markov_paths(seed: int, directory) -> tuple[str, str]:
  """(train, held-out) token files of the chain drawn from `seed` under `directory` (see `markov_shards`)."""
  return tuple(str(pathlib.Path(directory) / f"markov_{seed}_{split}.npy") for split in ("train", "heldout"))


def markov_shards(seed: int, directory) -> tuple[str, str]:
  """`markov_paths`, the files written there unless they are already (each whole, then renamed: a reader never
  sees a partial one)."""
  directory = pathlib.Path(directory)
  paths = [pathlib.Path(p) for p in markov_paths(seed, directory)]
  if not all(p.exists() for p in paths):
    directory.mkdir(parents=True, exist_ok=True)
    for path, tokens in zip(paths, markov_tokens(seed)[:2]):
      tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
      np.save(tmp, tokens)
      os.replace(tmp, path)
  return tuple(str(p) for p in paths)


def run_ablation(config, workdir, methods: Sequence[str], *, steps: int, seeds: Sequence[int] = (0,),
                 data_seed: int = 0, precompile: bool = False) -> dict:
  """Trains `config` once per method and seed for `steps` steps on the skewed shards of `data_seed` (written to
  `workdir/data`), unless `config.data.shards` names others; returns the table of `train_methods`."""
  workdir = pathlib.Path(workdir).resolve()
  config = copy.deepcopy(config)
  ours = not config.data.shards and config.data.mix.get("shards", 0.0) > 0
  if ours:
    config.data.shards, config.data.heldout_shards = markov_paths(data_seed, workdir / "data")
  configs = method_configs(config, methods, steps)
  for m, c in configs.items():  # before the data is written
    for s in seeds:
      workdir_lib.check_resume(runs.run_dir(workdir, m, s), runs.with_seed(c, s))
  if ours:
    markov_shards(data_seed, workdir / "data")
  return train_methods(configs, workdir, seeds=seeds, data_seed=data_seed if ours else None, precompile=precompile)


def train_methods(configs, workdir, *, seeds: Sequence[int] = (0,), data_seed: int | None = None,
                  precompile: bool = False, records=None) -> dict:
  """Trains each config of `configs` ({method: config}, equal but for the balancer) once per seed
  (`runs.train_variants`, `precompile` and `records` as there) and returns the table (see `format_table`): per
  method and seed the loss and MaxVio per step, and their summaries over seeds. `data_seed`: the chain the shards
  hold (its own loss is then reported as the floor), None for other data."""
  config = next(iter(configs.values()), None)
  if config is None or config.steps < 2 or len({c.steps for c in configs.values()}) != 1:
    raise ValueError("configs must be non-empty with equal steps >= 2 (the summary averages the last half)")
  model, steps = config.model, config.steps
  histories = runs.train_variants(configs, workdir, seeds=seeds, precompile=precompile, records=records)
  table = {"steps": steps, "seeds": list(seeds), "data_seed": data_seed,
           "optimal_loss": None if data_seed is None else markov_tokens(data_seed)[2],
           "moe_layers": list(spec_lib.model_spec(model).moe_layers),
           "max_vio_bound": model.moe.num_experts / model.moe.top_k - 1, "methods": {}}
  for m, hs in histories.items():
    per_seed = [{"seed": s, **summarize_run(h, steps)} for s, h in zip(seeds, hs)]
    table["methods"][m] = {"runs": per_seed, "summary": {
        k: None if any(r["summary"][k] is None for r in per_seed) else runs.spread(r["summary"][k] for r in per_seed)
        for k in SUMMARY}}
  return table


def plot(table: dict, fig=None):
  """Two panels, one line per method (the mean over seeds): MaxVio (max over MoE layers) and loss against the step.
  Draws into `fig` (e.g. a pyplot figure in a notebook), else a new `Figure`; returns it."""
  if fig is None:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4), layout="constrained")
  ax_vio, ax_loss = fig.subplots(1, 2)
  for name, r in table["methods"].items():
    step = r["runs"][0]["step"]
    ax_vio.plot(step, np.mean([x["max_vio"] for x in r["runs"]], axis=0), label=name, lw=1)
    ax_loss.plot(step, np.mean([x["loss"] for x in r["runs"]], axis=0), label=name, lw=1)
  ax_vio.axhline(table["max_vio_bound"], color="gray", ls=":", lw=1, label="bound E/k − 1")
  if table["optimal_loss"] is not None:
    ax_loss.axhline(table["optimal_loss"], color="gray", ls=":", lw=1, label="chain's own loss")
  seeds = f" (mean of {len(table['seeds'])} seeds)" if len(table["seeds"]) > 1 else ""
  ax_vio.set(xlabel="step", ylabel="MaxVio (max over MoE layers)", title="load imbalance" + seeds)
  ax_loss.set(xlabel="step", ylabel="training loss (nats/token)", yscale="log", title="loss" + seeds)
  for ax in (ax_vio, ax_loss):
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  return fig


def format_table(table: dict) -> str:
  """One line per method: the summary's means over seeds (± the standard deviation with several seeds)."""
  def cell(s, width, digits):
    if s is None:
      return f"{'-':>{width}}"
    text = f"{s['mean']:.{digits}f}" + (f"±{s['std']:.{digits}f}" if s["std"] is not None else "")
    return f"{text:>{width}}"

  optimal = table["optimal_loss"]
  lines = [f"{table['steps']} steps, seeds {table['seeds']}; MaxVio bound {table['max_vio_bound']:g}"
           + (f"; the chain's own loss {optimal:.4f}" if optimal is not None else ""),
           f"{'method':<19}{'MaxVio(last half)':>20}{'MaxVio(final)':>18}{'loss(final)':>18}"
           f"{'loss(last half)':>18}{'held-out loss':>18}{'bias range':>12}{'wall s':>8}"]
  for name, r in table["methods"].items():
    s = r["summary"]
    wall = sum(x["wall_s"] for x in r["runs"])
    lines.append(f"{name:<19}{cell(s['mean_max_vio_last_half'], 20, 3)}{cell(s['final_max_vio'], 18, 3)}"
                 f"{cell(s['final_loss'], 18, 4)}{cell(s['mean_loss_last_half'], 18, 4)}"
                 f"{cell(s['heldout_loss'], 18, 4)}{cell(s['final_bias_range'], 12, 3)}{wall:8.1f}")
  return "\n".join(lines)
