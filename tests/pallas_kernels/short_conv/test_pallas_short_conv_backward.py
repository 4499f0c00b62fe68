"""The short conv's backward kernel: shapes it does not take are refused before anything runs, and it lowers
through Pallas's Triton lowering at small's shapes (q, k and v of 768 channels each, bf16, with documents). Its
values: tests/ops/test_ops_short_conv.py (interpreted here; tests/gpu on the GPU through the KDA layer's step)."""
import jax
import jax.numpy as jnp
import pytest

from k3jax.ops.short_conv import short_conv
from pallas_kernels import short_conv as conv_kernels
from pallas_testing import cuda_module_text


def test_shapes_it_does_not_take_are_refused():
  W, T = 4, 40                                            # T not a multiple of 8 rows x 16 programs
  xp = jnp.zeros((1, T + W - 1, 128))
  with pytest.raises(ValueError, match="multiple of 128"):
    conv_kernels.dx_and_dw(xp, (jnp.zeros((1, T, 128)),), jnp.zeros((W, 128)))
  assert not conv_kernels.applies(64, (128, 96)) and conv_kernels.applies(4096, (768, 768, 768))


def test_lowers_to_triton_for_the_gpu_at_small_s_shapes_once_for_two_layers(monkeypatch):
  B, T, C = 2, 256, 3 * 768
  args = (jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16), jax.ShapeDtypeStruct((4, C), jnp.float32),
          jax.ShapeDtypeStruct((B, T), jnp.int32))

  def grads(x, w, seg):
    def f(x, w):   # two layers' convs, the second on the first's output: one kernel lowered for both
      conv = lambda x, w: jnp.concatenate(short_conv(x, w, None, seg, split=(768, 1536), backward="kernel")[0], -1)
      return jnp.sum(conv(conv(x, w), 2.0 * w).astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1))(x, w)
  text = cuda_module_text(monkeypatch, grads, *args)
  assert text.count('name = "short_conv_backward"') == 1
