"""Gated MLA: shapes, dtypes, the formula (docs/design.md, gated MLA), absorbed decode == full forward, documents."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.mla import GatedMLA
from kda_testing import rel_err
from model_testing import T, T0, abstract, decode, forward, normal, prefill, random_module, segments, small_config

TOL = 1e-5


@pytest.fixture(scope="module")
def layer():
  return random_module(lambda rngs: GatedMLA(small_config(), rngs=rngs))


def _reference(layer, x, seg):
  """The formula (docs/design.md, gated MLA) in float64 NumPy from the layer's parameters."""
  p = lambda v: np.asarray(v[...], np.float64)
  rms = lambda a, w: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6) * w
  x = np.asarray(x, np.float64)
  H, Dqk, Dv = layer.H, layer.Dqk, layer.Dv
  if layer.w_dq is None:
    q = x @ p(layer.w_uq.w)
  else:
    q = rms(x @ p(layer.w_dq.w), p(layer.q_norm.weight)) @ p(layer.w_uq.w)
  q = q.reshape(*x.shape[:2], H, Dqk)
  c = rms(x @ p(layer.w_dkv.w), p(layer.kv_norm.weight))
  k, v = np.einsum("btr,rhd->bthd", c, p(layer.w_uk)), np.einsum("btr,rhd->bthd", c, p(layer.w_uv))
  s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(Dqk)
  seg = np.asarray(seg)
  allowed = np.tril(np.ones((x.shape[1],) * 2, bool)) & (seg[:, :, None] == seg[:, None, :])
  s = np.where(allowed[:, None], s, -np.inf)
  a = np.exp(s - s.max(-1, keepdims=True))
  a = a / a.sum(-1, keepdims=True)
  o = np.einsum("bhij,bjhd->bihd", a, v).reshape(*x.shape[:2], H * Dv)
  gate = 1 / (1 + np.exp(-(x @ p(layer.w_g.w))))
  return (gate * o) @ p(layer.w_o.w)


def test_shapes_and_dtypes_bf16():
  cfg = small_config(dtype="bfloat16", **{"mla.q_lora_rank": 8})
  make = lambda rngs: GatedMLA(cfg, rngs=rngs)
  x = jax.ShapeDtypeStruct((2, T, cfg.d_model), jnp.float32)
  y, cache = abstract(make, lambda l, x: l.prefill(x, T + 4), x)
  chex.assert_shape([y, cache.ckv_BLR], [(2, T, cfg.d_model), (2, T + 4, cfg.mla.kv_lora_rank)])
  chex.assert_type([y, cache.ckv_BLR], [jnp.bfloat16, jnp.bfloat16])
  x1 = jax.ShapeDtypeStruct((2, 1, cfg.d_model), jnp.float32)
  y1, cache1 = abstract(make, lambda l, x: l.decode(x, l.init_cache(2, T), 3), x1)
  chex.assert_shape([y1, cache1.ckv_BLR], [(2, 1, cfg.d_model), (2, T, cfg.mla.kv_lora_rank)])
  chex.assert_type(y1, jnp.bfloat16)


def test_packed_forward_matches_formula_and_documents_run_alone(layer):
  x = normal(1, (2, T, 32))
  seg = segments(2, (T0, T - T0))
  packed = forward(layer, x, seg)
  assert rel_err(packed, _reference(layer, x, seg)) < TOL
  assert rel_err(packed[:, :T0], prefill(layer, x[:, :T0], T)[0]) < TOL
  assert rel_err(packed[:, T0:], prefill(layer, x[:, T0:], T)[0]) < TOL


def test_decode_matches_full_forward(layer):
  x = normal(2, (2, T, 32))
  full = forward(layer, x, None)
  assert rel_err(full, _reference(layer, x, jnp.zeros((2, T), jnp.int32))) < TOL
  y0, cache = prefill(layer, x[:, :T0], T)
  assert rel_err(y0, full[:, :T0]) < TOL
  for t in range(T0, T):
    y, cache = decode(layer, x[:, t:t + 1], cache, t)
    assert rel_err(y[:, 0], full[:, t]) < TOL, t


def test_q_lora_variant_decodes_like_its_full_forward():
  cfg = small_config(**{"mla.q_lora_rank": 8, "mla.qk_head_dim": 24, "mla.v_head_dim": 8})
  layer = random_module(lambda rngs: GatedMLA(cfg, rngs=rngs), seed=1)
  chex.assert_shape([layer.w_dq.w[...], layer.w_uq.w[...], layer.w_uk[...], layer.w_uv[...]],
                    [(32, 8), (8, 2 * 24), (16, 2, 24), (16, 2, 8)])
  x = normal(3, (2, T, 32))
  full = forward(layer, x, None)
  assert rel_err(full, _reference(layer, x, jnp.zeros((2, T), jnp.int32))) < TOL
  cache = layer.init_cache(2, T)
  for t in range(T):
    y, cache = decode(layer, x[:, t:t + 1], cache, t)
    assert rel_err(y[:, 0], full[:, t]) < TOL, t


def test_prefill_rejects_a_cache_shorter_than_the_prompt(layer):
  with pytest.raises(ValueError, match="max_len=4 is shorter than the prompt"):
    layer.prefill(normal(4, (1, 6, 32)), 4)
