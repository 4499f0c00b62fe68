"""The experiment scripts' shared pieces: the compilation cache switch (the environment variable wins, an empty
path turns it off) and the JSON writer."""
import json

import jax
import pytest

from experiments import harness


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
