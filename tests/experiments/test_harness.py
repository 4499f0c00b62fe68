"""The experiment scripts' shared pieces: the compilation cache switch (the environment variable wins, an empty
path turns it off), the training scripts' exit statuses, the JSON writer and the timers."""
import ast
import json
import pathlib
import signal
import time

import jax
import jax.numpy as jnp
import pytest

from experiments import harness
from k3jax.train import interrupt, trainer, workdir

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir_restored():
  before = jax.config.jax_compilation_cache_dir
  yield
  jax.config.update("jax_compilation_cache_dir", before)


def test_compilation_cache_goes_where_asked_unless_the_environment_says(tmp_path, monkeypatch, cache_dir_restored):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  harness.enable_compilation_cache(str(tmp_path / "a"))
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")
  harness.enable_compilation_cache("")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")  # '' leaves it off (here: as it was)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  harness.enable_compilation_cache(str(tmp_path / "b"))
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")


def test_write_json_creates_the_folder_and_skips_an_empty_path(tmp_path):
  harness.write_json(str(tmp_path / "x" / "r.json"), [{"a": 1}])
  assert json.loads((tmp_path / "x" / "r.json").read_text()) == [{"a": 1}]
  harness.write_json("", {"b": 2})
  harness.write_json(None, {"b": 2})


def test_kernel_times_sum_stream_launches_per_call_and_skip_derived_lines():
  from jax.profiler import ProfileData
  event = lambda meta, ps: f"events {{ metadata_id: {meta} offset_ps: 0 duration_ps: {ps} }}"
  text = ('planes { id: 1 name: "/device:GPU:0" '
          f'lines {{ id: 1 name: "Stream #13(Compute)" {event(1, 4_000_000)} {event(2, 1_000_000)} {event(1, 2_000_000)} }} '
          f'lines {{ id: 2 name: "XLA Ops" {event(1, 9_000_000)} }} '
          'event_metadata { key: 1 value { id: 1 name: "kern_a" } } '
          'event_metadata { key: 2 value { id: 2 name: "kern_b" } } } '
          f'planes {{ id: 2 name: "/host:CPU" lines {{ id: 1 name: "python" {event(1, 7_000_000)} }} '
          'event_metadata { key: 1 value { id: 1 name: "kern_a" } } }')
  profile = ProfileData.from_serialized_xspace(ProfileData.text_proto_to_serialized_xspace(text))
  assert harness.kernel_times_from_profile(profile, calls=2) == [("kern_a", 1.0, 3e-3), ("kern_b", 0.5, 5e-4)]


def test_device_kernel_times_is_empty_without_a_gpu():
  f = jax.jit(lambda x: x * 2)
  f(jax.numpy.ones(4))
  assert harness.device_kernel_times(f, jax.numpy.ones(4), calls=2) == []


def test_pipelined_seconds_calls_back_to_back_and_divides_by_the_calls():
  count = []
  fn = lambda x: (count.append(1), time.sleep(0.01), x)[-1]
  per_call = harness.pipelined_seconds(fn, jnp.ones(2), repeats=3, calls=4, warmup=2)
  assert len(count) == 2 + 3 * 4
  assert 0.01 <= per_call < 0.05


def test_guarded_runs_exit_with_the_signal_status_or_a_one_line_error(capsys):
  assert harness.run_guarded(lambda: None) is None

  def stopped():
    raise interrupt.Interrupted(signal.SIGTERM, 12)
  assert harness.run_guarded(stopped) == 143 and "SIGTERM: stopped at step 12" in capsys.readouterr().out
  for error in (workdir.ConfigChanged("fields differ"), trainer.Diverged("loss nan")):
    with pytest.raises(SystemExit, match=f"error: {error}"):
      harness.run_guarded(lambda e=error: (_ for _ in ()).throw(e))
  with pytest.raises(ZeroDivisionError):   # anything else is a bug: its traceback stays
    harness.run_guarded(lambda: 1 / 0)


def _defines_flags_on_import(path: pathlib.Path) -> bool:
  """Whether a module's top-level statements call an absl `DEFINE_*` (its flags exist once it is imported)."""
  for stmt in ast.parse(path.read_text()).body:
    if isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.If)):
      continue   # run later, or under `if __name__ == "__main__"`
    for node in ast.walk(stmt):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("DEFINE"):
        return True
  return False


def _experiments_imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "experiments":
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("experiments."):
      names.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("experiments.")}
  return names


def test_no_test_imports_a_script_whose_flags_would_clash_with_another():
  # Two scripts define --config, so importing both into one pytest worker raises DuplicateFlagError; a test runs a
  # script as a subprocess and imports only libraries (k3jax, experiments.harness/configs/kda_benchmark).
  experiments = ROOT / "experiments"
  scripts = {p.stem for p in experiments.glob("*.py") if _defines_flags_on_import(p)}
  assert {"train", "lower_train_step", "results_table"} <= scripts   # the check sees module-level flags
  assert not _defines_flags_on_import(experiments / "harness.py")     # ... and not those defined inside functions
  offending = {str(p.relative_to(ROOT)): sorted(_experiments_imports(p) & scripts)
               for p in (ROOT / "tests").rglob("*.py")}
  assert not {k: v for k, v in offending.items() if v}
