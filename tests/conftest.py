"""Test-wide set-up: 8 simulated CPU devices (expert/data-parallel tests) before JAX initialises; tests marked
`gpu` (tests/gpu/, `make gpu-test`) skipped where JAX sees no GPU. `make gpu-test` sets K3JAX_GPU_TESTS=1, which
keeps the CPU suite's compile flags off the GPU's programs; K3JAX_GPU_TESTS=cpu runs the gpu tests on the CPU
(Pallas in interpret mode) to check the tests themselves, not the GPU. Compiled programs are shared through a
persistent cache of the session's own."""
import os

GPU_RUN = os.environ.get("K3JAX_GPU_TESTS", "")
if GPU_RUN != "1":
  flag = "--xla_force_host_platform_device_count=8"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  # CPU tests are dominated by compile time (Pallas interpret mode especially); LLVM's -O0 compiles ~3x faster.
  if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One persistent compilation cache for the session, its workers and the scripts they start (fresh each session, so
# every run compiles as a clean clone does): a program compiled by one test is read back by another that builds it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3jax-tests-xla-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402  (after the flags: JAX must see them when it first initialises)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """Stage 0 of the train tests' config (tests/train_testing.py), trained once per session; tests that use it
  carry `pytest.mark.xdist_group("train_loop")` so one worker builds it."""
  import train_testing
  with train_testing.trained_run(tmp_path_factory.mktemp("train")) as t:
    yield t


# Run first, in this order: the files of the longest tests (the notebooks a minute each, then the whole-model
# equivalence tests of 30-60 s), so that no worker is left running one of them alone at the end while the other idles.
LONGEST_FIRST = ("test_notebooks.py", "test_train_step.py", "test_model.py")


def pytest_collection_modifyitems(config, items):
  _skip_gpu_tests_without_a_gpu(items)
  _group_for_loadgroup(config, items)
  first = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: first.get(item.path.name, len(first)))   # stable: the rest keep their order


def _skip_gpu_tests_without_a_gpu(items):
  if GPU_RUN == "cpu" or not any(item.get_closest_marker("gpu") for item in items):
    return
  import jax
  if jax.default_backend() != "gpu" and GPU_RUN == "1":
    raise pytest.UsageError(f"K3JAX_GPU_TESTS=1 (make gpu-test) needs a GPU; JAX sees {jax.devices()}")
  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason="needs a GPU (make gpu-test on a GPU machine)")
    for item in items:
      if item.get_closest_marker("gpu"):
        item.add_marker(skip)


def _group_for_loadgroup(config, items):
  """`--dist loadgroup` sends the tests of one `xdist_group` to one worker by a `@group` suffix on their node ids.
  pytest-xdist 3.8 adds it by setting `item._nodeid`, which pytest 9 no longer reads (node ids are `item._id`),
  so every group was spread over the workers and each built its fixtures; the suffix is added here where missing."""
  if not getattr(config.option, "loadgroup", False):
    return
  for item in items:
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")})
    if groups and "@" not in item.nodeid:
      grouped = f"{item.nodeid}@{'_'.join(groups)}"
      try:
        from _pytest.nodeid import NodeId   # pytest >= 9
        item._id = NodeId.parse(grouped)
      except ImportError:                  # pytest 8: where xdist puts it
        item._nodeid = grouped
