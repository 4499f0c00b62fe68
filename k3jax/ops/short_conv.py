"""The KDA layer's causal depthwise short convolution with SiLU (docs/design.md, KDA), one op with a hand-written
backward pass:

    y_t = SiLU(pre_t),   pre_t = Σ_j w_j x_{t−W+1+j},   inputs of an earlier document counting as zero

The W−1 inputs before x are a state (a decode cache, or zeros). The output comes in channel parts (q, k and v of
one projection), each its own array; their cotangents meet only inside the backward pass, which gives the W taps'
weight gradients as one reduction over the tokens: "fused" as XLA fuses the formulas, "kernel" with the
input's gradient and the weights' from one Pallas kernel pass (`pallas_kernels.short_conv`, where it applies; else
"fused"; the pre-activation's gradient recomputed there at each row shift it is read at, or computed once and read
back, `conv_kernels.Blocks.dpre`); "auto" the kernel on a GPU, else "fused".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.config import SHORT_CONV_BACKWARDS as BACKWARDS
from pallas_kernels import short_conv as conv_kernels


def short_conv(x_BTC, w_WC, state_BWC=None, segment_ids_BT=None, *, split=(), backward: str = "auto"):
  """Causal depthwise conv then SiLU: y_t = SiLU(Σ_j w_j x_{t−W+1+j}); inputs of an earlier document count as zero.

  `state_BWC` holds the W−1 inputs before x (zeros when None; taken to belong to x's first document). `split`: the
  channel indices at which y is returned in parts (as `jnp.split`), each part computed on its own, so that the parts
  are separate arrays without a copy. `backward` (BACKWARDS): how the backward pass runs (the same arithmetic).
  Returns (y_BTC, or the tuple of its parts; the last W−1 inputs: the next call's state).
  """
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  B, T, C = x_BTC.shape
  W = w_WC.shape[0]
  if state_BWC is None:
    state_BWC = jnp.zeros((B, W - 1, C), x_BTC.dtype)
  state_BWC = state_BWC.astype(x_BTC.dtype)
  seg_p = None if segment_ids_BT is None else segments_with_state(segment_ids_BT, W)
  parts = _conv_silu(x_BTC, state_BWC, w_WC, seg_p, tuple(split), backward)
  return (parts if split else parts[0]), _with_state(state_BWC, x_BTC)[:, T:]


def conv_tail(state_BWC, x_BTC, lengths_B):
  """The short conv's state after the first `lengths_B[b]` inputs of each row of `x_BTC` (0..T): the last W−1 of
  (state, those inputs), as `short_conv` returns after all T."""
  W1 = state_BWC.shape[1]
  xp = _with_state(state_BWC.astype(x_BTC.dtype), x_BTC)
  take_BW = lengths_B[:, None] + jnp.arange(W1)[None]                            # the last W−1 valid entries
  return jnp.take_along_axis(xp, take_BW[..., None], axis=1)


def _with_state(state_BWC, x_BTC):
  """xp `[B, T+W−1, C]`: the state's W−1 inputs, then x (xp[W−1+t] is input t)."""
  return jnp.concatenate([state_BWC, x_BTC], axis=1)


def segments_with_state(segment_ids_BT, W: int):
  """seg_p `[B, T+W−1]`: each xp row's document, the state's W−1 rows taken as the first token's."""
  return _with_state(jnp.repeat(segment_ids_BT[:, :1], W - 1, axis=1), segment_ids_BT)


def _keep(seg_p, j, T):
  """Tap j's mask `[B, T, 1]`: its input is of the output's document; None where every tap is (no documents, or
  the last tap, the output's own input)."""
  if seg_p is None or j == seg_p.shape[1] - T:
    return None
  return (seg_p[:, j:j + T] == seg_p[:, -T:])[..., None]


def _taps(xp_BSC, seg_p, W):
  """The W shifted inputs in fp32, `[B, T, C]` each (S = T+W−1); tap j < W−1 zero across a document boundary."""
  T = xp_BSC.shape[1] - W + 1
  taps = []
  for j in range(W):
    tap, keep = xp_BSC[:, j:j + T].astype(jnp.float32), _keep(seg_p, j, T)
    taps.append(tap if keep is None else tap * keep)
  return taps


def _pre(taps, w_WC):
  """Σ_j w_j tap_j in fp32."""
  return sum(tap * w_WC[j].astype(jnp.float32) for j, tap in enumerate(taps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _conv_silu(x_BTC, state_BWC, w_WC, seg_p, split, backward):
  """SiLU of the conv, `[B, T, C]` in x's dtype, in parts at `split` (a tuple of one array when empty)."""
  del backward
  xp, W = _with_state(state_BWC, x_BTC), w_WC.shape[0]
  bounds = (0, *split, x_BTC.shape[-1])
  return tuple(jax.nn.silu(_pre(_taps(xp[..., lo:hi], seg_p, W), w_WC[:, lo:hi])).astype(x_BTC.dtype)
               for lo, hi in zip(bounds[:-1], bounds[1:]))


def _conv_silu_fwd(x_BTC, state_BWC, w_WC, seg_p, split, backward):
  return _conv_silu(x_BTC, state_BWC, w_WC, seg_p, split, backward), (x_BTC, state_BWC, w_WC, seg_p)


def _dpre(taps, w_WC, dy_parts):
  """dpre = dy · SiLU'(pre), fp32 `[B, T, C]`, the parts' cotangents joined."""
  pre = _pre(taps, w_WC)
  sig = jax.nn.sigmoid(pre)
  dy = jnp.concatenate([d.astype(jnp.float32) for d in dy_parts], axis=-1)
  return dy * sig * (1.0 + pre * (1.0 - sig))


def _input_gradients(dpre_BTC, w_WC, seg_p):
  """(dx, dstate) from dpre: input xp[s] reaches the outputs s−j through tap j, so its gradient is
  Σ_j w_j keep_j[s−j] dpre[s−j] (one elementwise pass over dpre's W shifts)."""
  W, T = w_WC.shape[0], dpre_BTC.shape[1]
  dxp = 0.0
  for j in range(W):
    d = dpre_BTC * w_WC[j].astype(jnp.float32)
    keep = _keep(seg_p, j, T)
    dxp = dxp + jnp.pad(d if keep is None else d * keep, ((0, 0), (j, W - 1 - j), (0, 0)))
  return dxp[:, W - 1:], dxp[:, :W - 1]


def _fused_backward(x_BTC, state_BWC, w_WC, seg_p, dy_parts):
  """(dx, dstate, dw) from the formulas, left to XLA to fuse: the taps' weight gradients as one reduction, the
  parts' cotangents joined inside the pass that forms the input's gradient."""
  taps = _taps(_with_state(state_BWC, x_BTC), seg_p, w_WC.shape[0])
  dpre = _dpre(taps, w_WC, dy_parts)
  dw_WC = jnp.sum(jnp.stack([tap * dpre for tap in taps], axis=2), axis=(0, 1))
  return *_input_gradients(dpre, w_WC, seg_p), dw_WC


def _kernel_backward(x_BTC, state_BWC, w_WC, seg_p, dy_parts, blocks: conv_kernels.Blocks = conv_kernels.Blocks()):
  """(dx, dstate, dw): dx and dw from the kernel in one pass (tiled as `blocks`); dstate, which only the first W−1
  outputs reach, from the formulas on those rows."""
  W = w_WC.shape[0]
  dx, dw_WC = conv_kernels.dx_and_dw(x_BTC, state_BWC, dy_parts, w_WC, seg_p, blocks)
  head = None if seg_p is None else seg_p[:, :2 * (W - 1)]
  _, dstate, _ = _fused_backward(x_BTC[:, :W - 1], state_BWC, w_WC, head, [d[:, :W - 1] for d in dy_parts])
  return dx, dstate, dw_WC


def _conv_silu_bwd(split, backward, residuals, dy_parts):
  x_BTC, state_BWC, w_WC, seg_p = residuals
  T = x_BTC.shape[1]
  sizes = [d.shape[-1] for d in dy_parts]
  wants_kernel = backward == "kernel" or (backward == "auto" and jax.default_backend() == "gpu")
  use_kernel = wants_kernel and conv_kernels.applies(T, sizes)
  dx, dstate, dw = (_kernel_backward if use_kernel else _fused_backward)(x_BTC, state_BWC, w_WC, seg_p, dy_parts)
  return dx.astype(x_BTC.dtype), dstate.astype(state_BWC.dtype), dw.astype(w_WC.dtype), None


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)
