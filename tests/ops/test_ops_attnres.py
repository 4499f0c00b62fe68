"""The AttnRes read-out op: its output and every gradient equal autodiff of the plain formula
(`readout_reference`), with a partly valid buffer, invalid single values, saturated weights and garbage where nothing
is valid."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import attnres as attnres_ops
from model_testing import normal

EPS = 1e-6


def _inputs(C, count, valid_E, *, query_scale=1.0, seed=0, garbage=0.0, T=5, D=16):
  B = 2
  q = query_scale * (16 / D) ** 0.5 * normal(seed, (D,))   # scores of the same size whatever D
  g = 1.0 + 0.2 * normal(seed + 1, (D,))
  buffer = normal(seed + 2, (C, B, T, D)) * (1.0 + jnp.arange(C, dtype=jnp.float32))[:, None, None, None]
  valid_C = jnp.arange(C) < count
  if garbage:   # what lies past the valid slots must not matter
    buffer = jnp.where(valid_C[:, None, None, None], buffer, garbage)
  values = tuple(normal(seed + 3 + i, (B, T, D)) * (i + 0.5) for i in range(len(valid_E)))
  return q, g, buffer, valid_C, values, jnp.asarray(valid_E)


def _assert_gradients_close(got, want, names):
  """Each gradient finite and within 1e-4 relative (1e-5 of its largest element absolute) of autodiff's."""
  for name, x, y in zip(names, got, want, strict=True):
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
      assert np.all(np.isfinite(a)), name
      bound = float(np.max(np.abs(b), initial=0.0))
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * bound + 1e-30, err_msg=name)


CASES = {
    "buffer part valid, a single value invalid": dict(C=4, count=2, valid_E=[True, False, True]),
    "no buffer (a Stream)": dict(C=0, count=0, valid_E=[True, True, True]),
    "buffer only": dict(C=3, count=3, valid_E=[False]),
    "saturated weights": dict(C=3, count=2, valid_E=[True, True], query_scale=60.0),
    "garbage past the buffer's valid slots": dict(C=4, count=1, valid_E=[True, False], garbage=1e4),
    "no valid slot in the buffer": dict(C=3, count=0, valid_E=[True, True, True], garbage=1e4),
}


@pytest.mark.parametrize("backward", attnres_ops.BACKWARDS)
@pytest.mark.parametrize("case", CASES)
def test_readout_and_every_gradient_equal_autodiff_of_the_formula(case, backward):
  kw = dict(CASES[case])
  q, g, buffer, valid_C, values, valid_E = _inputs(kw.pop("C"), kw.pop("count"), kw.pop("valid_E"), **kw)
  cot = normal(99, values[0].shape)

  def loss(fn, q, g, buffer, values):
    return jnp.sum(fn(q, g, buffer, valid_C, values, valid_E) * cot)

  ours = functools.partial(attnres_ops.readout, eps=EPS, backward=backward)
  reference = functools.partial(attnres_ops.readout_reference, eps=EPS)
  if backward == "fused":   # the forward pass is the same whatever runs the backward
    np.testing.assert_allclose(ours(q, g, buffer, valid_C, values, valid_E),
                               reference(q, g, buffer, valid_C, values, valid_E), rtol=2e-5, atol=2e-5)
  got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2, 3)))(q, g, buffer, values)
  want = jax.jit(jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3)))(q, g, buffer, values)
  _assert_gradients_close(got, want, ("query", "scale", "buffer", "values"))
  # What is not valid gets exactly zero.
  assert not np.any(np.asarray(got[2])[np.asarray(~valid_C)])
  for d, ok in zip(got[3], np.asarray(valid_E)):
    assert ok or not np.any(np.asarray(d))


def test_each_backward_option_traces_as_it_says():
  """"barrier" puts the reductions behind an optimization barrier; "fused" has none."""
  q, g, buffer, valid_C, values, valid_E = _inputs(3, 2, [True, True])

  def backward(option):
    f = lambda q, buffer: jnp.sum(attnres_ops.readout(q, g, buffer, valid_C, values, valid_E, eps=EPS,
                                                      backward=option))
    return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(q, buffer))

  assert "optimization_barrier" in backward("barrier") and "optimization_barrier" not in backward("fused")
  with pytest.raises(ValueError, match="backward must be one of"):
    backward("triton")


def test_weights_are_a_softmax_over_the_valid_values():
  q, g, buffer, valid_C, values, valid_E = _inputs(4, 3, [True, False], query_scale=3.0)
  w = attnres_ops.weights(q, g, buffer, valid_C, values, valid_E, eps=EPS)
  valid = np.concatenate([np.asarray(valid_C), np.asarray(valid_E)])
  assert w.shape == (6, 2, 5)
  np.testing.assert_allclose(np.sum(w, 0), 1.0, rtol=1e-6)
  assert not np.any(np.asarray(w)[~valid]) and np.all(np.asarray(w)[valid] > 0)


@pytest.mark.parametrize("case", CASES)
def test_summarized_buffer_read_out_and_every_gradient_equal_autodiff_of_the_formula(case):
  """Three read-outs (three queries and key-norm weights) summarise one buffer together; each merged with its own
  single values is the formula's read-out, in value and in every gradient (the summary's queries included)."""
  kw = dict(CASES[case])
  C, count, valid_E = kw.pop("C"), kw.pop("count"), kw.pop("valid_E")
  q, g, buffer, valid_C, values, valid_E = _inputs(C, count, valid_E, **kw)
  scale = kw.get("query_scale", 1.0)
  qs = jnp.stack([q, scale * normal(40, q.shape), 0.5 * q])
  gs = jnp.stack([g, 1.0 + 0.2 * normal(41, g.shape), g[::-1]])
  cots = [normal(99 + j, values[0].shape) for j in range(3)]

  def ours(qs, gs, buffer, values):
    summary = attnres_ops.summarize_buffer(qs, gs, buffer, valid_C, eps=EPS)
    return [attnres_ops.readout_from_summary(qs[j], gs[j], summary.part(j), values[j:], valid_E[j:], eps=EPS)
            for j in range(3)]

  def reference(qs, gs, buffer, values):
    return [attnres_ops.readout_reference(qs[j], gs[j], buffer, valid_C, values[j:], valid_E[j:], eps=EPS)
            for j in range(3)]

  for a, b in zip(ours(qs, gs, buffer, values), reference(qs, gs, buffer, values)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  loss = lambda fn: lambda *a: sum(jnp.sum(h * c) for h, c in zip(fn(*a), cots))
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(qs, gs, buffer, values)
  want = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2, 3)))(qs, gs, buffer, values)
  _assert_gradients_close(got, want, ("queries", "scales", "buffer", "values"))
  assert not np.any(np.asarray(got[2])[np.asarray(~valid_C)])


@pytest.mark.parametrize("summarized", [False, True], ids=["read_out", "summarized_buffer"])
def test_bf16_sources_are_read_in_fp32_and_their_cotangents_rounded_once(summarized):
  """Sources stored in bf16 (`residual.source_dtype`): the read-out is the fp32 formula on the stored values (no
  bf16 arithmetic: within fp32 roundoff of the reference on the values read into fp32), and each gradient of a bf16
  input is the fp32 gradient rounded once to bf16 (within half a bf16 ulp of it), in the input's dtype."""
  q, g, buffer, valid_C, values, valid_E = _inputs(4, 3, [True, True, False], query_scale=3.0)
  buffer16, values16 = buffer.astype(jnp.bfloat16), (values[0].astype(jnp.bfloat16), *values[1:])
  as32 = lambda b, vs: (b.astype(jnp.float32), tuple(v.astype(jnp.float32) for v in vs))
  cot = normal(99, values[0].shape)

  def ours(q, g, buffer, values):
    if summarized:
      part = attnres_ops.summarize_buffer(q[None], g[None], buffer, valid_C, eps=EPS).part(0)
      return attnres_ops.readout_from_summary(q, g, part, values, valid_E, eps=EPS)
    return attnres_ops.readout(q, g, buffer, valid_C, values, valid_E, eps=EPS)

  reference = lambda q, g, buffer, values: attnres_ops.readout_reference(q, g, buffer, valid_C, values, valid_E,
                                                                         eps=EPS)
  np.testing.assert_allclose(ours(q, g, buffer16, values16), reference(q, g, *as32(buffer16, values16)),
                             rtol=2e-5, atol=2e-5)
  grad = lambda fn, *a: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3)))(*a)
  got = grad(ours, q, g, buffer16, values16)
  want = grad(reference, q, g, *as32(buffer16, values16))
  assert got[2].dtype == jnp.bfloat16 and [d.dtype for d in got[3]] == [jnp.bfloat16, jnp.float32, jnp.float32]
  _assert_gradients_close(got[:2], want[:2], ("query", "scale"))
  for name, a, b in (("buffer", got[2], want[2]), ("value 0", got[3][0], want[3][0])):
    a, b = np.asarray(a, np.float32), np.asarray(b)
    bound = float(np.max(np.abs(b)))
    np.testing.assert_array_less(np.abs(a - b), 2.0 ** -8 * np.abs(b) + 1e-5 * bound, err_msg=name)  # bf16: u = 2⁻⁸
  _assert_gradients_close((got[3][1:],), (want[3][1:],), ("values 1, 2",))
