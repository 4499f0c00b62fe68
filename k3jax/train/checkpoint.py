"""Checkpoints of the train state with orbax: asynchronous saves, the newest N kept, and a fingerprint of every
array so that a checkpoint damaged after it was written is detected on restore and the previous one used.

Each step directory holds two items: `state` (the TrainState arrays) and `meta` (JSON: step, stage, data position,
the run's config, and the fingerprint). Orbax writes a step into a temporary directory and renames it when
complete, so a save cut short by a crash never shows up as a step (the leftovers are removed on the next start).
A restore that raises, or whose arrays do not reproduce the saved fingerprint, marks the step unusable: it is
reported, moved to `<dir>.corrupt/` (left in place by a read-only Checkpointer), and the next older step is tried.
A state holding a non-finite float is never saved (`NonFiniteState`).
"""
from __future__ import annotations

import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils


class CorruptCheckpoint(Exception):
  """A checkpoint step that cannot be restored exactly."""


class NonFiniteState(ValueError):
  """A state with NaN or infinite values, refused by `Checkpointer.save`."""


def _leaf_fingerprint(x):
  """Position-weighted sum (mod 2^32) of the bit patterns of `x`: any single changed word changes it."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  words = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  w = jax.lax.bitcast_convert_type(x, words).astype(jnp.uint32).reshape(-1)
  odd = 2 * jnp.arange(w.size, dtype=jnp.uint32) + 1   # odd weights are invertible mod 2^32
  return jnp.sum(w * odd, dtype=jnp.uint32)


def _all_finite(x):
  return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)


@jax.jit
def _summaries(tree):
  """(fingerprint of every leaf, whether every leaf is finite), in leaf order."""
  leaves = jax.tree.leaves(tree)
  return (jnp.stack([_leaf_fingerprint(x) for x in leaves] or [jnp.uint32(0)]),
          jnp.stack([_all_finite(x) for x in leaves] or [jnp.bool_(True)]))


def leaf_signatures(tree) -> list[str]:
  """`"<path> <shape> <dtype>"` of every array of `tree`: what a checkpoint must match to be restored into it."""
  return [f"{jax.tree_util.keystr(path)} {tuple(x.shape)} {x.dtype}"
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _gather(x):
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def fingerprint(tree) -> list[int]:
  """One uint32 per array of `tree` (in leaf order), computed on device."""
  return [int(v) for v in _gather(_summaries(tree)[0])]


def nonfinite_leaves(tree) -> list[str]:
  """The paths of the leaves of `tree` that hold a NaN or an infinity."""
  finite = _gather(_summaries(tree)[1])
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return [p for p, ok in zip(paths, finite) if not ok]


class Checkpointer:
  """Saves and restores `(state, meta)` pairs by step in `directory`, keeping the newest `keep`.

  `read_only=True` opens an existing directory for restoring only: nothing in it is created, removed or moved.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int, async_save: bool = True, read_only: bool = False):
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}")
    self.directory = pathlib.Path(directory).absolute()
    self.read_only = read_only
    if read_only:
      if not self.directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {self.directory}")
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                             save_interval_steps=0)
    else:
      options = ocp.CheckpointManagerOptions(
          preservation_policy=ocp.checkpoint_managers.LatestN(n=keep), cleanup_tmp_directories=True,
          enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict) -> None:
    """Starts saving `state` at `step` (returns once the arrays are copied off the device); NonFiniteState if
    any of its floats is NaN or infinite."""
    if self.read_only:
      raise ValueError(f"{self.directory} is open read-only")
    prints, finite = (_gather(x) for x in _summaries(state))
    if not finite.all():
      raise NonFiniteState(f"refusing to save step {step} in {self.directory}: non-finite values in "
                           f"{nonfinite_leaves(state)[:6]}")
    meta = dict(meta, step=int(step), leaves=leaf_signatures(state), fingerprint=[int(v) for v in prints])
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def read_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state):
    """`(state, meta)` at `step`, with arrays placed as `abstract_state`'s shardings say.

    ValueError if the checkpoint holds a differently shaped state (another model or optimizer config);
    CorruptCheckpoint if it cannot be read or does not reproduce its fingerprint.
    """
    meta = self._read(step, lambda: self.read_meta(step))
    want_leaves = leaf_signatures(abstract_state)
    if meta.get("leaves") != want_leaves:
      diff = sorted(set(meta.get("leaves") or []) ^ set(want_leaves))
      raise ValueError(f"checkpoint step {step} in {self.directory} holds a different train state than this "
                       f"config builds (changed model or optimizer?); differing arrays: {diff[:6]}")
    state = self._read(step, lambda: self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"])
    got, want = fingerprint(state), meta.get("fingerprint")
    if got != want:
      bad = [i for i, (a, b) in enumerate(zip(got, want or [])) if a != b]
      raise CorruptCheckpoint(f"step {step} in {self.directory}: arrays differ from what was saved "
                              f"(fingerprint mismatch in leaves {bad[:10]} of {len(got)})")
    return state, meta

  def _read(self, step: int, fn):
    try:
      return fn()
    except Exception as e:  # any failure to read a step makes it unusable; the caller falls back
      first_line = str(e).splitlines()[0][:300] if str(e) else ""
      raise CorruptCheckpoint(f"step {step} in {self.directory} cannot be read: {type(e).__name__}: "
                              f"{first_line}") from e

  def restore_latest(self, abstract_state, *, at: int | None = None):
    """`(state, meta)` of the newest usable step (or of step `at` exactly), or None if there is none.

    Unusable steps newer than the one returned are reported and (unless read-only) moved aside, so later saves
    can reuse their numbers.
    """
    for step in reversed(self.steps()):
      if at is not None and step != at:
        continue
      try:
        return self.restore(step, abstract_state)
      except CorruptCheckpoint as e:
        self._quarantine(step, e)
    return None

  @property
  def quarantine_directory(self) -> pathlib.Path:
    return self.directory.parent / f"{self.directory.name}.corrupt"

  def _quarantine(self, step: int, error: Exception) -> None:
    if self.read_only:
      message = f"checkpoint unusable: {error}; trying the previous step (left in place: read-only)"
      logging.error(message)
      print(f"WARNING: {message}", flush=True)
      return
    target = self.quarantine_directory / f"{step}.{int(time.time())}"
    message = f"checkpoint unusable: {error}; moving it to {target} and trying the previous step"
    logging.error(message)
    print(f"WARNING: {message}", flush=True)
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      os.rename(self.directory / str(step), target)
    multihost_utils.sync_global_devices(f"k3jax checkpoint quarantine {step}")
    self.manager.reload()
