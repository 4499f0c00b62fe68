"""The short conv op: its output against the formula with a state and documents, every gradient against autodiff
of the formula (state, documents, the output in parts) for each backward and each form of the kernel, the kernel
taken where it applies, and the state after a call (`conv_tail`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.short_conv import conv_tail, short_conv
from model_testing import T, normal, segments
from pallas_kernels import short_conv as conv_kernels
from pallas_testing import use_short_conv_blocks

# The kernel's shapes: T a multiple of its 8 rows × 16 programs a row (here two blocks a program), parts multiples
# of its 128 channels. The gradients' documents start at 5 and n // 2 + 2: at the kernel's T, 2 rows into a
# program's, so dx at the program before's last rows masks what it reads past them.
KERNEL_T, KERNEL_SPLIT, KERNEL_C = 256, (128, 256), 384


def test_short_conv_matches_formula_with_state_and_documents():
  B, C, W = 2, 5, 4
  x, w, state = normal(2, (B, T, C)), normal(3, (W, C)), normal(4, (B, W - 1, C))
  seg = segments(B, (4, T - 4))
  y, new_state = jax.jit(short_conv)(x, w, state, seg)
  xp = np.concatenate([np.asarray(state), np.asarray(x)], axis=1)      # xp[t + W - 1] is token t
  segp = np.concatenate([np.repeat(np.asarray(seg)[:, :1], W - 1, axis=1), np.asarray(seg)], axis=1)  # the state: doc 1
  ref = np.zeros((B, T, C))
  for t in range(T):
    for j in range(W):
      ref[:, t] += np.asarray(w)[j] * xp[:, t + j] * (segp[:, t + j] == np.asarray(seg)[:, t])[:, None]
  np.testing.assert_allclose(y, ref / (1 + np.exp(-ref)), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(new_state, xp[:, -(W - 1):])


def _formula(x, w, state, seg):
  """The conv as its formula reads, tap by tap, left to autodiff (the gradients' reference)."""
  W, n = w.shape[0], x.shape[1]
  xp = jnp.concatenate([state, x], axis=1)
  segp = jnp.concatenate([jnp.repeat(seg[:, :1], W - 1, axis=1), seg], axis=1)
  pre = sum(w[j] * xp[:, j:j + n] * (segp[:, j:j + n] == seg)[..., None] for j in range(W))
  return jax.nn.silu(pre)


# (backward, T, C, split, the kernel's dpre form; None: the op's default)
CASES = {"fused, one part": ("fused", T, 9, (), None), "fused, three parts": ("fused", T, 9, (2, 7), None),
         "kernel, three parts": ("kernel", KERNEL_T, KERNEL_C, KERNEL_SPLIT, None),
         "kernel, one part": ("kernel", KERNEL_T, 128, (), None),
         "kernel with dpre recomputed, three parts": ("kernel", KERNEL_T, KERNEL_C, KERNEL_SPLIT, "recomputed"),
         "kernel's fallback (T)": ("kernel", 40, KERNEL_C, KERNEL_SPLIT, None)}


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_autodiff_of_the_formula(case, monkeypatch):
  backward, n, C, split, dpre = CASES[case]
  if dpre is not None:   # the op's kernel backward in this form, at its default tiling
    use_short_conv_blocks(monkeypatch, conv_kernels.Blocks(dpre=dpre))
  B, W = 2, 4
  x, w, state = normal(12, (B, n, C)), normal(13, (W, C)), normal(14, (B, W - 1, C))
  seg = segments(B, (5, n // 2 - 3, n - 2 - n // 2))   # three documents
  dy = normal(15, (B, n, C))

  def loss(fn):
    return lambda x, w, state: jnp.sum(fn(x, w, state) * dy)

  def ours(x, w, state):
    y, _ = short_conv(x, w, state, seg, split=split, backward=backward)
    return jnp.concatenate(y, axis=-1) if split else y
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(x, w, state)
  want = jax.grad(loss(lambda x, w, state: _formula(x, w, state, seg)), argnums=(0, 1, 2))(x, w, state)
  for name, g, r in zip(("x", "w", "state"), got, want):
    assert float(jnp.max(jnp.abs(r))) > 0.1, name
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-4, err_msg=name)
  if split:
    parts, _ = short_conv(x, w, state, seg, split=split, backward=backward)
    assert [p.shape[-1] for p in parts] == np.diff((0, *split, C)).tolist()


@pytest.mark.parametrize("n", [KERNEL_T, 40])
def test_the_kernel_backward_is_taken_where_it_applies(n):
  x, w = normal(1, (1, n, KERNEL_C)), normal(2, (4, KERNEL_C))

  def program(backward):
    f = lambda x, w: sum(jnp.sum(p) for p in short_conv(x, w, split=KERNEL_SPLIT, backward=backward)[0])
    return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
  assert ("short_conv_backward" in program("kernel")) == (n == KERNEL_T)
  assert "short_conv_backward" not in program("fused")
  assert "short_conv_backward" not in program("auto")   # the kernel on a GPU only; this is a CPU
  with pytest.raises(ValueError, match="backward must be one of"):
    program("triton")


def test_conv_tail_is_the_last_valid_inputs():
  state, x = normal(10, (3, 3, 4)), normal(11, (3, 5, 4))
  tail = conv_tail(state, x, jnp.asarray([0, 2, 5]))
  np.testing.assert_array_equal(tail[0], state[0])
  np.testing.assert_array_equal(tail[1], jnp.concatenate([state[1, 2:], x[1, :2]]))
  np.testing.assert_array_equal(tail[2], x[2, 2:])

