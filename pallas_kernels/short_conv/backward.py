"""The short conv's (`k3jax.ops.short_conv`) backward pass, the input's gradient and the weights', in one Triton pass.

With taps `tap_j[t] = xp[t + j]·keep_j[t]` (xp: the W−1 inputs of the state, then x; keep_j zero across a
document boundary), `pre = Σ_j w_j tap_j`:

    dpre[t] = dy[t] · SiLU'(pre[t]),   dw_j = Σ_t tap_j[t] dpre[t],   dx[t] = Σ_j w_j keep_j[u] dpre[u], u = t+W−1−j

xp is not formed (that would copy all of x): a program reads x, and the first block its W−1 rows before x from a
small head of xp's first rows. A program walks blocks of rows of one batch row and one slice of channels. dx at a
block's rows needs dpre at the W row shifts of the block (the block's rows and the W−1 after them), which registers
cannot shift. Two forms (`Blocks.dpre`):

  "recomputed": the program recomputes dpre at each of the W shifts from xp's 2W−1 shifted rows (the same rows
    again, from L1/L2) and the cotangent's W shifted rows: dpre is never written, but each element costs W
    sigmoids.
  "stored" (the default; faster on an H100, BUILD_NOTES): the program computes dpre once a row, writes each block
    of it, with the block before, to a scratch region of its own (fp32, discarded; two regions in turn, small enough
    to stay in L2), and after a CTA barrier reads it back at the W shifts to form the block before's dx: dx lags dpre
    by one block, and one block past the program's rows (the next program's first rows, recomputed, or zero past T)
    ends it.

The weights' gradient accumulates in one tile a tap, summed over rows once at the end. Rows past T read as zero
(masked loads). What it reads from memory is x and the cotangent once, what it writes is dx once (and the stored
form's scratch, from L2). The state's gradient (W−1 rows) is left to the caller. Interpret mode runs programs one at
a time, so only a GPU checks the barrier (`experiments/bench_short_conv.py`, against the fused backward).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._triton import barrier, traced_once, triton_call

DPRE_FORMS = ("recomputed", "stored")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The kernel's tiling: `rows` a step of a program's loop, `channels` a program, `splits` programs along each batch
  row's T (each walks its share of the row's blocks in turn), `num_warps` Triton warps a program; `dpre`
  (DPRE_FORMS): whether dx's W shifts of dpre are recomputed or read back from a scratch (the module's docstring)."""
  rows: int = 8
  channels: int = 128
  splits: int = 16
  num_warps: int = 4
  dpre: str = "stored"

  def __post_init__(self):
    if self.dpre not in DPRE_FORMS:
      raise ValueError(f"dpre must be one of {DPRE_FORMS}, got {self.dpre!r}")


def applies(T: int, sizes, blocks: Blocks = Blocks()) -> bool:
  """Whether the kernel takes T rows and channel parts of `sizes` (else the caller's XLA formulas do)."""
  return T % (blocks.rows * blocks.splits) == 0 and all(c % blocks.channels == 0 for c in sizes)


def dx_and_dw(x_BTC, state_BWC, dy_parts, w_WC, segp_BP=None, blocks: Blocks = Blocks()):
  """(dx `[B, T, C]` in x's dtype, dw `[W, C]` fp32): the gradients of x and of the weights.

  `x_BTC` the conv's input and `state_BWC` `[B, W−1, C]` the W−1 inputs before it (xp, the state then x, is never
  formed: a program reads x, and its first block the state from a small head, `_head`). `dy_parts`: the cotangents
  of the output's channel parts, in order, each `[B, T, C_i]`. `segp_BP` `[B, T + W−1]` int32: each xp row's
  document (the state's rows the first document's), or None (one document). `applies` must hold. One call lowered
  once per program and input types (`traced_once`): every KDA layer's conv, scanned or not, shares one compiled
  copy."""
  W = w_WC.shape[0]
  B, T, C = x_BTC.shape
  sizes = [d.shape[-1] for d in dy_parts]
  if sum(sizes) != C or not applies(T, sizes, blocks):
    raise ValueError(f"dx_and_dw needs T={T} a multiple of {blocks.rows * blocks.splits} and channel parts "
                     f"{sizes} (summing to C={C}) multiples of {blocks.channels}")
  if blocks.rows < W - 1:
    raise ValueError(f"dx_and_dw needs rows={blocks.rows} at least W−1={W - 1} (a block's shifted rows reach one "
                     f"block back at most)")
  if state_BWC.shape != (B, W - 1, C):
    raise ValueError(f"dx_and_dw needs the state as [B, W−1, C] = {(B, W - 1, C)}, got {state_BWC.shape}")
  return _dx_and_dw_once(x_BTC, _head(state_BWC, x_BTC, blocks.rows), tuple(dy_parts), w_WC, segp_BP, blocks)


def _head(state_BWC, x_BTC, rows: int):
  """xp's first rows, `[B, 2(W−1) + rows, C]` (fewer when T is short): what the first block reads at any of its
  2W−1 shifts. A copy of W−1 + rows + W−1 rows, where forming xp would copy all of x."""
  W1 = state_BWC.shape[1]
  return jnp.concatenate([state_BWC.astype(x_BTC.dtype), x_BTC[:, :rows + W1]], axis=1)


def _dx_and_dw(x_BTC, head_BHC, dy_parts, w_WC, segp_BP, blocks):
  W = w_WC.shape[0]
  B, T, C = x_BTC.shape
  P, bc = T + W - 1, blocks.channels
  sizes = [d.shape[-1] for d in dy_parts]
  starts = [sum(sizes[:i]) // bc for i in range(len(sizes))]
  part_blocks = [c // bc for c in sizes]
  grid = (B, blocks.splits, C // bc)
  # Blocks are whole batch rows: a program's rows are its split's, addressed inside the kernel.
  part_rows = [pl.BlockSpec((None, T, bc), functools.partial(
      lambda b, s, c, i: (b, 0, jnp.clip(c - starts[i], 0, part_blocks[i] - 1)), i=i)) for i in range(len(sizes))]
  in_specs = [pl.BlockSpec((None, T, bc), lambda b, s, c: (b, 0, c)),
              pl.BlockSpec((None, head_BHC.shape[1], bc), lambda b, s, c: (b, 0, c)),
              pl.BlockSpec((W, bc), lambda b, s, c: (0, c))]
  in_specs += part_rows
  args = [x_BTC, head_BHC, w_WC.astype(jnp.float32), *dy_parts]
  if segp_BP is not None:
    in_specs.append(pl.BlockSpec((None, P), lambda b, s, c: (b, 0)))
    args.append(segp_BP.astype(jnp.int32))
  out_specs = [pl.BlockSpec((None, T, bc), lambda b, s, c: (b, 0, c)),
               pl.BlockSpec((None, None, W, bc), lambda b, s, c: (b, s, 0, c))]
  out_shape = [jax.ShapeDtypeStruct((B, T, C), x_BTC.dtype),
               jax.ShapeDtypeStruct((B, blocks.splits, W, C), jnp.float32)]
  stored = blocks.dpre == "stored"
  if stored:   # each program's scratch: two regions of two blocks of dpre
    out_specs.append(pl.BlockSpec((None, None, 4 * blocks.rows, bc), lambda b, s, c: (b, s, 0, c)))
    out_shape.append(jax.ShapeDtypeStruct((B, blocks.splits, 4 * blocks.rows, C), jnp.float32))
  kernel = functools.partial(_kernel, W=W, T=T, rows=T // blocks.splits, block_t=blocks.rows, starts=tuple(starts),
                             parts=len(sizes), has_segments=segp_BP is not None, stored=stored)
  dx, dw_partial, *_ = triton_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                                   name="short_conv_backward", num_warps=blocks.num_warps, num_stages=1)(*args)
  return dx, jnp.sum(dw_partial, axis=(0, 1))


_dx_and_dw_once = traced_once(_dx_and_dw, static_argnums=(5,))


def _kernel(x_ref, head_ref, w_ref, *refs, W, T, rows, block_t, starts, parts, has_segments, stored):
  dy_refs = refs[:parts]
  segp_ref = refs[parts] if has_segments else None
  dx_ref, dw_ref, *scratch = refs[parts + has_segments:]
  c = pl.program_id(2)
  part = sum((c >= starts[i]).astype(jnp.int32) for i in range(1, parts))
  w = [w_ref[j, :] for j in range(W)]
  first = pl.program_id(1) * rows   # program ids outside the loop: interpret mode reads them only there
  r = jnp.arange(block_t)

  def rows_of(ref, t0, n):
    """`ref`'s rows t0.. (block_t of them), zero from row n on."""
    return pltriton.load(ref.at[pl.ds(t0, block_t)], mask=(t0 + r < n)[:, None], other=0).astype(jnp.float32)

  def xp_at(t0, shifts):
    """[xp's rows t0+k.. (x's t0+k−(W−1)..) for k in range(shifts)], zero past its last, in one branch: the first
    block's from the head (x's rows before 0 are the state's), every other block's from x (t0 ≥ rows ≥ W−1, so none
    before 0)."""
    return jax.lax.cond(t0 == 0, lambda: [rows_of(head_ref, k, head_ref.shape[0]) for k in range(shifts)],
                        lambda: [rows_of(x_ref, t0 + k - (W - 1), T) for k in range(shifts)])

  def dy_at(t0):
    """The cotangent's rows t0.. of this program's channels, from the part they belong to; zero past T."""
    load = lambda i: lambda: rows_of(dy_refs[i], t0, T)
    return load(0)() if parts == 1 else jax.lax.switch(part, [load(i) for i in range(parts)])

  def segs_at(t0, ks):
    """The documents of xp's rows t0+k.. (`[block_t, 1]`) for k in ks, by k; None without documents."""
    if not has_segments:
      return None
    return {k: pltriton.load(segp_ref.at[pl.ds(t0 + k, block_t)], mask=t0 + k + r < T + W - 1, other=-1)[:, None]
            for k in ks}

  def masked(v, segs, k, o):
    """v where xp's rows t0+k.. are of the documents of xp's rows t0+o.., else 0."""
    return v if segs is None or k == o else jnp.where(segs[k] == segs[o], v, 0.0)

  def dpre_at(xs, segs, t0, s):
    """(taps, dpre) of the outputs t0+s..; `xs`, `segs`: xp's rows t0+k.. (their taps are k = s..s+W−1)."""
    taps = [masked(xs[s + j], segs, s + j, s + W - 1) for j in range(W)]
    pre = sum(w[j] * taps[j] for j in range(W))
    sig = jax.nn.sigmoid(pre)
    return taps, dy_at(t0 + s) * sig * (1.0 + pre * (1.0 - sig))              # SiLU'(pre)

  def dx_from(dpre_at_shift, segs):
    """dx at x's rows t0.. (xp's t0+W−1..) from dpre at the outputs t0+s.., each reached through tap W−1−s."""
    return sum(w[W - 1 - s] * masked(dpre_at_shift(s), segs, W - 1, s + W - 1) for s in range(W))

  def recomputed_step(i, dw):
    t0 = first + i * block_t
    xs = xp_at(t0, 2 * W - 1)                                                # xp's rows t0+k..
    segs = segs_at(t0, range(2 * W - 1))
    taps, dpre = zip(*[dpre_at(xs, segs, t0, s) for s in range(W)])
    dx_ref[pl.ds(t0, block_t), :] = dx_from(lambda s: dpre[s], segs).astype(dx_ref.dtype)
    return tuple(dw[j] + taps[0][j] * dpre[0] for j in range(W))

  def stored_step(i, carry):
    """dpre at block i's rows, dx at block i−1's; block rows // block_t is the one after the program's rows."""
    dw, dpre_before = carry
    t0 = first + i * block_t
    segs = segs_at(t0, range(W))
    taps, dpre = dpre_at(xp_at(t0, W), segs, t0, 0)
    own = jnp.where(i < rows // block_t, dpre, 0.0)
    # Two regions in turn: the barrier orders this one's writes before its reads, and the other's reads (the step
    # before) before its writes (the step after).
    region = jax.lax.rem(i, 2) * (2 * block_t)
    scratch[0][pl.ds(region, block_t), :] = dpre_before
    scratch[0][pl.ds(region + block_t, block_t), :] = dpre
    barrier()

    @pl.when(i > 0)
    def _():
      t = t0 - block_t
      read = lambda s: scratch[0][pl.ds(region + s, block_t), :]
      dx_ref[pl.ds(t, block_t), :] = dx_from(read, segs_at(t, range(W - 1, 2 * W - 1))).astype(dx_ref.dtype)
    return tuple(dw[j] + taps[j] * own for j in range(W)), dpre

  zero = jnp.zeros((block_t, dw_ref.shape[-1]), jnp.float32)
  if stored:
    dw, _ = jax.lax.fori_loop(0, rows // block_t + 1, stored_step, ((zero,) * W, zero))
  else:
    dw = jax.lax.fori_loop(0, rows // block_t, recomputed_step, (zero,) * W)
  for j in range(W):
    dw_ref[j, :] = jnp.sum(dw[j], axis=0)
