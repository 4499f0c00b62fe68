"""The K3 decoder: embedding, KDA / gated-MLA layers with dense SiTU-GLU or LatentMoE FFNs, AttnRes, LM head.

Each decoder layer has two sub-layers, token mixer then FFN, each computing `f(RMSNorm(h))` on its input `h`, which
the residual scheme (`k3jax.layers.attnres`) provides. After the last layer a final AttnRes read-out (or the running
sum, without AttnRes) goes through the final RMSNorm and the LM head. Logits are fp32.

Layers run as `config.layer_plan` says: the repeating group of the layer pattern (e.g. KDA, KDA, KDA, MLA, each with
its FFN) under one `jax.lax.scan` over parameters stacked on a leading axis (`K3Model.groups`), so a deep model
traces and compiles one group; the layers outside the repetition (a dense first layer, a remainder, a forced last
layer) one by one (`K3Model.layers`). The residual stream crosses the scan as an `attnres.Carry`. Rematerialisation
is per layer, in the scan as outside it (a whole group would hold all its layers' activations at once in the
backward pass): `recomputing_scan` with `model.remat`'s policy for the groups, which keeps the carry's buffer of
AttnRes sources once rather than once per group; `jax.checkpoint` with `model.remat_unrolled`'s (by default the
same) for an unrolled layer, whose residuals, unlike a scanned layer's, need no copy to be kept.

Initialisation: embedding N(0, 1); untied LM head N(0, 1/d); a tied head reuses the embedding scaled by d^-0.5.
Layer i draws its parameters from its own key (the i-th of a split of the model's key); the layers of a scanned
group position are built at once, vmapped over their keys, so a scanned model starts from the parameters of the
unrolled one (`scanned_layout` maps the one to the other) and its compiled init holds each position's initialisers
once.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as config_lib, spec as spec_lib
from k3jax.layers import attnres
from k3jax.layers.common import RMSNorm, embed, normal_param
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.kda import KDA_OUT, KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.ops import kda as kda_ops, mla as mla_ops

# What each of config.REMAT_POLICIES keeps ("none": no jax.checkpoint at all), per mixer: the jax.checkpoint policy
# of a layer of that mixer; a mixer not named keeps nothing of its forward, and in the scanned groups runs it
# undifferentiated (`recomputing_scan`). "save_mixers" keeps the KDA output with the kernels' residuals: the layer's
# recomputation reads it, and would otherwise run the kernels.
REMAT_POLICIES = {
    "full": {},
    "save_attention": {"mla": mla_ops.saves_fused_attention},
    "save_mixers": {"kda": jax.checkpoint_policies.save_only_these_names(KDA_OUT, kda_ops.RESIDUALS_NAME),
                    "mla": mla_ops.saves_fused_attention},
}


@flax.struct.dataclass
class ModelCache:
  """Generation state: a `KDACache` or `MLACache` per unrolled layer (`layers`, in the order of `K3Model.layers`)
  and per position of the scanned group (`groups`, as `K3Model.groups`: each array stacked over the groups on a
  leading axis), and the number of tokens seen so far."""
  layers: tuple
  groups: tuple | None
  pos: jax.Array          # int32 scalar: the position the next token takes
  max_len: int = flax.struct.field(pytree_node=False)   # positions the MLA caches hold


class MoEPlacement(NamedTuple):
  """A LatentMoE module and the decoder layers whose weights it holds: one unrolled layer, or one position of the
  scanned group (`stacked`: its weights and balancer state stacked over the groups, in `layer_ids`' order)."""
  ffn: nnx.Module
  layer_ids: tuple[int, ...]
  stacked: bool


class DecoderLayer(nnx.Module):
  """Token mixer (KDA or gated MLA) and FFN (dense SiTU-GLU or LatentMoE), each behind its own AttnRes read-out.

  `closes` = (mixer, FFN): whether each sub-layer's output closes the AttnRes block (`attnres.closes`); bools, or
  traced bools inside the scan over groups."""

  def __init__(self, model_cfg, layer: spec_lib.LayerSpec, *, rngs: nnx.Rngs, mesh=None):
    d, eps, mode = model_cfg.d_model, model_cfg.norm_eps, model_cfg.residual.mode
    self.kind, self.uses_moe = layer.mixer, layer.moe
    self.dtype = config_lib.compute_dtype(model_cfg)
    new_res = lambda: None if mode == "none" else attnres.DepthAttention(d, eps=eps,
                                                                         backward=model_cfg.residual.backward)
    self.mixer_res, self.mixer_norm = new_res(), RMSNorm(d, eps=eps)
    self.mixer = KDALayer(model_cfg, rngs=rngs) if self.kind == "kda" else GatedMLA(model_cfg, rngs=rngs)
    self.ffn_res, self.ffn_norm = new_res(), RMSNorm(d, eps=eps)
    if self.uses_moe:
      from k3jax.layers.moe import LatentMoE  # the MoE layer is only needed (and imported) when MoE is on
      self.ffn = LatentMoE(d, model_cfg.moe, rngs=rngs, dtype=self.dtype, mesh=mesh)
    else:
      self.ffn = SiTUGLU(d, model_cfg.ffn_hidden, rngs=rngs, dtype=self.dtype)

  def __call__(self, stream, closes, *, segment_ids_BT=None):
    """Training / full forward: returns (stream, None, MoE stats or None). It runs as one jitted function of the
    layer's state (`_layer_forward`), so alike layers on alike inputs (a model's KDA + MoE layers, unrolled or at
    their positions of the scanned group) are traced, differentiated and lowered once, not once each."""
    graphdef, state = nnx.split(self)
    static = tuple(c if isinstance(c, bool) else None for c in closes)
    traced = tuple(c for c in closes if not isinstance(c, bool))
    return _layer_forward(graphdef, static, state, stream, traced, segment_ids_BT)

  def prefill(self, stream, closes, max_len: int):
    return self._apply(stream, closes, lambda x: self.mixer.prefill(x, max_len))

  def decode(self, stream, closes, cache, pos):
    return self._apply(stream, closes, lambda x: self.mixer.decode(x, cache, pos))

  def _apply(self, stream, closes, mix, valid_BT=None):
    with jax.named_scope("attnres"):
      x, stream = attnres.read(stream, self.mixer_res)
    with jax.named_scope(self.kind):
      y, cache = mix(self.mixer_norm(x).astype(self.dtype))
      stream = attnres.add(stream, y, close=closes[0])
    with jax.named_scope("attnres"):
      h, stream = attnres.read(stream, self.ffn_res)
    with jax.named_scope("moe" if self.uses_moe else "ffn"):
      h = self.ffn_norm(h).astype(self.dtype)
      y, stats = self.ffn(h, valid_BT) if self.uses_moe else (self.ffn(h), None)
      stream = attnres.add(stream, y, close=closes[1])
    return stream, cache, stats


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer_forward(graphdef, static_closes, state, stream, traced_closes, segment_ids_BT):
  """`DecoderLayer.__call__` of the layer `nnx.merge(graphdef, state)`; `static_closes` holds its close flags, None
  where the flag is the next of `traced_closes`."""
  layer, traced = nnx.merge(graphdef, state), iter(traced_closes)
  closes = tuple(next(traced) if c is None else c for c in static_closes)
  valid_BT = None if segment_ids_BT is None else segment_ids_BT != 0          # segment 0 is padding
  return layer._apply(stream, closes, lambda x: (layer.mixer(x, segment_ids_BT=segment_ids_BT), None), valid_BT)


def _layer_unit(layer, run, closes, remat: str):
  """`(stream, cache) -> run(layer, stream, closes, cache)` for an unrolled layer, rematerialised as `remat` names.
  Under jax.checkpoint it runs as a pure function of the layer's state (nnx.remat would write every variable back,
  the balancer state too, which lives outside the gradient's trace and may not be written from inside it)."""
  if remat == "none":
    return lambda stream, cache: run(layer, stream, closes, cache)
  graphdef, state = nnx.split(layer)
  policy = REMAT_POLICIES[remat].get(layer.kind, jax.checkpoint_policies.nothing_saveable)
  fn = jax.checkpoint(lambda st, s, c: run(nnx.merge(graphdef, st), s, closes, c), policy=policy)
  return lambda stream, cache: fn(state, stream, cache)


class K3Model(nnx.Module):
  """`model(tokens_BT, segment_ids_BT=None) -> (logits_BTV fp32, aux)`; `prefill` / `decode` for generation.

  `layers`: the unrolled decoder layers, `layers[k]` being layer `plan.unrolled[k]`; `groups`: one DecoderLayer per
  position j of the scanned group, its Variables holding that position's layer of every group stacked on a leading
  axis (None when nothing is scanned). `plan` is the `config.LayerPlan`."""

  def __init__(self, model_cfg, *, rngs: nnx.Rngs, mesh=None):
    spec = spec_lib.model_spec(model_cfg)   # validates the config
    d, V = model_cfg.d_model, model_cfg.vocab_size
    self.d_model, self.vocab_size = d, V
    self.dtype = config_lib.compute_dtype(model_cfg)
    self.mode = model_cfg.residual.mode
    self.source_dtype = config_lib.residual_source_dtype(model_cfg)
    self.summarize_groups = self.mode != "none" and model_cfg.residual.readout == "group"
    self.z_loss_coef = float(model_cfg.z_loss_coef)
    self.remat = model_cfg.remat
    self.remat_unrolled = model_cfg.remat if model_cfg.remat_unrolled is None else model_cfg.remat_unrolled
    self.plan, self.closes, self.moe_ids = spec.plan, spec.closes, spec.moe_layers
    self.embed = normal_param(rngs, (V, d), 1.0)
    # Layer i draws from keys[i] (see the module docstring).
    keys = jax.random.split(rngs.params(), len(spec.layers))
    build = lambda i, key: DecoderLayer(model_cfg, spec.layers[i], rngs=nnx.Rngs(key), mesh=mesh)
    self.layers = nnx.List([build(i, keys[i]) for i in self.plan.unrolled])
    # A position's layers share their mixer and FFN kinds (`config.layer_plan`), all a DecoderLayer's build reads.
    positions = [self.plan.position(j) for j in range(self.plan.group_size)]
    self.groups = nnx.List([_build_stacked(functools.partial(build, p[0]), keys[np.asarray(p)])
                            for p in positions]) if self.plan.num_groups else None
    self.final_res = None if self.mode == "none" else attnres.DepthAttention(
        d, eps=model_cfg.norm_eps, backward=model_cfg.residual.backward)
    self.final_norm = RMSNorm(d, eps=model_cfg.norm_eps)
    self.lm_head = None if model_cfg.tie_embeddings else normal_param(rngs, (d, V), d ** -0.5)

  def __call__(self, tokens_BT, *, segment_ids_BT=None):
    """aux: {"moe": [MoEStats per MoE layer, in layer order], "z_loss": z_loss_coef · mean(logsumexp(logits)²)}.
    `segment_ids_BT`: documents 1, 2, … (attention and the KDA state do not cross them) and 0 for padding, which
    no MoE statistic counts (`LatentMoE`: the balancer's update, the load, the auxiliary loss)."""
    _check_tokens(tokens_BT, segment_ids_BT)
    stream = self.start_stream(tokens_BT)
    run = lambda layer, s, closes, _: layer(s, closes, segment_ids_BT=segment_ids_BT)
    stream, _, stats = self.run_layers(stream, run, remat=True)
    logits = self._logits(stream)
    with jax.named_scope("loss"):
      z = z_loss(logits, self.z_loss_coef)
    return logits, {"moe": [stats[i] for i in self.moe_ids], "z_loss": z}

  def prefill(self, tokens_BT, max_len: int):
    """Runs the prompt; returns (logits of its last position `[B,V]`, a cache with room for `max_len` tokens)."""
    _check_tokens(tokens_BT, None)
    if max_len < tokens_BT.shape[1]:
      raise ValueError(f"max_len={max_len} is shorter than the prompt (T={tokens_BT.shape[1]})")
    stream = self.start_stream(tokens_BT)
    run = lambda layer, s, closes, _: layer.prefill(s, closes, max_len)
    stream, (caches, group_caches), _ = self.run_layers(stream, run)
    last = jax.tree.map(lambda a: a[:, -1:], stream)
    pos = jnp.asarray(tokens_BT.shape[1], jnp.int32)
    return self._logits(last)[:, 0], ModelCache(caches, group_caches, pos, max_len)

  def decode(self, token_B, cache: ModelCache):
    """One token per row at position `cache.pos` (< cache.max_len: checked when pos is concrete; under jit the
    caller sizes the cache, as `generate` does); returns (logits `[B,V]`, the advanced cache)."""
    if token_B.ndim != 1 or not jnp.issubdtype(token_B.dtype, jnp.integer):
      raise ValueError(f"token_B must be an integer array of shape [B], got {token_B.dtype}{tuple(token_B.shape)}")
    if not isinstance(cache.pos, jax.core.Tracer) and int(cache.pos) >= cache.max_len:
      raise ValueError(f"the cache is full: position {int(cache.pos)} >= max_len={cache.max_len}")
    stream = self.start_stream(token_B[:, None])
    run = lambda layer, s, closes, layer_cache: layer.decode(s, closes, layer_cache, cache.pos)
    stream, (caches, group_caches), _ = self.run_layers(stream, run, (cache.layers, cache.groups))
    return self._logits(stream)[:, 0], ModelCache(caches, group_caches, cache.pos + 1, cache.max_len)

  def run_layers(self, stream, run, caches=None, *, remat: bool = False):
    """Every decoder layer on `stream`, in order. `run(layer, stream, closes, cache) -> (stream, cache, MoE stats or
    None)` runs one layer; `cache` is its part of `caches` = (per unrolled layer, per group position), or None.
    `remat`: rematerialised as the config says (`model.remat`, `model.remat_unrolled`), for a gradient.
    Returns (stream, (caches of the unrolled layers, stacked caches of the group positions), MoE stats per layer)."""
    plan = self.plan
    scanned_policy, unrolled_policy = (self.remat, self.remat_unrolled) if remat else ("none", "none")
    layer_caches = list(caches[0]) if caches is not None else [None] * len(plan.unrolled)
    group_caches = caches[1] if caches is not None else None
    stats = [None] * len(self.closes)

    def unrolled(k, stream):
      i = plan.unrolled[k]
      with jax.named_scope(f"layer_{i}"):
        stream, layer_caches[k], stats[i] = _layer_unit(self.layers[k], run, self.closes[i], unrolled_policy)(
            stream, layer_caches[k])
      return stream

    before = [k for k, i in enumerate(plan.unrolled) if i < plan.start]
    for k in before:
      stream = unrolled(k, stream)
    if plan.num_groups:
      with jax.named_scope("groups"):   # the scan, the stream's way in and out of it, the stats' split by layer
        stream, group_caches, group_stats = self._scan(stream, run, group_caches, scanned_policy)
        for j, position_stats in enumerate(group_stats):
          if position_stats is not None:  # stacked over the groups: one array per group (one split, not G slices)
            leaves, treedef = jax.tree.flatten(position_stats)
            for i, group_leaves in zip(plan.position(j), zip(*(jnp.unstack(x) for x in leaves)), strict=True):
              stats[i] = jax.tree.unflatten(treedef, group_leaves)
    for k in range(len(before), len(plan.unrolled)):
      stream = unrolled(k, stream)
    return stream, (tuple(layer_caches), group_caches), stats

  def _scan(self, stream, run, caches, remat: str):
    """The scanned groups: (stream after them, stacked caches per position, stacked MoE stats per position)."""
    plan, closes = self.plan, self.closes
    sources_after = lambda i: attnres.num_sources(self.mode, [c for layer in closes[:i] for c in layer])
    # Read-outs see the sources present when the last group starts; the sums its flush writes are only returned.
    count, readable = sources_after(plan.end), sources_after(plan.end - plan.group_size)
    flags_GP2 = np.array([[closes[i] for i in plan.position(j)] for j in range(plan.group_size)], bool)
    flags_GP2 = flags_GP2.transpose(1, 0, 2)
    # A flag equal in every group stays a Python bool (no select in the body); the others are scanned over.
    static = [[bool(f[0]) if f.all() or not f.any() else None for f in flags_GP2[:, j].T]
              for j in range(plan.group_size)]
    # Each closed sum of a group (a sub-layer whose flag is not always False) lands in the slots the read-outs see,
    # unless it closes in the last group: then in the later slots (`attnres.flush`).
    targets = tuple("sources" if not flags_GP2[-1, j, s] else "later" if not flags_GP2[:-1, j, s].any() else "either"
                    for j in range(plan.group_size) for s in (0, 1) if static[j][s] is not False)
    flush = functools.partial(attnres.flush, targets=targets)
    graphdefs, params, rest = zip(*(nnx.split(layer, nnx.Param, ...) for layer in self.groups))

    def layer_step(j, params_j, rest_j, flags_P2, carry, cache):
      layer_closes = tuple(flags_P2[j, s] if static[j][s] is None else static[j][s] for s in (0, 1))
      with jax.named_scope(f"position_{j}"):
        return run(nnx.merge(graphdefs[j], params_j, rest_j), carry, layer_closes, cache)

    def summarize_group(params_g, rest_g, carry):
      """The buffer's part of every read-out of the group, in one pass (`model.residual.readout="group"`)."""
      with jax.named_scope("attnres"), jax.named_scope("summary"):
        layers = [nnx.merge(graphdefs[j], params_g[j], rest_g[j]) for j in range(plan.group_size)]
        return attnres.summarize(carry, [a for layer in layers for a in (layer.mixer_res, layer.ffn_res)])

    summarize = summarize_group if self.summarize_groups else None
    carry = attnres.to_carry(stream, count, readable)
    flags = jnp.asarray(flags_GP2)
    if remat == "none" or caches is not None:
      def body(carry, xs):
        params_g, rest_g, flags_P2, caches_g = xs
        if summarize is not None:
          carry = summarize(params_g, rest_g, carry)
        out_caches, out_stats = [], []
        for j in range(plan.group_size):
          carry, cache, layer_stats = layer_step(j, params_g[j], rest_g[j], flags_P2, carry,
                                                 None if caches_g is None else caches_g[j])
          out_caches.append(cache)
          out_stats.append(layer_stats)
        return flush(carry), (tuple(out_caches), tuple(out_stats))
      carry, (caches, stats) = jax.lax.scan(body, carry, (params, rest, flags, caches))
    else:
      step = lambda j, p, r, f, c: layer_step(j, p, r, f, c, None)[::2]
      policies = [REMAT_POLICIES[remat].get(layer.kind) for layer in self.groups]
      carry, stats = recomputing_scan(step, plan.group_size, carry, params, rest, flags, summarize=summarize,
                                      flush=flush, policies=policies)
    return attnres.from_carry(carry, count, not closes[plan.end - 1][1]), caches, stats

  def update_balance(self, moe_stats) -> None:
    """After the optimizer step: every MoE layer's balancer bias from its router scores. `moe_stats` is aux["moe"]
    (per MoE layer, in layer order), each entry a list of MoEStats (one per micro-batch) or one MoEStats."""
    by_layer = {i: list(s) if isinstance(s, (list, tuple)) else [s]
                for i, s in zip(self.moe_ids, moe_stats, strict=True)}
    for p in self._moe_placements():
      if not p.stacked:
        p.ffn.update_balance(by_layer[p.layer_ids[0]])
      else:   # each micro-batch's stats stacked over the groups, as the weights are
        micro = zip(*[by_layer[i] for i in p.layer_ids], strict=True)
        p.ffn.update_balance([jax.tree.map(lambda *xs: jnp.stack(xs), *per_group) for per_group in micro])

  def balancer_biases(self):
    """Every MoE layer's balancer bias, `[num MoE layers, E]` in layer order (as aux["moe"])."""
    by_layer = {}
    for p in self._moe_placements():
      bias = p.ffn.balancer.get_value().bias
      by_layer.update(zip(p.layer_ids, bias if p.stacked else bias[None]))
    return jnp.stack([by_layer[i] for i in self.moe_ids])

  def moe_layers(self) -> list:
    """The LatentMoE modules: one per unrolled MoE layer, then one per MoE position of the scanned group (holding
    that position's weights of every group, stacked)."""
    return [p.ffn for p in self._moe_placements()]

  def _moe_placements(self) -> list[MoEPlacement]:
    """Every MoE module where it sits, in `moe_layers`' order."""
    return ([MoEPlacement(layer.ffn, (self.plan.unrolled[k],), False)
             for k, layer in enumerate(self.layers) if layer.uses_moe]
            + [MoEPlacement(layer.ffn, self.plan.position(j), True)
               for j, layer in enumerate(self.groups or ()) if layer.uses_moe])

  @jax.named_scope("embed")
  def start_stream(self, tokens_BT):
    """The residual stream the first layer reads: the tokens' embedding as its first source (`attnres.start`)."""
    return attnres.start(embed(self.embed[...], tokens_BT, self.dtype), self.mode, self.source_dtype)

  @jax.named_scope("head")
  def _logits(self, stream):
    h, _ = attnres.read(stream, self.final_res)
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


def recomputing_scan(layer_step, num_positions: int, carry, params_G, rest_G, xs_G, *, summarize=None,
                     flush=attnres.flush, policies=None):
  """Groups of `num_positions` layers under one scan whose backward pass recomputes each layer from its input and
  what its policy kept of its forward.

  `layer_step(j, params_j, rest_j, xs_g, carry) -> (carry, MoE stats or None)` runs position j of a group on an
  `attnres.Carry`; `params_G` (differentiated), `rest_G` (the other state, not differentiated) and `xs_G` (not
  differentiated) hold a tuple per position of arrays stacked over the groups. Returns (the flushed carry after the
  last group, per position the MoE stats stacked over the groups). `summarize(params_g, rest_g, carry) -> carry`,
  if given, runs at each group's start and gives the carry the buffer's part of the group's read-outs
  (`attnres.summarize`), each layer reading the same number of them. `flush(carry) -> carry` writes a group's closed
  sums at its end (`attnres.flush`). `policies`: per position a `jax.checkpoint` policy, or None (the default, for
  every position) for a layer that keeps nothing of its forward.

  The forward pass runs a layer with a policy as `jax.vjp` of it under `jax.checkpoint(policy)`, and keeps that
  VJP's residuals: what the policy saves (cuDNN attention's output, say) and the layer's inputs (a partial sum, the
  sums closed in the group so far). A layer without one runs undifferentiated (its custom VJPs' plain forwards, which
  write no residuals) and keeps its inputs; the backward pass takes its VJP again. Kept, stacked over the groups:
  each array once, and not what the backward pass has again: the parameters and the other state, the scanned
  inputs, the summaries, and the buffer of sources, which is kept once, after the last group. The backward pass runs
  the groups in reverse, each layer's VJP with that final buffer in place of the one it read: the read-outs mask the
  buffer to the first `count` sources, and those slots never change once written, so the layer sees what it saw.
  Under `jax.checkpoint` inside a `lax.scan` the scan would instead keep the buffer of every group. The summaries are
  not kept either: the backward pass computes them again from that buffer, once per group, and after the group's
  layers adds their VJP (buffer and read-out parameters) to the layers'.
  """
  policies = (None,) * num_positions if policies is None else tuple(policies)
  if len(policies) != num_positions:
    raise ValueError(f"need a policy (or None) per position ({num_positions}), got {len(policies)}")

  def group(carry, xs):
    params_g, rest_g, xs_g = xs
    if summarize is not None:
      carry = summarize(params_g, rest_g, carry)
    stats = []
    for j in range(num_positions):
      carry, layer_stats = layer_step(j, params_g[j], rest_g[j], xs_g, carry)
      stats.append(layer_stats)
    return flush(carry), tuple(stats)

  def layer(j, rest_j, xs_g, input_carry):
    """Layer j (then the flush, for the last position) as a function of (params_j, the carry's differentiable
    part: buffer, its later slots, partial sum, closed sums, summaries) returning ((the output carry's
    differentiable part less the summaries, MoE stats), the output carry)."""
    flags = [closed for _, closed in input_carry.closed]

    def fn(params_j, diff):
      sources, later, partial, closed, summaries = diff
      c = input_carry.replace(sources_NBTD=sources, later_MBTD=later, partial_BTD=partial,
                              closed=tuple(zip(closed, flags)), summaries=summaries)
      c, layer_stats = layer_step(j, params_j, rest_j, xs_g, c)
      if j == num_positions - 1:
        c = flush(c)
      return ((c.sources_NBTD, c.later_MBTD, c.partial_BTD, tuple(v for v, _ in c.closed)), layer_stats), c
    return fn

  @jax.custom_vjp
  def groups(params_G, rest_G, xs_G, carry):
    return jax.lax.scan(group, carry, (params_G, rest_G, xs_G))

  # Where the backward pass finds each leaf: for the group's input carry (its first entry), then per position
  # (treedef, per leaf ("given", index) or ("kept", index)) of its VJP, or of its input carry where it has no policy.
  # Written by the forward pass's trace.
  layout = []

  def forward(params_G, rest_G, xs_G, carry):

    def kept_group(carry, xs):
      params_g, rest_g, xs_g = xs
      if summarize is not None:
        carry = summarize(params_g, rest_g, carry)
      n = len(carry.summaries) // num_positions
      given = jax.tree.leaves((params_g, rest_g, xs_g, carry.sources_NBTD, carry.later_MBTD, carry.summaries))
      given_at = {id(x): i for i, x in enumerate(given)}
      kept = {}
      def where(x):
        if id(x) in given_at:
          return "given", given_at[id(x)]
        return "kept", kept.setdefault(id(x), (len(kept), x))[0]
      start_leaves, start_def = jax.tree.flatten(carry.replace(sources_NBTD=None, later_MBTD=None, summaries=()))
      layout[:] = [(start_def, [where(x) for x in start_leaves])]
      stats = []
      for j in range(num_positions):
        summaries, later_summaries = carry.summaries[:n], carry.summaries[n:]
        c = carry.replace(summaries=summaries)
        fn = layer(j, rest_g[j], xs_g, c)
        if policies[j] is None:
          (_, layer_stats), carry = fn(params_g[j], _differentiable(c))
          leaves, treedef = jax.tree.flatten(c.replace(sources_NBTD=None, later_MBTD=None, summaries=()))
        else:
          (_, layer_stats), vjp, carry = jax.vjp(jax.checkpoint(fn, policy=policies[j]), params_g[j],
                                                 _differentiable(c), has_aux=True)
          leaves, treedef = jax.tree.flatten(vjp)
        carry = carry.replace(summaries=later_summaries)
        layout.append((treedef, [where(x) for x in leaves]))
        stats.append(layer_stats)
      return carry, (tuple(stats), [x for _, x in kept.values()])

    carry, (stats, kept_G) = jax.lax.scan(kept_group, carry, (params_G, rest_G, xs_G))
    return (carry, stats), (params_G, rest_G, xs_G, kept_G, (carry.sources_NBTD, carry.later_MBTD))

  def backward(residuals, cotangents):
    params_G, rest_G, xs_G, kept_G, (sources, later) = residuals
    d_carry, d_stats_G = cotangents

    def body(d, xs):
      params_g, rest_g, xs_g, kept_g, d_stats_g = xs
      given = jax.tree.leaves((params_g, rest_g, xs_g, sources, later))   # then the summaries
      rebuild = lambda treedef, where: jax.tree.unflatten(treedef, [given[i] if src == "given" else kept_g[i]
                                                                    for src, i in where])
      summaries = ()   # the group's, in order
      if summarize is not None:   # the group's summaries again, from the final buffer (what they read is unchanged)
        start = rebuild(*layout[0])
        of_buffer = lambda p, s: summarize(p, rest_g, start.replace(sources_NBTD=s)).summaries
        summaries, summary_vjp = jax.vjp(of_buffer, params_g, sources)
        given += jax.tree.leaves(summaries)
      n = len(summaries) // num_positions
      d_params, d_summaries = [None] * num_positions, [()] * num_positions
      for j in reversed(range(num_positions)):
        kept_j = rebuild(*layout[1 + j])
        # Tied to the incoming cotangent, the recomputation cannot run ahead of the later layers' backward passes
        # (XLA would be free to recompute every layer of the group first, holding all their activations at once).
        if policies[j] is None:   # kept_j is the layer's input carry
          c = kept_j.replace(sources_NBTD=sources, later_MBTD=later, summaries=summaries[j * n:(j + 1) * n])
          (params_j, diff), d = jax.lax.optimization_barrier(((params_g[j], _differentiable(c)), d))
          _, vjp, _ = jax.vjp(layer(j, rest_g[j], xs_g, c), params_j, diff, has_aux=True)
        else:                     # kept_j is the layer's VJP
          vjp, d = jax.lax.optimization_barrier((kept_j, d))
        d_params[j], (d_sources, d_later, d_partial, d_closed, d_summaries[j]) = vjp((d, d_stats_g[j]))
        d = (d_sources, d_later, d_partial, d_closed)
      if summarize is not None:
        d_params_s, d_buffer = summary_vjp(tuple(x for d_j in d_summaries for x in d_j))
        d_params = jax.tree.map(jnp.add, tuple(d_params), d_params_s)
        d = (d[0] + d_buffer, *d[1:])
      return d, tuple(d_params)

    (d_sources, d_later, d_partial, _), d_params_G = jax.lax.scan(
        body, (d_carry.sources_NBTD, d_carry.later_MBTD, d_carry.partial_BTD, ()),
        (params_G, rest_G, xs_G, kept_G, d_stats_G), reverse=True)
    return d_params_G, None, None, d_carry.replace(sources_NBTD=d_sources, later_MBTD=d_later, partial_BTD=d_partial)

  groups.defvjp(forward, backward)
  return groups(params_G, rest_G, xs_G, carry)


def _differentiable(carry: attnres.Carry):
  """A carry's differentiable part, as `recomputing_scan`'s layers take it: (buffer, its later slots, partial sum,
  closed sums, summaries)."""
  return (carry.sources_NBTD, carry.later_MBTD, carry.partial_BTD, tuple(v for v, _ in carry.closed), carry.summaries)


def unstacked_ndim(path, x) -> int:
  """The rank of one layer's copy of the parameter at key path `path` of a model's state: `x.ndim`, less the
  leading group axis under `groups`."""
  return x.ndim - any(getattr(k, "key", getattr(k, "name", None)) == "groups" for k in path)


def _stack(trees):
  """Trees of Variables (alike) stacked on a new leading axis, not sharded: sharding metadata gets None there.
  ShapeDtypeStructs (abstract trees) become ShapeDtypeStructs."""
  def stack(*xs):
    if not isinstance(xs[0], jax.ShapeDtypeStruct):
      return jnp.stack(xs)
    sharding = xs[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding) and any(a is not None for a in sharding.spec):
      sharding = sharding.update(spec=jax.sharding.PartitionSpec(None, *sharding.spec))
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype, sharding=sharding)
  return nnx.spmd.add_axis(jax.tree.map(stack, *trees), 0, {nnx.PARTITION_NAME: None})


def _build_stacked(build, keys):
  """The modules `build(key)` of every key (alike: same structure and static data) as one module, its Variables
  stacked on a new leading axis (not sharded), built in one vmapped program."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(keys[0])))
  return nnx.merge(graphdef, nnx.spmd.add_axis(jax.vmap(lambda key: nnx.state(build(key)))(keys), 0,
                                                {nnx.PARTITION_NAME: None}))


def scanned_layout(tree, model_cfg):
  """`tree` in the unrolled layout (`model.scan_layers=False`: `layers` holds every layer) mapped to the layout
  `model_cfg` builds (the unrolled layers under `layers`, the scanned ones stacked under `groups`). `tree` is a
  model's state or any pytree holding such states: parameters, their gradients or optimizer moments, a TrainState.
  E.g. a checkpoint written before scanning: restore it with `scan_layers=False`, convert, save."""
  plan = spec_lib.model_spec(model_cfg).plan

  def convert(state):
    out = dict(state.raw_mapping)   # nested plain dicts, as nnx.state makes them
    layers = out.pop("layers")      # a state of some Variable types may hold only some layers (balancers: MoE ones)
    if not set(layers) <= set(range(model_cfg.num_layers)):
      raise ValueError(f"expected layers 0..{model_cfg.num_layers - 1} (the unrolled layout), got {sorted(layers)}")
    out["layers"] = {k: layers[i] for k, i in enumerate(plan.unrolled) if i in layers}
    groups = {j: _stack([layers[i] for i in plan.position(j)]) for j in range(plan.group_size)
              if plan.num_groups and plan.position(j)[0] in layers}
    if groups:
      out["groups"] = groups
    return nnx.State(out)

  is_model_state = lambda x: isinstance(x, nnx.State) and "layers" in x
  return jax.tree.map(lambda x: convert(x) if is_model_state(x) else x, tree, is_leaf=is_model_state)
