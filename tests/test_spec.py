"""k3jax/spec.py: the model's structure derived once from its config (mixers, FFN kinds, AttnRes closes, scan plan),
and the model built from it."""
import pytest
from flax import nnx

from experiments import configs
from k3jax import config as config_lib
from k3jax.model import K3Model
from k3jax.spec import model_spec


def test_k3_full_spec_per_layer():
  """93 layers, 69 KDA and 24 MLA ending in MLA, MoE from layer 1, a block closing after every 12th FFN, the
  scanned groups of the config's plan."""
  m = configs.load("k3_full").model
  spec = model_spec(m)
  assert (len(spec.layers), spec.count("kda"), spec.count("mla"), spec.mixers[-1]) == (93, 69, 24, "mla")
  assert spec.moe_layers == tuple(range(1, 93))
  assert [i for i, c in enumerate(spec.closes) if c[1]] == list(range(11, 93, 12))
  assert not any(c[0] for c in spec.closes)
  assert spec.plan == config_lib.layer_plan(m)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_model_is_built_from_the_spec(scan_layers):
  m = configs.load("small").model
  m.scan_layers = scan_layers
  spec, model = model_spec(m), nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0)))
  assert (model.plan, model.closes, model.moe_ids) == (spec.plan, spec.closes, spec.moe_layers)
  assert model.plan.num_groups == (2 if scan_layers else 0)
  kinds = {i: (layer.kind, layer.uses_moe) for i, layer in zip(model.plan.unrolled, model.layers)}
  kinds.update({i: (g.kind, g.uses_moe) for j, g in enumerate(model.groups or ()) for i in model.plan.position(j)})
  assert [kinds[i] for i in range(len(spec.layers))] == [(x.mixer, x.moe) for x in spec.layers]


def test_a_bad_config_is_refused_before_anything_is_derived():
  m = configs.load("tiny").model
  m.layer_pattern = ("kda", "gdn")
  with pytest.raises(ValueError, match="unknown layer type 'gdn'"):
    model_spec(m)
