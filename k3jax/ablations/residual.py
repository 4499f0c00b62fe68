"""AttnRes depth weights of a model: how much each sub-layer's input draws on each source (the embedding, the
completed blocks, the current block's partial sum), averaged over the tokens of a batch.

Each read-out computes `softmax_i(w_lᵀ RMSNorm(v_i))` over its sources (k3jax/layers/attnres.py); the weights
depend on the input through the keys, so they are measured on data, with the trained pseudo-queries `w_l`. At
initialisation (`w_l = 0`) every read-out is the uniform average of its sources.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def read_outs(model) -> list[tuple[str, object]]:
  """(name, DepthAttention) of every AttnRes read-out of a `K3Model`, in the order they run: each decoder layer's
  mixer then FFN, then the final read-out. Empty for the pre-norm residual (mode "none"). ValueError for a model
  whose layers run as scanned groups (stacked, no read-out of its own per layer)."""
  if getattr(model, "groups", None):
    raise ValueError("the model runs its layers as scanned groups, whose read-outs record nothing per layer: train "
                     "the study with model.scan_layers off")
  out = []
  for i, layer in enumerate(model.layers):
    out += [(f"layer {i} {layer.kind}", layer.mixer_res), (f"layer {i} ffn", layer.ffn_res)]
  out.append(("final", model.final_res))
  return [(name, r) for name, r in out if r is not None]


def depth_weights(model, tokens_BT, *, segment_ids_BT=None) -> list[dict]:
  """For each read-out (`read_outs` order): {"name", "weights": [sources] mean softmax weight over the non-padding
  tokens (segment id != 0; all tokens without segment ids), "query_norm": |w_l|}. Source 0 is the embedding; in
  block mode the rest are the completed block sums and, when non-empty, the current block's partial sum (last);
  in full mode every earlier sub-layer output."""
  outs = read_outs(model)
  if not outs:
    raise ValueError("the model has no AttnRes read-outs (model.residual.mode is 'none')")
  graphdef, state = nnx.split(model)
  captured = _capture(graphdef, state, jnp.asarray(tokens_BT), segment_ids_BT)
  path_of = {id(m): path for path, m in nnx.iter_modules(model)}
  mask_BT = np.ones(np.shape(tokens_BT), bool) if segment_ids_BT is None else np.asarray(segment_ids_BT) != 0
  result = []
  for name, module in outs:
    node = captured
    for key in path_of[id(module)] + ("weights",):
      node = node[key] if node is not None and key in node else None
    if node is None:
      raise ValueError(f"the weights of {name!r} were not captured: a rematerialised layer runs as a pure function "
                       f"and records nothing; load the model with model.remat off (e.g. "
                       f"runs.trained_model(dir, overrides={{'model.remat': False}}))")
    (w_NBT,) = node.get_value()
    result.append({"name": name, "weights": np.asarray(w_NBT, np.float64)[:, mask_BT].mean(axis=1).tolist(),
                   "query_norm": float(jnp.linalg.norm(module.query[...]))})
  return result


@functools.partial(jax.jit, static_argnums=0)
def _capture(graphdef, state, tokens_BT, segment_ids_BT):
  model = nnx.merge(graphdef, state)
  _, intermediates = nnx.capture(model, nnx.Intermediate)(tokens_BT, segment_ids_BT=segment_ids_BT)
  return intermediates
