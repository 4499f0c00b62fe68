"""The Pallas KDA op (interpret mode) against the recurrence and the XLA path: outputs and every gradient, fp32 and
bf16, documents, states, saturated gates, the fused entry (docs/design.md, tolerances)."""
import collections
import re

import chex
import jax
import jax.numpy as jnp
import pytest

from k3jax.numerics import rel_err
from k3jax.ops import kda
from k3jax.ops.kda.testing import kda_outputs_and_grads, random_inputs
from pallas_kernels.kda import KDAKernelOptions, chunk
from pallas_testing import cuda_module_text, kernel_products

# (B, T, H, K, V): T not a multiple of the 64-token chunk; K = V = 32 keeps interpret mode fast.
SHAPE = (1, 100, 2, 32, 32)
BF16_TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2}
FP32_TOL = lambda n: 1e-5 if n in ("o", "S") else 1e-4


def _pallas(options=None):
  return lambda **kw: kda.chunk_kda(**kw, lower_bound=-5.0, backend="pallas", kernel_options=options)


def _compare(x, S0, seg, tol, options=None):
  o, S, grads = kda_outputs_and_grads(_pallas(options), x, S0, seg, cot_seed=11)
  f32 = {n: a.astype(jnp.float32) for n, a in x.items()}
  o_ref, S_ref, grads_ref = kda_outputs_and_grads(kda.naive_recurrent_kda, f32, S0, seg, cot_seed=11)
  errs = {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}
  errs.update({n: rel_err(grads[n], grads_ref[n]) for n in grads_ref})
  bad = {n: e for n, e in errs.items() if not e <= tol(n)}
  assert not bad, f"errors above tolerance: {bad} (all: {errs})"


def test_fp32_outputs_and_grads_with_segments_and_states():
  x, S0, seg = random_inputs(21, *SHAPE, segments=True)
  _compare(x, S0, seg, FP32_TOL)


@pytest.mark.parametrize("dtype,packed", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_state_pass_in_segments_matches_the_recurrence(dtype, packed):
  """The forward's state pass cut into 3 segments of 2 chunks (each from the state XLA's scan composes) gives the
  recurrence's outputs and gradients: T = 380 (not a chunk multiple), an initial state, packed documents in fp32."""
  x, S0, seg = random_inputs(23, 1, 380, 2, 32, 32, dtype=dtype, segments=packed)
  _compare(x, S0, seg, FP32_TOL if dtype == jnp.float32 else BF16_TOL.get, KDAKernelOptions(segments=3))


@pytest.mark.parametrize("segments", [1, 3])
def test_no_initial_state_is_a_zero_one_without_materialising_it(segments):
  """initial_state=None (the kernels start from zeros; no zero state is built) gives the outputs, final state and
  input gradients of an explicit zero state, fp32, in one segment and in three."""
  x, S0, _ = random_inputs(48, 1, 380, 2, 32, 32)

  def loss(x, state):
    o, S = _pallas(KDAKernelOptions(segments=segments))(**x, initial_state=state, output_final_state=True)
    return jnp.sum(o * x["v"]) + jnp.sum(S), (o, S)
  (_, none), grads = jax.value_and_grad(loss, has_aux=True)(x, None)
  (_, zero), grads_zero = jax.value_and_grad(loss, has_aux=True)(x, jnp.zeros_like(S0))
  chex.assert_trees_all_close((none, grads), (zero, grads_zero), rtol=1e-6, atol=1e-6)


def test_undifferentiated_forward_with_inverted_diagonal_blocks_matches_the_differentiated_one():
  """The forward alone (the key tiles invert B's diagonal blocks, the Mosaic solve in interpret mode, bf16) against
  the forward that keeps the backward's residuals (B as it is), and against the forward alone with inverting off:
  outputs and final state to bf16 rounding, with documents and a state; only the forward alone inverts."""
  x, S0, seg = random_inputs(47, 1, 200, 2, 64, 64, dtype=jnp.bfloat16, segments=True)
  default = KDAKernelOptions()
  assert chunk.inverts_diagonal(default, jnp.bfloat16, 64, 64, save=False)
  assert not chunk.inverts_diagonal(default, jnp.bfloat16, 64, 64, save=True)
  assert not chunk.inverts_diagonal(KDAKernelOptions(invert_diagonal=False), jnp.bfloat16, 64, 64, save=False)
  run = lambda options=None, **x: _pallas(options)(**x, initial_state=S0, output_final_state=True, segment_ids=seg)
  o, S = run(**x)
  (o_ref, S_ref), _ = jax.vjp(lambda q: run(**{**x, "q": q}), x["q"])
  o_kept, S_kept = run(KDAKernelOptions(invert_diagonal=False), **x)
  for a, b, tol in ((o, o_ref, 1e-3), (S, S_ref, 1e-4), (o, o_kept, 1e-3), (S, S_kept, 1e-4)):
    assert rel_err(a, b) <= tol, rel_err(a, b)


@pytest.mark.parametrize("saturate,options", [(None, None), (-5.0, None), (-5.0, KDAKernelOptions(bwd_block_k=16))])
def test_bf16_outputs_and_grads_within_spec_tolerances(saturate, options):
  """bf16 against the fp32 recurrence, random and saturated gates; the backward's column pass also in two blocks of
  K's 32 columns."""
  x, S0, _ = random_inputs(22, *SHAPE, dtype=jnp.bfloat16, saturate=saturate)
  _compare(x, S0, None, BF16_TOL.get, options)


def test_gate_at_zero_is_exact_and_finite():
  x, S0, _ = random_inputs(23, *SHAPE, saturate=0.0)
  o, S = _pallas()(**x, initial_state=S0, output_final_state=True)
  o_ref, S_ref = kda.naive_recurrent_kda(**x, initial_state=S0, output_final_state=True)
  chex.assert_tree_all_finite((o, S))
  assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def test_repeated_keys_with_no_decay_are_exact():
  """I + A_kk is then far from the identity (every row near one): the inverse must stay exact."""
  x, S0, _ = random_inputs(25, *SHAPE)
  x["k"] = jnp.broadcast_to(x["k"][:, :1], x["k"].shape)
  x["g"], x["beta"] = jnp.full_like(x["g"], -1e-3), jnp.full_like(x["beta"], 0.99)
  _compare(x, S0, None, FP32_TOL)


@pytest.mark.parametrize("cols_form", ["loop", "unrolled"])
def test_saturated_gate_gradients_are_within_fp32_tolerance_of_float64(cols_form):
  """Every gate at the bound, fp32, the backward's column pass in two blocks of K and in each form: every gradient
  within 1e-4 of the float64 recurrence's."""
  x, S0, _ = random_inputs(22, *SHAPE, saturate=-5.0)
  _, _, grads = kda_outputs_and_grads(_pallas(KDAKernelOptions(bwd_block_k=16, cols_form=cols_form)), x, S0, None,
                                      cot_seed=11)
  with jax.enable_x64(True):
    f64 = {n: a.astype(jnp.float64) for n, a in x.items()}
    _, _, ref = kda_outputs_and_grads(kda.naive_recurrent_kda, f64, S0.astype(jnp.float64), None, cot_seed=11)
  errs = {n: rel_err(grads[n], ref[n]) for n in ref}
  assert max(errs.values()) <= 1e-4, errs


def fused_args(seed):
  """`fused_kda`'s raw inputs at SHAPE (q, k, v, g_raw, beta_logits, A_log, dt_bias), fp32, and a spare key."""
  B, T, H, K, V = SHAPE
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  return (jax.random.normal(ks[0], (B, T, H, K)), jax.random.normal(ks[1], (B, T, H, K)),
          jax.random.normal(ks[2], (B, T, H, V)), 3 * jax.random.normal(ks[3], (B, T, H, K)),
          jax.random.normal(ks[4], (B, T, H)), jnp.log(jax.random.uniform(ks[5], (H,), minval=1, maxval=16)),
          jax.random.normal(ks[6], (H, K))), ks[7]


def test_fused_entry_differentiates_through_norm_gate_and_sigmoid():
  args, key = fused_args(24)
  cot = jax.random.normal(key, args[2].shape)

  def loss(backend, *a):
    return jnp.sum(kda.fused_kda(*a, backend=backend)[0] * cot)

  grads = jax.grad(lambda *a: loss("pallas", *a), argnums=tuple(range(7)))(*args)
  grads_ref = jax.grad(lambda *a: loss("xla", *a), argnums=tuple(range(7)))(*args)
  for name, d, d_ref in zip(("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias"), grads, grads_ref):
    assert rel_err(d, d_ref) < 1e-4, name


def test_bf16_gate_gradients_are_as_accurate_as_dq_dk_at_every_tile_position():
  """bf16, the fused entry on random raw projections (about half the gates near the bound): d g_raw, d A_log and
  d dt_bias against the XLA path in fp32 within dq and dk's tolerance, and d g_raw's error alike at the four tile
  positions of a chunk. The loss is linear in o alone: a final-state cotangent or an initial state adds a part of dg
  that the pairs of rows inside a chunk do not touch, and at this length it hides their error. A pair's two terms
  in dg must cancel: with the operands of other tiles rounded against the row tile's anchor they did not, and here
  d g_raw was 1.6e-2, d A_log 1.6e-2, d dt_bias 2.8e-2, d g_raw 3.0e-2 in a chunk's first tile and 7e-3 in its last."""
  B, T, H, K, V = 2, 256, 2, 32, 32
  ks = jax.random.split(jax.random.PRNGKey(37), 8)
  bf16 = lambda i, *shape: jax.random.normal(ks[i], shape).astype(jnp.bfloat16)
  args = (bf16(0, B, T, H, K), bf16(1, B, T, H, K), bf16(2, B, T, H, V), bf16(3, B, T, H, K), bf16(4, B, T, H),
          jnp.log(jax.random.uniform(ks[5], (H,), minval=1, maxval=16)), jax.random.normal(ks[6], (H, K)))
  cot = jax.random.normal(ks[7], (B, T, H, V))

  def grads(backend, args):
    loss = lambda *a: jnp.sum(kda.fused_kda(*a, backend=backend)[0].astype(jnp.float32) * cot)
    return dict(zip(("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias"),
                    jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*args)))
  got, ref = grads("pallas", args), grads("xla", [a.astype(jnp.float32) for a in args])
  errs = {n: rel_err(got[n], ref[n]) for n in ("q", "k", "g_raw", "A_log", "dt_bias")}
  assert max(errs.values()) <= BF16_TOL["q"], errs
  position = (jnp.arange(T) % 64) // 16
  by_tile = [rel_err(got["g_raw"][:, position == t], ref["g_raw"][:, position == t]) for t in range(4)]
  assert max(by_tile) <= 2 * min(by_tile), by_tile


def test_fused_entry_forward_matches_xla_with_padding_documents_and_states():
  """Undifferentiated, the fused entry's kernels run without their residuals and take the gate, norms and sigmoid in
  their pre-pass: o and the final state against the XLA path, T = 100 (the padding's gate must decay nothing, or the
  final state is off by e^{-2.5·28}), two packed documents and an initial state, fp32."""
  B, T, H, K, V = SHAPE
  args, key = fused_args(32)
  S0 = jax.random.normal(key, (B, H, K, V))
  seg = jnp.zeros((B, T), jnp.int32).at[:, 40:].set(1)
  run = lambda backend: kda.fused_kda(*args, backend=backend, initial_state=S0, output_final_state=True,
                                      segment_ids=seg)
  (o, S), (o_ref, S_ref) = run("pallas"), run("xla")
  assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5, (rel_err(o, o_ref), rel_err(S, S_ref))


@pytest.mark.parametrize("on_gpu", [True, False])
def test_fp32_products_are_three_tf32_products_on_the_gpu_and_fp32_interpreted(monkeypatch, on_gpu):
  """Every product the fp32 kernels (forward and backward) mean to be exact is 3xTF32 as lowered for the GPU, never
  Triton's IEEE fp32 product (CUDA-core FMAs, a slow compile), and fp32 in interpret mode; the rest are tf32."""
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "0" if on_gpu else "1")
  B, T, H, K, V = 1, 128, 2, 64, 64
  shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H)]
  args = [jnp.zeros(s, jnp.float32) for s in shapes]

  def loss(q, k, v, g, beta):
    return kda.chunk_kda(q, k, v, g, beta, lower_bound=-5.0, backend="pallas")[0].sum()
  products = kernel_products(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args))
  exact = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if on_gpu else (jax.lax.Precision.HIGHEST,) * 2
  kernels = {name for name, _, _ in products}
  assert {"kda_intra_fwd_solve", "kda_state_fwd", "kda_state_bwd", "kda_intra_bwd_cols"} <= kernels, kernels
  precisions = {precision for _, dtype, precision in products if dtype == "float32"}
  assert exact in precisions and precisions <= {exact, None}, precisions


def test_kernels_lower_to_triton_for_the_gpu(monkeypatch):
  """Forward and backward lower through Pallas's Triton lowering here (interpret mode would not catch an op the
  lowering lacks); the GPU is described as an H200. The forward's state pass runs in 2 segments."""
  B, T, H, K, V = 1, 128, 2, 64, 64
  shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes] + [jax.ShapeDtypeStruct((B, T), jnp.int32)]
  options = KDAKernelOptions(segments=2)

  def loss(q, k, v, g, beta, seg):
    return kda.chunk_kda(q, k, v, g, beta, segment_ids=seg, lower_bound=-5.0, backend="pallas",
                         kernel_options=options)[0].sum()
  text = cuda_module_text(monkeypatch, jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
  assert "kda_intra_fwd_solve_mosaic" in text   # bf16 on the (described) H200
  for name in ("kda_prepare", "kda_intra_fwd_key_tiles", "kda_state_segment_maps",
               "kda_state_fwd", "kda_state_bwd", "kda_state_grads", "kda_intra_bwd_rows", "kda_intra_bwd_cols",
               "kda_intra_bwd_dg"):
    assert f'name = "{name}"' in text, name
  gate = [jax.ShapeDtypeStruct((H,), jnp.float32), jax.ShapeDtypeStruct((H, K), jnp.float32)]
  for dtype in (jnp.bfloat16, jnp.float32):   # the fused forward, in both precisions of its products
    f_args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    fused = lambda *a: kda.fused_kda(*a, lower_bound=-5.0, backend="pallas")[0]
    text = cuda_module_text(monkeypatch, fused, *f_args, *gate)
    names = ("kda_prepare", "kda_intra_fwd_key_tiles") + (("kda_intra_fwd_solve",) if dtype == jnp.float32 else ())
    assert all(f'name = "{n}"' in text for n in names), dtype
    assert ("kda_intra_fwd_solve_mosaic" in text) == (dtype == jnp.bfloat16), dtype


def test_layers_share_one_lowered_copy_of_each_kernel(monkeypatch):
  """A program of one KDA layer and one of five (two unrolled, one rematerialised, two scanned), forward and backward
  as lowered for the GPU, hold the same copies of each kernel: however JAX's transformations copy the calls, each
  kernel is lowered once, so XLA compiles it once, not per layer, per scan or per recomputation."""
  B, T, H, D = 1, 128, 2, 64
  args = ([jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)] * 4 + [jax.ShapeDtypeStruct((B, T, H), jnp.bfloat16)]
          + [jax.ShapeDtypeStruct((H,), jnp.float32), jax.ShapeDtypeStruct((H, D), jnp.float32)])

  def copies(layers):
    def loss(q, k, v, g, beta, A_log, dt_bias):
      layer = lambda v: v + kda.fused_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound=-5.0, backend="pallas")[0]
      v = layer(v)
      if layers > 1:
        v = jax.checkpoint(layer)(layer(v))
        v = jax.lax.scan(lambda v, _: (layer(v), None), v, length=2)[0]
      return v.astype(jnp.float32).sum()
    text = cuda_module_text(monkeypatch, jax.grad(loss, argnums=tuple(range(7))), *args)
    return collections.Counter(re.findall(r'name = "(kda_\w+)"', text))
  one, five = copies(1), copies(5)
  assert one == five and {"kda_prepare", "kda_state_bwd", "kda_intra_bwd_cols"} <= set(one), (one, five)
  assert set(one.values()) == {1}, one