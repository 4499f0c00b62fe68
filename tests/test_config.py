"""Config validation (clear errors naming the field), the layer layout of the experiment configs, and locking:
Python-side configs reject unknown fields as the command line does."""
import ml_collections
import pytest

from experiments import configs
from k3jax import config as config_lib
from k3jax.layers import moe
from model_testing import small_config


@pytest.mark.parametrize("changes,match", [
    ({"kda.num_heads": 5}, r"model.kda.num_heads=5 does not divide model.d_model=32"),
    ({"mla.num_heads": 3}, r"model.mla.num_heads=3 does not divide model.d_model=32"),
    ({"layer_pattern": ("kda", "gla")}, r"unknown layer type 'gla'"),
    ({"layer_pattern": ()}, r"model.layer_pattern must be a non-empty tuple"),
    ({"last_layer": "attention"}, r"model.last_layer must be one of"),
    ({"moe.enabled": True, "moe.latent_dim": None}, r"model.moe.latent_dim must be set"),
    ({"moe.enabled": True, "moe.latent_dim": 8, "moe.top_k": 9}, r"model.moe.top_k=9 exceeds"),
    ({"residual.mode": "hyper"}, r"model.residual.mode must be one of"),
    ({"residual.block_size": 0}, r"model.residual.block_size must be a positive int"),
    ({"residual.backward": "fast"}, r"model.residual.backward must be one of"),
    ({"residual.source_dtype": "float16"}, r"model.residual.source_dtype must be one of"),
    ({"kda.gate": "relu"}, r"model.kda.gate must be one of"),
    ({"kda.lower_bound": 1.0}, r"model.kda.lower_bound must be negative"),
    ({"mla.kv_lora_rank": None}, r"model.mla.kv_lora_rank must be a positive int"),
    ({"dtype": "float8"}, r"model.dtype must be one of"),
])
def test_bad_config_raises_a_clear_value_error(changes, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate(small_config(**changes))


@pytest.mark.parametrize("changes,match", [
    ({"moe.expert_hidden": None}, r"moe.expert_hidden must be set"),
    ({"moe.num_shared_experts": None}, r"moe.num_shared_experts must be an int >= 0"),
    ({"moe.balancer": "loss_free"}, r"moe.balancer must be one of"),
    ({"moe.balancer_method": "median"}, r"moe.balancer_method must be one of"),
    ({"moe.correction_step": 0.0}, r"moe.correction_step must be a number > 0"),
    ({"moe.load_unit": -1.0}, r"moe.load_unit must be a number > 0"),
])
def test_the_moe_layer_and_the_model_config_raise_the_same_error(changes, match):
  cfg = small_config(**{"moe.enabled": True, "moe.latent_dim": 8, **changes})
  with pytest.raises(ValueError, match="model." + match) as from_model:
    config_lib.validate(cfg)
  with pytest.raises(ValueError, match=match) as from_layer:
    moe.check_config(cfg.d_model, cfg.moe)
  assert str(from_model.value) == "model." + str(from_layer.value)


def test_explicit_head_dim_allows_heads_that_do_not_divide_the_width():
  cfg = small_config(**{"kda.num_heads": 5, "kda.head_dim": 16, "mla.num_heads": 3, "mla.qk_head_dim": 8})
  config_lib.validate(cfg)
  assert config_lib.kda_head_dim(cfg) == 16 and config_lib.mla_head_dims(cfg) == (8, 8)


def test_missing_field_is_named():
  cfg = small_config()
  with cfg.unlocked():
    del cfg.mla["q_lora_rank"]
  with pytest.raises(ValueError, match=r"model.mla.q_lora_rank is missing"):
    config_lib.validate(cfg)


def test_k3_layer_layout_is_69_kda_and_24_mla_ending_in_mla():
  m = configs.load("k3_full").model
  config_lib.validate(m)
  types = config_lib.layer_types(m)
  assert (len(types), types.count("kda"), types.count("mla"), types[-1]) == (93, 69, 24, "mla")
  assert types[:4] == ("kda", "kda", "kda", "mla")
  assert [config_lib.uses_moe(m, i) for i in (0, 1, 92)] == [False, True, True]


@pytest.mark.parametrize("name", ["tiny", "small", "k3_full"])
def test_experiment_configs_validate(name):
  cfg = configs.load(name)
  config_lib.validate(cfg.model)
  assert cfg.model.moe.enabled


def _plan(name, **changes):
  m = configs.load(name).model
  for field, value in changes.items():
    m[field] = value
  lp = config_lib.layer_plan(m)
  return lp, config_lib.layer_types(m), [config_lib.uses_moe(m, i) for i in range(m.num_layers)]


def test_layer_plan_scans_the_repeating_group_and_unrolls_the_rest():
  # small scanned (it runs unrolled by default): layer 0 dense, then (kda, kda, kda, mla) with MoE; the remainder 1-3
  # goes in front so that the group reads as the pattern. k3_full: the forced MLA last layer breaks the pattern and
  # stays unrolled too.
  for name, unrolled, groups in (("tiny", (0, 1, 2, 3), 0), ("small", (0, 1, 2, 3), 2),
                                 ("k3_full", (0, 1, 2, 3, 92), 22)):
    lp, types, moe = _plan(name, scan_layers=True)
    assert (lp.unrolled, lp.num_groups) == (unrolled, groups), name
    if groups:
      assert (lp.start, lp.group_size, lp.end) == (4, 4, 4 + 4 * groups)
      assert tuple(types[i] for i in range(4, 8)) == ("kda", "kda", "kda", "mla")
      assert sorted(lp.unrolled + sum((lp.position(j) for j in range(4)), ())) == list(range(len(types)))
      assert lp.position(3) == tuple(4 + 4 * g + 3 for g in range(groups))
  # Ten tiny layers: the group starts right after the dense layer (rotated: kda, kda, mla, kda), as two groups fit
  # only there; the forced MLA last layer stays outside.
  lp, types, moe = _plan("tiny", num_layers=10)
  assert (lp.unrolled, lp.start, lp.num_groups) == ((0, 9), 1, 2)
  for j in range(4):
    assert len({(types[i], moe[i]) for i in lp.position(j)}) == 1
  assert [types[i] for i in range(1, 5)] == ["kda", "kda", "mla", "kda"]


def test_layer_plan_needs_two_groups_and_can_be_turned_off():
  assert _plan("k3_full", scan_layers=False)[0].unrolled == tuple(range(93))
  assert _plan("k3_full", scan_layers=False)[0].num_groups == 0
  lp, _, _ = _plan("small", scan_layers=True, num_layers=8)   # 0 dense, 1-7: one group and a remainder
  assert (lp.unrolled, lp.num_groups) == (tuple(range(8)), 0)
  lp, _, _ = _plan("small", scan_layers=True, layer_pattern=("mla",), last_layer="mla")   # one layer, eleven times
  assert (lp.unrolled, lp.start, lp.group_size, lp.num_groups) == ((0,), 1, 1, 11)


@pytest.mark.parametrize("field,value,match", [
    ("remat", True, "True is today's 'full'"), ("remat", "kda", "model.remat must be one of"),
    ("remat_unrolled", "kda", r"model.remat_unrolled must be None \(as model.remat\) or one of"),
    ("remat_unrolled", False, "model.remat_unrolled must be None")])
def test_remat_policies_are_names(field, value, match):
  # A bool arrives from the config.json of a run made before the policies had names.
  cfg = ml_collections.ConfigDict(dict(small_config().to_dict(), **{field: value}))
  with pytest.raises(ValueError, match=match):
    config_lib.validate(cfg)


@pytest.mark.parametrize("name", ["tiny", "small", "k3_full"])
def test_experiment_configs_reject_unknown_fields_from_python(name):
  c = configs.load(name)
  with pytest.raises(AttributeError):
    c.stpes = 5
  with pytest.raises(AttributeError):
    c.model.d_modle = 32
  with pytest.raises(AttributeError):
    c.optimizer.lr_peak = 1e-3
  c.steps, c.model.d_model = 5, 32          # known fields still change
  with c.unlocked():                         # and a new one can be added deliberately
    c.note = "ablation"
  assert (c.steps, c.model.d_model, c.note) == (5, 32, "ablation")


def test_model_config_rejects_unknown_fields():
  m = config_lib.model_config()
  with pytest.raises(AttributeError):
    m.kda.num_haeds = 4


def test_unread_moe_fields_are_other_balancers_settings_or_everything_with_the_moe_off():
  moe = dict(config_lib.model_config().moe, latent_dim=32)
  on = lambda **kw: dict(moe, enabled=True, **kw)
  article = config_lib.unread_moe_fields(on(balancer="quantile", balancer_method="article"))
  assert {"sign_update_rate", "aux_loss_coef", "balancer_eta"} <= article
  assert not article & {"correction_step", "load_decay", "correction_bound", "load_unit", "num_experts",
                       "balancer_method"}
  sign = config_lib.unread_moe_fields(on(balancer="sign"))
  assert {"correction_step", "balancer_eta", "aux_loss_coef", "balancer_method"} <= sign
  assert "sign_update_rate" not in sign
  assert config_lib.unread_moe_fields(on(balancer="quantile", balancer_method="exact")) >= {"correction_step"}
  assert "balancer_eta" not in config_lib.unread_moe_fields(on(balancer="quantile", balancer_method="exact"))
  assert config_lib.unread_moe_fields(dict(moe, enabled=False)) == set(moe) - {"enabled"}
