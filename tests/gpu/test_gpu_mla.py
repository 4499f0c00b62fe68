"""MLA's training attention on cuDNN (`k3jax.ops.mla.causal_attention`, impl "cudnn"): documents as packed runs,
and `blocked_attention` (fp32, by blocks) when a row has more runs than `max_documents`. bf16 inputs against the
fp32 formula ("highest"), the output and the gradients of q, k and v over real (non-padding) positions, each held to
the error of cuDNN with the dense mask (the path before the packed runs, the anchor) on the same inputs. Cases:
documents of random lengths and a padding tail, one document, more documents than slots (the fallback), a length no
tile divides, Dv < Dqk. A GPU only (cuDNN).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.numerics import rel_err
from k3jax.ops import mla
from model_testing import causal_attention_reference, random_segments

pytestmark = pytest.mark.gpu

ON_GPU = jax.default_backend() == "gpu"
BF16_FLOOR = 2e-3      # bf16's rounding of a result at unit scale
# (B, T, documents, padding, max_documents, Dv)
CASES = {"documents and padding": (2, 1024, 5, 37, 8, 128), "one document": (3, 1000, 1, 0, 16, 128),
         "more documents than slots": (2, 512, 9, 0, 4, 128), "Dv under Dqk": (2, 640, 3, 11, 16, 64)}


def _outputs_and_grads(attend, q, k, v, seg, do):
  def loss(q, k, v):
    o = attend(q, k, v, seg)
    return jnp.sum(o.astype(jnp.float32) * do), o
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return (o, *grads)


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_are_held_to_the_dense_masks_error(case):
  if not ON_GPU:
    pytest.skip("cuDNN attention needs a GPU")
  B, T, docs, pad, max_documents, Dv = CASES[case]
  H, D = 2, 128
  ks = jax.random.split(jax.random.PRNGKey(T + docs), 4)
  q, k = (jax.random.normal(kk, (B, T, H, D), jnp.float32) for kk in ks[:2])
  v = jax.random.normal(ks[2], (B, T, H, Dv), jnp.float32)
  do = jax.random.normal(ks[3], (B, T, H, Dv), jnp.float32)
  seg = jnp.asarray(random_segments(T, B, T, docs, pad))
  _, _, runs = mla.document_runs(seg, max_documents)
  assert (int(runs.max()) > max_documents) == (case == "more documents than slots")
  scale = D ** -0.5
  ref = _outputs_and_grads(lambda *a: causal_attention_reference(*a[:3], a[3], scale), q, k, v, seg, do)
  bf16 = tuple(a.astype(jnp.bfloat16) for a in (q, k, v))
  packed = _outputs_and_grads(lambda q, k, v, s: mla.causal_attention(
      q, k, v, s, scale=scale, impl="cudnn", max_documents=max_documents), *bf16, seg, do)
  dense = _outputs_and_grads(lambda q, k, v, s: jax.nn.dot_product_attention(
      *(jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, D - a.shape[-1]))) for a in (q, k, v)),
      mask=mla.document_mask(s), is_causal=True, scale=scale, implementation="cudnn")[..., :Dv], *bf16, seg, do)
  real = np.asarray(seg != 0)
  for name, ours, anchor, want in zip(("o", "dq", "dk", "dv"), packed, dense, ref):
    want = np.asarray(want, np.float32)[real]
    err = rel_err(np.asarray(ours.astype(jnp.float32))[real], want)
    anchor_err = rel_err(np.asarray(anchor.astype(jnp.float32))[real], want)
    assert err <= 2 * anchor_err + BF16_FLOOR, (name, err, anchor_err)


def test_the_backward_carries_no_quadratic_residual():
  """Neither branch of the `lax.cond` carries an O(T²) residual into the backward pass: a residual of one branch is
  written (as zeros) by the other too, and the dense mask's, at T = 65,536, was 5 ms a layer."""
  if not ON_GPU:
    pytest.skip("cuDNN attention needs a GPU (it is traced only where cuDNN is found)")
  B, T, H, D = 1, 512, 2, 128
  x = jnp.ones((B, T, H, D), jnp.bfloat16)
  seg = jnp.asarray(random_segments(0, B, T, 3, 5))

  def forward_and_backward(q, k, v):
    o, vjp = jax.vjp(lambda *a: mla.causal_attention(*a, seg, scale=D ** -0.5, impl="cudnn"), q, k, v)
    return vjp(o)

  conds = [e for e in _equations(jax.make_jaxpr(forward_and_backward)(x, x, x).jaxpr) if e.primitive.name == "cond"]
  assert conds, "no cond: the fallback is gone from the program, and this test with it"
  sizes = [int(np.prod(v.aval.shape)) for e in conds for v in e.outvars]
  assert max(sizes) < T * T, sizes


def _equations(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside its equations."""
  for e in jaxpr.eqns:
    yield e
    for param in e.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)
