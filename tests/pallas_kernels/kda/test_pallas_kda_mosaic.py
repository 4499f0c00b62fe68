"""The Mosaic GPU kernels (wgmma, TMA; interpret mode here): the intra pass's solve and the sequential state passes
against the Triton ones, where each is picked, what each refuses, and their lowering for CUDA."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.numerics import rel_err
from k3jax.ops import kda
from k3jax.ops.kda.testing import kda_outputs_and_grads, random_inputs
from kda_kernel_testing import state_pass_inputs
from pallas_kernels.kda import KDAKernelOptions, Launch, bwd, fwd, solve_mosaic, state_mosaic
from pallas_testing import cuda_module_text

BF16_TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2}


@pytest.mark.parametrize("save", [True, False])
def test_mosaic_solve_gives_the_triton_solves_outputs(save):
  """The Mosaic GPU solve (products on bf16 halves, interpret mode) against the Triton one (fp32 here): W, U and M,
  bf16 inputs with K unlike V and resets, with and without M written for the backward; and it is the default there."""
  B, T, H, K, V = 1, 128, 2, 64, 128
  x, _, _ = random_inputs(40, B, T, H, K, V, dtype=jnp.bfloat16)
  reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 64, 100])].set(1)
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, reset, lower_bound=-5.0)
  run = lambda solve: fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, scale=K ** -0.5,
                                        lower_bound=-5.0, save=save, options=KDAKernelOptions(solve=solve))
  (w, u, *_, minv), (w_ref, u_ref, *_, minv_ref) = run("mosaic"), run("triton")
  assert rel_err(w, w_ref) <= 1e-3 and rel_err(u, u_ref) <= 1e-3, (rel_err(w, w_ref), rel_err(u, u_ref))
  assert (minv is None) == (not save)
  if save:
    assert rel_err(minv, minv_ref) <= 1e-5, rel_err(minv, minv_ref)
  chex.assert_trees_all_equal(run(None), run("mosaic"))


def test_inverting_the_diagonal_blocks_in_the_key_tiles_gives_the_same_solve():
  """With `invert_diagonal` the key tiles write (I + βB_II)⁻¹ − I on B's diagonal blocks (fp32 products) and the
  Mosaic solve (interpret mode) takes two doubling steps from there: W and U as the default's (its four steps on
  bf16 halves differ in rounding), the other outputs unchanged; bf16, K unlike V, documents; the off-diagonal
  blocks of B are kept and the diagonal ones are the inverses."""
  B, T, H, K, V = 1, 128, 2, 64, 128
  x, _, _ = random_inputs(46, B, T, H, K, V, dtype=jnp.bfloat16)
  reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 64, 100])].set(1)
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, reset, lower_bound=-5.0, save=False)
  run = lambda inv: fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, scale=K ** -0.5,
                                      lower_bound=-5.0, save=False, invert_diagonal=inv)
  (w, u, qs, kd, aqk, decay, kk, _), (w_ref, u_ref, qs_ref, kd_ref, aqk_ref, decay_ref, kk_ref, _) = (run(True),
                                                                                                      run(False))
  assert rel_err(w, w_ref) <= 1e-4 and rel_err(u, u_ref) <= 1e-4, (rel_err(w, w_ref), rel_err(u, u_ref))
  chex.assert_trees_all_equal((qs, kd, aqk, decay), (qs_ref, kd_ref, aqk_ref, decay_ref))
  blocks = lambda m: m[0, :, 0].reshape(2, 4, 16, 4, 16)           # chunk, row tile, row, column tile, column
  diag = jnp.eye(4, dtype=bool)[None, :, None, :, None]
  chex.assert_trees_all_equal(jnp.where(diag, 0.0, blocks(kk)), jnp.where(diag, 0.0, blocks(kk_ref)))
  beta = p.beta[0, :, 0].reshape(2, 4, 16, 1)
  for c in range(2):
    for i in range(4):
      n = beta[c, i] * blocks(kk_ref)[c, i, :, i]
      inverse = np.linalg.inv(np.eye(16) + np.asarray(n, np.float64))
      assert rel_err(blocks(kk)[c, i, :, i] + np.eye(16), inverse) <= 1e-5, (c, i)
  with pytest.raises(ValueError, match="invert_diagonal"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, reset, scale=1.0, lower_bound=-5.0, save=True,
                      invert_diagonal=True)


def test_the_solve_is_mosaic_only_where_it_can_run():
  """bf16 with K, V multiples of 64 (up to 256) takes the Mosaic solve (here in interpret mode); fp32, or K = 32,
  the Triton one; asked for anyway, or given the Triton solve's launch, it refuses before any compute."""
  assert solve_mosaic.available(jnp.bfloat16, 128, 64)
  assert not solve_mosaic.available(jnp.float32, 128, 128)
  assert not solve_mosaic.available(jnp.bfloat16, 32, 128)
  assert not solve_mosaic.available(jnp.bfloat16, 128, 320)
  assert fwd.solve_used(KDAKernelOptions(), jnp.float32, 128, 128) == "triton"
  with pytest.raises(ValueError, match="Mosaic GPU solve takes bf16"):
    fwd.solve_used(KDAKernelOptions(solve="mosaic"), jnp.float32, 64, 64)
  with pytest.raises(ValueError, match="intra_fwd_solve is the Triton solve's launch"):
    fwd.solve_used(KDAKernelOptions(intra_fwd_solve=Launch(8, 1)), jnp.bfloat16, 64, 64)


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("segments,start", [(1, True), (1, False), (2, True)])
def test_mosaic_state_pass_gives_the_triton_passes_outputs(segments, start, save):
  """The Mosaic GPU state pass (wgmma, interpret mode) against the Triton one on the same bf16 launches' outputs:
  o, the final state and, with `save`, the states entering each chunk and v_new; 4 chunks with documents, from a
  state or from zeros, in one segment and in two; and it is the default there."""
  B, T, H, K, V = 1, 256, 2, 64, 64
  x, _, _ = random_inputs(49, B, T, H, K, V, dtype=jnp.bfloat16)
  reset = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([5, 70, 200])].set(1)
  w, u, qs, kd, aqk, decay = state_pass_inputs(x, reset, scale=K ** -0.5, lower_bound=-5.0)
  S0 = jax.random.normal(jax.random.PRNGKey(50), (B, H, K, V)) if start else None
  assert state_mosaic.available(jnp.bfloat16, K, V, V)
  run = lambda state_pass: fwd.state_forward(w, u, qs, kd, aqk, decay, S0, block_v=V, save=save, segments=segments,
                                             options=KDAKernelOptions(state_pass=state_pass))
  got, ref = run("mosaic"), run("triton")
  assert len(got) == len(ref) == (4 if save else 2)
  for name, a, b in zip(("o", "S", "h", "v_new"), got, ref):
    chex.assert_equal_shape((a, b))
    assert rel_err(a, b) <= 1e-4, (name, rel_err(a, b))
  chex.assert_trees_all_equal(run(None), got)


def test_mosaic_backward_state_pass_gives_the_triton_passes_gradients():
  """The Mosaic GPU reverse pass (interpret mode) against the Triton one on the same bf16 operands: dv_new, the
  gradients w.r.t. the states entering each chunk and w.r.t. the initial state; and it is the default there."""
  B, T, H, K, V = 1, 256, 2, 64, 64
  x, _, _ = random_inputs(52, B, T, H, K, V, dtype=jnp.bfloat16)
  w, u, qs, kd, aqk, decay = state_pass_inputs(x, None, scale=K ** -0.5, lower_bound=-5.0)
  do = jax.random.normal(jax.random.PRNGKey(53), (B, T, H, V), jnp.bfloat16)
  dS_T = jax.random.normal(jax.random.PRNGKey(54), (B, H, K, V))
  run = lambda state_pass: bwd.state_backward(do, aqk, kd, qs, w, decay, dS_T, block_v=V,
                                              options=KDAKernelOptions(state_pass=state_pass))
  got, ref = run("mosaic"), run("triton")
  for name, a, b in zip(("dv_new", "dh", "dS0"), got, ref):
    chex.assert_equal_shape((a, b))
    assert rel_err(a, b) <= 1e-4, (name, rel_err(a, b))
  chex.assert_trees_all_equal(run(None), got)


def test_bf16_with_the_mosaic_state_pass_matches_the_recurrence():
  """The whole operator in bf16 with both state passes on Mosaic GPU (all of V in one program, the forward's in 3
  segments, interpret mode): outputs and every gradient against the recurrence within the bf16 tolerances, with
  packed documents, an initial state and T = 380; the program holds both Mosaic passes, and the undifferentiated
  forward runs Mosaic's pass too."""
  options = KDAKernelOptions(block_v=64, segments=3)
  run = lambda **kw: kda.chunk_kda(**kw, lower_bound=-5.0, backend="pallas", kernel_options=options)
  x, S0, seg = random_inputs(51, 1, 380, 2, 64, 64, dtype=jnp.bfloat16, segments=True)
  grads = lambda x: jax.grad(lambda x: run(**x, initial_state=S0, segment_ids=seg)[0].astype(jnp.float32).sum())(x)
  program = str(jax.make_jaxpr(grads)(x))
  assert "kda_state_fwd_mosaic" in program and "kda_state_bwd_mosaic" in program   # else Triton's were compared
  assert "kda_state_fwd_mosaic" in str(jax.make_jaxpr(lambda x: run(**x, initial_state=S0, segment_ids=seg))(x))
  o, S, got = kda_outputs_and_grads(run, x, S0, seg, cot_seed=11)
  f32 = {n: a.astype(jnp.float32) for n, a in x.items()}
  o_ref, S_ref, ref = kda_outputs_and_grads(kda.naive_recurrent_kda, f32, S0, seg, cot_seed=11)
  errs = {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref), **{n: rel_err(got[n], ref[n]) for n in ref}}
  assert all(e <= BF16_TOL[n] for n, e in errs.items()), errs


def test_mosaic_state_pass_takes_only_what_it_can_run():
  """bf16 with K and V of 64 or 128 and all of V in one program takes the Mosaic state passes; fp32, K = 32,
  V = 256 or a narrower column block the Triton ones; asked for anyway, or given Triton's launch, they refuse before
  any compute."""
  assert state_mosaic.available(jnp.bfloat16, 128, 128, 128) and state_mosaic.available(jnp.bfloat16, 64, 128, 128)
  for dtype, K, V, block_v in ((jnp.float32, 128, 128, 128), (jnp.bfloat16, 32, 64, 64),
                               (jnp.bfloat16, 128, 256, 256), (jnp.bfloat16, 128, 128, 64)):
    assert not state_mosaic.available(dtype, K, V, block_v), (dtype, K, V, block_v)

  def args(dtype, K):   # w, u, qs, kd, aqk, decay and no start, one chunk, K = V
    x = jnp.ones((1, 64, 1, K), dtype)
    return x, x, x, x, jnp.ones((1, 64, 1, 64), dtype), jnp.ones((1, 1, 1, K)), None
  mosaic = KDAKernelOptions(state_pass="mosaic")
  with pytest.raises(ValueError, match="bf16 with K, V in"):
    fwd.state_forward(*args(jnp.float32, 32), block_v=32, options=mosaic)
  with pytest.raises(ValueError, match="block_v=32"):
    fwd.state_forward(*args(jnp.bfloat16, 64), block_v=32, options=mosaic)
  with pytest.raises(ValueError, match="Mosaic GPU state pass runs here"):
    fwd.state_forward(*args(jnp.bfloat16, 64), block_v=64, options=KDAKernelOptions(state_fwd=Launch(8, 2)))
  with pytest.raises(ValueError, match="block_v=32"):
    bwd.state_backward(*args(jnp.bfloat16, 64)[:6], jnp.ones((1, 1, 64, 64)), block_v=32, options=mosaic)
  with pytest.raises(ValueError, match="Mosaic GPU state pass runs here"):
    bwd.state_backward(*args(jnp.bfloat16, 64)[:6], jnp.ones((1, 1, 64, 64)), block_v=64,
                       options=KDAKernelOptions(state_bwd=Launch(8, 2)))


def test_mosaic_launches_lower_for_cuda_and_refuse_what_they_cannot_take(monkeypatch):
  """The Mosaic solve, with and without resets and M, and from the key tiles' inverted diagonal blocks, and the Mosaic
  state pass, with the backward's residuals and in segments: lowering checks the shared-memory layouts and transfers
  that interpret mode does not."""
  B, T, H, K, V = 1, 128, 2, 128, 64
  shapes = [((B, T, H, K), jnp.bfloat16)] * 3 + [((B, T // 16, H, K), jnp.float32), ((B, T, H, V), jnp.bfloat16),
                                                  ((B, T, H), jnp.float32), ((B, T), jnp.int32)]
  args = [jax.ShapeDtypeStruct(*s) for s in shapes]
  mosaic = KDAKernelOptions(solve="mosaic")
  for save in (True, False):
    f = functools.partial(fwd.intra_forward, scale=K ** -0.5, lower_bound=-5.0, save=save, options=mosaic)
    assert "kda_intra_fwd_solve_mosaic" in cuda_module_text(monkeypatch, f, *args[:-1], None if save else args[-1])
  f = functools.partial(fwd.intra_forward, scale=K ** -0.5, lower_bound=-5.0, save=False, invert_diagonal=True)
  text = cuda_module_text(monkeypatch, f, *args)
  assert "kda_intra_fwd_solve_mosaic" in text and 'name = "kda_intra_fwd_key_tiles"' in text
  state_args = [jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16) for d in (K, V, K, K, 64)]
  state_args += [jax.ShapeDtypeStruct((B, T // 64, H, K), jnp.float32), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
  for save, segments in ((True, 1), (False, 2)):   # the states entering chunks and v_new; segments' starts
    f = functools.partial(fwd.state_forward, block_v=V, save=save, segments=segments)
    assert "kda_state_fwd_mosaic" in cuda_module_text(monkeypatch, f, *state_args)
  do, aqk, kd = (jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16) for d in (V, 64, K))
  f = functools.partial(bwd.state_backward, block_v=V)
  assert "kda_state_bwd_mosaic" in cuda_module_text(monkeypatch, f, do, aqk, kd, kd, kd, *state_args[5:])
  monkeypatch.setenv("K3JAX_PALLAS_INTERPRET", "1")
  x, _, _ = random_inputs(41, 1, 64, 1, 32, 32)
  p = fwd.prepare(x["q"], x["k"], x["g"], x["beta"], None, None, lower_bound=-5.0)
  with pytest.raises(ValueError, match="Mosaic GPU"):
    fwd.intra_forward(p.qe, p.kq, p.ke, p.tot, x["v"], p.beta, None, scale=1.0, lower_bound=-5.0, options=mosaic)
