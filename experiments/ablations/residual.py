"""AttnRes depth weights of a model: how much each sub-layer's input draws on each source (the embedding, the
completed blocks, the current block's partial sum), averaged over the tokens of a batch.

Each read-out computes `softmax_i(w_lᵀ RMSNorm(v_i))` over its sources (`attnres.DepthAttention.weights`); the
weights depend on the input through the keys, so they are measured on data, with the trained pseudo-queries `w_l`.
At initialisation (`w_l = 0`) every read-out is the uniform average of its sources. The model runs its layers as it
does in training (`K3Model.run_layers`: unrolled ones one by one, scanned groups under their scan), each layer as
`DecoderLayer` computes it, with every read-out's weights taken on the way; `walk` returns the final stream too, so
a test can check that this forward is the model's own.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers import attnres


def names(model) -> list[str]:
  """The read-outs of a `K3Model` in the order they run: each decoder layer's token mixer, then its FFN, then the
  final read-out before the LM head."""
  return [f"layer {i} {name}" for i, layer, _ in _layers(model) for name in (layer.kind, "ffn")] + ["final"]


def _layers(model):
  """(layer index, its module, its slot in the module's stacked parameters or None) of every decoder layer, in
  order: unrolled layers are modules of their own, a scanned group's layer at index i is slot g of the group."""
  at = {i: (model.layers[k], None) for k, i in enumerate(model.plan.unrolled)}
  for j, layer in enumerate(model.groups or ()):
    at.update((i, (layer, g)) for g, i in enumerate(model.plan.position(j)))
  return [(i, *at[i]) for i in sorted(at)]


def depth_weights(model, tokens_BT, *, segment_ids_BT=None) -> list[dict]:
  """For each read-out (`names` order): {"name", "weights": [sources] mean softmax weight over the non-padding
  tokens (segment id != 0; all tokens without segment ids), "query_norm": |w_l|}. Source 0 is the embedding; in
  block mode the rest are the completed block sums and, when non-empty, the current block's partial sum (last);
  in full mode every earlier sub-layer output."""
  if model.mode == "none":
    raise ValueError("the model has no AttnRes read-outs (model.residual.mode is 'none')")
  tokens_BT = jnp.asarray(tokens_BT)
  weights, _ = walk(model, tokens_BT, segment_ids_BT=segment_ids_BT)
  mask_BT = np.ones(tokens_BT.shape, bool) if segment_ids_BT is None else np.asarray(segment_ids_BT) != 0
  queries = _queries(model)
  return [{"name": name, "weights": np.asarray(w_NBT, np.float64)[:, mask_BT].mean(axis=1).tolist(),
           "query_norm": float(np.linalg.norm(q))} for name, w_NBT, q in zip(names(model), weights, queries)]


def walk(model, tokens_BT, *, segment_ids_BT=None):
  """(the weights `[sources, B, T]` of every read-out in `names` order, only its valid sources; the stream after
  the last layer), the model run as in training."""
  graphdef, state = nnx.split(model)
  per_layer, final, stream = _walk(graphdef, state, jnp.asarray(tokens_BT),
                                   None if segment_ids_BT is None else jnp.asarray(segment_ids_BT))
  out = [np.asarray(w)[np.asarray(valid)] for layer in per_layer for w, valid in layer]
  return out + [np.asarray(final[0])[np.asarray(final[1])]], stream


@functools.partial(jax.jit, static_argnums=0)
def _walk(graphdef, state, tokens_BT, segment_ids_BT):
  model = nnx.merge(graphdef, state)

  def run(layer, stream, closes, cache):   # DecoderLayer's training forward, the read-outs' weights on the way
    mixer_w = layer.mixer_res.weights(stream)
    y = layer.mixer(layer.mixer_norm(layer.mixer_res(stream)).astype(layer.dtype), segment_ids_BT=segment_ids_BT)
    stream = attnres.add(stream, y, close=closes[0])
    ffn_w = layer.ffn_res.weights(stream)
    h = layer.ffn_norm(layer.ffn_res(stream)).astype(layer.dtype)
    y = layer.ffn(h)[0] if layer.uses_moe else layer.ffn(h)
    return attnres.add(stream, y, close=closes[1]), cache, (mixer_w, ffn_w)

  stream = model.start_stream(tokens_BT)
  stream, _, per_layer = model.run_layers(stream, run)
  return per_layer, model.final_res.weights(stream), stream


def _queries(model) -> list[np.ndarray]:
  """Every read-out's pseudo-query w_l, in `names` order (a scanned group's, one per group)."""
  slot = lambda w, g: np.asarray(w if g is None else w[g])
  return [slot(res.query[...], g) for _, layer, g in _layers(model) for res in (layer.mixer_res, layer.ffn_res)] + [
      np.asarray(model.final_res.query[...])]
