"""README.md's code runs as written: every ```python block is executed, in order, each in a fresh namespace, with
the working directory holding `runs/tiny` (a trained run, as `make run` leaves it). A block whose first line is
`# illustrative` is only shown, not run; there is none today."""
import pathlib
import re

import pytest

from train_testing import REPO

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
RUN = [b for b in BLOCKS if not b.startswith("# illustrative")]


def test_the_readme_has_the_blocks_it_runs():
  assert len(RUN) >= 2 and any("k3jax.load" in b for b in RUN) and any("chunk_kda" in b for b in RUN)


@pytest.mark.xdist_group("train_loop")
@pytest.mark.parametrize("index", range(len(RUN)))
def test_readme_block_runs_as_written(index, trained, tmp_path, monkeypatch, capsys):
  (tmp_path / "runs").mkdir()
  (tmp_path / "runs" / "tiny").symlink_to(trained.workdir)
  monkeypatch.chdir(tmp_path)
  exec(compile(RUN[index], f"README.md python block {index}", "exec"), {"__name__": "readme"})
  if "print(" in RUN[index]:
    assert capsys.readouterr().out.strip()
