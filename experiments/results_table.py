"""The research-fidelity table of docs/results.md from the notebooks' JSON (`experiments.ablations.verdicts`: the rules,
the rows, the table), and the table of what each notebook runs at a scale (experiments/configs/ablations.py).

  python -m experiments.results_table --results=notebooks/results --scale=gpu            # print the table
  python -m experiments.results_table --results=notebooks/results --scale=cpu --write    # into docs/results.md

`--write` replaces the text between the table's markers for that scale in docs/results.md, the table of what each
notebook runs at that scale between its own markers, and the verdict rules between theirs.
"""
import pathlib

from absl import app, flags

from experiments import harness
from experiments.configs import ablations
from experiments.ablations import notebook, verdicts

_RESULTS = flags.DEFINE_string("results", "notebooks/results", "directory holding <scale>/<notebook>.json")
_SCALE = flags.DEFINE_enum("scale", "gpu", list(notebook.SCALES), "which results")
_WRITE = flags.DEFINE_bool("write", False, "write the tables into docs/results.md between their markers")
_DOC = flags.DEFINE_string("doc", str(pathlib.Path(__file__).resolve().parent.parent / "docs" / "results.md"),
                           "the results page")


def main(argv):
  harness.check_argv(argv)
  text = verdicts.table(_RESULTS.value, _SCALE.value)
  print(text)
  if _WRITE.value:
    doc = pathlib.Path(_DOC.value)
    verdicts.write_into(doc, _SCALE.value, text)
    verdicts.write_into(doc, _SCALE.value, verdicts.settings_table(ablations.NOTEBOOKS, _SCALE.value), verdicts.SETTINGS_MARKERS)
    verdicts.write_into(doc, _SCALE.value, verdicts.rules_text(), verdicts.RULES_MARKERS)


if __name__ == "__main__":
  app.run(main)
