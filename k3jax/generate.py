"""Generation with caches: prefill a prompt, then decode one token at a time (greedy or sampled).

The cache (`k3jax.model.ModelCache`) holds, per KDA layer, the recurrent state and the short-conv state (the last
conv_size−1 pre-conv q|k|v inputs) and, per MLA layer, the latent c_kv of every position (absorbed decoding).
Prompts in a batch share one length (no padding).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def prefill(model, prompt_BT, max_len: int):
  """(logits of the prompt's last position `[B,V]`, a cache with room for `max_len` tokens in all)."""
  return model.prefill(prompt_BT, max_len)


def decode_step(model, token_B, cache):
  """(logits `[B,V]` for the token after `token_B`, the advanced cache)."""
  return model.decode(token_B, cache)


def generate(model, prompt_BT, num_tokens: int, *, rng=None, temperature: float = 0.0):
  """`[B, num_tokens]` new tokens after the prompt: argmax when temperature == 0, else sampled from softmax(l/T)."""
  if prompt_BT.ndim != 2 or prompt_BT.shape[1] == 0 or not jnp.issubdtype(prompt_BT.dtype, jnp.integer):
    raise ValueError(f"prompt_BT must be a non-empty integer array [B,T], got "
                     f"{prompt_BT.dtype}{tuple(prompt_BT.shape)}")
  if not isinstance(num_tokens, int) or num_tokens < 1:
    raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if temperature > 0 and rng is None:
    raise ValueError("sampling (temperature > 0) needs rng")
  rng = jax.random.PRNGKey(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt_BT, rng, num_tokens=num_tokens, temperature=float(temperature))


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens", "temperature"))
def _generate(graphdef, state, prompt_BT, rng, *, num_tokens, temperature):
  model = nnx.merge(graphdef, state)
  keys = jax.random.split(rng, num_tokens)
  logits, cache = prefill(model, prompt_BT, prompt_BT.shape[1] + num_tokens)
  first = _pick(logits, keys[0], temperature)

  def step(carry, key):
    token, cache = carry
    logits, cache = decode_step(model, token, cache)
    token = _pick(logits, key, temperature)
    return (token, cache), token

  _, rest_NB = jax.lax.scan(step, (first, cache), keys[1:])
  return jnp.concatenate([first[:, None], rest_NB.T], axis=1)


def _pick(logits_BV, key, temperature):
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits_BV / temperature, axis=-1).astype(jnp.int32)
