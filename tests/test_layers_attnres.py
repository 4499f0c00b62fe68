"""Attention residuals: the read-out formula, zero queries give the uniform average, block / full / none streams."""
import chex
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers import attnres
from model_testing import normal


def _stream(n_sources, partial=True, seed=0):
  vs = [normal(seed + i, (2, 3, 8)) for i in range(n_sources + 1)]
  return attnres.Stream(tuple(vs[:n_sources]), vs[-1] if partial else None), vs if partial else vs[:-1]


def test_zero_queries_give_the_uniform_average_of_sources():
  attn = attnres.DepthAttention(8)
  for partial in (True, False):
    stream, values = _stream(3, partial)
    h = attn(stream)
    chex.assert_shape(h, (2, 3, 8))
    np.testing.assert_allclose(h, sum(values) / len(values), rtol=1e-6, atol=1e-6)


def test_read_out_is_a_softmax_over_rms_normalised_keys():
  attn = attnres.DepthAttention(8)
  attn.query[...] = normal(10, (8,))
  attn.key_norm.weight[...] = 1.0 + 0.1 * normal(11, (8,))
  stream, values = _stream(2)
  v = np.stack([np.asarray(x, np.float64) for x in values])                  # [N,B,T,D]
  keys = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * np.asarray(attn.key_norm.weight[...])
  logits = np.einsum("d,nbtd->nbt", np.asarray(attn.query[...]), keys)
  w = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
  np.testing.assert_allclose(attn(stream), np.einsum("nbt,nbtd->btd", w, v), rtol=1e-5, atol=1e-6)


def _run(mode, closes):
  """Feeds sub-layer outputs y_1, y_2, ... and records the sources each read-out would see."""
  x0 = normal(20, (1, 2, 4))
  stream, seen, ys = attnres.start(x0, mode), [], []
  for i, close in enumerate(closes):
    seen.append(stream.sources + (() if stream.partial is None else (stream.partial,)))
    y = normal(30 + i, (1, 2, 4))
    ys.append(y)
    stream = attnres.add(stream, y, close=close)
  return x0, ys, seen, stream


def test_block_stream_closes_blocks_and_leaves_out_the_empty_partial_sum():
  # Two decoder layers per block = four sub-layers; the block closes after the fourth.
  x0, ys, seen, stream = _run("block", [False, False, False, True, False])
  counts = [len(s) for s in seen]
  assert counts == [1, 2, 2, 2, 2]                         # x0; x0 + partial; ...; x0 + b_1 (partial left out)
  np.testing.assert_allclose(seen[3][1], ys[0] + ys[1] + ys[2], rtol=1e-6)
  np.testing.assert_allclose(seen[4][1], ys[0] + ys[1] + ys[2] + ys[3], rtol=1e-6)
  np.testing.assert_allclose(stream.partial, ys[4], rtol=1e-6)
  np.testing.assert_allclose(seen[0][0], x0)


def test_full_stream_makes_every_output_a_source():
  x0, ys, seen, stream = _run("full", [True] * 4)
  assert [len(s) for s in seen] == [1, 2, 3, 4]
  assert stream.partial is None
  for got, want in zip(stream.sources, [x0] + ys):
    np.testing.assert_allclose(got, want)


def test_none_stream_is_the_running_sum_and_is_read_without_attention():
  x0, ys, seen, stream = _run("none", [True, False, True])
  np.testing.assert_allclose(attnres.read(stream, None), x0 + sum(ys), rtol=1e-6)
  assert stream.sources == ()


def test_stream_is_float32():
  stream = attnres.add(attnres.start(normal(1, (1, 2, 4), jnp.bfloat16), "block"),
                       normal(2, (1, 2, 4), jnp.bfloat16), close=False)
  chex.assert_type([stream.sources[0], stream.partial], jnp.float32)
  assert jax.tree.leaves(stream)  # a pytree (crosses jit / remat boundaries)
