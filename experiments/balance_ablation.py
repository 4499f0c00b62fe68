"""Balance ablation: the tiny model trained briefly on skewed data once per MoE balancer; MaxVio and loss per step.

  python -m experiments.balance_ablation --workdir=runs/balance_ablation [--steps=100] [--seeds=0,1] \
      [--methods=article,cutoff,cutoff_histogram,none,aux_loss,sign] [--data_seed=0]

The ablation itself (the skewed data, the methods, the table) is `experiments.ablations.balance`; each method trains in
`workdir/<method>/seed_<s>/`. Writes `balance_ablation.json` and `balance_ablation.png` to `workdir` (`wall_s`: this
invocation's time on each run, compilation included). Running the same command again reuses finished runs; a run
directory holding a run of another config is an error.
"""
from absl import app, flags
from ml_collections import config_flags

from experiments import harness
from experiments.configs import tiny
from experiments.ablations import balance

_CONFIG = config_flags.DEFINE_config_dict("config", balance.ablation_config(tiny.get_config()),
                                          "model and training settings; the balancer, steps and seed come from the "
                                          "flags below", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory: one run per method and seed, the table, the plot")
_STEPS = flags.DEFINE_integer("steps", 100, "training steps per run")
_METHODS = flags.DEFINE_list("methods", ["article", "cutoff", "none", "aux_loss", "sign"],
                             f"balancing methods, from {sorted(balance.METHODS)}")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds of the model init and the batches (one run per method and seed)")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "seed of the skewed data")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  harness.check_argv(argv)
  table = balance.run_ablation(_CONFIG.value, _WORKDIR.value, _METHODS.value, steps=_STEPS.value,
                               seeds=[int(s) for s in _SEEDS.value], data_seed=_DATA_SEED.value)
  harness.write_json(f"{_WORKDIR.value}/balance_ablation.json", table)
  balance.plot(table).savefig(f"{_WORKDIR.value}/balance_ablation.png", dpi=120)
  print(balance.format_table(table), flush=True)


if __name__ == "__main__":
  app.run(main)
