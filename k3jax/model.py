"""The K3 decoder: embedding, KDA / gated-MLA layers with dense SiTU-GLU or LatentMoE FFNs, AttnRes, LM head.

Each decoder layer has two sub-layers, token mixer then FFN, each computing `f(RMSNorm(h))` on its input `h`, which
the residual scheme (`k3jax.layers.attnres`) provides. After the last layer a final AttnRes read-out (or the running
sum, without AttnRes) goes through the final RMSNorm and the LM head. Logits are fp32.

Initialisation: embedding N(0, 1); untied LM head N(0, 1/d); a tied head reuses the embedding scaled by d^-0.5.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import config as config_lib
from k3jax.layers import attnres
from k3jax.layers.common import RMSNorm, embed, normal_param
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.kda import KDA_OUT, KDALayer
from k3jax.layers.mla import GatedMLA


@flax.struct.dataclass
class ModelCache:
  """Generation state: one `KDACache` or `MLACache` per layer, and the number of tokens seen so far."""
  layers: tuple
  pos: jax.Array          # int32 scalar: the position the next token takes
  max_len: int = flax.struct.field(pytree_node=False)   # positions the MLA caches hold


class DecoderLayer(nnx.Module):
  """Token mixer (KDA or gated MLA) and FFN (dense SiTU-GLU or LatentMoE), each behind its own AttnRes read-out."""

  def __init__(self, model_cfg, index: int, *, rngs: nnx.Rngs, mesh=None):
    d, eps, mode = model_cfg.d_model, model_cfg.norm_eps, model_cfg.residual.mode
    self.kind = config_lib.layer_types(model_cfg)[index]
    self.uses_moe = config_lib.uses_moe(model_cfg, index)
    self.dtype = config_lib.compute_dtype(model_cfg)
    self.close_each = mode == "full"
    self.closes_block = mode == "block" and (index + 1) % model_cfg.residual.block_size == 0
    new_res = lambda: None if mode == "none" else attnres.DepthAttention(d, eps=eps)
    self.mixer_res, self.mixer_norm = new_res(), RMSNorm(d, eps=eps)
    self.mixer = KDALayer(model_cfg, rngs=rngs) if self.kind == "kda" else GatedMLA(model_cfg, rngs=rngs)
    self.ffn_res, self.ffn_norm = new_res(), RMSNorm(d, eps=eps)
    if self.uses_moe:
      from k3jax.layers.moe import LatentMoE  # the MoE layer is only needed (and imported) when MoE is on
      self.ffn = LatentMoE(d, model_cfg.moe, rngs=rngs, dtype=self.dtype, mesh=mesh)
    else:
      self.ffn = SiTUGLU(d, model_cfg.ffn_hidden, rngs=rngs, dtype=self.dtype)

  def __call__(self, stream, *, segment_ids_BT=None):
    """Training / full forward: returns (stream, None, MoE stats or None)."""
    return self._apply(stream, lambda x: (self.mixer(x, segment_ids_BT=segment_ids_BT), None))

  def prefill(self, stream, max_len: int):
    return self._apply(stream, lambda x: self.mixer.prefill(x, max_len))

  def decode(self, stream, cache, pos):
    return self._apply(stream, lambda x: self.mixer.decode(x, cache, pos))

  def _apply(self, stream, mix):
    y, cache = mix(self.mixer_norm(attnres.read(stream, self.mixer_res)).astype(self.dtype))
    stream = attnres.add(stream, y, close=self.close_each)
    h = self.ffn_norm(attnres.read(stream, self.ffn_res)).astype(self.dtype)
    y, stats = self.ffn(h) if self.uses_moe else (self.ffn(h), None)
    stream = attnres.add(stream, y, close=self.close_each or self.closes_block)
    return stream, cache, stats


def _remat_layer(layer, stream, segment_ids_BT):
  """A decoder layer rematerialised in the backward pass. The layer's forward mutates nothing, so it runs as a pure
  function of its state under `jax.checkpoint` (`nnx.remat` would write every variable back, the balancer state
  too, which lives outside the gradient's trace and may not be written from inside it). The KDA output is kept."""
  graphdef, state = nnx.split(layer)
  return jax.checkpoint(lambda st, s, seg: nnx.merge(graphdef, st)(s, segment_ids_BT=seg),
                        policy=jax.checkpoint_policies.save_only_these_names(KDA_OUT))(state, stream, segment_ids_BT)


class K3Model(nnx.Module):
  """`model(tokens_BT, segment_ids_BT=None) -> (logits_BTV fp32, aux)`; `prefill` / `decode` for generation."""

  def __init__(self, model_cfg, *, rngs: nnx.Rngs, mesh=None):
    config_lib.validate(model_cfg)
    d, V = model_cfg.d_model, model_cfg.vocab_size
    self.d_model, self.vocab_size = d, V
    self.dtype = config_lib.compute_dtype(model_cfg)
    self.mode = model_cfg.residual.mode
    self.z_loss_coef = float(model_cfg.z_loss_coef)
    self.remat = bool(model_cfg.remat)
    self.embed = normal_param(rngs, (V, d), 1.0)
    self.layers = nnx.List([DecoderLayer(model_cfg, i, rngs=rngs, mesh=mesh) for i in range(model_cfg.num_layers)])
    self.final_res = None if self.mode == "none" else attnres.DepthAttention(d, eps=model_cfg.norm_eps)
    self.final_norm = RMSNorm(d, eps=model_cfg.norm_eps)
    self.lm_head = None if model_cfg.tie_embeddings else normal_param(rngs, (d, V), d ** -0.5)

  def __call__(self, tokens_BT, *, segment_ids_BT=None):
    """aux: {"moe": [MoEStats per MoE layer, in layer order], "z_loss": z_loss_coef · mean(logsumexp(logits)²)}."""
    _check_tokens(tokens_BT, segment_ids_BT)
    stream = attnres.start(self._embed(tokens_BT), self.mode)
    apply = _remat_layer if self.remat else (lambda layer, s, seg: layer(s, segment_ids_BT=seg))
    moe_stats = []
    for layer in self.layers:
      stream, _, stats = apply(layer, stream, segment_ids_BT)
      if stats is not None:
        moe_stats.append(stats)
    logits = self._logits(stream)
    return logits, {"moe": moe_stats, "z_loss": z_loss(logits, self.z_loss_coef)}

  def prefill(self, tokens_BT, max_len: int):
    """Runs the prompt; returns (logits of its last position `[B,V]`, a cache with room for `max_len` tokens)."""
    _check_tokens(tokens_BT, None)
    if max_len < tokens_BT.shape[1]:
      raise ValueError(f"max_len={max_len} is shorter than the prompt (T={tokens_BT.shape[1]})")
    stream = attnres.start(self._embed(tokens_BT), self.mode)
    caches = []
    for layer in self.layers:
      stream, cache, _ = layer.prefill(stream, max_len)
      caches.append(cache)
    last = jax.tree.map(lambda a: a[:, -1:], stream)
    pos = jnp.asarray(tokens_BT.shape[1], jnp.int32)
    return self._logits(last)[:, 0], ModelCache(tuple(caches), pos, max_len)

  def decode(self, token_B, cache: ModelCache):
    """One token per row at position `cache.pos` (< cache.max_len: checked when pos is concrete; under jit the
    caller sizes the cache, as `generate` does); returns (logits `[B,V]`, the advanced cache)."""
    if token_B.ndim != 1 or not jnp.issubdtype(token_B.dtype, jnp.integer):
      raise ValueError(f"token_B must be an integer array of shape [B], got {token_B.dtype}{tuple(token_B.shape)}")
    if not isinstance(cache.pos, jax.core.Tracer) and int(cache.pos) >= cache.max_len:
      raise ValueError(f"the cache is full: position {int(cache.pos)} >= max_len={cache.max_len}")
    stream = attnres.start(self._embed(token_B[:, None]), self.mode)
    caches = []
    for layer, layer_cache in zip(self.layers, cache.layers):
      stream, layer_cache, _ = layer.decode(stream, layer_cache, cache.pos)
      caches.append(layer_cache)
    return self._logits(stream)[:, 0], ModelCache(tuple(caches), cache.pos + 1, cache.max_len)

  def moe_layers(self) -> list:
    """The LatentMoE modules, in the order of aux["moe"]."""
    return [layer.ffn for layer in self.layers if layer.uses_moe]

  def _embed(self, tokens_BT):
    return embed(self.embed[...], tokens_BT, self.dtype)

  def _logits(self, stream):
    h = attnres.read(stream, self.final_res)
    h = self.final_norm(h).astype(self.dtype)
    if self.lm_head is None:
      w_DV = self.embed[...].T * self.d_model ** -0.5
    else:
      w_DV = self.lm_head[...]
    return jnp.einsum("btd,dv->btv", h, w_DV.astype(self.dtype), preferred_element_type=jnp.float32)


def z_loss(logits_BTV, coef: float, mask_BT=None):
  """`coef · mean(logsumexp(logits)²)` over the positions where mask is true (all when None); 0.0 when coef is 0."""
  if coef == 0.0:
    return jnp.zeros((), jnp.float32)
  lse2 = jnp.square(jax.nn.logsumexp(logits_BTV.astype(jnp.float32), axis=-1))
  if mask_BT is None:
    return coef * jnp.mean(lse2)
  mask = mask_BT.astype(jnp.float32)
  return coef * jnp.sum(lse2 * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _check_tokens(tokens_BT, segment_ids_BT):
  if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
    raise ValueError(f"tokens_BT must be an integer array of shape [B,T], got "
                     f"{tokens_BT.dtype}{tuple(tokens_BT.shape)}")
  if segment_ids_BT is not None and (segment_ids_BT.shape != tokens_BT.shape
                                     or not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer)):
    raise ValueError(f"segment_ids_BT must be an integer array shaped like tokens {tuple(tokens_BT.shape)}, got "
                     f"{segment_ids_BT.dtype}{tuple(segment_ids_BT.shape)}")
