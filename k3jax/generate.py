"""Generation in one call: `generate(model, prompt_BT, num_tokens)`, greedy or sampled, prompts of one length.

A convenience over `k3jax.generate_lib` (one chunked-prefill step over the whole prompt, then its decode loop with
`k3jax.sampling`); use that module directly for per-row lengths, stop tokens, nucleus sampling or long prompts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax import generate_lib, sampling


def generate(model, prompt_BT, num_tokens: int, *, rng=None, temperature: float = 0.0, top_p: float = 1.0,
             max_len: int | None = None):
  """`[B, num_tokens]` new tokens after the prompt: argmax when temperature == 0, else sampled from softmax(l/T)
  within the nucleus `top_p`. `max_len`: the cache's positions (prompt + new tokens; None: exactly that many).
  Every argument is checked before any compute."""
  prompt_BT = jnp.asarray(prompt_BT)
  if prompt_BT.ndim != 2 or prompt_BT.shape[1] == 0 or not jnp.issubdtype(prompt_BT.dtype, jnp.integer):
    raise ValueError(f"prompt_BT must be a non-empty integer array [B,T], got "
                     f"{prompt_BT.dtype}{tuple(prompt_BT.shape)}")
  if not isinstance(num_tokens, int) or num_tokens < 1:
    raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
  options = sampling.SamplingOptions(temperature=float(temperature), top_p=float(top_p))   # checks both ranges
  if temperature > 0 and rng is None:
    raise ValueError("sampling (temperature > 0) needs rng")
  T = prompt_BT.shape[1]
  max_len = T + num_tokens if max_len is None else max_len
  if not isinstance(max_len, int) or max_len < T + num_tokens:
    raise ValueError(f"max_len={max_len!r} cannot hold the prompt ({T} tokens) and {num_tokens} new tokens")
  low, high = int(prompt_BT.min()), int(prompt_BT.max())
  if low < 0 or high >= model.vocab_size:
    raise ValueError(f"prompt tokens must lie in [0, vocab_size={model.vocab_size}), got [{low}, {high}]")
  rng = jax.random.PRNGKey(0) if rng is None else rng
  logits, cache = generate_lib.prefill_chunked(model, prompt_BT, chunk=T, max_len=max_len)
  tokens, _, _ = generate_lib.decode_loop(model, logits, cache, rng, max_new=num_tokens, options=options)
  return tokens
