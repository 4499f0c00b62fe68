"""Checkpoints: exact round trip, keep-N, interrupted saves ignored, damaged steps (flipped bytes, truncated files)
detected and reported with a fall back to the previous step, a differently shaped state refused; the scanned
model's stacked layout round-trips, and an unrolled state converts to it."""
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import common
from k3jax import parallel
from k3jax.model import scanned_layout
from k3jax.train import checkpoint, state as state_lib
from model_testing import SCANNED, small_config


def make_state(seed):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {"params": {"w": jax.random.normal(k1, (64, 48)), "b": jax.random.normal(k2, (48,)).astype(jnp.bfloat16)},
          "step": jnp.int32(seed)}


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def saved(tmp_path, steps, keep=5):
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", keep=keep)
  for s in steps:
    ckpt.save(s, make_state(s), {"stage": 0, "note": f"step {s}"})
  ckpt.wait()
  return ckpt


def data_files(step_dir: pathlib.Path):
  return sorted((p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
                key=lambda p: p.stat().st_size)


def test_restore_is_exact_and_only_the_newest_are_kept(tmp_path):
  ckpt = saved(tmp_path, [1, 2, 3, 4], keep=2)
  assert ckpt.steps() == [3, 4]
  state, meta = ckpt.restore_latest(abstract(make_state(0)))
  assert_same(state, make_state(4))
  assert meta["step"] == 4 and meta["note"] == "step 4" and len(meta["fingerprint"]) == 3


def test_fingerprint_sees_any_single_changed_word():
  state = make_state(3)
  base = checkpoint.fingerprint(state)
  for path in (("params", "w"), ("params", "b")):
    x = state[path[0]][path[1]]
    changed = dict(state, params=dict(state["params"], **{path[1]: x.at[(0,) * x.ndim].set(x[(0,) * x.ndim] + 1)}))
    assert checkpoint.fingerprint(changed) != base
  swapped = dict(state, params=dict(state["params"], w=state["params"]["w"][::-1]))
  assert checkpoint.fingerprint(swapped) != base


@pytest.mark.parametrize("damage", ["flip_bytes", "truncate"])
def test_damaged_latest_step_is_reported_and_the_previous_used(tmp_path, capsys, damage):
  ckpt = saved(tmp_path, [1, 2])
  victim = data_files(ckpt.directory / "2")[-1]
  with open(victim, "r+b") as f:
    if damage == "truncate":
      f.truncate(victim.stat().st_size // 2)
    else:
      f.seek(victim.stat().st_size // 2)
      f.write(bytes(b ^ 0xFF for b in f.read(16)))
  fresh = checkpoint.Checkpointer(tmp_path / "ckpt", keep=5)
  state, meta = fresh.restore_latest(abstract(make_state(0)))
  assert meta["step"] == 1
  assert_same(state, make_state(1))
  assert "checkpoint unusable: step 2" in capsys.readouterr().out
  assert fresh.steps() == [1] and len(list((tmp_path / "ckpt.corrupt").iterdir())) == 1
  fresh.save(2, make_state(2), {})  # the step number is free again
  fresh.wait()
  assert_same(fresh.restore_latest(abstract(make_state(0)))[0], make_state(2))


def test_interrupted_save_is_not_a_step_and_is_cleaned_up(tmp_path):
  saved(tmp_path, [1]).close()
  partial = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1234"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "junk").write_bytes(os.urandom(100))
  fresh = checkpoint.Checkpointer(tmp_path / "ckpt", keep=5)
  assert fresh.steps() == [1]
  assert fresh.restore_latest(abstract(make_state(0)))[1]["step"] == 1
  fresh.save(2, make_state(2), {})  # orbax removes the leftovers in the background, at the latest before a save
  fresh.wait()
  assert not partial.exists() and fresh.steps() == [1, 2]


def test_differently_shaped_state_is_refused_and_nothing_moved(tmp_path):
  ckpt = saved(tmp_path, [1])
  other = dict(make_state(0), params={"w": jnp.zeros((64, 49)), "b": jnp.zeros((48,), jnp.bfloat16)})
  with pytest.raises(ValueError, match="different train state"):
    ckpt.restore_latest(abstract(other))
  assert ckpt.steps() == [1] and not (tmp_path / "ckpt.corrupt").exists()


def test_scanned_train_state_round_trips_and_an_unrolled_one_converts_to_it(tmp_path):
  # The stacked layout, experts sharded over `expert` behind the leading group axis: restored exactly, with the
  # abstract state's shardings. An unrolled train state (scan_layers=False: the layout of older checkpoints)
  # converted by scanned_layout has the same arrays, shardings and (the same RNG order at init) values.
  config = common.base_config()
  config.model, config.mesh = small_config(**SCANNED), "data:2,expert:2"
  unrolled_config = config.copy_and_resolve_references()
  unrolled_config.model.scan_layers = False
  tx, mesh = optax.adam(1e-3), parallel.mesh_from_string(config.mesh)
  (_, abstract, init), (_, abstract_u, init_u) = (state_lib.abstract_state(c, tx, mesh)
                                                  for c in (config, unrolled_config))
  state = jax.jit(init, out_shardings=state_lib.shardings_of(abstract))(config.seed)
  experts = state.params["groups"][0]["ffn"]["w_gate_up"].get_value()
  assert experts.shape[0] == 2 and experts.sharding.spec[:2] == (None, parallel.EXPERT)
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", keep=1)
  ckpt.save(1, state, {})
  ckpt.wait()
  restored, _ = ckpt.restore_latest(abstract)
  assert_same(restored, state)
  assert jax.tree.leaves(state_lib.shardings_of(restored)) == jax.tree.leaves(state_lib.shardings_of(abstract))
  converted = scanned_layout(abstract_u, config.model)
  assert checkpoint.leaf_signatures(converted) == checkpoint.leaf_signatures(abstract)
  assert jax.tree.leaves(state_lib.shardings_of(converted)) == jax.tree.leaves(state_lib.shardings_of(abstract))
  assert_same(jax.jit(lambda seed: scanned_layout(init_u(seed), config.model))(config.seed), state)   # one program


def test_read_only_restores_without_moving_cleaning_or_creating_anything(tmp_path, capsys):
  saved(tmp_path, [1, 2]).close()
  victim = data_files(tmp_path / "ckpt" / "2")[-1]
  with open(victim, "r+b") as f:
    f.seek(victim.stat().st_size // 2)
    f.write(bytes(b ^ 0xFF for b in f.read(16)))
  (tmp_path / "ckpt" / "3.orbax-checkpoint-tmp-99").mkdir()   # a save cut short
  tree = lambda: sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  before = tree()
  with checkpoint.Checkpointer(tmp_path / "ckpt", keep=1, read_only=True) as ckpt:
    state, meta = ckpt.restore_latest(abstract(make_state(0)))
    with pytest.raises(ValueError, match="read-only"):
      ckpt.save(3, make_state(3), {})
  assert meta["step"] == 1 and "left in place: read-only" in capsys.readouterr().out
  assert_same(state, make_state(1))
  assert tree() == before
  with pytest.raises(FileNotFoundError):
    checkpoint.Checkpointer(tmp_path / "absent", keep=1, read_only=True)
  assert not (tmp_path / "absent").exists()


def test_a_state_with_a_nan_or_an_infinity_is_never_saved(tmp_path):
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", keep=2)
  state = make_state(1)
  bad = dict(state, params=dict(state["params"], w=state["params"]["w"].at[3, 4].set(jnp.inf)))
  with pytest.raises(checkpoint.NonFiniteState, match=r"refusing to save step 1 .*\['w'\]"):
    ckpt.save(1, bad, {})
  assert checkpoint.nonfinite_leaves(bad) == ["['params']['w']"]
  ckpt.wait()
  assert ckpt.steps() == []
