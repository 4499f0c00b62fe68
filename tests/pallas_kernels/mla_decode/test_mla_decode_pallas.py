"""The split-K MLA decode kernel (interpret mode here) against its plain-JAX reference: fresh random inputs, odd
cache lengths, per-row lengths down to 1, splits that leave parts empty, fp32 exactly and bf16 within the XLA
path's rounding; and it lowers through Pallas's Triton lowering for the GPU."""
import jax
import jax.numpy as jnp
import pytest

from k3jax.numerics import rel_err
from k3jax.ops.mla import decode_attention_xla
from pallas_testing import cuda_module_text, kernel_products
from pallas_kernels.mla_decode import DecodeConfig, mla_decode, mla_decode_reference


def _inputs(seed, B, H, R, L, dtype=jnp.float32):
  kq, kc = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(kq, (B, H, R), dtype), jax.random.normal(kc, (B, L, R), dtype)


@pytest.mark.parametrize("config", [DecodeConfig(block_l=16, num_splits=3), DecodeConfig(block_l=32, num_splits=1),
                                    DecodeConfig(block_l=16, num_splits=8), None])
def test_kernel_matches_reference_in_fp32_with_per_row_lengths(config):
  """L = 53 (no block divides it: the last block is shifted back), rows of 1, 29 and 53 latents; with 8 parts of
  16 the 29-latent row leaves parts empty."""
  q, ckv = _inputs(0, 3, 6, 32, 53)
  lengths = jnp.asarray([1, 29, 53], jnp.int32)
  got = mla_decode(q, ckv, lengths, scale=0.2, config=config)
  assert got.shape == (3, 6, 32) and got.dtype == jnp.float32
  assert rel_err(got, mla_decode_reference(q, ckv, lengths, scale=0.2)) < 1e-5


def test_heads_in_several_blocks():
  """20 heads in blocks of 16: the second block is mostly padding, which must not leak into the output."""
  q, ckv = _inputs(3, 2, 20, 16, 37)
  lengths = jnp.asarray([37, 5], jnp.int32)
  got = mla_decode(q, ckv, lengths, scale=0.3, config=DecodeConfig(block_l=16, block_h=16, num_splits=2))
  assert rel_err(got, mla_decode_reference(q, ckv, lengths, scale=0.3)) < 1e-5


def test_kernel_in_bf16_is_within_the_xla_paths_rounding():
  """bf16 q̃ and cache: both the kernel and XLA's einsums round the probabilities to bf16 for the second product;
  against the fp32 reference on the same inputs the kernel's error is that of the XLA path (and ~2^-9)."""
  q, ckv = _inputs(1, 2, 4, 64, 97, jnp.bfloat16)
  lengths = jnp.asarray([97, 40], jnp.int32)
  ref = mla_decode_reference(q, ckv, lengths, scale=64 ** -0.5)
  got = mla_decode(q, ckv, lengths, scale=64 ** -0.5, config=DecodeConfig(block_l=16, num_splits=2))
  xla = decode_attention_xla(q, ckv, lengths, scale=64 ** -0.5)
  assert got.dtype == jnp.bfloat16
  err, err_xla = rel_err(got, ref), rel_err(xla, ref)
  assert err < 4e-3 and err < 1.5 * err_xla + 1e-4, (err, err_xla)


def test_bad_inputs_raise_before_any_compute():
  q, ckv = _inputs(2, 1, 2, 32, 20)
  ok = jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match="power of two"):
    mla_decode(q[..., :24], ckv[..., :24], ok, scale=1.0)
  with pytest.raises(ValueError, match="at least 16 positions"):
    mla_decode(q, ckv[:, :8], ok, scale=1.0)
  with pytest.raises(ValueError, match="integer array"):
    mla_decode(q, ckv, jnp.ones((1,)), scale=1.0)
  with pytest.raises(ValueError, match="block_l must be a power of two"):
    mla_decode(q, ckv, ok, scale=1.0, config=DecodeConfig(block_l=24))
  with pytest.raises(ValueError, match="block_h must be a power of two"):
    mla_decode(q, ckv, ok, scale=1.0, config=DecodeConfig(block_h=8))


def test_kernel_lowers_to_triton_for_the_gpu(monkeypatch):
  """Through Pallas's Triton lowering (not interpret mode) for a GPU described as an H200, at R = 512 (K3's), 64 heads
  (four head blocks) and an odd L."""
  args = (jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, 1001, 512), jnp.bfloat16),
          jax.ShapeDtypeStruct((2,), jnp.int32))
  text = cuda_module_text(monkeypatch, lambda q, c, n: mla_decode(q, c, n, scale=0.1), *args)
  assert 'name = "mla_decode_split"' in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp32_products_are_three_tf32_products_on_the_gpu(monkeypatch, dtype):
  """As lowered for the GPU, fp32 scores and values are 3xTF32 products (not Triton's IEEE fp32 FMA loop, nor tf32's
  1e-3); bf16 ones take the tensor cores as they are."""
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0")
  q, ckv = jnp.zeros((1, 16, 64), dtype), jnp.zeros((1, 100, 64), dtype)
  products = kernel_products(jax.make_jaxpr(lambda q, c, n: mla_decode(q, c, n, scale=0.1))(q, ckv, jnp.ones((1,),
                                                                                                     jnp.int32)))
  exact = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if dtype == jnp.float32 else None
  assert {precision for _, _, precision in products} == {exact}, products
