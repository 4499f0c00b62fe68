"""Optimizer: global-norm clipping, then AdamW (or Muon for matrices), on a warmup-stable-decay schedule per stage."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from k3jax.model import unstacked_ndim

# The KDA decay parameters take no weight decay (docs/design.md, KDA); nor do vectors (norms, biases, AttnRes queries).
NO_DECAY_NAMES = ("A_log", "dt_bias")
# Muon orthogonalises the 2-D hidden matrices; embeddings, the output head and the depthwise short-conv kernels
# stay with AdamW (as do vectors and the stacked 3-D / 4-D weights: per-head and per-expert tensors). Ranks are
# a layer's own: the scanned layers' leading group axis is a batch axis (`unstacked_ndim`).
ADAM_ONLY_NAMES = ("embed", "lm_head", "conv")


def wsd_schedule(peak: float, steps: int, warmup_fraction: float, decay_fraction: float, final_fraction: float):
  """Warmup-stable-decay: linear rise to `peak` over the first steps, flat, linear fall to `final_fraction*peak`."""
  warmup = max(round(warmup_fraction * steps), 1)
  decay = round(decay_fraction * steps)
  decay_start = steps - decay

  def schedule(step):
    s = jnp.asarray(step, jnp.float32)
    rise = jnp.minimum(1.0, (s + 1.0) / warmup)
    fall = 1.0 - (1.0 - final_fraction) * jnp.clip((s - decay_start) / max(decay, 1), 0.0, 1.0)
    return peak * rise * fall
  return schedule


def _names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def decay_mask(params):
  """True for matrices (ndim >= 2) that take weight decay."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: unstacked_ndim(path, x) >= 2 and not set(_names(path)) & set(NO_DECAY_NAMES), params)


def muon_dims(params):
  """Muon's dimension numbers for the 2-D hidden matrices, None (AdamW) for the rest."""
  def dims(path, x):
    names, own = set(_names(path)), unstacked_ndim(path, x)
    use = own == 2 and not names & set(NO_DECAY_NAMES) and not names & set(ADAM_ONLY_NAMES)
    return contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1) if use else None
  return jax.tree_util.tree_map_with_path(dims, params)


def check(o) -> None:
  """ValueErrors for `config.optimizer` values out of range, naming the field (the peak lr of each stage is
  checked by `stages.training_plan`)."""
  def require(field, ok, what):
    value = o[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
      raise ValueError(f"config.optimizer.{field} must be {what}, got {value!r}")
  if o.name not in ("adamw", "muon"):
    raise ValueError(f"config.optimizer.name must be 'adamw' or 'muon', got {o.name!r}")
  require("lr", lambda v: v > 0, "> 0")
  require("b1", lambda v: 0 <= v < 1, "in [0, 1)")
  require("b2", lambda v: 0 <= v < 1, "in [0, 1)")
  require("eps", lambda v: v > 0, "> 0")
  require("weight_decay", lambda v: v >= 0, ">= 0")
  require("final_lr_fraction", lambda v: 0 <= v <= 1, "in [0, 1]")
  require("grad_clip", lambda v: v > 0, "> 0")


def make_optimizer(o, lr: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer of `o` (a config's `optimizer` section) on the learning-rate schedule `lr` (a training plan's,
  `stages.TrainingPlan.learning_rate`, or the RL stage's)."""
  check(o)
  if o.name == "adamw":
    core = optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
  else:
    core = contrib.muon(lr, beta=o.b1, weight_decay=o.weight_decay, weight_decay_mask=decay_mask,
                        adam_b1=o.b1, adam_b2=o.b2, adam_weight_decay=o.weight_decay,
                        muon_weight_dimension_numbers=muon_dims, consistent_rms=0.2)
  return optax.chain(optax.clip_by_global_norm(o.grad_clip), core)
