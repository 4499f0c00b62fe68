"""Gated multi-head latent attention, NoPE (docs/design.md, gated MLA): the global-attention layers beside the KDA ones.

    c_kv = RMSNorm(W_dkv x)                   latent, rank r_kv: the only thing decoding caches
    k_h = c_kv W_uk,h,   v_h = c_kv W_uv,h,   q_h = RMSNorm(x W_dq) W_uq,h   (or x W_q,h without q-LoRA)
    y = W_o[ σ(W_g x) ⊙ concat_h softmax(q_h k_hᵀ / sqrt(d_qk) + causal/document mask) v_h ]

Decoding uses the absorbed form: q̃_h = W_uk,h q_h scores the cached latents directly (multi-query attention over
c_kv), and W_uv,h is applied to the attention-weighted latent, so no per-token key or value is ever formed.
Initialisation: projections N(0, 1/fan_in), norm weights 1.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as config_lib
from k3jax.layers.common import Linear, RMSNorm, normal_param
from k3jax.ops import mla as mla_ops


@flax.struct.dataclass
class MLACache:
  """Decode state of one MLA layer: the latents of every position so far, zero-padded to the cache length.
  Positions at or past a row's length are scratch: a later token of that row overwrites them."""
  ckv_BLR: jax.Array      # [B, max_len, r_kv], compute dtype

  def keep_rows(self, new: "MLACache", active_B) -> "MLACache":
    """`new` for the rows where `active_B`, this cache for the others: `new` itself, since an inactive row's step
    writes only at its length (scratch), and selecting over the whole cache would read and write all of it."""
    del active_B
    return new


class GatedMLA(nnx.Module):
  """Gated MLA token mixer. `__call__` for training, `prefill` for a prompt, `decode` for one token (absorbed)."""

  def __init__(self, model_cfg, *, rngs: nnx.Rngs):
    c = model_cfg.mla
    d, H, R = model_cfg.d_model, c.num_heads, c.kv_lora_rank
    (self.Dqk, self.Dv), self.H, self.R = config_lib.mla_head_dims(model_cfg), H, R
    self.dtype = config_lib.compute_dtype(model_cfg)
    self.impl = c.attention_impl
    self.decode_impl = c.decode_impl
    self.max_documents = c.max_documents
    lin = lambda d_in, d_out: Linear(d_in, d_out, rngs=rngs, dtype=self.dtype)
    if c.q_lora_rank is None:
      self.w_dq, self.q_norm = None, None
      self.w_uq = lin(d, H * self.Dqk)
    else:
      self.w_dq, self.q_norm = lin(d, c.q_lora_rank), RMSNorm(c.q_lora_rank, eps=model_cfg.norm_eps)
      self.w_uq = lin(c.q_lora_rank, H * self.Dqk)
    self.w_dkv = lin(d, R)
    self.kv_norm = RMSNorm(R, eps=model_cfg.norm_eps)
    self.w_uk = normal_param(rngs, (R, H, self.Dqk), R ** -0.5)
    self.w_uv = normal_param(rngs, (R, H, self.Dv), R ** -0.5)
    self.w_g = lin(d, H * self.Dv)
    self.w_o = lin(H * self.Dv, d)

  @jax.named_scope("mla")
  def __call__(self, x_BTD, *, segment_ids_BT=None):
    return self._forward(x_BTD, segment_ids_BT)[0]

  def init_cache(self, batch: int, max_len: int) -> MLACache:
    """The empty cache: room for `max_len` latents, none written."""
    return MLACache(jnp.zeros((batch, max_len, self.R), self.dtype))

  def prefill(self, x_BTD, max_len: int):
    """Full forward over a prompt; the cache holds its latents, zero-padded to `max_len` positions."""
    B, T, _ = x_BTD.shape
    if max_len < T:
      raise ValueError(f"max_len={max_len} is shorter than the prompt (T={T})")
    y, ckv = self._forward(x_BTD, None)
    return y, MLACache(jnp.pad(ckv, ((0, 0), (0, max_len - T), (0, 0))))

  def decode(self, x_B1D, cache: MLACache, pos):
    """One token per row at position `pos` (int32 scalar, or `[B]`: each row's own), attending to cached positions
    0..pos: `decode_rows`. The call every token mixer shares (`KDALayer.decode` takes and ignores `pos`)."""
    return self.decode_rows(x_B1D, cache, pos)

  def prefill_chunk(self, x_BTD, cache: MLACache, start_B, lengths_B=None):
    """A chunk of each row's prompt after the `start_B[b]` positions already cached (int32 `[B]` or a scalar).

    Row b's first `lengths_B[b]` tokens (all T when None) take positions start_b, start_b + 1, …; their latents
    are written to the cache there and each attends to the row's positions up to its own
    (`k3jax.ops.mla.chunk_attention`, on cuDNN where the full forward's attention is). The other tokens are
    padding: they write nothing and their outputs are arbitrary. Returns (y `[B, T, d]`, the cache)."""
    B, T, _ = x_BTD.shape
    start_B, lengths_B = _row_lengths(start_B, lengths_B, B, T, cache.ckv_BLR.shape[1])
    ckv = mla_ops.write_latents(cache.ckv_BLR, self._latents(x_BTD), start_B, lengths_B)
    o = mla_ops.chunk_attention(self._queries(x_BTD), ckv, start_B, self.w_uk[...], self.w_uv[...],
                                scale=self.Dqk ** -0.5, impl=self._implementation())
    return self._output(o, x_BTD), MLACache(ckv)

  def decode_rows(self, x_B1D, cache: MLACache, pos_B):
    """One token per row, row b's at position `pos_B[b]` (int32 `[B]` or a scalar), attending to the row's cached
    positions 0..pos_b in the absorbed form (`k3jax.ops.mla.decode_attention`, `mla.decode_impl`)."""
    B = x_B1D.shape[0]
    pos_B, ones = _row_lengths(pos_B, None, B, 1, cache.ckv_BLR.shape[1])
    q = self._queries(x_B1D)[:, 0]                                                     # [B,H,Dqk]
    ckv = mla_ops.write_latents(cache.ckv_BLR, self._latents(x_B1D), pos_B, ones)
    q_lat = jnp.einsum("bhd,rhd->bhr", q, self.w_uk[...].astype(self.dtype))
    o_lat = mla_ops.decode_attention(q_lat, ckv, pos_B + 1, scale=self.Dqk ** -0.5, impl=self.decode_impl)
    o = jnp.einsum("bhr,rhv->bhv", o_lat, self.w_uv[...].astype(self.dtype))
    return self._output(o.reshape(B, 1, self.H, self.Dv), x_B1D), MLACache(ckv)

  def _forward(self, x_BTD, segment_ids_BT):
    ckv = self._latents(x_BTD)
    k = jnp.einsum("btr,rhd->bthd", ckv, self.w_uk[...].astype(self.dtype))
    v = jnp.einsum("btr,rhv->bthv", ckv, self.w_uv[...].astype(self.dtype))
    o = mla_ops.causal_attention(self._queries(x_BTD), k, v, segment_ids_BT, scale=self.Dqk ** -0.5,
                                 impl=self._implementation(), max_documents=self.max_documents)
    return self._output(o, x_BTD), ckv

  def _queries(self, x_BTD):
    B, T, _ = x_BTD.shape
    h = x_BTD if self.w_dq is None else self.q_norm(self.w_dq(x_BTD))
    return self.w_uq(h).reshape(B, T, self.H, self.Dqk)

  def _latents(self, x_BTD):
    return self.kv_norm(self.w_dkv(x_BTD))

  def _output(self, o_BTHV, x_BTD):
    B, T, _ = x_BTD.shape
    gate = jax.nn.sigmoid(self.w_g(x_BTD).astype(jnp.float32))
    return self.w_o((gate * o_BTHV.reshape(B, T, self.H * self.Dv).astype(jnp.float32)).astype(self.dtype))

  def _implementation(self):
    if self.impl != "auto":
      return self.impl
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and self.dtype in (jnp.bfloat16, jnp.float16) else "xla"


def _row_lengths(start_B, lengths_B, B: int, T: int, L: int):
  """(start `[B]`, lengths `[B]`) as int32 vectors (scalars broadcast; lengths None: all T); when concrete (also a
  constant inside a trace), checked: 0 ≤ length ≤ T and start + length ≤ L (the cache would drop the rest)."""
  start = _concrete(start_B)
  lengths = np.full((), T) if lengths_B is None else _concrete(lengths_B)
  if start is not None and lengths is not None:
    start, lengths = np.broadcast_to(start, (B,)), np.broadcast_to(lengths, (B,))
    if lengths.min() < 0 or lengths.max() > T or start.min() < 0:
      raise ValueError(f"need 0 <= lengths <= T={T} and start >= 0, got start {start}, lengths {lengths}")
    if (start + lengths).max() > L:
      raise ValueError(f"the cache holds {L} positions; start + length reaches {int((start + lengths).max())}")
  start_B = jnp.broadcast_to(jnp.asarray(start_B, jnp.int32), (B,))
  lengths_B = jnp.full((B,), T, jnp.int32) if lengths_B is None else jnp.broadcast_to(
      jnp.asarray(lengths_B, jnp.int32), (B,))
  return start_B, lengths_B


def _concrete(x):
  """`x` as a NumPy array, or None when it is traced."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None
