"""KDA layer (docs/design.md, KDA): projections, causal short convolution, bounded decay gate, chunked/recurrent KDA.

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x));  q, k L2-normalised per head
    g = γ_min·σ(e^{A_log}(W_f x + dt_bias))   (or −e^{A_log}·softplus(W_f x + dt_bias)),   β = σ(W_β x)
    y = W_o( RMSNorm_head(KDA(q, k, v, g, β)) ⊙ σ(W_g x) )

Initialisation: projections N(0, 1/fan_in); conv taps N(0, 1/conv_size); A_log = log U[1, 16]; dt log-uniform in
[1e-3, 1e-1] (the Mamba / Kimi Linear convention) and dt_bias chosen so that at z = 0 both gates start at the same
decay g = −e^{A_log}·dt: softplus⁻¹(dt) for the softplus gate, logit(e^{A_log}·dt/|γ_min|)/e^{A_log} for the
bounded one (its sigmoid then starts in its live range; softplus⁻¹(dt) there would put e^{A_log}(z+dt_bias) near
−100 and the gate would start dead). Norm weights 1. A_log and dt_bias should take no weight decay.
"""
from __future__ import annotations

import math

import flax.struct
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from k3jax import config as config_lib
from k3jax.layers.common import Linear, RMSNorm, normal_param
from k3jax.ops.kda import chunk_kda, fused_inputs, fused_kda, kda_decode_step
from k3jax.ops.short_conv import conv_tail, short_conv

# The KDA output's name, for a remat policy to keep it ("save_mixers"; k3jax.config.REMAT_POLICIES).
KDA_OUT = "kda_out"


@flax.struct.dataclass
class KDACache:
  """Decode state of one KDA layer: the last conv_size−1 pre-conv q|k|v inputs and the recurrent state."""
  conv_BWC: jax.Array     # [B, conv_size−1, 2·H·K + H·V], compute dtype
  state_BHKV: jax.Array   # [B, H, K, V], fp32

  def keep_rows(self, new: "KDACache", active_B) -> "KDACache":
    """`new` for the rows where `active_B` (bool `[B]`), this cache for the others."""
    pick = lambda a, b: jnp.where(active_B.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return KDACache(pick(new.conv_BWC, self.conv_BWC), pick(new.state_BHKV, self.state_BHKV))


class KDALayer(nnx.Module):
  """KDA token mixer. `__call__` for training (chunked), `prefill` for a prompt, `decode` for one token."""

  def __init__(self, model_cfg, *, rngs: nnx.Rngs):
    c = model_cfg.kda
    d, H, K = model_cfg.d_model, c.num_heads, config_lib.kda_head_dim(model_cfg)
    self.H, self.K, self.V = H, K, K
    self.dtype = config_lib.compute_dtype(model_cfg)
    self.lower_bound = c.lower_bound if c.gate == "bounded" else None
    self.backend = c.backend
    self.conv_size = c.conv_size
    self.conv_backward = c.conv_backward
    lin = lambda d_in, d_out, rank=None: Linear(d_in, d_out, rngs=rngs, dtype=self.dtype, rank=rank)
    self.w_qkv = lin(d, H * (2 * K + self.V))
    self.conv = normal_param(rngs, (c.conv_size, H * (2 * K + self.V)), c.conv_size ** -0.5)
    self.w_f = lin(d, H * K, c.gate_rank)
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (H,), jnp.float32, 1.0, 16.0)))
    dt = jnp.exp(jax.random.uniform(rngs.params(), (H, K), jnp.float32, math.log(1e-3), math.log(1e-1)))
    if self.lower_bound is None:
      dt_bias = dt + jnp.log(-jnp.expm1(-dt))                                     # softplus⁻¹(dt)
    else:
      a = jnp.exp(self.A_log[...])[:, None]
      dt_bias = jax.scipy.special.logit(jnp.minimum(a * dt / -self.lower_bound, 0.5)) / a  # (capped at |γ_min|/2)
    self.dt_bias = nnx.Param(dt_bias)
    self.w_beta = lin(d, H)
    self.w_g = lin(d, H * self.V, c.gate_rank)
    self.o_norm = RMSNorm(self.V, eps=model_cfg.norm_eps)
    self.w_o = lin(H * self.V, d)

  @jax.named_scope("kda")
  def __call__(self, x_BTD, *, segment_ids_BT=None):
    raw, _ = self._projections(x_BTD, None, segment_ids_BT)
    o, _ = fused_kda(*raw, self.A_log[...], self.dt_bias[...], lower_bound=self.lower_bound,
                     segment_ids=segment_ids_BT, backend=self.backend)
    return self._output(checkpoint_name(o, KDA_OUT), x_BTD)

  def init_cache(self, batch: int, max_len: int | None = None) -> KDACache:
    """The empty state (before any token); `max_len` is unused (the state does not grow)."""
    C = self.H * (2 * self.K + self.V)
    return KDACache(jnp.zeros((batch, self.conv_size - 1, C), self.dtype),
                    jnp.zeros((batch, self.H, self.K, self.V), jnp.float32))

  def prefill(self, x_BTD, max_len: int | None = None):
    """Full forward over a prompt from an empty state; returns (y, KDACache). `max_len` is unused (no growth)."""
    del max_len
    raw, conv = self._projections(x_BTD, None, None)
    o, S = fused_kda(*raw, self.A_log[...], self.dt_bias[...], lower_bound=self.lower_bound,
                     output_final_state=True, backend=self.backend)
    return self._output(o, x_BTD), KDACache(conv, S)

  def prefill_chunk(self, x_BTD, cache: KDACache, start_B=None, lengths_B=None):
    """A chunk of each row's prompt continuing from `cache`: row b's first `lengths_B[b]` tokens (all T when None);
    the rest is padding, which leaves the row's state and conv state as they were (g = 0 and β = 0 there make
    S_t = S_{t−1} exactly; the conv state is the row's last conv_size−1 valid inputs). `start_B` is unused (the
    state carries position; the argument matches `GatedMLA.prefill_chunk`). Returns (y `[B, T, d]`, padding rows
    arbitrary, the cache)."""
    del start_B
    B, T, _ = x_BTD.shape
    n_B = jnp.full((B,), T, jnp.int32) if lengths_B is None else jnp.broadcast_to(
        jnp.asarray(lengths_B, jnp.int32), (B,))
    (q, k, v, g_raw, beta_logits), _ = self._projections(x_BTD, cache.conv_BWC, None)
    # The same product as inside _projections (XLA computes it once): the pre-conv inputs, for the conv state.
    conv = conv_tail(cache.conv_BWC, self.w_qkv(x_BTD), n_B)
    q, k, g, beta = fused_inputs(q, k, g_raw, beta_logits, self.A_log[...], self.dt_bias[...],
                                 lower_bound=self.lower_bound)
    valid_BT = jnp.arange(T)[None] < n_B[:, None]
    g = jnp.where(valid_BT[..., None, None], g, 0.0)
    beta = jnp.where(valid_BT[..., None], beta, 0.0)
    o, S = chunk_kda(q, k, v, g, beta, initial_state=cache.state_BHKV, output_final_state=True,
                     lower_bound=self.lower_bound, backend=self.backend)
    return self._output(o, x_BTD), KDACache(conv, S)

  def decode(self, x_B1D, cache: KDACache, pos=None):
    """One token through the recurrence; `pos` is unused (the state carries position)."""
    del pos
    (q, k, v, g_raw, beta_logits), conv = self._projections(x_B1D, cache.conv_BWC, None)
    q, k, g, beta = fused_inputs(q, k, g_raw, beta_logits, self.A_log[...], self.dt_bias[...],
                                 lower_bound=self.lower_bound)
    o, S = kda_decode_step(q, k, v, g, beta, cache.state_BHKV)
    return self._output(o, x_B1D), KDACache(conv, S)

  def _projections(self, x_BTD, conv_state, segment_ids_BT):
    """((q, k, v after the short conv, gate input z, β logits), the new conv state); q and k not yet normalised.

    One product gives the pre-conv q|k|v; the conv (depthwise, so channel by channel) writes q, k and v as arrays of
    their own (the kernels take each whole: splitting one conv output would copy all three)."""
    B, T, _ = x_BTD.shape
    H, K, V = self.H, self.K, self.V
    cuts = [H * K, 2 * H * K]
    (q, k, v), state = short_conv(self.w_qkv(x_BTD), self.conv[...], conv_state, segment_ids_BT, split=cuts,
                                  backward=self.conv_backward)
    raw = (q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V),
           self.w_f(x_BTD).reshape(B, T, H, K), self.w_beta(x_BTD))
    return raw, state

  def _output(self, o_BTHV, x_BTD):
    B, T, _ = x_BTD.shape
    gate = jax.nn.sigmoid(self.w_g(x_BTD).astype(jnp.float32)).reshape(B, T, self.H, self.V)
    o = self.o_norm(o_BTHV.astype(jnp.float32)) * gate
    return self.w_o(o.reshape(B, T, self.H * self.V))
