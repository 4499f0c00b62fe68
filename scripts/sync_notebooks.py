#!/usr/bin/env python3
"""Writes notebooks/*.ipynb from their percent-format sources notebooks/*.py, outputs empty (Colab opens the .ipynb;
the .py is what is edited and reviewed).

  python scripts/sync_notebooks.py            # rewrite every .ipynb whose .py changed
  python scripts/sync_notebooks.py --check    # exit 1, naming them, if any .ipynb is out of date

The sources use the percent format jupytext reads (`# %%` starts a code cell, `# %% [markdown]` a markdown cell
whose lines are comments), so `jupytext --to ipynb` gives the same cells (checked on notebooks 01-05 with jupytext
1.19); this script needs only the standard library. The check compares cell types and sources, not the JSON bytes, so a notebook written by jupytext or saved
from Jupyter with outputs cleared passes as well.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
METADATA = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"}}


def cells_of(source: str, name: str = "<source>") -> list[tuple[str, str]]:
  """(cell type, cell source) pairs of a percent-format script; ValueError for text before the first cell marker,
  an unknown marker, or a markdown line that is not a comment."""
  cells, kind, lines = [], None, []

  def close():
    if kind is not None:
      text = "\n".join(lines).strip("\n")
      cells.append((kind, text))

  for number, line in enumerate(source.splitlines(), start=1):
    if line.startswith("# %%"):
      close()
      marker = line[len("# %%"):].strip()
      if marker not in ("", "[markdown]"):
        raise ValueError(f"{name}:{number}: unknown cell marker {line!r} (use '# %%' or '# %% [markdown]')")
      kind, lines = ("markdown" if marker else "code"), []
    elif kind is None:
      if line.strip():
        raise ValueError(f"{name}:{number}: text before the first '# %%' cell marker")
    elif kind == "markdown":
      if line and not (line == "#" or line.startswith("# ")):
        raise ValueError(f"{name}:{number}: a markdown cell's lines must be comments ('# ...'), got {line!r}")
      lines.append(line[2:])
    else:
      lines.append(line)
  close()
  return cells


def notebook_of(cells: list[tuple[str, str]]) -> dict:
  """An nbformat 4.5 notebook of the cells, no outputs, deterministic cell ids."""
  out = []
  for i, (kind, text) in enumerate(cells):
    cell = {"cell_type": kind, "id": f"c{i:02d}", "metadata": {}, "source": text.splitlines(keepends=True)}
    if kind == "code":
      cell.update(execution_count=None, outputs=[])
    out.append(cell)
  return {"cells": out, "metadata": METADATA, "nbformat": 4, "nbformat_minor": 5}


def render(path: pathlib.Path) -> str:
  return json.dumps(notebook_of(cells_of(path.read_text(), str(path))), indent=1, sort_keys=True,
                    ensure_ascii=False) + "\n"


def cells_in_ipynb(path: pathlib.Path) -> list[tuple[str, str]]:
  nb = json.loads(path.read_text())
  return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
          for c in nb["cells"]]


def stale(sources) -> list[str]:
  """Problems of the .ipynb next to each source: missing, other cells than the source's, or outputs kept."""
  problems = []
  for py in sources:
    ipynb = py.with_suffix(".ipynb")
    if not ipynb.exists():
      problems.append(f"{ipynb.name}: missing")
      continue
    if cells_in_ipynb(ipynb) != cells_of(py.read_text(), str(py)):
      problems.append(f"{ipynb.name}: its cells differ from {py.name}")
    if any(c.get("outputs") for c in json.loads(ipynb.read_text())["cells"]):
      problems.append(f"{ipynb.name}: has outputs (strip them)")
  return problems


def sources(directory=NOTEBOOKS) -> list[pathlib.Path]:
  return sorted(pathlib.Path(directory).glob("*.py"))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="report out-of-date notebooks and exit 1 if any")
  parser.add_argument("--dir", default=str(NOTEBOOKS), help="the notebooks' directory (default: notebooks/)")
  args = parser.parse_args(argv)
  if args.check:
    problems = stale(sources(args.dir))
    for p in problems:
      print(p)
    if problems:
      print("run: python scripts/sync_notebooks.py")
    return 1 if problems else 0
  for py in sources(args.dir):
    ipynb, text = py.with_suffix(".ipynb"), render(py)
    if not ipynb.exists() or ipynb.read_text() != text:
      ipynb.write_text(text)
      print(f"wrote {ipynb}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
