"""Balance ablation: the tiny model trained briefly on skewed data once per MoE balancer; MaxVio and loss per step.

  python -m experiments.balance_ablation --workdir=runs/balance_ablation [--steps=100] [--seed=0] \
      [--methods=quantile,none,aux_loss,sign] [--config.model.moe.balancer_method=histogram]

Skewed data: an order-2 Markov chain over the 8 letters a–h (transition rows drawn from Dirichlet(0.2), so each
context has one or two likely successors), fed as a token shard. With 8 byte values out of 260, every MoE layer sees
few distinct inputs, and top-k routing piles onto a few experts: without balancing, MaxVio comes close to its
bound E/k − 1 = 3 within ten steps (seed 0). The router keeps its ordinary init: the data alone gives the balancers
work. The chain's own loss on its held-out stream (`optimal_loss`) is the floor a model can reach.

Each method trains in `workdir/<method>/` (a `k3jax.train` run: metrics.jsonl, eval.jsonl, final checkpoint) from
the same seed, hence the same initial model and batches. MaxVio is measured on each step's batch under the bias the
step ran with (before its balancer update); the loss is the cross-entropy alone (the aux-loss run's objective adds
its auxiliary loss). Writes `balance_ablation.json` and `balance_ablation.png` to `workdir` (`wall_s`: this
invocation's time on the method, compilation included). Running the same command again reuses finished runs; a
method directory holding a run of another config is an error.
"""
from __future__ import annotations

import copy
import json
import pathlib
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from experiments.configs import tiny
from k3jax import config as config_lib
from k3jax.train import trainer

ALPHABET = b"abcdefgh"
CHAIN_ORDER = 2
CHAIN_CONCENTRATION = 0.2
TRAIN_TOKENS, HELDOUT_TOKENS = 2 ** 18, 2 ** 14


def ablation_config():
  """The tiny config set up for the ablation: skewed shards only, every step logged, one checkpoint at the end,
  held-out loss only (no task evaluation)."""
  c = tiny.get_config()
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


def method_config(config, method: str, steps: int, seed: int):
  c = copy.deepcopy(config)
  c.steps, c.seed = steps, seed
  c.model.moe.balancer = method
  return c


def check_reusable(run_dir: pathlib.Path, config) -> None:
  saved = run_dir / "config.json"
  if saved.exists() and json.loads(saved.read_text()) != json.loads(config.to_json_best_effort()):
    raise ValueError(f"{run_dir} holds a run with another config (steps, seed or overrides differ): "
                     f"use a new --workdir or the same flags")


def read_run(run_dir: pathlib.Path, steps: int) -> dict:
  """Per logged step loss and MaxVio (max over MoE layers and per layer), and the summary, of a finished run."""
  records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
  evals = [json.loads(l) for l in (run_dir / "eval.jsonl").read_text().splitlines() if l.strip()]
  step = [r["step"] for r in records]
  loss = [r["loss"] for r in records]
  per_layer = [r["moe_max_vio"] for r in records]
  max_vio = [max(v) for v in per_layer]
  last_half = [i for i, s in enumerate(step) if s > steps / 2]
  summary = {"mean_max_vio_last_half": float(np.mean([max_vio[i] for i in last_half])),
             "final_max_vio": max_vio[-1], "final_loss": loss[-1],
             "mean_loss_last_half": float(np.mean([loss[i] for i in last_half])),
             "heldout_loss": evals[-1]["heldout_loss"]}
  return {"step": step, "loss": loss, "max_vio": max_vio, "max_vio_per_layer": per_layer, "summary": summary}


def run_ablation(config, workdir, methods, *, steps: int, seed: int) -> dict:
  """Trains `config` once per balancer in `methods` (from `seed`, `steps` steps) on the skewed shards written to
  `workdir/data`, unless `config.data.shards` names others; writes the JSON table and the plot; returns the table."""
  unknown = [m for m in methods if m not in config_lib.BALANCERS]
  if unknown or not methods or len(set(methods)) != len(methods):
    raise ValueError(f"methods must be distinct balancers from {config_lib.BALANCERS}, got {list(methods)}")
  if steps < 2:
    raise ValueError(f"steps must be >= 2 (the summary averages the last half), got {steps}")
  workdir = pathlib.Path(workdir).resolve()
  config = copy.deepcopy(config)
  ours = not config.data.shards and config.data.mix.get("shards", 0.0) > 0
  if ours:
    config.data.shards, config.data.heldout_shards = (str(workdir / "data" / f"{n}.npy") for n in ("train", "heldout"))
  configs = {m: method_config(config, m, steps, seed) for m in methods}
  for m, c in configs.items():
    check_reusable(workdir / m, c)
  optimal_loss = None
  if ours:
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    train, heldout, optimal_loss = markov_tokens(seed)
    np.save(config.data.shards, train)
    np.save(config.data.heldout_shards, heldout)

  results = {}
  for m, c in configs.items():
    start = time.perf_counter()
    trainer.Run(c).train(workdir / m)
    results[m] = {**read_run(workdir / m, steps), "wall_s": time.perf_counter() - start}
  model = config.model
  table = {"steps": steps, "seed": seed, "optimal_loss": optimal_loss,
           "moe_layers": [i for i in range(model.num_layers) if config_lib.uses_moe(model, i)],
           "max_vio_bound": model.moe.num_experts / model.moe.top_k - 1, "methods": results}
  harness.write_json(str(workdir / "balance_ablation.json"), table)
  plot(table, workdir / "balance_ablation.png")
  return table


def plot(table: dict, path) -> None:
  """Two panels, one line per method: MaxVio (max over MoE layers) and loss against the step."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(11, 4), layout="constrained")
  ax_vio, ax_loss = fig.subplots(1, 2)
  for name, r in table["methods"].items():
    ax_vio.plot(r["step"], r["max_vio"], label=name, lw=1)
    ax_loss.plot(r["step"], r["loss"], label=name, lw=1)
  ax_vio.axhline(table["max_vio_bound"], color="gray", ls=":", lw=1, label="bound E/k − 1")
  if table["optimal_loss"] is not None:
    ax_loss.axhline(table["optimal_loss"], color="gray", ls=":", lw=1, label="chain's own loss")
  ax_vio.set(xlabel="step", ylabel="MaxVio (max over MoE layers)", title="load imbalance")
  ax_loss.set(xlabel="step", ylabel="training loss (nats/token)", yscale="log", title="loss")
  for ax in (ax_vio, ax_loss):
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  fig.savefig(path, dpi=120)


def format_table(table: dict) -> str:
  lines = [f"{table['steps']} steps, seed {table['seed']}; MaxVio bound {table['max_vio_bound']:g}"
           + (f"; the chain's own loss {table['optimal_loss']:.4f}" if table["optimal_loss"] is not None else ""),
           "method     MaxVio(last half)  MaxVio(final)  loss(final)  loss(last half)  held-out loss  wall s"]
  for name, r in table["methods"].items():
    s = r["summary"]
    heldout = "-" if s["heldout_loss"] is None else f"{s['heldout_loss']:.4f}"
    lines.append(f"{name:<10} {s['mean_max_vio_last_half']:17.3f}  {s['final_max_vio']:13.3f}  {s['final_loss']:11.4f}"
                 f"  {s['mean_loss_last_half']:15.4f}  {heldout:>13}  {r['wall_s']:6.1f}")
  return "\n".join(lines)


_CONFIG = config_flags.DEFINE_config_dict("config", ablation_config(), "model and training settings; the balancer, "
                                          "steps and seed come from the flags below", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory: one run per method, the JSON table, the plot")
_STEPS = flags.DEFINE_integer("steps", 100, "training steps per method")
_METHODS = flags.DEFINE_list("methods", ["quantile", "none", "aux_loss", "sign"], "balancers (model.moe.balancer)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the model init, the batches and the skewed data")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  harness.check_argv(argv)
  table = run_ablation(_CONFIG.value, _WORKDIR.value, _METHODS.value, steps=_STEPS.value, seed=_SEED.value)
  print(format_table(table), flush=True)


if __name__ == "__main__":
  app.run(main)
