"""experiments/plan.py: the script plans the config's own mesh and stages, and an unknown config name or a mesh
that does not divide the experts is a one-line error."""
import subprocess
import sys

import pytest

from experiments import configs
from train_testing import REPO


def plan(*flags):
  return subprocess.run([sys.executable, "-m", "experiments.plan", *flags], cwd=REPO, capture_output=True, text=True,
                        timeout=300)


def test_the_config_own_mesh_and_stages_are_planned():
  proc = plan("--config=tiny")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "memory plan: mesh data:-1,expert:1 (1 devices)" in proc.stdout and "1024 (T=64)" in proc.stdout


@pytest.mark.parametrize("flags,message", [
    (["--config=huge"], "error: unknown config 'huge': expected one of ['k3_full', 'rl_small', 'rl_tiny', 'small', "
                         "'tiny'] or a path to a .py file"),
    (["--config=tiny", "--mesh=data:1,expert:3"], "error: mesh 'data:1,expert:3': the expert axis (3) does not "
                                                  "divide model.moe.num_experts=8"),
])
def test_bad_names_and_meshes_are_one_line_errors(flags, message):
  proc = plan(*flags)
  assert proc.returncode == 1 and proc.stderr.strip() == message, proc.stderr[-2000:]


def test_config_names_are_the_files_with_a_get_config():
  assert configs.names() == ["k3_full", "rl_small", "rl_tiny", "small", "tiny"]
  with pytest.raises(FileNotFoundError):
    configs.load("experiments/configs/absent.py")
