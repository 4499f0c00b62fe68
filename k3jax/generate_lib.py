"""Long-context generation (docs/design.md, generation): a prompt prefilled in chunks from a preallocated cache,
then a jitted decode loop, with per-row lengths throughout.

- `init_cache(model, batch, max_len)`: empty per-layer caches (KDA state and conv state; MLA latents for
  `max_len` positions) and each row's length (0).
- `prefill_chunked(model, tokens_BT, lengths_B, chunk=…)`: row b's first `lengths_B[b]` tokens appended to its
  cache `chunk` tokens at a time; each chunk runs the KDA kernels from the previous state and attends over the MLA
  latents cached so far, so no layer ever holds more than `chunk` tokens of activations. One compile per
  (batch, chunk, max_len). Returns the logits after each row's last token and the cache. Given a cache it
  continues it (a row may take no tokens and keeps its logits): a multi-turn rollout appends a tool result so.
- `decode_loop(model, logits_BV, cache, rng, max_new=…, options=…)`: samples a token per row from the logits,
  feeds it, and repeats inside one `lax.while_loop` (the cache donated: updated in place) until every row is
  done: a stop token, a stop sequence, its own budget `max_new_B[b]` (0: the row sits out), or a full cache. One
  compile per (batch, max_len, max_new, options). Returns the new tokens `[B, max_new]` (`options.pad_id` after a
  row is done), how many each row got, and the cache, which holds every token fed so far (not each row's last
  sampled token).

Rows are independent: a row's tokens never see another row's, and padding (a row shorter than the chunk) leaves
its caches as they were (`KDALayer.prefill_chunk`, `GatedMLA.prefill_chunk`).

Every decoder layer runs unrolled, each with a cache of its own (`decoder_layers`: a scanned group's layers are cut
out of its stacked parameters once per call). Under a scan over the groups the caches would be a scanned input and a
scanned output, two buffers of the stacked caches (32 GiB at B = 32 and 1M positions), and every step would slice
each group's weights anew; unrolled, each cache is updated in place in its donated buffer.
"""
from __future__ import annotations

import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import parallel, sampling


@flax.struct.dataclass
class GenerationCache:
  """A `KDACache` or `MLACache` per decoder layer (`layers`, in layer order) and each row's length: the tokens its
  caches hold, which is also the position its next token takes."""
  layers: tuple
  lengths_B: jax.Array                                   # int32 [B]
  max_len: int = flax.struct.field(pytree_node=False)   # positions the MLA caches hold


def init_cache(model, batch: int, max_len: int) -> GenerationCache:
  """Empty caches for `batch` rows of up to `max_len` tokens each (MLA: `batch × max_len × kv_lora_rank` latents in
  the compute dtype; KDA: a fixed state per row). A mixer's cache depends only on its static configuration, so a
  scanned layer's comes from its position's module."""
  if batch < 1 or max_len < 1:
    raise ValueError(f"batch and max_len must be positive, got {batch}, {max_len}")
  return GenerationCache(layers=tuple(m.mixer.init_cache(batch, max_len) for m, _ in _modules(model)),
                         lengths_B=jnp.zeros((batch,), jnp.int32), max_len=max_len)


def _replicated(state) -> NamedSharding | None:
  """Where the inputs of the generation programs of a model with weights `state` live: replicated on the weights'
  mesh, as the prefill step and the decode loop return their cache and logits. So a program's first call (on a new
  cache) and its later ones (on its own outputs), whatever the caller's arrays, take the same input shardings and
  compile once, and `lower`'s programs are the ones the calls use. None for weights on no mesh."""
  sharding = getattr(jax.tree.leaves(state)[0], "sharding", None)
  return NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None


def _placed(sharding: NamedSharding | None, tree):
  """`tree` on `sharding` (`_replicated`; a no-op for arrays already there, so a donated buffer stays the one
  donated); as it is for None."""
  return tree if sharding is None else jax.device_put(tree, sharding)


def _modules(model) -> list:
  """(module, group) of each decoder layer in order: an unrolled layer's module and None, or a scanned layer's
  position module (its Variables stacked over the groups) and the layer's group."""
  by_index = {i: (layer, None) for i, layer in zip(model.plan.unrolled, model.layers)}
  for j, stacked in enumerate(model.groups or ()):
    by_index.update((i, (stacked, g)) for g, i in enumerate(model.plan.position(j)))
  return [by_index[i] for i in range(len(model.closes))]


def decoder_layers(model) -> list:
  """Every decoder layer of `model` in order as a module of its own: the unrolled ones as they are, the scanned
  ones cut out of their position's stacked Variables (inside a jit, a copy of those weights per call)."""
  def cut(module, g):
    if g is None:
      return module
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[g], state))
  return [cut(module, g) for module, g in _modules(model)]


def cache_bytes(cache) -> int:
  """Bytes of every array in a cache."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def prefill_chunk(model, cache: GenerationCache, tokens_BT, lengths_B):
  """Row b's first `lengths_B[b]` tokens of `tokens_BT` (0..T; the rest padding) appended to its cache.
  Returns (fp32 logits after each row's last token of the chunk `[B, V]`; arbitrary for rows with none, the
  advanced cache)."""
  stream = model.start_stream(tokens_BT)
  start_B = cache.lengths_B
  mix = lambda mixer, x, layer_cache: mixer.prefill_chunk(x, layer_cache, start_B, lengths_B)
  stream, cache = _run_layers(model, stream, cache, mix)
  last_B = jnp.maximum(lengths_B - 1, 0)
  last = jax.tree.map(lambda a: jnp.take_along_axis(a, last_B[:, None, None], axis=1), stream)
  return model._logits(last)[:, 0], cache.replace(lengths_B=start_B + lengths_B)


def decode_step(model, cache: GenerationCache, token_B, active_B, layers=None):
  """One token per row at the row's own position `cache.lengths_B[b]`; rows not `active_B` keep their caches and
  length (their logits are arbitrary). `layers`: `decoder_layers(model)` when already cut (a decode loop cuts them
  once, outside its loop). Returns (fp32 logits `[B, V]`, the advanced cache)."""
  stream = model.start_stream(token_B[:, None])
  pos_B = cache.lengths_B

  def mix(mixer, x, layer_cache):
    y, new = mixer.decode(x, layer_cache, pos_B)
    return y, layer_cache.keep_rows(new, active_B)

  stream, cache = _run_layers(model, stream, cache, mix, layers)
  return model._logits(stream)[:, 0], cache.replace(lengths_B=pos_B + active_B.astype(jnp.int32))


def _run_layers(model, stream, cache: GenerationCache, mix: Callable, layers=None):
  """`stream` through every decoder layer (`layers`, or `decoder_layers(model)` when None), `mix(token mixer, its
  input, its cache) -> (output, cache)` in place of the mixer's training call; returns (stream, the cache with every
  layer's new cache; lengths unchanged)."""
  caches = []
  layers = decoder_layers(model) if layers is None else layers
  for i, (layer, layer_cache) in enumerate(zip(layers, cache.layers, strict=True)):
    with jax.named_scope(f"layer_{i}"):
      stream, new, _ = layer._apply(stream, model.closes[i], lambda x: mix(layer.mixer, x, layer_cache))
    caches.append(new)
  return stream, cache.replace(layers=tuple(caches))


def prefill_chunked(model, tokens_BT, lengths_B=None, *, chunk: int, max_len: int | None = None,
                    cache: GenerationCache | None = None, logits_BV=None,
                    progress: Callable[[int, int], None] | None = None, step=None):
  """Row b's first `lengths_B[b]` tokens (0..T; all T when None) appended to `cache` (a new one of `max_len`
  positions when None; a given cache is consumed: donated) `chunk` tokens at a time. A row given no tokens keeps
  its cache and its row of `logits_BV` (the logits its last call returned, consumed; zeros when None).
  `progress(tokens done, tokens in all)` after each chunk (dispatched, not finished). `step`: the chunk step
  compiled ahead (`lower`), else jitted here. Returns (fp32 logits after each row's last token `[B, V]`, the
  cache)."""
  tokens_BT = jnp.asarray(tokens_BT)
  if tokens_BT.ndim != 2 or tokens_BT.shape[1] == 0 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
    raise ValueError(f"tokens_BT must be a non-empty integer array [B,T], got {tokens_BT.dtype}{tokens_BT.shape}")
  B, T = tokens_BT.shape
  lengths = np.full((B,), T) if lengths_B is None else np.asarray(lengths_B)
  if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 0 or lengths.max() > T:
    raise ValueError(f"lengths_B must be B={B} ints in [0, T={T}], got {lengths_B!r}")
  if not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk must be a positive int, got {chunk!r}")
  if cache is None:
    if max_len is None:
      raise ValueError("prefill_chunked needs max_len (or a cache)")
    cache = init_cache(model, B, max_len)
  have = np.asarray(cache.lengths_B)
  if have.shape != (B,):
    raise ValueError(f"the cache holds {have.shape[0]} rows, the tokens {B}")
  if int((have + lengths).max()) > cache.max_len:
    raise ValueError(f"the cache holds {cache.max_len} positions; a row would reach {int((have + lengths).max())}")
  num_chunks = -(-int(lengths.max()) // chunk)
  tokens_BT = jnp.pad(tokens_BT.astype(jnp.int32), ((0, 0), (0, max(0, num_chunks * chunk - T))))
  graphdef, state = nnx.split(model)
  step = step or functools.partial(_programs(state)[0], graphdef)
  if logits_BV is not None and (logits_BV.shape != (B, model.vocab_size) or logits_BV.dtype != jnp.float32):
    raise ValueError(f"logits_BV must be fp32 [B={B}, V={model.vocab_size}], got {logits_BV.dtype}"
                     f"{tuple(logits_BV.shape)}")
  logits = jnp.zeros((B, model.vocab_size), jnp.float32) if logits_BV is None else logits_BV
  sharding = _replicated(state)
  for c in range(num_chunks):
    n_B = jnp.asarray(np.clip(lengths - c * chunk, 0, chunk), jnp.int32)
    logits, cache = step(state, *_placed(sharding, (cache, tokens_BT[:, c * chunk:(c + 1) * chunk], n_B, logits)))
    if progress is not None:
      progress(int(np.clip(lengths, 0, (c + 1) * chunk).sum()), int(lengths.sum()))
  return logits, cache


def _prefill_step(graphdef, state, cache, tokens_BT, lengths_B, logits_BV):
  new, cache = prefill_chunk(nnx.merge(graphdef, state), cache, tokens_BT, lengths_B)
  return jnp.where((lengths_B > 0)[:, None], new, logits_BV), cache


def decode_loop(model, logits_BV, cache: GenerationCache, rng, *, max_new, max_new_B=None,
                options: sampling.SamplingOptions = sampling.SamplingOptions(), loop=None):
  """Up to `max_new` (static) new tokens per row, row b's budget `max_new_B[b]` (0..max_new; all max_new when None;
  a row of budget 0 gets none and keeps its cache), sampled from `logits_BV` (the prefill's) and then from each
  step's. A row is done after a stop token (`options.stop_tokens`), when its new tokens end with a stop sequence
  (`options.stop_sequences`), after its budget, or when its cache is full. The cache is consumed (donated). `loop`: the
  decode loop compiled ahead (`lower`, for these max_new and options), else jitted here. Returns (int32 tokens
  `[B, max_new]`, pad_id after each row's end; int32 `[B]` tokens each row got; the cache, which holds every token
  but each row's last)."""
  B = cache.lengths_B.shape[0]
  if not isinstance(max_new, int) or max_new < 1:
    raise ValueError(f"max_new must be a positive int, got {max_new!r}")
  budget = np.full((B,), max_new) if max_new_B is None else np.asarray(max_new_B)
  if budget.shape != (B,) or budget.min() < 0 or budget.max() > max_new:
    raise ValueError(f"max_new_B must be B={B} ints in [0, max_new={max_new}], got {max_new_B!r}")
  if logits_BV.shape != (B, model.vocab_size):
    raise ValueError(f"logits must be [B={B}, V={model.vocab_size}], got {tuple(logits_BV.shape)}")
  graphdef, state = nnx.split(model)
  loop = loop or functools.partial(_programs(state)[1], graphdef, max_new=max_new, options=options)
  return loop(state, *_placed(_replicated(state), (cache, logits_BV, rng, jnp.asarray(budget, jnp.int32))))


def lower(model, batch: int, max_len: int, *, chunk: int | None, max_new: int,
          options: sampling.SamplingOptions = sampling.SamplingOptions()):
  """(prefill chunk step, decode loop) lowered for `batch` rows, a cache of `max_len`, chunks of `chunk` tokens and
  `max_new` decoded tokens: `.compile()` them (in threads: XLA compiles outside the GIL) and pass them to
  `prefill_chunked(step=…)` and `decode_loop(loop=…)`. `chunk` None: no prefill step (None in its place)."""
  step = None if chunk is None else lower_prefill(model, batch, max_len, chunk=chunk)
  return step, lower_decode(model, batch, max_len, max_new=max_new, options=options)


def lower_prefill(model, batch: int, max_len: int, *, chunk: int):
  """The prefill chunk step lowered for `batch` rows, a cache of `max_len` and chunks of `chunk` tokens."""
  graphdef, state, spec, cache = _abstract_inputs(model, batch, max_len)
  return _programs(state)[0].lower(graphdef, state, cache, spec((batch, chunk), jnp.int32),
                                   spec((batch,), jnp.int32), spec((batch, model.vocab_size), jnp.float32))


def lower_decode(model, batch: int, max_len: int, *, max_new: int,
                 options: sampling.SamplingOptions = sampling.SamplingOptions()):
  """The decode loop lowered for `batch` rows, a cache of `max_len`, `max_new` tokens and `options`."""
  graphdef, state, spec, cache = _abstract_inputs(model, batch, max_len)
  rng = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  return _programs(state)[1].lower(graphdef, state, cache, spec((batch, model.vocab_size), jnp.float32),
                                   spec(rng.shape, rng.dtype), spec((batch,), jnp.int32), max_new=max_new,
                                   options=options)


def _programs(state) -> tuple:
  """(prefill chunk step, decode loop) jitted for a model of weights `state`: with the XLA options of the weights'
  mesh (`parallel.compiler_options`; weights on no mesh are on one device)."""
  sharding = _replicated(state)
  return _jitted(tuple(parallel.compiler_options(sharding and sharding.mesh).items()))


@functools.cache
def _jitted(options: tuple) -> tuple:
  """The two generation programs jitted once per set of XLA options (`options`: its items)."""
  options = dict(options)
  return (jax.jit(_prefill_step, static_argnames=("graphdef",), donate_argnames=("cache", "logits_BV"),
                  compiler_options=options),
          jax.jit(_decode_loop, static_argnames=("graphdef", "max_new", "options"), donate_argnames=("cache",),
                  compiler_options=options))


def _abstract_inputs(model, batch: int, max_len: int):
  """(graphdef, weights, `spec(shape, dtype)`, the cache as specs) for lowering the generation programs: each spec
  placed as the calls place their inputs (`_placed`)."""
  graphdef, state = nnx.split(model)
  sharding = _replicated(state)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  cache = jax.tree.map(lambda a: spec(a.shape, a.dtype), jax.eval_shape(lambda: init_cache(model, batch, max_len)))
  return graphdef, state, spec, cache


def _decode_loop(graphdef, state, cache, logits_BV, rng, budget_B, *, max_new, options):
  model = nnx.merge(graphdef, state)
  layers = decoder_layers(model)          # cut once: the loop's body then reads the same weights every step
  B = budget_B.shape[0]
  pick = lambda logits, t: sampling.sample(logits, jax.random.fold_in(rng, t), temperature=options.temperature,
                                           top_p=options.top_p)

  def finished(done_B, token_B, got_B, recent_BW):
    """(done after `token_B`, the window of latest tokens the stop sequences look at)."""
    recent_BW = sampling.push(recent_BW, token_B)
    done_B = sampling.finished(done_B, token_B, got_B, budget_B, options.stop_tokens)
    return done_B | sampling.ends_with(recent_BW, options.stop_sequences), recent_BW

  live_B = budget_B > 0
  token = jnp.where(live_B, pick(logits_BV, 0), options.pad_id)
  out_BN = jnp.full((B, max_new), options.pad_id, jnp.int32).at[:, 0].set(token)
  got_B = live_B.astype(jnp.int32)
  done_B, recent_BW = finished(~live_B, token, got_B, jnp.full((B, options.stop_window), -1, jnp.int32))

  def cond(carry):
    t, _, done_B, _, _, _, cache = carry
    return (t < max_new) & ~jnp.all(done_B | (cache.lengths_B >= cache.max_len))

  def body(carry):
    t, token_B, done_B, got_B, recent_BW, out_BN, cache = carry
    active_B = ~done_B & (cache.lengths_B < cache.max_len)
    logits, cache = decode_step(model, cache, token_B, active_B, layers)
    token_B = jnp.where(active_B, pick(logits, t), options.pad_id)
    got_B = got_B + active_B.astype(jnp.int32)
    done_B, recent_BW = finished(done_B, token_B, got_B, recent_BW)
    return t + 1, token_B, ~active_B | done_B, got_B, recent_BW, out_BN.at[:, t].set(token_B), cache

  start = (jnp.int32(1), token, done_B, got_B, recent_BW, out_BN, cache)
  _, _, _, got_B, _, out_BN, cache = jax.lax.while_loop(cond, body, start)
  return out_BN, got_B, cache
