"""Attention residuals: the read-out formula, zero queries give the uniform average, block / full / none streams."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
  np.testing.assert_allclose(attnres.read(stream, None)[0], x0 + sum(ys), rtol=1e-6)
  assert stream.sources == ()


def test_partial_sum_is_float32_and_sources_keep_the_dtype_they_start_in():
  x0, ys = normal(1, (1, 2, 4), jnp.bfloat16), [normal(2 + i, (1, 2, 4), jnp.bfloat16) for i in range(2)]
  stream = attnres.add(attnres.start(x0, "block"), ys[0], close=False)
  chex.assert_type([stream.sources[0], stream.partial], jnp.float32)
  assert jax.tree.leaves(stream)  # a pytree (crosses jit / remat boundaries)
  # Stored in bf16: the partial sum still adds in fp32, and is rounded once, when it closes.
  stream = attnres.add(attnres.start(x0, "block", jnp.bfloat16), ys[0], close=False)
  chex.assert_type([stream.sources[0], stream.partial], [jnp.bfloat16, jnp.float32])
  closed = attnres.add(stream, ys[1], close=True)
  chex.assert_type(closed.sources, jnp.bfloat16)
  np.testing.assert_array_equal(closed.sources[1], (ys[0].astype(jnp.float32) + ys[1]).astype(jnp.bfloat16))


@pytest.mark.parametrize("readable", ["all", "read"], ids=["every_slot_readable", "last_writes_unread"])
@pytest.mark.parametrize("summarized", [False, True], ids=["buffer_read_per_read_out", "buffer_summarized"])
@pytest.mark.parametrize("mode", ["block", "full", "none", "block_bf16_sources"])
def test_carry_reads_and_adds_as_the_stream_does(mode, summarized, readable):
  # The same sub-layer outputs through a Stream and through a Carry entered after two sub-layers (so it starts with
  # a partial sum), its close flags traced, its buffer written twice: every read-out agrees, and so does the stream
  # taken back out. Summarized: after each write the buffer's part of the read-outs up to the next is computed at
  # once (as at the start of a scanned group), and each read-out takes its own. "read": read-outs see only the
  # slots written by the first write (as a scan's read-outs see those present when its last group starts); the
  # second writes the rest to the slots past them. bf16 sources: the Carry rounds each sum where the Stream does.
  mode, dtype = (mode[:5], jnp.bfloat16) if mode.endswith("bf16_sources") else (mode, jnp.float32)
  closes = {"block": [False, True, False, False, False, True, True, False],
            "full": [True] * 8, "none": [False] * 8}[mode]
  attn = attnres.DepthAttention(8)
  attn.query[...] = normal(40, (8,))
  attn.key_norm.weight[...] = 1.0 + 0.1 * normal(41, (8,))
  ys = [normal(50 + i, (2, 3, 8)) for i in range(len(closes))]
  enter = 2
  capacity = attnres.num_sources(mode, closes)
  stream, want = attnres.start(normal(42, (2, 3, 8)), mode, dtype), []
  for y, close in zip(ys, closes):
    want.append(attnres.read(stream, None if mode == "none" else attn)[0])
    stream = attnres.add(stream, y, close=close)

  @jax.jit
  def through_carry(flags):
    s, got = attnres.start(normal(42, (2, 3, 8)), mode, dtype), []
    for y, close in zip(ys[:enter], closes[:enter]):
      got.append(attnres.read(s, None if mode == "none" else attn)[0])
      s = attnres.add(s, y, close=close)
    c = attnres.to_carry(s, capacity, capacity if readable == "all" else attnres.num_sources(mode, closes[:5]))
    reads = lambda n: [attn] * n if summarized and mode != "none" else []
    c = attnres.summarize(c, reads(5 - enter))
    for i in range(enter, len(ys)):
      x, c = attnres.read(c, None if mode == "none" else attn)
      got.append(x)
      c = attnres.add(c, ys[i], close=flags[i])
      if i == 4:  # the buffer written in the middle (as at the end of a scanned group) changes nothing
        c = attnres.summarize(attnres.flush(c), reads(len(ys) - 5))
    assert not c.summaries
    return got, attnres.flush(c)

  got, carry = through_carry(jnp.asarray(closes))
  for i, (g, w) in enumerate(zip(got, want)):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=f"read-out {i}")
  assert int(carry.count) == capacity and bool(carry.has_partial) == (not closes[-1] or mode == "none")
  out = attnres.from_carry(carry, capacity, not closes[-1] or mode == "none")
  assert len(out.sources) == len(stream.sources) and (out.partial is None) == (stream.partial is None)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(stream)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
  assert {x.dtype for x in out.sources} <= {jnp.dtype(dtype)}


def test_flush_writes_each_closed_sum_to_the_array_its_target_names():
  # A buffer of 2 readable slots (x_0 written) and 2 later ones; three sums close in turn, the first two at traced
  # flags (the second not closed): slots 1 and 2. Told where each lands, the flush writes the same buffer as when
  # it must look ("either"); told wrong, the sum is not where the stream wants it.
  ys = [normal(80 + i, (2, 3, 8)) for i in range(3)]
  carry = attnres.to_carry(attnres.start(normal(79, (2, 3, 8)), "block"), 4, 2)
  for y, close in zip(ys, (jnp.asarray(True), jnp.asarray(False), True)):
    carry = attnres.add(carry, y, close=close)
  want = attnres.flush(carry)
  got = attnres.flush(carry, ("sources", "either", "later"))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(want.later_MBTD[0], ys[1] + ys[2])   # slot 2: the third sum, the partial y1 + y2
  wrong = attnres.flush(carry, ("later", "either", "later"))
  assert not np.array_equal(wrong.sources_NBTD[1], want.sources_NBTD[1])
  with pytest.raises(ValueError, match="one of"):
    attnres.flush(carry, ("sources", "later"))


def test_summaries_are_made_after_a_flush_and_all_read_before_the_next():
  attn = attnres.DepthAttention(8)
  carry = attnres.to_carry(attnres.start(normal(1, (2, 3, 8)), "block"), 3)
  carry = attnres.summarize(carry, [attn, attn])
  with pytest.raises(ValueError, match="no summaries left unread"):
    attnres.summarize(carry, [attn])
  with pytest.raises(ValueError, match="1 summaries of the old buffer left unread"):
    attnres.flush(attnres.read(carry, attn)[1])
  closed = attnres.add(attnres.to_carry(attnres.start(normal(1, (2, 3, 8)), "block"), 3), normal(2, (2, 3, 8)),
                       close=jnp.asarray(True))
  with pytest.raises(ValueError, match="flushed carry"):
    attnres.summarize(closed, [attn])


def test_carry_read_out_ignores_what_lies_past_its_sources():
  # Slots past `count` (and the partial when flagged empty) take no weight: filling them with large values changes
  # neither the read-out nor its gradient.
  attn = attnres.DepthAttention(8)
  attn.query[...] = normal(60, (8,))
  sources = jnp.stack([normal(61 + i, (2, 3, 8)) for i in range(4)])
  closed = ((normal(71, (2, 3, 8)), jnp.asarray(True)), (jnp.full((2, 3, 8), 1e3), jnp.asarray(False)))
  junk = attnres.Carry(sources.at[2:].set(1e3), jnp.asarray(2, jnp.int32), jnp.full((2, 3, 8), -1e3),
                       jnp.asarray(False), closed)
  want = attn(attnres.Stream(tuple(sources[:2]) + (closed[0][0],), None))
  np.testing.assert_allclose(attn(junk), want, rtol=1e-6, atol=1e-6)
  loss = lambda v, p, c: jnp.sum(attn(junk.replace(sources_NBTD=v, partial_BTD=p, closed=c)) ** 2)
  d_sources, d_partial, d_closed = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)(
      junk.sources_NBTD, junk.partial_BTD, closed)
  assert float(jnp.abs(d_sources[2:]).max()) == float(jnp.abs(d_partial).max()) == 0.0
  assert float(jnp.abs(d_closed[1][0]).max()) == 0.0
  assert float(jnp.abs(d_sources[:2]).max()) > 0.0 and float(jnp.abs(d_closed[0][0]).max()) > 0.0
  # The same through the buffer's summary (`summarize`, before the closed sums exist, as at a group's start).
  def summarized(v, p, c):
    carry = attnres.summarize(junk.replace(sources_NBTD=v, partial_BTD=p, closed=()), [attn])
    return attnres.read(carry.replace(closed=c), attn)
  np.testing.assert_allclose(summarized(junk.sources_NBTD, junk.partial_BTD, closed)[0], want, rtol=1e-6, atol=1e-6)
  assert not summarized(junk.sources_NBTD, junk.partial_BTD, closed)[1].summaries
  loss = lambda v, p, c: jnp.sum(summarized(v, p, c)[0] ** 2)
  d_sources, d_partial, d_closed = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)(
      junk.sources_NBTD, junk.partial_BTD, closed)
  assert float(jnp.abs(d_sources[2:]).max()) == float(jnp.abs(d_partial).max()) == 0.0
  assert float(jnp.abs(d_closed[1][0]).max()) == 0.0
  assert float(jnp.abs(d_sources[:2]).max()) > 0.0 and float(jnp.abs(d_closed[0][0]).max()) > 0.0


def test_weights_are_the_read_outs_softmax_and_a_carrys_valid_ones_are_its_streams():
  attn = attnres.DepthAttention(8)
  attn.query[...] = normal(80, (8,))
  stream, values = _stream(2)
  w, valid = attn.weights(stream)
  chex.assert_shape(w, (3, 2, 3))
  assert bool(valid.all()) and valid.shape == (3,)
  np.testing.assert_allclose(w.sum(0), 1.0, rtol=1e-6)
  np.testing.assert_allclose(attn(stream), jnp.einsum("nbt,nbtd->btd", w, jnp.stack(values)), rtol=1e-6, atol=1e-6)
  # A carry holding two sources in a buffer of four, one closed sum after them and an empty partial sum: its valid
  # weights, in order, are those of the stream of the same three sources.
  sources = jnp.stack([normal(81 + i, (2, 3, 8)) for i in range(4)])
  closed = ((normal(90, (2, 3, 8)), jnp.asarray(True)), (normal(91, (2, 3, 8)), jnp.asarray(False)))
  carry = attnres.Carry(sources, jnp.asarray(2, jnp.int32), normal(92, (2, 3, 8)), jnp.asarray(False), closed)
  w_carry, valid_carry = jax.jit(attn.weights)(carry)
  np.testing.assert_array_equal(valid_carry, [True, True, False, False, True, False, False])
  assert float(jnp.abs(w_carry[~valid_carry]).max()) == 0.0
  want, _ = attn.weights(attnres.Stream((sources[0], sources[1], closed[0][0]), None))
  np.testing.assert_allclose(w_carry[valid_carry], want, rtol=1e-6, atol=1e-7)
