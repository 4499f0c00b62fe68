"""Shared helpers for the layer, model and generation tests: small fp32 configs, shared jitted calls, random inputs,
the primitives of a jaxpr, the programs a block compiles.

Compiles dominate these tests on CPU (the initialiser alone compiles once per parameter shape), so most tests take
modules with NumPy-drawn random parameters (`random_module`), share them (`shared_model`), and call them through the
jitted functions below (traced once per module structure and input shape). The real initialisers are tested where it
matters (zero AttnRes queries, the KDA gate ranges).
"""
import contextlib
import functools
import logging

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as config_lib
from k3jax.model import K3Model

T, T0 = 12, 6   # sequence length of the tests and the prompt length after which decoding starts
# The model tests' model: KDA, KDA, MLA (the last layer forced to MLA); layer 0 dense, layers 1-2 a small LatentMoE;
# one AttnRes block closes after layer 1.
MODEL = {"num_layers": 3, "layer_pattern": ("kda",), "moe.enabled": True, "moe.num_experts": 4, "moe.top_k": 2,
         "moe.latent_dim": 16, "moe.expert_hidden": 16, "moe.shared_hidden": 24}
# A scanned model: layers 0 (KDA, dense) and 1 (MLA) unrolled, then two groups of (KDA, MLA) under the scan; AttnRes
# blocks of three layers close after layers 2 and 5, at position 0 of group 0 and position 1 of group 1 (blocks
# straddle the groups).
SCANNED = {**MODEL, "num_layers": 6, "layer_pattern": ("kda", "mla"), "residual.block_size": 3}


def small_config(**changes):
  """A 4-layer fp32 model config (KDA, KDA, KDA, MLA), d = 32; `changes` maps dotted field names to values."""
  m = config_lib.model_config()
  m.dtype = "float32"
  m.vocab_size = 64
  m.d_model = 32
  m.ffn_hidden = 48
  m.kda.num_heads = 2
  m.mla.num_heads = 2
  m.mla.kv_lora_rank = 16
  m.residual.block_size = 2
  for dotted, value in changes.items():
    *path, last = dotted.split(".")
    node = m
    for p in path:
      node = node[p]
    node[last] = value
  return m


def random_module(factory, seed=0):
  """`factory(rngs)` with every Param redrawn by NumPy: N(0, 1/n), n its largest leading dim, and 1 + N(0, 0.2²)
  for vectors (norm weights, pseudo-queries, A_log). Other state (the balancer's bias and load) stays zero."""
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))), nnx.Param, ...)
  rng = np.random.default_rng(seed)

  def draw(x):
    z = rng.standard_normal(x.shape)
    z = 1.0 + 0.2 * z if len(x.shape) == 1 else z / np.sqrt(max(x.shape[:-1]))
    return jnp.asarray(z, x.dtype)

  params = jax.tree.map(draw, params)
  rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), rest)
  return nnx.merge(graphdef, params, rest)


@functools.cache
def shared_model(changes=tuple(MODEL.items()), seed=0):
  """One random K3Model (see `random_module`) per (changes, seed) and test process; tests must not modify it."""
  return random_module(lambda rngs: K3Model(small_config(**dict(changes)), rngs=rngs), seed)


forward = nnx.jit(lambda module, x, seg: module(x, segment_ids_BT=seg))
prefill = nnx.jit(lambda module, x, max_len: module.prefill(x, max_len), static_argnums=2)
decode = nnx.jit(lambda module, x, cache, pos: module.decode(x, cache, pos))
# Token mixers' per-row generation calls: `args` are the layer's own (KDA: lengths; MLA: start, lengths / pos).
prefill_chunk = nnx.jit(lambda module, x, cache, *args: module.prefill_chunk(x, cache, *args))
decode_rows = nnx.jit(lambda module, x, cache, pos: module.decode_rows(x, cache, pos))


def chunk_lengths(lengths, start: int, chunk: int):
  """int32 `[B]`: how many of each row's `lengths` tokens fall in the chunk of `chunk` tokens at `start`."""
  return jnp.clip(jnp.asarray(lengths, jnp.int32) - start, 0, chunk)


def normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def segments(B, lengths):
  """Segment ids `[B, sum(lengths)]`: document i (from 1: 0 is padding) covers lengths[i] consecutive tokens."""
  ids = jnp.concatenate([jnp.full((n,), i, jnp.int32) for i, n in enumerate(lengths, start=1)])
  return jnp.broadcast_to(ids, (B, ids.shape[0]))


def random_segments(seed, B, T, docs, pad):
  """Segment ids `[B, T]` (NumPy): per row `docs` documents of random lengths ≥ 1 (ids 1..docs), then `pad`
  padding positions (id 0)."""
  rng = np.random.default_rng(seed)
  out = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T - pad), docs - 1, replace=False))
    for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, T - pad])):
      out[b, lo:hi] = i + 1
  return out


def causal_attention_reference(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT, scale):
  """Causal attention within documents (equal segment ids) as its formula in fp32 with exact products
  (differentiable: the reference for attention's gradients)."""
  s = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BTHD, precision="highest") * scale
  T = q_BTHD.shape[1]
  allowed = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None] & jnp.tril(jnp.ones((T, T), bool))
  p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bshv->bthv", p, v_BTHV, precision="highest")


def abstract(factory, fn, *args):
  """Shapes and dtypes of `fn(module, *args)` for `module = factory(rngs)`, never allocated: nothing compiles."""
  module = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
  return nnx.eval_shape(fn, module, *args)


def equations(fn, *args):
  """The equations of `fn`'s jaxpr, nested jaxprs (custom VJPs, checkpoints) included."""
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from walk(sub)
  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def primitives(fn, *args):
  """Names of the primitives in `fn`'s jaxpr, nested jaxprs (custom VJPs, checkpoints) included."""
  return [eqn.primitive.name for eqn in equations(fn, *args)]


@contextlib.contextmanager
def compiled_programs():
  """The names of the jitted functions whose programs the block gets from XLA, from any thread: each call that
  missed jit's caches (compiled, or read from the persistent compilation cache)."""
  names = []

  class Names(logging.Handler):
    def emit(self, record):
      message = record.getMessage()
      if message.startswith("Finished XLA compilation of jit("):
        names.append(message[len("Finished XLA compilation of jit("):].split(")")[0])

  handler, logger, before = Names(), logging.getLogger("jax"), jax.config.jax_log_compiles
  logger.addHandler(handler)
  jax.config.update("jax_log_compiles", True)   # the global value: `jax.log_compiles()` is the calling thread's
  try:
    yield names
  finally:
    jax.config.update("jax_log_compiles", before)
    logger.removeHandler(handler)
