"""Gated MLA: shapes, dtypes, the formula (docs/design.md, gated MLA), absorbed decode == full forward, documents."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.mla import GatedMLA
from k3jax.numerics import rel_err
from model_testing import (T, T0, abstract, chunk_lengths, decode, decode_rows, forward, normal, prefill,
                           prefill_chunk, random_module, segments, small_config)

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


def _prefill_in_chunks(layer, x, chunk, lengths=None, max_len=None):
  """Outputs and cache after `x` fed `chunk` tokens at a time from an empty cache (row b's first lengths[b] valid)."""
  B, L = x.shape[:2]
  lengths = [L] * B if lengths is None else lengths
  cache, ys = layer.init_cache(B, max_len or L), []
  for start in range(0, L, chunk):
    n = chunk_lengths(lengths, start, chunk)
    y, cache = prefill_chunk(layer, x[:, start:start + chunk], cache, jnp.minimum(start, jnp.asarray(lengths)), n)
    ys.append(y)
  return jnp.concatenate(ys, axis=1), cache


@pytest.mark.parametrize("chunk", [4, 5, T])
def test_chunked_prefill_equals_one_prefill(layer, chunk):
  x = normal(5, (2, T, 32))
  y_ref, cache_ref = prefill(layer, x, T + 2)
  y, cache = _prefill_in_chunks(layer, x, chunk, max_len=T + 2)
  assert rel_err(y, y_ref) < TOL
  np.testing.assert_allclose(cache.ckv_BLR, cache_ref.ckv_BLR, rtol=1e-6, atol=1e-6)


def test_rows_of_different_lengths_equal_each_row_alone_and_decode_at_their_own_positions(layer):
  """Rows of 3, 7 and 12 tokens in chunks of 5 (garbage past each row's end): each row's outputs and latents are
  those of the row alone; then two tokens per row decoded at the rows' own positions equal the full forward."""
  lengths = [3, 7, T]
  x = normal(6, (3, T + 2, 32))
  y, cache = _prefill_in_chunks(layer, x[:, :T], 5, lengths, max_len=T + 2)
  for b, n in enumerate(lengths):
    y_ref, cache_ref = prefill(layer, x[b:b + 1, :n], n)
    assert rel_err(y[b, :n], y_ref[0]) < TOL, b
    np.testing.assert_allclose(cache.ckv_BLR[b, :n], cache_ref.ckv_BLR[0], rtol=1e-6, atol=1e-6)
  pos = jnp.asarray(lengths)
  for step in range(2):
    y1, cache = decode_rows(layer, jnp.stack([x[b, n + step] for b, n in enumerate(lengths)])[:, None], cache,
                            pos + step)
    for b, n in enumerate(lengths):
      full = forward(layer, x[b:b + 1, :n + step + 1], None)
      assert rel_err(y1[b, 0], full[0, n + step]) < TOL, (b, step)


def test_decode_rows_at_a_shared_position_equals_decode(layer):
  x = normal(7, (2, T, 32))
  _, cache = prefill(layer, x[:, :T0], T)
  y, c = decode(layer, x[:, T0:T0 + 1], cache, T0)
  y_rows, c_rows = decode_rows(layer, x[:, T0:T0 + 1], cache, jnp.full((2,), T0, jnp.int32))
  assert rel_err(y_rows, y) < TOL
  np.testing.assert_array_equal(c_rows.ckv_BLR, c.ckv_BLR)


def test_prefill_chunk_rejects_writes_past_the_cache(layer):
  cache = layer.init_cache(1, 8)
  with pytest.raises(ValueError, match="the cache holds 8 positions"):
    layer.prefill_chunk(normal(8, (1, 4, 32)), cache, jnp.asarray([6]), jnp.asarray([4]))
  with pytest.raises(ValueError, match="need 0 <= lengths <= T=4"):
    layer.prefill_chunk(normal(8, (1, 4, 32)), cache, jnp.asarray([0]), jnp.asarray([5]))


def test_decode_with_the_pallas_kernel_equals_the_xla_path():
  """mla.decode_impl = "pallas" (interpret mode here) decodes like "xla" at per-row positions (R = 16, L = 20)."""
  layers = {impl: random_module(lambda rngs: GatedMLA(small_config(**{"mla.decode_impl": impl}), rngs=rngs), seed=2)
            for impl in ("xla", "pallas")}
  x = normal(9, (2, 1, 32))
  cache = layers["xla"].init_cache(2, 20)
  cache = type(cache)(normal(10, cache.ckv_BLR.shape))
  pos = jnp.asarray([3, 17], jnp.int32)
  (y_x, c_x), (y_p, c_p) = (decode_rows(layers[i], x, cache, pos) for i in ("xla", "pallas"))
  assert rel_err(y_p, y_x) < TOL
  np.testing.assert_array_equal(c_p.ckv_BLR, c_x.ckv_BLR)
