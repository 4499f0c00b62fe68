"""Test-wide set-up: 8 simulated CPU devices (expert/data-parallel tests) before JAX initialises."""
import os

flag = "--xla_force_host_platform_device_count=8"
if flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
# CPU tests are dominated by compile time (Pallas interpret mode especially); LLVM's -O0 compiles ~3x faster.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import pytest  # noqa: E402  (after the flags: JAX must see them when it first initialises)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """Stage 0 of the train tests' config (tests/train_testing.py), trained once per session; tests that use it
  carry `pytest.mark.xdist_group("train_loop")` so one worker builds it."""
  import train_testing
  with train_testing.trained_run(tmp_path_factory.mktemp("train")) as t:
    yield t
