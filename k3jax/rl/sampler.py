"""Generation for multi-turn rollouts, on `k3jax.generate_lib`: one cache per episode row, continued across turns.

`Sampler(model, options, ...).open(prompts, max_len)` prefills the prompts (rows of their own lengths) into a cache
of `max_len` positions and returns a `Session`. Each turn, `session.generate(rows, max_new, rng)` runs one decode
loop over every row (the rows not asked sit it out) until each asked row ends a call (a stop sequence of
`protocol.STOP_STRINGS`), emits a stop token or spends its budget; `session.append(row, tokens)` adds a tool result
to a row. Before the next decode, each row's tokens not yet in its cache (its last sampled token, which the decode
loop does not feed, and the result) are prefilled from the cache: the KDA state and the MLA latents continue, the
history is never run again.

A session compiles three programs, once per (rows, max_len): the prompt's chunk step (`prefill_chunk` tokens), the
continuation's chunk step (`append_chunk` tokens) and the decode loop (`turn_tokens` steps, these options). Its
`timing` counts the tokens and seconds of each kind of work: prefill (prompts and what is appended to them) and
decode (the sampled tokens), each waited for before its clock stops.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import generate_lib, sampling
from k3jax.data import tokenizer as tok
from k3jax.envs import protocol


class Session(Protocol):
  """What a rollout drives (`k3jax.rl.rollout.play`): one context per row."""

  def generate(self, rows: Sequence[int], max_new: Sequence[int], rng: jax.Array) -> list[np.ndarray]:
    """Samples on from the contexts of `rows`; returns each row's new int32 tokens (its stop included), which
    are appended to its context."""

  def append(self, row: int, tokens: np.ndarray) -> None:
    """Adds tokens (a tool result) to a row's context."""

  def context(self, row: int) -> np.ndarray:
    """A row's tokens so far."""


def rollout_options(temperature: float, top_p: float = 1.0) -> sampling.SamplingOptions:
  """Sampling for episodes: a turn ends at the end of a call (the tokens of `protocol.STOP_STRINGS`) or at EOS."""
  return sampling.SamplingOptions(temperature=temperature, top_p=top_p, stop_tokens=(tok.EOS,),
                                  stop_sequences=tuple(tuple(int(t) for t in tok.encode(s))
                                                       for s in protocol.STOP_STRINGS), pad_id=tok.PAD)


def _padded(rows: Sequence[np.ndarray], chunk: int) -> np.ndarray:
  """int32 `[R, k·chunk]`: the rows left-aligned, padded to the next multiple of `chunk` (so a session's calls
  see few shapes)."""
  width = max(chunk, -(-max(len(r) for r in rows) // chunk) * chunk)
  out = np.full((len(rows), width), tok.PAD, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


class Sampler:
  """Opens sessions on `model` (a K3Model, used read-only) with sampling `options`; a turn takes at most
  `turn_tokens` tokens."""

  def __init__(self, model, options: sampling.SamplingOptions, *, turn_tokens: int, prefill_chunk: int = 256,
               append_chunk: int = 64):
    for name, value in (("turn_tokens", turn_tokens), ("prefill_chunk", prefill_chunk),
                        ("append_chunk", append_chunk)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    self.model, self.options = model, options
    self.turn_tokens, self.prefill_chunk, self.append_chunk = turn_tokens, prefill_chunk, append_chunk

  def open(self, prompts: Sequence[np.ndarray], max_len: int) -> "CachedSession":
    return CachedSession(self, prompts, max_len)


@dataclasses.dataclass
class Timing:
  """Tokens and seconds a session spent prefilling (prompts, appended results; real tokens, not padding) and
  decoding (the tokens sampled for the rows asked)."""
  prefill_tokens: int = 0
  prefill_s: float = 0.0
  decode_tokens: int = 0
  decode_s: float = 0.0

  def rates(self) -> dict[str, float]:
    """{"prefill_tokens_per_s", "decode_tokens_per_s"} (0 where nothing ran)."""
    rate = lambda n, s: n / s if s > 0 else 0.0
    return {"prefill_tokens_per_s": rate(self.prefill_tokens, self.prefill_s),
            "decode_tokens_per_s": rate(self.decode_tokens, self.decode_s)}


class CachedSession:
  """A `Session` over a `generate_lib` cache (see the module docstring)."""

  def __init__(self, sampler: Sampler, prompts, max_len: int):
    self.sampler, self.max_len = sampler, int(max_len)
    self.contexts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not self.contexts or any(len(c) == 0 or len(c) > self.max_len for c in self.contexts):
      raise ValueError(f"prompts must be non-empty and at most max_len={max_len} tokens, got lengths "
                       f"{[len(c) for c in self.contexts]}")
    self.queued = [np.zeros(0, np.int32) for _ in self.contexts]   # each row's tokens not yet in its cache
    self.timing = Timing()
    start = time.perf_counter()
    self.logits, self.cache = generate_lib.prefill_chunked(
        sampler.model, jnp.asarray(_padded(self.contexts, sampler.prefill_chunk)),
        np.array([len(c) for c in self.contexts]), chunk=sampler.prefill_chunk, max_len=self.max_len)
    self._count_prefill(sum(len(c) for c in self.contexts), start)

  def context(self, row: int) -> np.ndarray:
    return self.contexts[row]

  def append(self, row: int, tokens) -> None:
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if len(self.contexts[row]) + len(tokens) > self.max_len:
      raise ValueError(f"row {row}: {len(self.contexts[row])} + {len(tokens)} tokens exceed max_len={self.max_len}")
    self.contexts[row] = np.concatenate([self.contexts[row], tokens])
    self.queued[row] = np.concatenate([self.queued[row], tokens])

  def _feed_queued(self) -> None:
    """Prefills every row's queued tokens from its cache (rows with none keep their logits)."""
    lengths = np.array([len(q) for q in self.queued])
    if not lengths.any():
      return
    s = self.sampler
    start = time.perf_counter()
    self.logits, self.cache = generate_lib.prefill_chunked(
        s.model, jnp.asarray(_padded(self.queued, s.append_chunk)), lengths, chunk=s.append_chunk,
        cache=self.cache, logits_BV=self.logits)
    self._count_prefill(int(lengths.sum()), start)
    self.queued = [np.zeros(0, np.int32) for _ in self.queued]

  def _count_prefill(self, tokens: int, start: float) -> None:
    jax.block_until_ready(self.logits)
    self.timing.prefill_tokens += tokens
    self.timing.prefill_s += time.perf_counter() - start

  def generate(self, rows, max_new, rng) -> list[np.ndarray]:
    rows, max_new = [int(r) for r in rows], [int(n) for n in max_new]
    if len(rows) != len(max_new) or len(set(rows)) != len(rows) or not rows:
      raise ValueError(f"rows must be distinct, non-empty and match max_new, got rows={rows}, max_new={max_new}")
    s = self.sampler
    for r, n in zip(rows, max_new):
      if not 1 <= n <= min(s.turn_tokens, self.max_len - len(self.contexts[r])):
        raise ValueError(f"row {r}: max_new={n} must lie in [1, min(turn_tokens={s.turn_tokens}, max_len - its "
                         f"length = {self.max_len - len(self.contexts[r])})]")
    self._feed_queued()
    budget_B = np.zeros(len(self.contexts), np.int32)
    budget_B[rows] = max_new
    start = time.perf_counter()
    out_BN, got_B, self.cache = generate_lib.decode_loop(s.model, self.logits, self.cache, rng,
                                                         max_new=s.turn_tokens, max_new_B=budget_B,
                                                         options=s.options)
    out_BN, got_B = jax.device_get((out_BN, got_B))
    new = [out_BN[r, :got_B[r]].astype(np.int32) for r in rows]
    self.timing.decode_tokens += sum(len(t) for t in new)
    self.timing.decode_s += time.perf_counter() - start
    for r, t in zip(rows, new):
      self.contexts[r] = np.concatenate([self.contexts[r], t])
      self.queued[r] = t[-1:]   # the decode loop feeds every token but the last
    return new
