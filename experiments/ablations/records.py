"""A study's finished runs as small JSON files, so that a study resumes on another machine.

A study's training runs (checkpoints and all) live in a work directory that a GPU machine loses when it is given
back. What a notebook reads of a finished run (its logged history, and what `measure` took from its trained model)
is small, so each finished run also writes `<records>/<variant>/seed_<s>.json`: the config it trained, the result,
the commit, the device kind and the time (`provenance` sums them up for a study). A study run again finds its
finished runs there and does not train them again; the files can be copied back from a GPU machine and committed
(notebooks/results/<scale>/records/), and a machine with a copy of the repository then continues where the last one
stopped.

Measurements that are not training runs (a notebook's timings) are recorded the same way, per device kind, under
`<records>/measured/` (`measured`).

A record of another config is an error (`workdir.ConfigChanged`, listing the fields), raised before anything
trains, as for a run directory; only where a file lives may differ (`MACHINE_FIELDS`: the data cache, and the
token shards, compared by file name).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import time
from collections.abc import Callable

from k3jax import config as config_lib
from k3jax.train import workdir as workdir_lib

# Fields that name places on a machine, not what a run computes; the token shards (comma-separated paths) are
# compared by their file names.
MACHINE_FIELDS = ("data.cache_dir",)
# How kernels run the same formulas (their order of fp32 sums, the GLU's rounding) and what the backward pass keeps
# rather than recomputes: a record stays valid across them.
KERNEL_CHOICES = ("model.kda.conv_backward", "model.residual.backward", "model.moe.glu_epilogue", "model.remat",
                  "model.remat_unrolled")
SHARD_FIELDS = ("data.shards", "data.heldout_shards")
COMMIT_ENV = "K3JAX_COMMIT"


def path(records, variant: str, seed: int) -> pathlib.Path:
  return pathlib.Path(records) / variant / f"seed_{seed}.json"


def read(records, variant: str, seed: int) -> dict | None:
  """The whole record of (`variant`, `seed`) ({"config", "commit", "device", "time", "result"}; records written
  before the device was recorded lack it), or None."""
  p = path(records, variant, seed)
  return json.loads(p.read_text()) if p.exists() else None


def of_variant(records, variant: str) -> list[dict]:
  """Every record of `variant` under `records` (whole, as `read` gives them), by seed."""
  found = pathlib.Path(records, variant).glob("seed_*.json")
  return [json.loads(p.read_text()) for p in sorted(found, key=lambda p: int(p.stem.removeprefix("seed_")))]


def load(records, variant: str, seed: int, config) -> dict | None:
  """The result recorded for (`variant`, `seed`), or None when there is no record; ConfigChanged when the record
  holds a run of another config."""
  record = read(records, variant, seed)
  if record is None:
    return None
  refuse_differences(f"{path(records, variant, seed)} records a run of another config",
                     differences(record["config"], config),
                     "Delete the record to train the run again with this config.")
  return record["result"]


def differences(saved_json: dict, config) -> dict:
  """{field: (saved, config's)} where a saved config (a record's, a run directory's config.json) and `config`
  differ in what a run computes (machine settings and the MoE settings the run never reads left out)."""
  return workdir_lib.differences(_comparable(workdir_lib.saved_config(saved_json)),
                                 _comparable(workdir_lib.as_json(config)))


def refuse_differences(held: str, diff: dict, advice: str = "") -> None:
  """ConfigChanged saying `held` (what holds a run of another config), the fields of `diff` ({field: (held, asked)})
  and `advice`; nothing when `diff` is empty."""
  if diff:
    listing = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
    raise workdir_lib.ConfigChanged(f"{held}; these fields differ:\n{listing}" + (f"\n{advice}" if advice else ""))


def load_plan(records, plan) -> dict:
  """{(variant, seed): result} of the runs of `plan` ((variant, seed, config) triples) recorded under `records`,
  each checked as `load` does (so a changed config is an error before anything runs); {} when `records` is None."""
  if records is None:
    return {}
  found = {(variant, seed): load(records, variant, seed, config) for variant, seed, config in plan}
  return {key: result for key, result in found.items() if result is not None}


def save(records, variant: str, seed: int, config, result: dict, *, commit: str | None = None,
         device: str | None = None) -> pathlib.Path:
  """Writes the record of a finished run (the file appears whole or not at all) and returns its path. `commit` and
  `device`: where the run ran, when not here (default: this checkout's commit and this process's device)."""
  p = path(records, variant, seed)
  _write(p, {"config": workdir_lib.as_json(config), "commit": commit or _commit(), "device": device or _device(),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "result": result})
  return p


def provenance(records) -> str:
  """Where a study's recorded runs and measurements come from, as text: each (commit, device kind) with its count,
  e.g. "d6e617a, device not recorded: 10 runs; 8f0229f, NVIDIA H100 80GB HBM3: 2 runs"; "" when nothing is
  recorded."""
  counts: dict[tuple[str, str], list[int]] = {}
  root = pathlib.Path(records)
  for p in sorted(root.glob("*/seed_*.json")) + sorted(root.glob("measured/*.json")):
    record = json.loads(p.read_text())
    key = (record.get("commit") or "commit unknown", record.get("device") or "device not recorded")
    counts.setdefault(key, [0, 0])[p.parent.name == "measured"] += 1
  parts = []
  for (commit, device), (runs, measured) in counts.items():
    what = [f"{n} {word}{'s' if n > 1 else ''}" for n, word in ((runs, "run"), (measured, "measurement")) if n]
    parts.append(f"{commit}, {device}: {', '.join(what)}")
  return "; ".join(parts)


def measurement_path(records, name: str, device: str) -> pathlib.Path:
  """Where measurement `name` (e.g. a notebook's timings) made on a device of kind `device` is recorded."""
  kind = re.sub(r"[^0-9A-Za-z]+", "_", device).strip("_") or "unknown"
  return pathlib.Path(records) / "measured" / f"{name}@{kind}.json"


def measured(records, name: str, settings: dict, measure: Callable[[], object], *, device: str) -> tuple[object,
                                                                                                         bool]:
  """(what `measure()` returns, whether it was read from a record): a measurement that is not a training run
  (timings), recorded under `records` as `name` for the device kind `device` and its `settings` (what it measured:
  shapes, repeats, the anchor's version), so a notebook run again, here or on another machine with the files,
  reads it instead of measuring again; a measurement of the same name and device with other settings is an error
  (ConfigChanged, naming the fields; delete the file to measure again). Devices of other kinds keep their own."""
  p = measurement_path(records, name, device)
  settings = plain(settings)
  if p.exists():
    record = json.loads(p.read_text())
    refuse_differences(f"{p} records {name!r} measured with other settings",
                       workdir_lib.differences(_comparable_settings(record["settings"]),
                                               _comparable_settings(settings)),
                       "Delete the record to measure again with these settings.")
    return record["result"], True
  result = plain(measure())
  _write(p, {"settings": settings, "device": device, "commit": _commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "result": result})
  return result, False


def _write(p: pathlib.Path, record: dict) -> None:
  """Writes a record (the file appears whole or not at all)."""
  p.parent.mkdir(parents=True, exist_ok=True)
  tmp = p.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(record, default=_plain) + "\n")
  os.replace(tmp, p)


def plain(obj):
  """`obj` as it reads back from a record: NumPy and JAX numbers and arrays become JSON numbers and lists, tuples
  lists (so a run's result is the same whether it was just trained or read from its record)."""
  return json.loads(json.dumps(obj, default=_plain))


def _plain(x):
  if hasattr(x, "tolist"):
    return x.tolist()
  raise TypeError(f"a record holds JSON values; got {type(x).__name__}")


def _comparable(config_json: dict) -> dict:
  """The fields of a config that say what a run computes: not where files live, nor which kernels run the same
  formulas (`KERNEL_CHOICES`), nor MoE settings the model never reads (`k3jax.config.unread_moe_fields`: a
  balancer's settings in another balancer's run, any MoE setting with the MoE off), so that a record stays valid
  when only those change."""
  unread = [f"model.moe.{f}" for f in config_lib.unread_moe_fields(config_json.get("model", {}).get("moe", {}))]
  flat = workdir_lib.flatten(config_json)
  out = {k: v for k, v in flat.items() if not workdir_lib.under(k, (*MACHINE_FIELDS, *KERNEL_CHOICES, *unread))}
  for k in SHARD_FIELDS:
    if out.get(k):
      out[k] = ",".join(pathlib.PurePath(p.strip()).name for p in out[k].split(","))
  return out


def _comparable_settings(settings):
  """A measurement's settings as they are compared: each config inside them (a dict with a "model" entry, such as
  the models a timing ran) as `_comparable` sees a run's, so that a timing stays valid when only fields its models
  never read change, or fields they predate are added."""
  if not isinstance(settings, dict):
    return settings
  if isinstance(settings.get("model"), dict):
    return _comparable(workdir_lib.saved_config(settings))
  return {k: _comparable_settings(v) for k, v in settings.items()}


def _device() -> str:
  """The kind of the device runs train on (the first of `jax.devices()`)."""
  import jax
  return jax.devices()[0].device_kind


def _commit() -> str | None:
  """$K3JAX_COMMIT when set (a copy of the repository on a GPU machine has no .git), else the checkout's commit;
  None when neither is known."""
  if os.environ.get(COMMIT_ENV):
    return os.environ[COMMIT_ENV]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=pathlib.Path(__file__).parent,
                          capture_output=True, text=True, timeout=10, check=True).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None
