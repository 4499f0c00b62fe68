"""Records a finished `experiments.rl` run as the RL notebook's run, so that notebook 06 reads it instead of training:

  python -m experiments.record_rl --run=runs/rl_small --scale=gpu --commit=<hash> --device="NVIDIA H200"

The run directory needs only its logs (sft/ and rl/ without checkpoints: what comes back from a GPU machine). The
record goes where the notebook looks (`<results>/<scale>/records/06_rl/`); it is refused unless the run's config
is the notebook's at that scale and seed, and an existing record is not overwritten
(`experiments.ablations.rl.record_for_notebook`).
"""
from absl import app, flags

from experiments import harness
from experiments.ablations import notebook, rl

_RUN = flags.DEFINE_string("run", None, "the run directory of experiments.rl (holding sft/ and rl/)")
_SCALE = flags.DEFINE_enum("scale", "gpu", list(notebook.SCALES), "the notebook's scale the run is")
_SEED = flags.DEFINE_integer("seed", None, "the run's seed (default: the study's first)")
_COMMIT = flags.DEFINE_string("commit", None, "the commit the run ran at")
_DEVICE = flags.DEFINE_string("device", None, "the device kind it ran on, as JAX names it (e.g. 'NVIDIA H200')")
_RESULTS = flags.DEFINE_string("results", "notebooks/results", "the notebooks' results directory")
flags.mark_flags_as_required(["run", "commit", "device"])


def main(argv):
  harness.check_argv(argv)
  path = rl.record_for_notebook(_RESULTS.value, _SCALE.value, _RUN.value, commit=_COMMIT.value,
                                device=_DEVICE.value, seed=_SEED.value)
  print(f"recorded {path}")


if __name__ == "__main__":
  app.run(main)
