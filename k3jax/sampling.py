"""Choosing the next token (docs/design.md, generation): greedy, temperature and nucleus (top-p) sampling from
logits `[B, V]`, and when a row is done (a stop token, a stop sequence, its own budget of new tokens).

Pure functions of arrays, usable under `jax.jit`: `temperature` and `top_p` may be traced, and either a scalar or
one value per row `[B]`. Sampling is deterministic given the key.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """How `k3jax.generate_lib.decode_loop` picks tokens and stops rows."""
  temperature: float = 0.0               # 0: greedy (argmax); else sample from softmax(logits / temperature)
  top_p: float = 1.0                     # nucleus: the smallest set of most likely tokens holding ≥ top_p
  stop_tokens: tuple[int, ...] = ()      # a row is done once it has emitted one of these (the stop is kept)
  # A row is done once its new tokens end with one of these (a stop string's tokens, e.g. the end of a tool call);
  # only tokens of the same call count, not the prompt's.
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  pad_id: int = 0                        # what a done row emits afterwards

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_tokens):
      raise ValueError(f"stop_tokens must be non-negative ints, got {self.stop_tokens!r}")
    if not isinstance(self.stop_sequences, tuple) or any(
        not isinstance(s, tuple) or not s or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in s)
        for s in self.stop_sequences):
      raise ValueError(f"stop_sequences must be a tuple of non-empty tuples of non-negative ints, got "
                       f"{self.stop_sequences!r}")

  @property
  def stop_window(self) -> int:
    """How many of a row's latest tokens the stop sequences look at (the longest one's length)."""
    return max((len(s) for s in self.stop_sequences), default=0)


def top_p_mask(logits_BV, top_p):
  """bool `[B, V]`: the smallest set of tokens, most likely first, whose probability sums to ≥ `top_p` (ties in
  order of token id). top_p ≥ 1 keeps every token."""
  B, V = logits_BV.shape
  logits = logits_BV.astype(jnp.float32)
  order_BV = jnp.argsort(-logits, axis=-1, stable=True)
  p_sorted = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), order_BV, axis=-1)
  mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted           # probability of the tokens ranked above
  top_p = _per_row(top_p, B)
  keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
  return jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], order_BV].set(keep_sorted)


def sample(logits_BV, key, *, temperature=0.0, top_p=1.0):
  """int32 `[B]`: the argmax where temperature is 0, else a draw from softmax(logits / temperature) restricted to
  `top_p_mask(logits, top_p)`."""
  if logits_BV.ndim != 2:
    raise ValueError(f"logits must be [B, V], got shape {tuple(logits_BV.shape)}")
  B = logits_BV.shape[0]
  logits = logits_BV.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if isinstance(temperature, (int, float)) and temperature == 0:   # known greedy: no sort, no draw
    return greedy
  temperature = _per_row(temperature, B)
  hot = temperature > 0
  scaled = logits / jnp.where(hot, temperature, 1.0)
  if not (isinstance(top_p, (int, float)) and top_p >= 1):
    scaled = jnp.where(top_p_mask(logits, top_p), scaled, -jnp.inf)
  drawn = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
  return jnp.where(hot[:, 0], drawn, greedy)


def is_stop(token_B, stop_tokens: tuple[int, ...]):
  """bool `[B]`: whether each token is one of `stop_tokens`."""
  if not stop_tokens:
    return jnp.zeros(token_B.shape, bool)
  return jnp.isin(token_B, jnp.asarray(stop_tokens, token_B.dtype))


def finished(done_B, token_B, generated_B, max_new_B, stop_tokens: tuple[int, ...]):
  """bool `[B]`: rows done after emitting `token_B`, their `generated_B`-th new token (counting it): done before,
  a stop token, or the row's budget `max_new_B` reached."""
  return done_B | is_stop(token_B, stop_tokens) | (generated_B >= max_new_B)


def push(recent_BW, token_B):
  """The window of each row's latest W tokens after `token_B` (the oldest drops out; W may be 0)."""
  return jnp.concatenate([recent_BW, token_B[:, None].astype(recent_BW.dtype)], axis=1)[:, 1:]


def ends_with(recent_BW, stop_sequences: tuple[tuple[int, ...], ...]):
  """bool `[B]`: whether each row's window of latest tokens (`push`; -1 where a row has fewer) ends with one of
  `stop_sequences` (none longer than the window)."""
  W = recent_BW.shape[1]
  match_B = jnp.zeros(recent_BW.shape[:1], bool)
  for seq in stop_sequences:
    if len(seq) > W:
      raise ValueError(f"stop sequence {seq} is longer than the window of {W} tokens")
    match_B |= jnp.all(recent_BW[:, W - len(seq):] == jnp.asarray(seq, recent_BW.dtype), axis=1)
  return match_B


def _per_row(value, B):
  """A scalar or `[B]` option as fp32 `[B, 1]`."""
  value = jnp.asarray(value, jnp.float32)
  if value.ndim not in (0, 1) or (value.ndim == 1 and value.shape[0] != B):
    raise ValueError(f"a sampling option must be a scalar or one value per row [{B}], got shape {value.shape}")
  return jnp.broadcast_to(value.reshape(-1, 1), (B, 1))
