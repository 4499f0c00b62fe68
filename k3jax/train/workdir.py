"""A run directory's memory of its config, and the guard that keeps a resumed run the same run.

`config.json` holds the config the directory was trained with (without it, the newest checkpoint's config counts).
Starting it again with a config that changes what training computes stops with `ConfigChanged`, listing the
differing fields, before anything in the directory is written. Fields that only change how the run is observed or
stored (`RESUMABLE`) may change freely. With `allow_change` (`--allow_config_change`) the run continues and the
change is appended to `config_changes.jsonl`; a change of the run's length or of its schedule must still keep the
learning rate of the steps already taken.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import time
from typing import Callable

import jax
import ml_collections
import numpy as np

from k3jax import config as config_lib
from k3jax.train import checkpoint, stages as stages_lib

CONFIG, CHANGES = "config.json", "config_changes.jsonl"
# Dotted fields (a prefix covers its subfields) that never change what a step computes: how a run is observed or
# stored, how cuDNN lays out documents (`model.mla.max_documents`: the same attention, rounded alike), and how the
# AttnRes read-out's backward and the short conv's are compiled (`model.residual.backward`, `model.kda.conv_backward`:
# the same arithmetic).
RESUMABLE = ("log_every", "checkpoint_every", "keep_checkpoints", "eval", "data.cache_dir", "model.mla.max_documents",
             "model.residual.backward", "model.kda.conv_backward", "model.moe.glu_epilogue")
# Fields whose change moves the learning-rate schedule over the global steps.
SCHEDULE = ("steps", "stages", "optimizer.warmup_fraction", "optimizer.decay_fraction", "optimizer.final_lr_fraction")
ABSENT = "<absent>"


def training_learning_rate(config):
  """The training run's learning rate over its global steps."""
  return stages_lib.training_plan(config).learning_rate


@dataclasses.dataclass(frozen=True)
class ResumeRules:
  """What a run directory's guard lets change: the fields that may change freely (dotted prefixes), the fields whose
  change moves the learning-rate schedule, and that schedule of a config over the directory's checkpoint steps.
  The default is a training run's; a later stage kept in its own directory (the RL stage) brings its own."""
  resumable: tuple[str, ...] = RESUMABLE
  schedule: tuple[str, ...] = SCHEDULE
  learning_rate: Callable = training_learning_rate


class ConfigChanged(ValueError):
  """A run directory resumed with a config that changes what training computes."""


def saved_config(d: dict) -> dict:
  """A config saved as JSON, its model config given the fields it predates with the values it was trained with
  (`k3jax.config.saved_model_fields`): what it is compared as, and rebuilt from."""
  return {**d, "model": config_lib.saved_model_fields(d["model"])} if "model" in d else d


def config_from_json(d: dict) -> ml_collections.ConfigDict:
  """A config saved as JSON (`saved_config`; lists back to tuples, as the config files write them), locked like
  `get_config()`."""
  def tuples(x):
    if isinstance(x, dict):
      return {k: tuples(v) for k, v in x.items()}
    return tuple(tuples(v) for v in x) if isinstance(x, list) else x
  return ml_collections.ConfigDict(tuples(saved_config(d))).lock()


def override(config, overrides: dict | None) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted fields set (e.g. {"model.kda.gate": "softplus", "eval.lengths": (64, 256)}); a
  field that does not exist, or a value of another type than the field's, is a ValueError naming it."""
  config = copy.deepcopy(config)
  for dotted, value in (overrides or {}).items():
    *path, last = dotted.split(".")
    node = config
    for p in path:
      node = node[p] if isinstance(node, ml_collections.ConfigDict) and p in node else None
    if not isinstance(node, ml_collections.ConfigDict) or last not in node:
      raise ValueError(f"config has no field {dotted!r}")
    try:
      node[last] = value
    except TypeError as e:
      raise ValueError(f"{dotted}={value!r}: {e}") from None
  return config


def as_json(config) -> dict:
  return json.loads(config.to_json_best_effort())


def flatten(d: dict, prefix: str = "") -> dict:
  """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists of dicts (stages) stay whole."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def differences(old: dict, new: dict) -> dict[str, tuple]:
  """`{dotted field: (old value, new value)}` of two JSON configs (`ABSENT` where a field is missing)."""
  a, b = flatten(old), flatten(new)
  pairs = {k: (a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(set(a) | set(b))}
  return {k: (x, y) for k, (x, y) in pairs.items() if x != y}


def under(field: str, prefixes) -> bool:
  """Whether dotted `field` is one of `prefixes` or a subfield of one."""
  return any(field == p or field.startswith(p + ".") for p in prefixes)


def remembered(workdir) -> dict | None:
  """The config `workdir` was trained with: its config.json, else the one saved in its newest checkpoint; None for
  a new directory."""
  path = pathlib.Path(workdir) / CONFIG
  if path.exists():
    return json.loads(path.read_text())
  found = checkpointed_stages(workdir)
  if not found:
    return None
  stage = max(found)
  with checkpoint.Checkpointer(stage_directory(workdir, stage), keep=1, read_only=True) as ckpt:
    return ckpt.read_meta(found[stage][-1])["config"]


def stage_directory(workdir, stage: int) -> pathlib.Path:
  return pathlib.Path(workdir) / "checkpoints" / f"stage_{stage}"


def checkpointed_stages(workdir) -> dict[int, list[int]]:
  """`{stage: sorted steps}` of the stages that have checkpoint steps, from the directory names only."""
  found = {}
  for d in pathlib.Path(workdir).glob("checkpoints/stage_*"):
    index = d.name.removeprefix("stage_")
    steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if index.isdigit() and d.is_dir() else []
    if steps:
      found[int(index)] = steps
  return dict(sorted(found.items()))


def latest_step(workdir) -> int:
  """The highest step among the directory's checkpoints (0 if none)."""
  return max((steps[-1] for steps in checkpointed_stages(workdir).values()), default=0)


def check_resume(workdir, config, *, allow_change: bool = False, rules: ResumeRules = ResumeRules()) -> dict | None:
  """Checks `config` against the one `workdir` remembers, writing nothing; returns the change record to append
  to config_changes.jsonl when the run goes ahead with allowed changes (None when there is nothing to record).

  ConfigChanged if fields outside `rules.resumable` differ (and `allow_change` is False), or if an allowed change
  alters the learning rate of a step already taken.
  """
  old = remembered(workdir)
  if old is None:
    return None
  diff = differences(saved_config(old), as_json(config))
  if not diff:
    return None
  blocking = {k: v for k, v in diff.items() if not under(k, rules.resumable)}
  listing = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, (a, b) in (blocking or diff).items())
  step = latest_step(workdir)
  if blocking and not allow_change:
    raise ConfigChanged(
        f"{pathlib.Path(workdir) / CONFIG} was trained (to step {step}) with another config; these fields differ:\n"
        f"{listing}\nResuming would mix two runs. Use a new --workdir, or pass --allow_config_change "
        f"(allow_config_change=True) to continue with the new values deliberately (the change is recorded in "
        f"{CHANGES}). Fields that may change freely: {', '.join(rules.resumable)}.")
  if blocking and any(under(k, rules.schedule) for k in blocking):
    _check_schedule(old, config, step, rules.learning_rate)
  return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "at_step": step, "allowed": bool(blocking),
          "changes": {k: list(v) for k, v in diff.items()}}


def _check_schedule(old: dict, config, step: int, learning_rate: Callable) -> None:
  """ConfigChanged if the new config's learning rate differs from the old one's at a step < `step`."""
  if step == 0:
    return
  old_config = config_from_json(old)
  before, after = learning_rate(old_config), learning_rate(config)
  steps = np.arange(step)
  a, b = np.asarray(before(steps)), np.asarray(after(steps))
  bad = np.flatnonzero(~np.isclose(a, b, rtol=1e-6, atol=0.0))
  if bad.size:
    s = int(bad[0])
    hint = ""
    if not old_config.stages and not config.stages and config.steps != old_config.steps:
      scale = old_config.steps / config.steps
      hint = (f" For one stage, optimizer.warmup_fraction={old_config.optimizer.warmup_fraction * scale:.6g} keeps "
              f"the warmup; the decay keeps only if it has not started.")
    raise ConfigChanged(
        f"the new config changes the learning rate of steps already taken (step {s}: {a[s]:.4g} before, "
        f"{b[s]:.4g} now; {bad.size} of the {step} steps differ), so the resumed run would not continue the "
        f"schedule it followed. Warmup and decay are fractions of each stage's steps: scale them to keep the "
        f"steps taken, or add a stage (config.stages) for the extension.{hint}")


def commit(workdir, config, change: dict | None) -> None:
  """Writes config.json (process 0) and appends `change` to config_changes.jsonl."""
  if jax.process_index() != 0:
    return
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  tmp = workdir / (CONFIG + ".tmp")
  tmp.write_text(config.to_json_best_effort(indent=2) + "\n")
  os.replace(tmp, workdir / CONFIG)
  if change is not None:
    with open(workdir / CHANGES, "a") as f:
      f.write(json.dumps(change) + "\n")
    if change["allowed"]:
      print(f"config changed as allowed at step {change['at_step']} (recorded in {workdir / CHANGES}): "
            + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in change["changes"].items()), flush=True)
