"""Attention residuals (docs/design.md, AttnRes): each sub-layer reads a softmax over depth of earlier representations.

    h_l = Σ_i softmax_i( w_lᵀ RMSNorm_l(v_i) ) · v_i,     w_l ∈ R^d initialised to zero (uniform weights at start)

The residual stream is a `Stream`: completed sources plus the partial sum of the current block.
- "block": sources are v_0 (the embedding) and the completed block sums b_1 … b_{n−1}; the partial sum of the
  current block is one more source. At the first sub-layer of a block that sum is empty and is *left out* of the
  softmax (a zero vector would get key RMSNorm(0) = 0 and still take a share of the weight); this matches the
  reference pseudocode, where the block that just closed is the last source instead.
- "full": every sub-layer output is a source of its own (a block of one sub-layer).
- "none": the standard pre-norm residual; the stream is the running sum x_0 + Σ f_l and is each sub-layer's input.
The partial sum is kept in fp32; the sources are stored in the dtype `start` is given (`residual.source_dtype`): a sum
is rounded to it once, when it closes, and every read-out computes in fp32 from what is stored. In bf16 the sources
halve what the read-outs read, the largest part of their passes. Between unrolled layers the stream is a `Stream` (a
tuple that grows); through a scan over layer groups it is a `Carry`, the same state in a fixed shape: a buffer with room
for every source the scan will hold, of which the first `count` are valid, the partial sum with a flag for "empty", and
the sums closed since the buffer was last written (with flags for whether each did close). The buffer is two arrays: the
slots a read-out may see (as many as the last group of a scan reads), and the slots only the scan's last flush writes,
which no read-out inside the scan sees: every read-out's passes, forward and backward, then cover only the first. A
read-out of a `Carry` masks the softmax to what is valid, so it gives the `Stream`'s result (up to fp32 summation
order). Inside a group the buffer is not written (`flush` writes it at the group's end), so every layer of the group
reads the same buffer: a rematerialised layer then keeps only its partial sum, not a copy of the buffer. For the same
reason the buffer's part of all the group's read-outs can be computed at the group's start in one pass (`summarize`,
`model.residual.readout="group"`): the carry then holds one summary per read-out still to come, and each read-out takes
the next.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import RMSNorm
from k3jax.ops import attnres as attnres_ops


@flax.struct.dataclass
class Stream:
  """Completed sources (a tuple of `[B,T,D]`) and the current block's partial sum (`[B,T,D]`, or None when empty)."""
  sources: tuple
  partial: jax.Array | None


@flax.struct.dataclass
class Carry:
  """A `Stream` in a fixed shape (a scan carry). The completed sources are the first `count` slots of the buffer
  (`sources_NBTD`, then `later_MBTD`) and, of `closed` (sums closed since the buffer was last written, as (value
  `[B,T,D]`, closed flag) pairs), those whose flag is set; `partial_BTD` is the current block's partial sum, not a
  value when `has_partial` is false (empty). Read-outs see `sources_NBTD` only: a carry whose `count` exceeds its
  length is not read, only flushed and returned (`from_carry`)."""
  sources_NBTD: jax.Array   # [readable, B, T, D] in the sources' dtype; slots from `count` on are not sources
  count: jax.Array          # int32 scalar
  partial_BTD: jax.Array    # [B, T, D] fp32
  has_partial: jax.Array    # bool scalar
  closed: tuple = ()
  summaries: tuple = ()     # the buffer's part of each read-out still to come, in order (`summarize`)
  later_MBTD: jax.Array | None = None   # [capacity - readable, B, T, D] as sources_NBTD, or None: the slots no
                                        # read-out sees


def closes(mode: str, block_size: int, num_layers: int) -> tuple[tuple[bool, bool], ...]:
  """Per decoder layer, whether its token mixer's and its FFN's outputs close the current block (the partial sum
  becomes a source): every sub-layer in "full", the FFN of every `block_size`-th layer in "block", none in "none"."""
  if mode == "full":
    return ((True, True),) * num_layers
  return tuple((False, mode == "block" and (i + 1) % block_size == 0) for i in range(num_layers))


def num_sources(mode: str, closes_so_far) -> int:
  """Completed sources after the sub-layers whose close flags are `closes_so_far` (x_0 counts; none in "none")."""
  return 0 if mode == "none" else 1 + sum(bool(c) for c in closes_so_far)


def start(x0_BTD, mode: str, source_dtype=jnp.float32) -> Stream:
  """The stream of the embedding `x0_BTD`: its first source, stored in `source_dtype` (the dtype of every source
  after it), or in "none" the running sum (fp32)."""
  if mode == "none":
    return Stream((), x0_BTD.astype(jnp.float32))
  return Stream((x0_BTD.astype(source_dtype),), None)


def to_carry(stream: Stream, capacity: int, readable: int | None = None) -> Carry:
  """The stream in a buffer with room for `capacity` sources, of which read-outs see the first `readable` (all by
  default; at least the stream's own sources)."""
  n = len(stream.sources)
  readable = capacity if readable is None else readable
  if not n <= readable <= capacity:
    raise ValueError(f"need the stream's {n} sources <= readable={readable} <= capacity={capacity}")
  like = stream.sources[0] if n else stream.partial
  dtype = like.dtype if n else jnp.float32
  # Concatenated, not scattered into zeros: the scatter's VJP would keep the zeros for the backward pass.
  pieces = ([jnp.stack(stream.sources)] if n else []) + [jnp.zeros((readable - n, *like.shape), dtype)]
  sources = jnp.concatenate(pieces)
  later = jnp.zeros((capacity - readable, *like.shape), dtype) if capacity > readable else None
  partial = jnp.zeros(like.shape, jnp.float32) if stream.partial is None else stream.partial
  return Carry(sources, jnp.asarray(n, jnp.int32), partial, jnp.asarray(stream.partial is not None),
               later_MBTD=later)


FLUSH_TARGETS = ("sources", "later", "either")


def flush(carry: Carry, targets=None) -> Carry:
  """The carry with its closed sums written into the buffer (those whose flag is set, in order). `targets`: per
  closed sum, which of the buffer's arrays its slot may be in (FLUSH_TARGETS: the slots read-outs see, the later
  ones, or either, the default); a sum known to land in one array is written to that one alone."""
  if carry.summaries:
    raise ValueError(f"flush of a carry with {len(carry.summaries)} summaries of the old buffer left unread")
  targets = ("either",) * len(carry.closed) if targets is None else tuple(targets)
  if len(targets) != len(carry.closed) or not set(targets) <= set(FLUSH_TARGETS):
    raise ValueError(f"need one of {FLUSH_TARGETS} per closed sum ({len(carry.closed)}), got {targets}")
  sources, later, count = carry.sources_NBTD, carry.later_MBTD, carry.count
  readable = sources.shape[0]
  for (value, closed), target in zip(carry.closed, targets):
    if later is None or target == "sources":
      sources = _write_slot(sources, count, value, closed)
    elif target == "later":
      later = _write_slot(later, count - readable, value, closed)
    else:   # the slot is in one array or the other
      sources = _write_slot(sources, count, value, closed & (count < readable))
      later = _write_slot(later, count - readable, value, closed & (count >= readable))
    count = count + jnp.asarray(closed, jnp.int32)
  return Carry(sources, count, carry.partial_BTD, carry.has_partial, later_MBTD=later)


def _write_slot(buffer_NBTD, index, value_BTD, write):
  """`buffer_NBTD` with slot `index` set to `value_BTD` where `write`. One slot is rewritten either way (the value,
  or its own contents); an index out of range clamps to a valid slot, which is then rewritten unchanged."""
  slot = jax.lax.dynamic_index_in_dim(buffer_NBTD, index, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(buffer_NBTD, jnp.where(write, value_BTD, slot), index, 0)


def summarize(carry: Carry, attns) -> Carry:
  """The carry with the buffer's part of the read-outs of `attns` (`DepthAttention`s, in the order they will read)
  computed in one pass over the buffer (`k3jax.ops.attnres.summarize_buffer`); a read-out of the carry then takes
  the next summary instead of reading the buffer (`read`)."""
  if carry.summaries or carry.closed:
    raise ValueError("summarize needs a flushed carry (no closed sums) with no summaries left unread")
  if not attns:
    return carry
  queries, scales = (jnp.stack(x) for x in zip(*((a.query[...], a.key_norm.weight[...]) for a in attns)))
  valid_C = jnp.arange(carry.sources_NBTD.shape[0]) < carry.count
  summary = attnres_ops.summarize_buffer(queries, scales, carry.sources_NBTD, valid_C, eps=attns[0].key_norm.eps)
  return carry.replace(summaries=tuple(summary.part(j) for j in range(len(attns))))


def from_carry(carry: Carry, count: int, has_partial: bool) -> Stream:
  """The `Stream` of a flushed carry whose count and partial flag the caller knows statically."""
  if carry.closed:
    raise ValueError("from_carry needs a flushed carry (see flush)")
  partial = carry.partial_BTD if has_partial else None
  # One split, not a slice per source: a slice's transpose pads its cotangent to the whole buffer, then they are added.
  slots = [*jnp.unstack(carry.sources_NBTD), *(() if carry.later_MBTD is None else jnp.unstack(carry.later_MBTD))]
  return Stream(tuple(slots[:count]), partial)


def add(stream: Stream | Carry, y_BTD, *, close) -> Stream | Carry:
  """Adds a sub-layer output to the partial sum; `close` makes that sum a completed source (ignored in "none").
  For a `Carry`, `close` may be a traced bool."""
  y = y_BTD.astype(jnp.float32)
  if isinstance(stream, Carry):
    partial = jnp.where(stream.has_partial, stream.partial_BTD, 0.0) + y
    if close is False or (stream.sources_NBTD.shape[0] == 0 and stream.later_MBTD is None):
      return stream.replace(partial_BTD=partial, has_partial=jnp.asarray(True))
    close = jnp.asarray(close)  # in fp32 sources, the partial sum itself is the closed value: no copy
    closed = partial.astype(stream.sources_NBTD.dtype)
    return stream.replace(partial_BTD=partial, has_partial=~close, closed=stream.closed + ((closed, close),))
  partial = y if stream.partial is None else stream.partial + y
  if close and stream.sources:
    return Stream(stream.sources + (partial.astype(stream.sources[0].dtype),), None)
  return Stream(stream.sources, partial)


class DepthAttention(nnx.Module):
  """One AttnRes read-out: a zero-initialised pseudo-query and the RMSNorm of its keys. `backward`: how the op's
  backward pass runs (`k3jax.ops.attnres.readout`; a read through a carry's summary is left to autodiff and has no
  such choice)."""

  def __init__(self, d_model: int, *, eps: float = 1e-6, backward: str = "fused"):
    self.backward = backward
    self.query = nnx.Param(jnp.zeros((d_model,), jnp.float32))
    self.key_norm = RMSNorm(d_model, eps=eps)

  def __call__(self, stream: Stream | Carry):
    """The input of the next sub-layer: softmax-weighted sum over the sources and the non-empty partial sum. A
    carry with summaries (`summarize`) is read through its first one, not its buffer."""
    q, g, buffer, valid_C, values, valid_E = self._operands(stream)
    if isinstance(stream, Carry) and stream.summaries:
      return attnres_ops.readout_from_summary(q, g, stream.summaries[0], values, valid_E, eps=self.key_norm.eps)
    return attnres_ops.readout(q, g, buffer, valid_C, values, valid_E, eps=self.key_norm.eps,
                               backward=self.backward)

  def weights(self, stream: Stream | Carry):
    """(the read-out's softmax weights `[N, B, T]`, which of the N are values `[N]` bool): over a `Stream`'s
    sources, then its partial sum when not empty (all valid); over a `Carry`'s buffer slots, its closed sums and
    its partial sum, in that order, those not valid at weight exactly 0 (the valid ones, in order, are the weights
    of the carry's `Stream`)."""
    q, g, buffer, valid_C, values, valid_E = self._operands(stream)
    w_NBT = attnres_ops.weights(q, g, buffer, valid_C, values, valid_E, eps=self.key_norm.eps)
    return w_NBT, jnp.concatenate([valid_C, valid_E])

  def _operands(self, stream: Stream | Carry):
    """The read-out's operands (`k3jax.ops.attnres.readout`): query, key-norm weight, buffer and its valid slots,
    the single values and theirs. A `Stream` has no buffer (its sources are single values, none stacked)."""
    q, g = self.query[...], self.key_norm.weight[...]
    if isinstance(stream, Stream):
      values = stream.sources + (() if stream.partial is None else (stream.partial,))
      empty = jnp.zeros((0, *values[0].shape), jnp.float32)
      return q, g, empty, jnp.zeros((0,), bool), values, jnp.ones((len(values),), bool)
    extra = [*stream.closed, (stream.partial_BTD, stream.has_partial)]
    valid_C = jnp.arange(stream.sources_NBTD.shape[0]) < stream.count
    return (q, g, stream.sources_NBTD, valid_C, tuple(v for v, _ in extra),
            jnp.stack([jnp.asarray(valid) for _, valid in extra]))


def read(stream: Stream | Carry, attn: DepthAttention | None):
  """(a sub-layer's input, the stream after the read): the AttnRes read-out, or the running sum when there is no
  AttnRes ("none"). A carry's read takes its first summary, if it has any (`summarize`)."""
  if attn is None:
    return (stream.partial_BTD if isinstance(stream, Carry) else stream.partial), stream
  x = attn(stream)
  if isinstance(stream, Carry) and stream.summaries:
    stream = stream.replace(summaries=stream.summaries[1:])
  return x, stream
