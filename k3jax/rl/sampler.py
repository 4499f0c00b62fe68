"""Generation for rollouts: the interface a multi-turn rollout needs, and a reference implementation of it.

The interface (`Sampler`, `Session`): `sampler.open(prompts, max_len)` starts one context per row; each turn,
`session.generate(rows, max_new)` extends the given rows with sampled tokens until a stop string, a stop token or
the row's `max_new` tokens, and returns the new tokens of each row; `session.append(row, tokens)` adds a tool
result to a row's context. Rows have their own lengths throughout.

`ReprefillSampler` is the reference: every `generate` runs the rows' whole contexts again (a prefill of the
part all active rows share, rounded down to `prefill_bucket`, then teacher-forced decode steps up to each row's
end) and samples on from there, so it needs only `k3jax.generate`'s `prefill` and `decode_step`. It is exact
(each row sees only its own tokens, no padding) and compiles once per prefill length bucket, but costs a
re-prefill per turn. A cache-continuing sampler (the KDA state and MLA latents carried across turns, only the
tool result prefilled) implements the same interface once generation has per-row lengths.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import generate
from k3jax.data import tokenizer as tok
from k3jax.rl import protocol


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  temperature: float = 1.0      # 0: greedy
  top_p: float = 1.0            # nucleus: sample among the most likely tokens holding this much probability
  stop_strings: tuple[str, ...] = protocol.STOP_STRINGS   # a row stops after generating one of these
  stop_tokens: tuple[int, ...] = (tok.EOS,)

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
    if not self.stop_strings or any(not s for s in self.stop_strings):
      raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")


class Session(Protocol):
  def generate(self, rows: Sequence[int], max_new: Sequence[int], rng: jax.Array) -> list[np.ndarray]:
    """Samples on from the contexts of `rows`; returns each row's new int32 tokens (its stop included), which
    are appended to its context."""

  def append(self, row: int, tokens: np.ndarray) -> None:
    """Adds tokens (a tool result) to a row's context."""

  def context(self, row: int) -> np.ndarray:
    """A row's tokens so far."""


class Sampler(Protocol):
  def open(self, prompts: Sequence[np.ndarray], max_len: int) -> Session:
    """A session with one row per prompt; no row may grow beyond `max_len` tokens."""


def sample(logits_RV, key, temperature, top_p):
  """int32 `[R]`: the argmax (temperature 0) or a draw from softmax(logits / temperature) restricted to the
  smallest set of tokens, most likely first, that holds `top_p` of the probability. `temperature` and `top_p`
  may be traced."""
  hot = temperature > 0
  logits = logits_RV.astype(jnp.float32) / jnp.where(hot, temperature, 1.0)

  def nucleus(logits):
    desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs   # probability of the more likely tokens
    cutoff = jnp.min(jnp.where(before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)
  logits = jax.lax.cond(hot & (top_p < 1.0), nucleus, lambda x: x, logits)
  drawn = jax.random.categorical(key, logits, axis=-1)
  return jnp.where(hot, drawn, jnp.argmax(logits_RV, axis=-1)).astype(jnp.int32)


def _stop_arrays(options: SamplingOptions):
  """The stop strings' tokens right-aligned in a `[S, W]` array of -1, their lengths `[S]`, and the stop tokens
  `[K]` padded with -1; S, W, K are rounded up so that most option sets share one compiled decode loop."""
  stops = [tok.encode(x) for x in options.stop_strings]
  width = max([16] + [len(x) for x in stops])
  count = max(4, len(stops))
  stops_SW = np.full((count, width), -1, np.int32)
  lens_S = np.zeros(count, np.int32)
  for i, x in enumerate(stops):
    stops_SW[i, width - len(x):], lens_S[i] = x, len(x)
  tokens_K = np.full(max(4, len(options.stop_tokens)), -1, np.int32)
  tokens_K[:len(options.stop_tokens)] = options.stop_tokens
  return stops_SW, lens_S, tokens_K


class ReprefillSampler:
  """The reference `Sampler` for a model given as (graphdef, variables) (`nnx.split` pieces); its sessions are
  `ReprefillSession`s."""

  def __init__(self, graphdef, variables, options: SamplingOptions, *, prefill_bucket: int = 32):
    if prefill_bucket < 1:
      raise ValueError(f"prefill_bucket must be >= 1, got {prefill_bucket}")
    self.graphdef, self.variables, self.options, self.bucket = graphdef, tuple(variables), options, prefill_bucket

  def open(self, prompts, max_len: int) -> "ReprefillSession":
    return ReprefillSession(self, prompts, max_len)


class ReprefillSession:
  def __init__(self, sampler: ReprefillSampler, prompts, max_len: int):
    self.sampler, self.max_len = sampler, int(max_len)
    self.contexts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not self.contexts or any(len(c) == 0 or len(c) > self.max_len for c in self.contexts):
      raise ValueError(f"prompts must be non-empty and at most max_len={max_len} tokens, got lengths "
                       f"{[len(c) for c in self.contexts]}")

  def context(self, row: int) -> np.ndarray:
    return self.contexts[row]

  def append(self, row: int, tokens) -> None:
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if len(self.contexts[row]) + len(tokens) > self.max_len:
      raise ValueError(f"row {row}: {len(self.contexts[row])} + {len(tokens)} tokens exceed max_len={self.max_len}")
    self.contexts[row] = np.concatenate([self.contexts[row], tokens])

  def generate(self, rows, max_new, rng) -> list[np.ndarray]:
    rows, max_new = [int(r) for r in rows], [int(n) for n in max_new]
    if len(rows) != len(max_new) or len(set(rows)) != len(rows) or not rows:
      raise ValueError(f"rows must be distinct, non-empty and match max_new, got rows={rows}, max_new={max_new}")
    lengths_R = np.array([len(c) for c in self.contexts], np.int32)
    new_R = np.zeros(len(self.contexts), np.int32)
    new_R[rows] = max_new
    if np.any(lengths_R + new_R > self.max_len) or min(max_new) < 1:
      raise ValueError(f"each row needs 1 <= max_new <= max_len - its length; got max_new={max_new} for lengths "
                       f"{lengths_R[rows].tolist()} and max_len={self.max_len}")
    buffer_RT = np.full((len(self.contexts), self.max_len), tok.PAD, np.int32)
    for r, c in enumerate(self.contexts):
      buffer_RT[r, :len(c)] = c
    s = self.sampler
    shortest = int(lengths_R[rows].min())   # rows left out may be shorter: their tokens are ignored
    prefix = shortest if shortest < s.bucket else shortest // s.bucket * s.bucket
    logits, cache = _prefill(s.graphdef, s.variables, jnp.asarray(buffer_RT[:, :prefix]), max_len=self.max_len)
    stops_SW, lens_S, tokens_K = _stop_arrays(s.options)
    out_RT, count_R = jax.device_get(_decode(
        s.graphdef, s.variables, logits, cache, jnp.asarray(buffer_RT), jnp.asarray(lengths_R), jnp.asarray(new_R),
        rng, stops_SW, lens_S, tokens_K, jnp.float32(s.options.temperature), jnp.float32(s.options.top_p)))
    new = [out_RT[r, lengths_R[r]:lengths_R[r] + count_R[r]].astype(np.int32) for r in rows]
    for r, t in zip(rows, new):
      self.contexts[r] = np.concatenate([self.contexts[r], t])
    return new


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _prefill(graphdef, variables, prefix_RP, *, max_len):
  return generate.prefill(nnx.merge(graphdef, *variables), prefix_RP, max_len)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _decode(graphdef, variables, logits_RV, cache, buffer_RT, lengths_R, max_new_R, rng, stops_SW, stop_lens_S,
            stop_tokens_K, temperature, top_p):
  """Decode steps from the cache's position to the end of the buffer (or until every row is done): a row takes
  its own tokens while its context lasts, then samples until a stop or `max_new_R` tokens. Returns the buffer
  with the sampled tokens written after each context, and how many each row sampled."""
  model = nnx.merge(graphdef, *variables)
  num_rows, max_len = buffer_RT.shape
  width = stops_SW.shape[1]
  # A stop string of length n matches when the last n tokens equal it: compare on the last `width` tokens,
  # ignoring the positions before the string (-1 in stops_SW).
  care_SW = stops_SW >= 0

  def cond(carry):
    t, _, _, _, _, done_R, _ = carry
    return (t < max_len) & ~jnp.all(done_R)

  def body(carry):
    t, logits_RV, cache, buffer_RT, count_R, done_R, window_RW = carry
    forced_R = t < lengths_R
    picked_R = sample(logits_RV, jax.random.fold_in(rng, t), temperature, top_p)
    column_R = jax.lax.dynamic_index_in_dim(buffer_RT, t, axis=1, keepdims=False)
    sampling_R = ~forced_R & ~done_R
    token_R = jnp.where(forced_R, column_R, jnp.where(done_R, tok.PAD, picked_R))
    buffer_RT = jax.lax.dynamic_update_index_in_dim(buffer_RT, jnp.where(sampling_R, token_R, column_R), t, axis=1)
    count_R = count_R + sampling_R
    window_RW = jnp.concatenate([window_RW[:, 1:], token_R[:, None]], axis=1)
    match_RS = jnp.all((window_RW[:, None, :] == stops_SW[None]) | ~care_SW[None], axis=-1)
    match_RS &= (stop_lens_S[None] > 0) & (count_R[:, None] >= stop_lens_S[None])
    stopped_R = jnp.any(match_RS, axis=1) | jnp.isin(token_R, stop_tokens_K) | (count_R >= max_new_R)
    done_R = done_R | (sampling_R & stopped_R)
    logits_RV, cache = generate.decode_step(model, token_R, cache)
    return t + 1, logits_RV, cache, buffer_RT, count_R, done_R, window_RW

  start = (cache.pos, logits_RV, cache, buffer_RT, jnp.zeros(num_rows, jnp.int32), max_new_R == 0,
           jnp.full((num_rows, width), tok.PAD, jnp.int32))
  _, _, _, buffer_RT, count_R, _, _ = jax.lax.while_loop(cond, body, start)
  return buffer_RT, count_R
