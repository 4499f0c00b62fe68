"""The model's structure derived from its config once (`model_spec`): per decoder layer its token mixer, its FFN
kind and where the AttnRes blocks close, and the scan plan. The model, the parameter and memory sizing and the FLOP
count read this instead of re-deriving it from the ConfigDict."""
from __future__ import annotations

import dataclasses

from k3jax import config as config_lib
from k3jax.layers import attnres


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  mixer: str                   # "kda" or "mla" (config.LAYER_TYPES)
  moe: bool                    # the FFN is LatentMoE (else the dense SiTU-GLU)
  closes: tuple[bool, bool]    # whether the mixer's / the FFN's output closes the AttnRes block


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  layers: tuple[LayerSpec, ...]
  plan: config_lib.LayerPlan   # which layers run under the scan over groups, which one by one

  @property
  def mixers(self) -> tuple[str, ...]:
    return tuple(layer.mixer for layer in self.layers)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i, layer in enumerate(self.layers) if layer.moe)

  @property
  def closes(self) -> tuple[tuple[bool, bool], ...]:
    return tuple(layer.closes for layer in self.layers)

  def count(self, mixer: str) -> int:
    return self.mixers.count(mixer)


def model_spec(m) -> ModelSpec:
  """The structure of `config.model` `m` (validated first)."""
  config_lib.validate(m)
  closes = attnres.closes(m.residual.mode, m.residual.block_size, m.num_layers)
  layers = tuple(LayerSpec(t, config_lib.uses_moe(m, i), closes[i]) for i, t in enumerate(config_lib.layer_types(m)))
  return ModelSpec(layers, config_lib.layer_plan(m))
