"""Loss-free quantile balancing of MoE routing (docs/design.md, quantile balancing), its baselines and load metrics.

The state is a per-expert bias used for selection only, and a decayed load per expert. `update` moves the bias after
each optimizer step from the router scores of that step: "article" (the K3 article's §4.2: the selection counts of
recent steps, the load's deviation judged against its median, P50, a smooth bounded correction) moves it by
`article_correction`; "exact" sets each expert's bias to the cut-off quantile that would give it exactly T·k/E of
the tokens (the project's own method); "histogram" does the same from per-expert histograms that sum across
micro-batches and devices; "sign" is the DeepSeek-V3 baseline. The Switch-style auxiliary loss is the other
baseline. Pure functions, never differentiated.
Token weights `weights_T` (1 for a real token, 0 for padding; None: all real) keep padding out of every statistic:
the quantiles, histograms, loads and the auxiliary loss count the real tokens only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from k3jax.ops import moe_dispatch

METHODS = ("article", "exact", "histogram", "sign")
NUM_BINS = 4096
# The article method's defaults (`update`): its largest step, in cut-off gaps, and the load deviation, in even shares,
# up to which the step stays in proportion to it (two gaps per share). A step of two gaps at a unit of one share
# (the earlier defaults) slowed to a crawl on a training router whose load had collapsed (docs/design.md).
CORRECTION_STEP = 16.0
LOAD_UNIT = 8.0


@struct.dataclass
class State:
  bias: jax.Array                  # [E] float32, added to the scores for selection only
  load_E: jax.Array | None = None  # [E] float32, each expert's decayed load ratio over recent steps (1 = even share)


class BalancerState(nnx.Variable):
  """Holds a `State` in a module: non-trainable, outside the gradients, saved with checkpoints."""


def init(num_experts: int) -> State:
  if not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
  return State(bias=jnp.zeros((num_experts,), jnp.float32), load_E=jnp.ones((num_experts,), jnp.float32))


def _check(scores_TE, bias_E, top_k):
  if scores_TE.ndim != 2 or bias_E.shape != (scores_TE.shape[1],):
    raise ValueError(f"expected scores [T, E] and bias [E], got {scores_TE.shape} and {bias_E.shape}")
  if not 1 <= top_k <= scores_TE.shape[1]:
    raise ValueError(f"top_k must be in [1, E={scores_TE.shape[1]}], got {top_k}")


def select(scores_TE, bias_E, *, top_k: int, routed_scaling: float = 1.0):
  """Experts by top-k of `scores + bias`; weights are the chosen unbiased scores, normalised, × routed_scaling.

  Returns (weights_TK in the scores' dtype, expert_ids_TK int32). Differentiable in the scores, not the bias.
  """
  _check(scores_TE, bias_E, top_k)
  _, ids_TK = jax.lax.top_k(scores_TE + jax.lax.stop_gradient(bias_E), top_k)
  chosen_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=-1)
  return chosen_TK / jnp.sum(chosen_TK, axis=-1, keepdims=True) * routed_scaling, ids_TK.astype(jnp.int32)


def expert_load(expert_ids_TK, num_experts: int, weights_T=None):
  """Token-slots routed to each expert, float32 `[E]` (each token's slots counted at its weight)."""
  return moe_dispatch.expert_counts(expert_ids_TK, num_experts, jnp.float32, weights=weights_T)


def cutoff_residuals(scores_TE, bias_E, *, top_k: int):
  """`r_ij = α_i − s_ij`, α_i the (k+1)-th largest of `s_i + b`: the bias expert j needs to win token i."""
  alpha_T = jax.lax.top_k(scores_TE + bias_E, top_k + 1)[0][:, top_k]
  return alpha_T[:, None] - scores_TE


def exact_quantile(residuals_TE, *, top_k: int, weights_T=None):
  """Per expert, the value b̂ with a fraction k/E of the residuals below it (n·k/E tokens won, n the real tokens:
  all T, or those of weight 1 in `weights_T`, 0/1; at least one).

  Interpolates the sorted residuals at position n·k/E − 1/2 (the midpoint of the two around the cut when
  n·k/E is whole), so `count(r < b̂) = round(n·k/E)` for distinct residuals.
  """
  t, e = residuals_TE.shape
  if weights_T is None:
    n = float(t)
  else:   # padding sorts last, past every real residual
    residuals_TE = jnp.where(weights_T[:, None] > 0, residuals_TE, jnp.inf)
    n = jnp.maximum(jnp.sum(weights_T > 0), 1).astype(jnp.float32)
  pos = jnp.clip(n * top_k / e - 0.5, 0.0, n - 1.0)
  lo = jnp.floor(pos).astype(jnp.int32)
  frac = pos - lo
  hi = jnp.minimum(lo + 1, jnp.asarray(n - 1).astype(jnp.int32))
  # Each expert's residuals as one row, sorted along the minor axis: XLA's GPU compiler hands only minor-axis sorts to
  # CUB's radix sort (batched); along the major axis of [T, E] it emits its own sorting network, dozens of passes.
  r_sorted_ET = jnp.sort(residuals_TE.T, axis=-1)
  return r_sorted_ET[:, lo] + frac * (r_sorted_ET[:, hi] - r_sorted_ET[:, lo])


def histogram_range(bias_E):
  """`[min b − 1, max b + 1]`: holds every residual, since α_i − s_ij ∈ (min b − 1, max b + 1) for s ∈ (0, 1)."""
  return jnp.min(bias_E) - 1.0, jnp.max(bias_E) + 1.0


def histogram(scores_TE, bias_E, *, top_k: int, num_bins: int = NUM_BINS, weights_T=None):
  """Per-expert counts `[E, num_bins]` (float32) of the residuals over `histogram_range(bias)`, each token counted
  at its weight.

  The bins depend on the bias only, so histograms of micro-batches or devices under the same bias add up.
  """
  _check(scores_TE, bias_E, top_k)
  lo, hi = histogram_range(bias_E)
  r_TE = cutoff_residuals(scores_TE, bias_E, top_k=top_k)
  bins_TE = jnp.clip(jnp.floor((r_TE - lo) / (hi - lo) * num_bins), 0, num_bins - 1).astype(jnp.int32)
  e = scores_TE.shape[1]
  w_T1 = jnp.ones((scores_TE.shape[0], 1), jnp.float32) if weights_T is None else weights_T[:, None]
  return jnp.zeros((e, num_bins), jnp.float32).at[jnp.arange(e)[None, :], bins_TE].add(
      jnp.broadcast_to(w_T1.astype(jnp.float32), bins_TE.shape))


def histogram_quantile(counts_EB, bias_E, *, top_k: int):
  """`exact_quantile` from summed histograms: the bin where the count reaches T·k/E, linearly interpolated."""
  e, num_bins = counts_EB.shape
  lo, hi = histogram_range(bias_E)
  target = jnp.sum(counts_EB[0]) * top_k / e  # every expert's row counts all (real) tokens
  cum_EB = jnp.cumsum(counts_EB, axis=1)
  bin_E = jnp.argmax(cum_EB >= target, axis=1)
  in_bin_E = jnp.take_along_axis(counts_EB, bin_E[:, None], axis=1)[:, 0]
  before_E = jnp.take_along_axis(cum_EB, bin_E[:, None], axis=1)[:, 0] - in_bin_E
  frac_E = (target - before_E) / jnp.maximum(in_bin_E, 1.0)
  return lo + (bin_E + frac_E) * (hi - lo) / num_bins


def update(state: State, scores_TE, weights_T=None, *, top_k: int, eta: float = 1.0, method: str = "exact",
           num_bins: int = NUM_BINS, sign_rate: float = 1e-3, rate: float = CORRECTION_STEP, decay: float = 0.5,
           bound: float = 1.0, load_unit: float = LOAD_UNIT, axis_name=None) -> State:
  """The state after a step whose router scores (all micro-batches) are `scores_TE`, of tokens weighted `weights_T`
  (0/1; None: all real). A step without a real token leaves the state as it is.

  article: `L ← (1 − decay) L + decay · n/(T·k/E)` (this step's selection counts n), then
  `b ← clip(b + Δ − mean Δ, ±bound)` with Δ = `article_correction(L, rate · gap, load_unit)`: `rate` is the largest
  change a step in units of `gap`, the cut-off gap: the mean over real tokens of the k-th minus the (k+1)-th largest
  `s + b`. So the step follows how close the router's scores are at the cut-off, whatever their spread.

  exact / histogram: `b ← b + η((b̂ − mean b̂) − b)` with b̂ the per-expert quantile. sign (baseline):
  `b ← b + sign_rate · sign(mean load − load)`. With `axis_name` (inside shard_map / pmap, scores sharded
  over that axis) the statistics are reduced over it: histograms and loads by a sum, exact by gathering scores.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if not 0.0 < eta <= 1.0:
    raise ValueError(f"eta must be in (0, 1], got {eta}")
  scores_TE = jax.lax.stop_gradient(scores_TE.astype(jnp.float32))
  bias_E = jax.lax.stop_gradient(state.bias)
  _check(scores_TE, bias_E, top_k)
  e = scores_TE.shape[1]
  psum = (lambda v: jax.lax.psum(v, axis_name)) if axis_name is not None else (lambda v: v)
  if weights_T is not None:
    weights_T = jax.lax.stop_gradient(weights_T.astype(jnp.float32))
    if weights_T.shape != scores_TE.shape[:1]:
      raise ValueError(f"weights_T must be [T={scores_TE.shape[0]}], got {weights_T.shape}")
  n_real = psum(jnp.asarray(scores_TE.shape[0], jnp.float32) if weights_T is None else jnp.sum(weights_T))
  any_real = n_real > 0
  if method == "sign":
    load_E = psum(expert_load(select(scores_TE, bias_E, top_k=top_k)[1], e, weights_T))
    new_E = bias_E + sign_rate * jnp.sign(jnp.mean(load_E) - load_E)
  elif top_k == e:  # every expert takes every token: nothing to balance
    return state
  elif method == "article":
    if not (0.0 < decay <= 1.0 and rate > 0.0 and bound > 0.0 and load_unit > 0.0):
      raise ValueError(f"need 0 < decay <= 1 and rate, bound, load_unit > 0, got {decay}, {rate}, {bound}, {load_unit}")
    gap_sum, ids_TK = _cutoff_gaps(scores_TE, bias_E, top_k, weights_T)
    load_E = psum(expert_load(ids_TK, e, weights_T))
    gap = psum(gap_sum) / jnp.maximum(n_real, 1.0)
    return article_step(state.replace(bias=bias_E), load_E, n_real, top_k=top_k, step=rate * gap, decay=decay,
                        bound=bound, load_unit=load_unit)
  elif method == "exact":
    if axis_name is not None:
      scores_TE = jax.lax.all_gather(scores_TE, axis_name, tiled=True)
      weights_T = None if weights_T is None else jax.lax.all_gather(weights_T, axis_name, tiled=True)
    target_E = exact_quantile(cutoff_residuals(scores_TE, bias_E, top_k=top_k), top_k=top_k, weights_T=weights_T)
    new_E = bias_E + eta * ((target_E - jnp.mean(target_E)) - bias_E)
  else:
    target_E = histogram_quantile(psum(histogram(scores_TE, bias_E, top_k=top_k, num_bins=num_bins,
                                                 weights_T=weights_T)), bias_E, top_k=top_k)
    new_E = bias_E + eta * ((target_E - jnp.mean(target_E)) - bias_E)
  return state.replace(bias=jnp.where(any_real, new_E, bias_E))


def cutoff_gap(scores_TE, bias_E, *, top_k: int, weights_T=None):
  """The cut-off gap: the mean over real tokens of the k-th minus the (k+1)-th largest `s + b` (how close the
  scores are where selection is decided; the article method's step unit). 0 without a real token."""
  gap_sum, _ = _cutoff_gaps(scores_TE.astype(jnp.float32), bias_E, top_k, weights_T)
  n_real = scores_TE.shape[0] if weights_T is None else jnp.sum(weights_T.astype(jnp.float32))
  return gap_sum / jnp.maximum(n_real, 1.0)


def _cutoff_gaps(scores_TE, bias_E, top_k, weights_T):
  """(the sum over real tokens of the cut-off gap, the chosen experts `[T, k]`)."""
  top_TK, ids_TK = jax.lax.top_k(scores_TE + bias_E, top_k + 1)   # the chosen k, then the first one left out
  gap_T = top_TK[:, top_k - 1] - top_TK[:, top_k]
  return jnp.sum(gap_T if weights_T is None else gap_T * weights_T), ids_TK[:, :top_k]


def article_step(state: State, load_E, num_tokens, *, top_k: int, step, decay: float, bound: float,
                 load_unit: float = LOAD_UNIT) -> State:
  """The article method's state after a step whose selection counts are `load_E` over `num_tokens` real tokens:
  the decayed load ratios, then the bias moved by `article_correction` at `step` (score units) and clipped to
  ±`bound`. A step without a real token leaves the state as it is."""
  bias_E, e = state.bias, load_E.shape[0]
  any_real = num_tokens > 0
  ratio_E = load_E / jnp.maximum(num_tokens * top_k / e, 1e-9)
  old_load = jnp.ones_like(bias_E) if state.load_E is None else state.load_E
  new_load = jnp.where(any_real, (1.0 - decay) * old_load + decay * ratio_E, old_load)
  delta_E = article_correction(new_load, rate=step, unit=load_unit)
  return state.replace(bias=jnp.where(any_real, jnp.clip(bias_E + delta_E - jnp.mean(delta_E), -bound, bound),
                                      bias_E), load_E=new_load)


def article_correction(load_E, *, rate, unit: float = LOAD_UNIT):
  """The article method's change of the bias from the decayed load ratios L: `−rate · tanh((L − P50) / unit)`,
  the deviation from the median load: an expert above the median loses bias, one below gains; the change is smooth
  in L (in proportion, `rate / unit` per even share, up to about `unit` shares from the median) and never above
  `rate` a step (`update` passes its `rate` times the cut-off gap). (Scaling the deviation by the load's spread,
  P90 − P50, made the step full-size at any imbalance and the load oscillate: docs/design.md, quantile balancing.)"""
  return -rate * jnp.tanh((load_E - jnp.percentile(load_E, 50.0)) / unit)


def switch_aux_loss(scores_TE, expert_ids_TK, weights_T=None):
  """Switch-style `E · Σ_j f_j · P_j`: f = fraction of slots routed to j, P = mean normalised score of j, over the
  tokens at their weights."""
  t, e = scores_TE.shape
  p_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
  if weights_T is None:
    n, p_E = t, jnp.mean(p_TE, axis=0)
  else:
    w_T = jax.lax.stop_gradient(weights_T.astype(jnp.float32))
    n = jnp.maximum(jnp.sum(w_T), 1.0)
    p_E = jnp.sum(w_T[:, None] * p_TE, axis=0) / n
  f_E = jax.lax.stop_gradient(expert_load(expert_ids_TK, e, weights_T)) / (n * expert_ids_TK.shape[1])
  return e * jnp.sum(f_E * p_E)


def load_metrics(load_E, top_k: int, num_tokens) -> dict:
  """Load ratios `L_j = n_j / (T·k/E)`: MaxVio = max L − 1, and the P50 / P90 / max of L."""
  ratio_E = load_E / (num_tokens * top_k / load_E.shape[0])
  return {"max_vio": jnp.max(ratio_E) - 1.0, "p50": jnp.percentile(ratio_E, 50.0),
          "p90": jnp.percentile(ratio_E, 90.0), "max": jnp.max(ratio_E)}
