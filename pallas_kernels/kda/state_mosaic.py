"""The sequential state passes as Mosaic GPU kernels (wgmma, TMA), as `fwd.state_forward` and `bwd.state_backward`:
one warpgroup per (batch·head, segment) keeps its [K,V] fp32 state (or its gradient) in registers, as the update's
wgmma accumulator, and walks the chunks while TMA brings the next chunk's operands. On the H200 both are faster than
the Triton passes, whose mma.sync runs from 4 warps that also hold the state (BUILD_NOTES.md, KDA kernels). On the
CPU they run in Mosaic GPU's interpret mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret_mode, mosaic_gpu_reason
from pallas_kernels.kda.solve_mosaic import BF16, WGMMA, swizzled
from pallas_kernels.kda.tiles import CHUNK, F32

STAGES = 2   # chunks whose operands are in shared memory at once: 2 x 72.5 KB at K = V = 128


def _takes(dtype, K, V, block_v):
  return jnp.dtype(dtype) == BF16 and K in (64, 128) and V in (64, 128) and block_v == V


def available(dtype, K, V, block_v):
  """Whether `fwd.state_forward` runs this kernel: bf16, K and V of 64 or 128 with all of V in one program, on a
  Hopper GPU, in interpret mode, or lowered for the GPU from a machine without one."""
  return _takes(dtype, K, V, block_v) and mosaic_gpu_reason(off_gpu=True) is None


def check_supported(dtype, K, V, block_v):
  """Raises unless this kernel takes these inputs: bf16, K and V of 64 or 128, all of V in one program."""
  if not _takes(dtype, K, V, block_v):
    raise ValueError(f"the Mosaic GPU state pass takes bf16 with K, V in (64, 128) and block_v = V; got "
                     f"{jnp.dtype(dtype).name}, K={K}, V={V}, block_v={block_v}")


def chosen(dtype, K, V, block_v, state_pass, triton_launch):
  """Whether a state pass runs here rather than on Triton: `state_pass` ("mosaic", "triton" or None, which picks it
  where `available`); asked for with inputs it cannot take, or given the Triton pass's launch (`triton_launch` not
  None), it raises before any compute."""
  if not (available(dtype, K, V, block_v) if state_pass is None else state_pass == "mosaic"):
    return False
  check_supported(dtype, K, V, block_v)
  if triton_launch is not None:
    raise ValueError(f"a Triton launch ({triton_launch}) was given for the state pass, but the Mosaic GPU state pass "
                     "runs here and takes none")
  return True


def state_forward(w, u, qs, kd, aqk, decay, starts, *, save, segments):
  """`fwd.state_forward` for `available` inputs: `starts` fp32 `[B,H,segments,K,V]` or None (zeros). Returns o,
  the states at the segments' ends `[B,H,segments,K,V]` fp32 and, with `save`, the states entering each chunk
  `[B,H,N·K,V]` and v_new `[B,T,H,V]` (bf16)."""
  B, T, H, K = w.shape
  V = u.shape[-1]
  N = T // CHUNK
  check_supported(w.dtype, K, V, V)
  out = [jax.ShapeDtypeStruct((B, T, H, V), BF16), jax.ShapeDtypeStruct((B, H, segments, K, V), F32)]
  if save:
    out += [jax.ShapeDtypeStruct((B, H, N * K, V), BF16), jax.ShapeDtypeStruct((B, T, H, V), BF16)]
  body = functools.partial(_walk, H=H, num_chunks=N // segments, save=save, has_start=starts is not None)
  return _launch(body, out, (B * H, segments), ("bh", "s"), "kda_state_fwd_mosaic")(
      w, u, qs, kd, aqk, decay, *([] if starts is None else [starts]))


def state_backward(do, aqk, kd, qs, w, decay, dS_T):
  """`bwd.state_backward` for `available` inputs (all of V in one program): dv_new `[B,T,H,V]`, the gradient w.r.t.
  the state entering each chunk `[B,H,N·K,V]` (bf16) and w.r.t. the initial state `[B,H,K,V]` (fp32)."""
  B, T, H, K = w.shape
  V = do.shape[-1]
  N = T // CHUNK
  check_supported(w.dtype, K, V, V)
  out = [jax.ShapeDtypeStruct((B, T, H, V), BF16), jax.ShapeDtypeStruct((B, H, N * K, V), BF16),
         jax.ShapeDtypeStruct((B, H, K, V), F32)]
  body = functools.partial(_walk_back, H=H, num_chunks=N)
  return _launch(body, out, (B * H,), ("bh",), "kda_state_bwd_mosaic")(do, aqk, kd, qs, w, decay, dS_T)


def _launch(body, out, grid, grid_names, name):
  return plgpu.kernel(body, out_type=out, grid=grid, grid_names=grid_names,
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
                      kernel_name=name, interpret=plgpu.InterpretGPUParams() if interpret_mode() else None)


def _accumulate(init, *pairs):
  """init + Σ a·b over the (a, b) pairs of shared-memory operands, waited for. On the GPU the wgmma accumulator
  starts from `init` (no second [K,V] fp32 value beside it); Mosaic GPU's interpret mode has no initialised
  accumulators (`pl.run_state`), so there the sum is added after."""
  def products(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a, b)
    plgpu.wgmma_wait(0)
  if interpret_mode():
    return init + pl.run_scoped(lambda acc: (products(acc), acc[...])[1], plgpu.ACC(init.shape, F32))
  return pl.run_state(products)(plgpu.ACC.init(init))


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA)


def _decayed(decay_row_s, S_KV):
  """decay ⊙ S: the chunk's decay row (shared memory, [K]) scaling the state's rows."""
  decay_row = plgpu.load(decay_row_s, layout=WGMMA.reduce(1))
  return lax.broadcast_in_dim(decay_row, S_KV.shape, [0]) * S_KV


def _square(rows, cols, dtype):
  return plgpu.SMEM((rows, cols), dtype, transforms=swizzled(dtype))


def _tiles(cols):
  """A chunk's rows of one operand, in each of the STAGES slots."""
  return plgpu.SMEM((STAGES, CHUNK, cols), BF16, transforms=swizzled(BF16))


class _ChunkPipeline:
  """Walks chunks with their operands in shared memory: TMA of one chunk's [64, ·] rows of each source
  (`[B,T,H,·]`) and its decay row into a slot's buffers, each copy on its own barrier (`loaded`: one per source and
  slot, the decay row's last), the next chunk's copies issued before this one's are waited for."""

  def __init__(self, sources, buffers, decay_g, decay_s, loaded, b, h):
    self.pairs = tuple(zip(sources, buffers)) + ((decay_g, decay_s),)
    self.loaded, self.b, self.h = loaded, b, h

  def _fetch(self, chunk, slot):
    for i, (src, dst) in enumerate(self.pairs):
      rows = chunk if i == len(self.pairs) - 1 else pl.ds(chunk * CHUNK, CHUNK)
      plgpu.copy_gmem_to_smem(src.at[self.b, rows, self.h], dst.at[slot], self.loaded.at[i * STAGES + slot])

  def walk(self, num_steps, chunk_of, step, carry):
    """carry <- step(chunk_of(i), slot, carry) for i < num_steps, the step's operands in `slot` of each buffer;
    returns once the last step's stores to global memory have read shared memory."""
    self._fetch(chunk_of(0), 0)

    def body(i, carry):
      slot = lax.rem(i, STAGES)

      @pl.when(i + 1 < num_steps)
      def _():
        self._fetch(chunk_of(i + 1), lax.rem(i + 1, STAGES))

      for j in range(len(self.pairs)):
        plgpu.barrier_wait(self.loaded.at[j * STAGES + slot])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last step's stores have read the buffers it wrote
      return step(chunk_of(i), slot, carry)

    carry = lax.fori_loop(0, num_steps, body, carry)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    return carry


def _load_state(src_g):
  """[K,V] fp32 from global memory into registers (wgmma layout), through shared memory."""
  def scoped(buf, loaded):
    plgpu.copy_gmem_to_smem(src_g, buf, loaded.at[0])
    plgpu.barrier_wait(loaded.at[0])
    return plgpu.load(buf, layout=WGMMA)
  return pl.run_scoped(scoped, _square(*src_g.shape, F32), plgpu.Barrier(num_barriers=1))


def _store_state(S, dst_g):
  def scoped(buf):
    buf[...] = S
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, dst_g)
    plgpu.wait_smem_to_gmem(0)
  pl.run_scoped(scoped, _square(*S.shape, F32))


def _walk(w_g, u_g, qs_g, kd_g, aqk_g, decay_g, *refs, H, num_chunks, save, has_start):
  """Chunks first to last: v_new = U − W S, o = Qs S + A_qk v_new, S ← decay ⊙ S + Kdᵀ v_new."""
  start_g, (o_g, ends_g, *saved_g) = (refs[0], refs[1:]) if has_start else (None, refs)
  bh, seg = lax.axis_index("bh"), lax.axis_index("s")
  b, h = bh // H, bh % H
  K, V = kd_g.shape[-1], u_g.shape[-1]
  S0 = _load_state(start_g.at[b, h, seg]) if has_start else _zeros((K, V))

  def pipeline(w_s, u_s, qs_s, kd_s, aqk_s, decay_s, S_s, vn_s, o_s, loaded):
    def chunk(c, slot, S_KV):
      rows = pl.ds(c * CHUNK, CHUNK)
      S_s[...] = S_KV.astype(BF16)
      plgpu.commit_smem()
      if save:
        plgpu.copy_smem_to_gmem(S_s, saved_g[0].at[b, h, pl.ds(c * K, K)])
      u_in = plgpu.load(u_s.at[slot], layout=WGMMA).astype(F32)
      v_new = -_accumulate(-u_in, (w_s.at[slot], S_s))   # U − W S, the accumulator started from −U
      vn_s[...] = v_new.astype(BF16)
      plgpu.commit_smem()
      if save:
        plgpu.copy_smem_to_gmem(vn_s, saved_g[1].at[b, rows, h])
      o = _accumulate(_zeros((CHUNK, V)), (qs_s.at[slot], S_s), (aqk_s.at[slot], vn_s))
      S_next = _accumulate(_decayed(decay_s.at[slot], S_KV), (kd_s.at[slot].transpose((1, 0)), vn_s))
      o_s[...] = o.astype(BF16)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_g.at[b, rows, h])
      return S_next

    chunks = _ChunkPipeline((w_g, u_g, qs_g, kd_g, aqk_g), (w_s, u_s, qs_s, kd_s, aqk_s), decay_g, decay_s, loaded,
                            b, h)
    return chunks.walk(num_chunks, lambda i: seg * num_chunks + i, chunk, S0)

  S_T = pl.run_scoped(pipeline, _tiles(K), _tiles(V), _tiles(K), _tiles(K), _tiles(CHUNK),
                      plgpu.SMEM((STAGES, K), F32), _square(K, V, BF16), _square(CHUNK, V, BF16),
                      _square(CHUNK, V, BF16), plgpu.Barrier(num_barriers=6 * STAGES))
  _store_state(S_T, ends_g.at[b, h, seg])


def _walk_back(do_g, aqk_g, kd_g, qs_g, w_g, decay_g, dsT_g, dvn_g, dh_g, ds0_g, *, H, num_chunks):
  """Chunks last to first: dv_new = A_qkᵀ dO + Kd dS, then dS ← decay ⊙ dS + Qsᵀ dO − Wᵀ dv_new."""
  bh = lax.axis_index("bh")
  b, h = bh // H, bh % H
  K, V = kd_g.shape[-1], do_g.shape[-1]
  T = lambda ref: ref.transpose((1, 0))
  dS_T = _load_state(dsT_g.at[b, h])   # before the pipeline's buffers: its 64 KB would not fit beside them

  def pipeline(do_s, aqk_s, kd_s, qs_s, w_s, decay_s, dS_s, dvn_s, neg_dvn_s, loaded):
    def chunk(c, slot, dS_KV):
      dS_s[...] = dS_KV.astype(BF16)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(dS_s, dh_g.at[b, h, pl.ds(c * K, K)])
      dv_new = _accumulate(_zeros((CHUNK, V)), (T(aqk_s.at[slot]), do_s.at[slot]), (kd_s.at[slot], dS_s))
      dvn_s[...] = dv_new.astype(BF16)
      neg_dvn_s[...] = (-dv_new).astype(BF16)   # wgmma only adds: Wᵀ dv_new is subtracted as Wᵀ (−dv_new)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(dvn_s, dvn_g.at[b, pl.ds(c * CHUNK, CHUNK), h])
      return _accumulate(_decayed(decay_s.at[slot], dS_KV), (T(qs_s.at[slot]), do_s.at[slot]),
                         (T(w_s.at[slot]), neg_dvn_s))

    chunks = _ChunkPipeline((do_g, aqk_g, kd_g, qs_g, w_g), (do_s, aqk_s, kd_s, qs_s, w_s), decay_g, decay_s,
                            loaded, b, h)
    return chunks.walk(num_chunks, lambda i: num_chunks - 1 - i, chunk, dS_T)

  dS0 = pl.run_scoped(pipeline, _tiles(V), _tiles(CHUNK), _tiles(K), _tiles(K), _tiles(K),
                      plgpu.SMEM((STAGES, K), F32), _square(K, V, BF16), _square(CHUNK, V, BF16),
                      _square(CHUNK, V, BF16), plgpu.Barrier(num_barriers=6 * STAGES))
  _store_state(dS0, ds0_g.at[b, h])
