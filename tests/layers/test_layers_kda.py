"""KDA layer: shapes and dtypes, decode == full forward, packed documents, the short conv's backward setting (the
conv itself: tests/ops/test_ops_short_conv.py)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers.kda import KDALayer
from k3jax.ops.kda import kda_gate
from k3jax.numerics import rel_err
from model_testing import (T, T0, abstract, chunk_lengths, decode, forward, normal, prefill, prefill_chunk,
                           random_module, segments, small_config)

TOL = 1e-5


@pytest.fixture(scope="module")
def layer():
  return random_module(lambda rngs: KDALayer(small_config(), rngs=rngs))


def test_shapes_and_dtypes_bf16():
  cfg = small_config(dtype="bfloat16")
  H, K, C = cfg.kda.num_heads, cfg.d_model // cfg.kda.num_heads, 3 * cfg.d_model
  x = jax.ShapeDtypeStruct((2, T, cfg.d_model), jnp.float32)
  make = lambda rngs: KDALayer(cfg, rngs=rngs)
  y, cache = abstract(make, lambda l, x: l.prefill(x), x)
  chex.assert_shape(y, (2, T, cfg.d_model))
  chex.assert_type(y, jnp.bfloat16)
  chex.assert_shape([cache.conv_BWC, cache.state_BHKV], [(2, cfg.kda.conv_size - 1, C), (2, H, K, K)])
  chex.assert_type([cache.conv_BWC, cache.state_BHKV], [jnp.bfloat16, jnp.float32])
  x1 = jax.ShapeDtypeStruct((2, 1, cfg.d_model), jnp.float32)
  y1, _ = abstract(make, lambda l, x: l.decode(x, l.init_cache(2)), x1)
  chex.assert_shape(y1, (2, 1, cfg.d_model))
  chex.assert_type(y1, jnp.bfloat16)


def test_decode_matches_full_forward(layer):
  x = normal(5, (2, T, layer.w_o.w.shape[1]))
  full = forward(layer, x, None)
  y0, cache = prefill(layer, x[:, :T0], T)
  assert rel_err(y0, full[:, :T0]) < TOL
  for t in range(T0, T):
    y, cache = decode(layer, x[:, t:t + 1], cache, t)
    assert rel_err(y[:, 0], full[:, t]) < TOL, t


def test_softplus_low_rank_variant_decodes_like_its_full_forward():
  cfg = small_config(**{"kda.gate": "softplus", "kda.gate_rank": 8})
  layer = random_module(lambda rngs: KDALayer(cfg, rngs=rngs), seed=1)
  chex.assert_shape([layer.w_f.w[...], layer.w_f.w_b[...]], [(cfg.d_model, 8), (8, cfg.d_model)])
  chex.assert_shape([layer.w_g.w[...], layer.w_g.w_b[...]], [(cfg.d_model, 8), (8, cfg.d_model)])
  assert layer.lower_bound is None
  x = normal(6, (2, T, cfg.d_model))
  full = forward(layer, x, None)
  cache = layer.init_cache(2)
  for t in range(T):
    y, cache = decode(layer, x[:, t:t + 1], cache, t)
    assert rel_err(y[:, 0], full[:, t]) < TOL, t


def test_packed_sequence_equals_documents_run_alone(layer):
  x = normal(7, (2, T, layer.w_o.w.shape[1]))
  packed = forward(layer, x, segments(2, (T0, T - T0)))
  assert rel_err(packed[:, :T0], prefill(layer, x[:, :T0], T)[0]) < TOL
  assert rel_err(packed[:, T0:], prefill(layer, x[:, T0:], T)[0]) < TOL


def test_init_follows_documented_ranges():
  """Both gates start at decays −A·dt with A in [1, 16], dt in [1e-3, 1e-1] (the bounded one capped at γ_min/2)."""
  for gate in ("bounded", "softplus"):
    cfg = small_config()
    cfg.kda.gate = gate
    layer = KDALayer(cfg, rngs=nnx.Rngs(0))
    A = np.exp(np.asarray(layer.A_log[...], np.float64))
    assert np.all((A >= 1.0) & (A <= 16.0))
    zero = jnp.zeros((1, 1, *layer.dt_bias[...].shape))
    g0 = -np.asarray(kda_gate(zero, layer.A_log[...], layer.dt_bias[...], lower_bound=layer.lower_bound), np.float64)
    dt = g0[0, 0] / A[:, None]
    hi = 1e-1 if gate == "softplus" else np.minimum(1e-1, 2.5 / A[:, None])
    assert np.all((dt >= 1e-3 * (1 - 1e-4)) & (dt <= hi * (1 + 1e-4))), gate


def _prefill_in_chunks(layer, x, chunk, lengths=None):
  """Row outputs and the cache after `x` fed `chunk` tokens at a time (each row's first `lengths[b]` valid)."""
  B, L = x.shape[:2]
  lengths = [L] * B if lengths is None else lengths
  cache, ys = layer.init_cache(B), []
  for start in range(0, L, chunk):
    y, cache = prefill_chunk(layer, x[:, start:start + chunk], cache, jnp.minimum(start, jnp.asarray(lengths)),
                             chunk_lengths(lengths, start, chunk))
    ys.append(y)
  return jnp.concatenate(ys, axis=1), cache


@pytest.mark.parametrize("chunk", [4, 5, T])
def test_chunked_prefill_equals_one_prefill(layer, chunk):
  x = normal(8, (2, T, layer.w_o.w.shape[1]))
  y_ref, cache_ref = prefill(layer, x, T)
  y, cache = _prefill_in_chunks(layer, x, chunk)
  assert rel_err(y, y_ref) < TOL
  assert rel_err(cache.state_BHKV, cache_ref.state_BHKV) < TOL
  np.testing.assert_array_equal(cache.conv_BWC, cache_ref.conv_BWC)


def test_rows_of_different_lengths_equal_each_row_alone_and_decode_on(layer):
  """Rows of 3, 7 and 12 tokens in chunks of 5 (garbage, not zeros, past each row's end): each row's outputs and
  cache are those of the row run alone, and the next token decoded from there is the full forward's."""
  lengths = [3, 7, T]
  x = normal(9, (3, T + 1, layer.w_o.w.shape[1]))
  y, cache = _prefill_in_chunks(layer, x[:, :T], 5, lengths)
  for b, n in enumerate(lengths):
    y_ref, cache_ref = prefill(layer, x[b:b + 1, :n], n)
    assert rel_err(y[b, :n], y_ref[0]) < TOL, b
    assert rel_err(cache.state_BHKV[b], cache_ref.state_BHKV[0]) < TOL, b
    np.testing.assert_array_equal(cache.conv_BWC[b], cache_ref.conv_BWC[0])
  nxt = jnp.stack([x[b, n] for b, n in enumerate(lengths)])[:, None]
  y1, _ = decode(layer, nxt, cache, None)
  for b, n in enumerate(lengths):
    full = forward(layer, x[b:b + 1, :n + 1], None)
    assert rel_err(y1[b, 0], full[0, n]) < TOL, b


def test_keep_rows_takes_the_new_cache_only_where_active(layer):
  old, new = layer.init_cache(2), layer.init_cache(2)
  new = type(new)(new.conv_BWC + 1, new.state_BHKV + 2)
  kept = old.keep_rows(new, jnp.asarray([True, False]))
  np.testing.assert_array_equal(kept.state_BHKV[0], new.state_BHKV[0])
  np.testing.assert_array_equal(kept.state_BHKV[1], old.state_BHKV[1])
  np.testing.assert_array_equal(kept.conv_BWC[1], old.conv_BWC[1])


@pytest.mark.parametrize("conv_backward", ["fused", "kernel", "auto"])
def test_the_conv_backward_setting_reaches_the_short_conv(conv_backward):
  """`kda.conv_backward` picks how the layer's short conv runs its backward pass (the op's tests check its values;
  "auto" is the kernel on a GPU only, and this is a CPU): q, k and v of 128 channels each and T = 128 are shapes the
  kernel takes."""
  cfg = small_config(**{"d_model": 128, "kda.num_heads": 1, "kda.conv_backward": conv_backward})
  graphdef, params, rest = nnx.split(random_module(lambda rngs: KDALayer(cfg, rngs=rngs)), nnx.Param, ...)
  x = jax.ShapeDtypeStruct((1, 128, cfg.d_model), jnp.float32)
  loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x)[0])
  program = str(jax.make_jaxpr(jax.grad(loss))(params, x))
  assert ("short_conv_backward" in program) == (conv_backward == "kernel")
