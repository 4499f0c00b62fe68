"""Evaluates a checkpoint of a training run: held-out loss and synthetic-task accuracy at several lengths.

`python -m experiments.eval --workdir=DIR [--stage=N] [--step=S] [--lengths=256,1024] [--tasks=mqar,passkey]`
uses the config saved in the checkpoint; the result is printed and written as JSON to `--output`
(default DIR/eval_stage<N>_step<S>.json). Nothing else in DIR is written, moved or removed (an unusable checkpoint
is reported and the previous one evaluated).
"""
import pathlib

from absl import app, flags

from experiments import harness
from k3jax.train import trainer

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (as given to experiments.train)")
_STAGE = flags.DEFINE_integer("stage", None, "stage whose checkpoint to evaluate (default: the last one)")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the newest usable one)")
_LENGTHS = flags.DEFINE_list("lengths", None, "task lengths (default: the config's eval.lengths)")
_TASKS = flags.DEFINE_list("tasks", None, "tasks (default: the config's eval.tasks)")
_EXAMPLES = flags.DEFINE_integer("examples", None, "examples per task and length")
_MESH = flags.DEFINE_string("mesh", None, "device mesh, e.g. data:-1,expert:1 (default: the run's)")
_OUTPUT = flags.DEFINE_string("output", None, "JSON output path")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  harness.check_argv(argv)
  overrides = {"eval.lengths": _LENGTHS.value and tuple(int(x) for x in _LENGTHS.value),
               "eval.tasks": _TASKS.value and tuple(_TASKS.value), "eval.examples": _EXAMPLES.value,
               "mesh": _MESH.value}
  try:
    result = trainer.evaluate_checkpoint(_WORKDIR.value, stage=_STAGE.value, step=_STEP.value,
                                         overrides={k: v for k, v in overrides.items() if v is not None})
  except FileNotFoundError as e:
    raise SystemExit(f"error: {e}") from None
  default = pathlib.Path(_WORKDIR.value) / f"eval_stage{result['stage']}_step{result['step']}.json"
  harness.write_json(_OUTPUT.value or str(default), result)


if __name__ == "__main__":
  app.run(main)
