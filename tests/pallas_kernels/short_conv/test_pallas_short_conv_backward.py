"""The short conv's backward kernel: shapes and tilings it does not take are refused before anything runs, and it
lowers through Pallas's Triton lowering at small's shapes (q, k and v of 768 channels each, bf16, with documents) in
each of its forms (`Blocks.dpre`). Its values: tests/ops/test_ops_short_conv.py (interpreted here; tests/gpu on the
GPU through the KDA layer's step)."""
import re

import jax
import jax.numpy as jnp
import pytest

from k3jax.ops.short_conv import short_conv
from pallas_kernels import short_conv as conv_kernels
from pallas_testing import cuda_module_text, primitive_calls, use_short_conv_blocks


def test_shapes_it_does_not_take_are_refused():
  W, T = 4, 40                                            # T not a multiple of 8 rows x 16 programs
  x, state, dy, w = jnp.zeros((1, T, 128)), jnp.zeros((1, W - 1, 128)), jnp.zeros((1, T, 128)), jnp.zeros((W, 128))
  with pytest.raises(ValueError, match="multiple of 128"):
    conv_kernels.dx_and_dw(x, state, (dy,), w)
  assert not conv_kernels.applies(64, (128, 96)) and conv_kernels.applies(4096, (768, 768, 768))
  with pytest.raises(ValueError, match="dpre must be one of"):
    conv_kernels.Blocks(dpre="cached")
  for dpre in conv_kernels.DPRE_FORMS:   # a block's shifted rows reach one block back at most
    with pytest.raises(ValueError, match="at least W−1"):
      conv_kernels.dx_and_dw(x, state, (dy,), w, blocks=conv_kernels.Blocks(rows=2, splits=4, dpre=dpre))
  with pytest.raises(ValueError, match=r"state as \[B, W−1, C\]"):
    conv_kernels.dx_and_dw(x, jnp.zeros((1, W, 128)), (dy,), w, blocks=conv_kernels.Blocks(rows=8, splits=5))


@pytest.mark.parametrize("dpre", conv_kernels.DPRE_FORMS)
def test_lowers_to_triton_for_the_gpu_at_small_s_shapes_once_for_two_layers(monkeypatch, dpre):
  use_short_conv_blocks(monkeypatch, conv_kernels.Blocks(dpre=dpre))   # the op's kernel backward in this form
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
  # Its operands are x itself and a small head, not x with the state's rows before it (a copy of all of x).
  call = next(line for line in text.splitlines() if 'name = "short_conv_backward"' in line)
  operands = re.search(r" : \((.*?)\) ->", call).group(1)
  assert f"tensor<{B}x{T}x{C}xbf16>" in operands and f"tensor<{B}x{T + 3}x{C}xbf16>" not in operands
  # The stored form orders its scratch's writes before its reads with a CTA barrier (here, lowering for the GPU).
  assert (primitive_calls(jax.make_jaxpr(grads)(*args), "debug_barrier_p") > 0) == (dpre == "stored")
