"""The forward's state pass as a Mosaic GPU kernel (wgmma, TMA pipeline), one warpgroup per (column block, batch·head,
segment): the undifferentiated forward's default on Hopper for bf16 (`solve_mosaic.available`).

The state is kept transposed, Sᵀ `[block_v, K]` fp32 in registers, so the recurrence's two dependent products take
their left operands from registers and nothing on the chain goes through shared memory:
v_newᵀ = I·Uᵀ − Sᵀ·Wᵀ, then Sᵀ ← Sᵀ ⊙ decay + v_newᵀ·Kd. The output o = Qs·S + A_qk·v_new reads Sᵀ and v_newᵀ back
from shared memory, off the chain. The next chunks' W, U, Qs, Kd and A_qk arrive by TMA while one is computed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret_mode
from pallas_kernels.kda.solve_mosaic import BF16, WGMMA, _swizzled, check_supported
from pallas_kernels.kda.tiles import CHUNK, F32

T_ = (1, 0)


def state_forward(w, u, qs, kd, aqk, decay, starts, *, block_v=64, stages=2):
  """As `fwd.state_forward` without `save`: w, qs, kd `[B,T,H,K]`, u `[B,T,H,V]`, aqk `[B,T,H,64]` (bf16), decay
  fp32 `[B,N,H,K]`, starts fp32 `[B,H,segments,K,V]` (each segment's entering state). Returns o `[B,T,H,V]` and the
  states at the segments' ends `[B,H,segments,K,V]` fp32."""
  B, T, H, K = w.shape
  V = u.shape[-1]
  segments = starts.shape[2]
  check_supported(w.dtype, K, V)
  if V % block_v or block_v % 64:
    raise ValueError(f"state_mosaic.state_forward: block_v={block_v} must be a multiple of 64 dividing V={V}")
  if T % (segments * CHUNK):
    raise ValueError(f"state_mosaic.state_forward: {segments} segments must divide the {T // CHUNK} chunks")
  steps = T // segments // CHUNK
  o, ends_T = plgpu.kernel(
      functools.partial(_program, H=H, steps=steps, block_v=block_v, stages=min(stages, steps)),
      out_type=[jax.ShapeDtypeStruct((B, T, H, V), w.dtype), jax.ShapeDtypeStruct((B, H, segments, V, K), F32)],
      grid=(V // block_v, B * H, segments), grid_names=("vb", "bh", "s"),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      kernel_name="kda_state_fwd_mosaic", interpret=plgpu.InterpretGPUParams() if interpret_mode() else None,
  )(w, u, qs, kd, aqk, decay, jnp.swapaxes(starts.astype(F32), -1, -2))
  return o, jnp.swapaxes(ends_T, -1, -2)


def _program(w_g, u_g, qs_g, kd_g, aqk_g, decay_g, s0_g, o_g, end_g, *, H, steps, block_v, stages):
  vb, bh, s = lax.axis_index("vb"), lax.axis_index("bh"), lax.axis_index("s")
  b, h = bh // H, bh % H
  K = w_g.shape[-1]
  rows, cols = pl.ds(s * steps * CHUNK, steps * CHUNK), pl.ds(vb * block_v, block_v)
  S_T = plgpu.load(s0_g.at[b, h, s, cols], (), layout=WGMMA, optimized=False)

  def chunks(eye_smem, s_smem, vn_smem, o_smem):
    r = plgpu.broadcasted_iota(jnp.int32, (block_v, block_v), 0, layout=WGMMA)
    c = plgpu.broadcasted_iota(jnp.int32, (block_v, block_v), 1, layout=WGMMA)
    eye_smem[...] = jnp.where(r == c, -1.0, 0.0).astype(BF16)

    def body(idx, w_s, u_s, qs_s, kd_s, aqk_s, decay_s, S_T):
      s_smem[...] = S_T.astype(BF16)
      plgpu.commit_smem()

      def new_values(acc):   # −v_newᵀ = (−I) Uᵀ + Sᵀ Wᵀ
        plgpu.wgmma(acc, eye_smem, u_s.transpose(T_))
        plgpu.wgmma(acc, s_smem, w_s.transpose(T_))
        plgpu.wgmma_wait(0)
        return acc[...]
      vn_smem[...] = (-pl.run_scoped(new_values, plgpu.ACC((block_v, CHUNK), F32))).astype(BF16)
      plgpu.commit_smem()
      decay = lax.broadcast_in_dim(plgpu.load(decay_s.at[0], (), layout=WGMMA.reduce(0)), S_T.shape, [1])

      def advance(acc):   # v_newᵀ Kd
        plgpu.wgmma(acc, vn_smem, kd_s)
        plgpu.wgmma_wait(0)
        return acc[...]
      S_next = S_T * decay + pl.run_scoped(advance, plgpu.ACC(S_T.shape, F32))

      def output(acc):   # o = Qs S + A_qk v_new
        plgpu.wgmma(acc, qs_s, s_smem.transpose(T_))
        plgpu.wgmma(acc, aqk_s, vn_smem.transpose(T_))
        plgpu.wgmma_wait(0)
        return acc[...]
      o = pl.run_scoped(output, plgpu.ACC((CHUNK, block_v), F32)).astype(o_smem.dtype)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous chunk's o has left o_smem
      o_smem[...] = o
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_g.at[b, pl.ds((s * steps + idx[0]) * CHUNK, CHUNK), h, cols])
      return S_next

    tile = lambda d: plgpu.BlockSpec((CHUNK, d), lambda n: (n, 0), transforms=_swizzled(BF16))
    pipeline = plgpu.emit_pipeline(
        body, grid=(steps,), in_specs=[tile(K), tile(block_v), tile(K), tile(K), tile(CHUNK),
                                       plgpu.BlockSpec((1, K), lambda n: (n, 0))],
        max_concurrent_steps=stages, init_carry=S_T)
    return pipeline(w_g.at[b, rows, h], u_g.at[b, rows, h, cols], qs_g.at[b, rows, h], kd_g.at[b, rows, h],
                    aqk_g.at[b, rows, h], decay_g.at[b, pl.ds(s * steps, steps), h])
  square = lambda d: plgpu.SMEM((block_v, d), BF16, transforms=_swizzled(BF16))
  S_T = pl.run_scoped(chunks, square(block_v), square(K), square(CHUNK),
                      plgpu.SMEM((CHUNK, block_v), BF16, transforms=_swizzled(BF16)))

  plgpu.wait_smem_to_gmem(0)
  end_g.at[b, h, s, cols][...] = S_T
