"""The intra pass's solve as a Mosaic GPU kernel (wgmma, TMA), one warpgroup per chunk: the default on Hopper for
bf16 (`available`), faster there than the Triton `fwd._solve_kernel` (BUILD_NOTES.md, KDA kernels).

wgmma takes fp32 operands (as tf32) only from shared memory and untransposed, so the products here run on bf16
halves instead: x ≈ hi + lo, x·y ≈ hi·hi + hi·lo + lo·hi with fp32 accumulation (≈ 16 bits of mantissa, more than
tf32's 11). On the CPU the kernel runs in Mosaic GPU's interpret mode (tests only).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret_mode, mosaic_gpu_reason
from pallas_kernels.kda.tiles import CHUNK, F32

BF16 = jnp.bfloat16
WGMMA = plgpu.Layout.WGMMA


def _takes(dtype, K, V):
  return jnp.dtype(dtype) == BF16 and not any(d % 64 or d > 256 for d in (K, V))


def available(dtype, K, V):
  """Whether `fwd.intra_forward` uses this kernel by default: inputs it takes, on a Hopper GPU (wgmma is Hopper's;
  elsewhere the Triton solve runs), in interpret mode, or lowered for the GPU from a machine without one (export)."""
  return _takes(dtype, K, V) and mosaic_gpu_reason(off_gpu=True) is None


def check_supported(dtype, K, V):
  """Raises unless this kernel takes these inputs: bf16, K and V multiples of 64 up to 256 (wgmma's N)."""
  if not _takes(dtype, K, V):
    raise ValueError(f"the Mosaic GPU solve takes bf16 with K, V in (64, 128, 192, 256); got {jnp.dtype(dtype).name}, "
                     f"K={K}, V={V}")


def solve(beta_BHT, kk_BTHC, kgb_BTHK, v_BTHV, *, save, diagonal_inverted=False):
  """M = (I + βB)⁻¹ per chunk, U = M βV and W = M (βΓK), as `fwd._solve_kernel`: β `[B,H,T]` fp32 (heads before
  time, so a chunk's β is contiguous for TMA), B fp32 `[B,T,H,64]`, βΓK and V bf16. Returns W, U (bf16) and M (fp32
  `[B,T,H,64]`, or None unless `save`). `diagonal_inverted`: B's 16x16 diagonal blocks hold (I + βB_II)⁻¹ − I
  (the key tiles' `invert_diagonal`), so the inverse takes two doubling steps instead of six steps."""
  B, T, H, K = kgb_BTHK.shape
  V = v_BTHV.shape[-1]
  check_supported(kgb_BTHK.dtype, K, V)
  if diagonal_inverted and save:
    raise ValueError("solve_mosaic.solve: diagonal_inverted does not write M (save=False only)")
  out = [jax.ShapeDtypeStruct((B, T, H, K), BF16), jax.ShapeDtypeStruct((B, T, H, V), BF16)]
  out += [jax.ShapeDtypeStruct((B, T, H, CHUNK), F32)] if save else []
  w, u, *m = plgpu.kernel(
      functools.partial(_chunk, H=H, diagonal_inverted=diagonal_inverted), out_type=out, grid=(B * H, T // CHUNK),
      grid_names=("bh", "n"), compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      kernel_name="kda_intra_fwd_solve_mosaic", interpret=plgpu.InterpretGPUParams() if interpret_mode() else None,
  )(beta_BHT, kk_BTHC, kgb_BTHK, v_BTHV)
  return w, u, (m[0] if save else None)


def swizzled(dtype):
  """Shared-memory transforms for wgmma operands and TMA: 128-byte rows, swizzled."""
  return plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128)


def _halves(x):
  """bf16 hi and lo parts of fp32 x (x ≈ hi + lo to ≈ 16 bits of mantissa)."""
  hi = x.astype(BF16)
  return hi, (x - hi.astype(F32)).astype(BF16)


def _product(shape, *pairs):
  """Σ a·b over the (a, b) pairs of shared-memory operands, fp32, waited for."""
  def scoped(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a, b)
    plgpu.wgmma_wait(0)
    return acc[...]
  return pl.run_scoped(scoped, plgpu.ACC(shape, F32))


def _unit_lower_inverse(a, squares, diagonal=None):
  """(I + a)⁻¹ of the chunk's strictly lower [64,64] a (fp32, wgmma layout), as `tiles.unit_lower_inverse`: Neumann
  series on the 4x4 diagonal blocks, then four doubling steps; each product on bf16 halves staged through the four
  [64,64] bf16 shared-memory `squares`. With `diagonal` (its 16x16 diagonal blocks hold theirs less I), only the
  doubling steps to 32 and 64 rows remain."""
  a_hi, a_lo, b_hi, b_lo = squares
  r = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=WGMMA)
  c = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=WGMMA)
  eye = jnp.where(r == c, 1.0, 0.0).astype(F32)

  def mm(x, y):
    (a_hi[...], a_lo[...]), (b_hi[...], b_lo[...]) = _halves(x), _halves(y)
    plgpu.commit_smem()
    return _product((CHUNK, CHUNK), (a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi))

  if diagonal is not None:
    x = eye + jnp.where(r // 16 == c // 16, diagonal, 0.0)
  else:
    n4 = jnp.where(r // 4 == c // 4, a, 0.0)
    x = eye - n4
    for _ in range(2):
      x = eye - mm(n4, x)
  for blk in (4, 8, 16, 32) if diagonal is None else (16, 32):
    outside = (r // (2 * blk) == c // (2 * blk)) & (r // blk != c // blk)
    x = x - mm(x, mm(jnp.where(outside, a, 0.0), x))
  return x


def _solve_in_place(b_kk, beta_s, squares, v, kgb, m_s, diagonal_inverted):
  """M = (I + βB)⁻¹ from B (fp32 [64,64], wgmma layout), written to `m_s` if given, then U = M βV over V's
  shared-memory buffer and W = M (βΓK) over βΓK's; V and βΓK are exact in bf16, so two products on M's halves each.
  With `diagonal_inverted`, B's diagonal blocks are inverses already (β included), so only the rest takes β.
  The caller commits shared memory before storing."""
  a_hi, a_lo, b_hi, b_lo = squares
  beta = lambda dim: lax.broadcast_in_dim(plgpu.load(beta_s, layout=WGMMA.reduce(1 - dim)), (CHUNK, CHUNK), [dim])
  x = _unit_lower_inverse(b_kk * beta(0), squares, b_kk if diagonal_inverted else None)
  if m_s is not None:
    m_s[...] = x
  (a_hi[...], a_lo[...]), (b_hi[...], b_lo[...]) = _halves(x * beta(1)), _halves(x)
  plgpu.commit_smem()
  for (hi, lo), buf in (((a_hi, a_lo), v), ((b_hi, b_lo), kgb)):
    buf[...] = _product((CHUNK, buf.shape[-1]), (hi, buf), (lo, buf)).astype(BF16)


def _chunk(beta_gmem, kk_gmem, kgb_gmem, v_gmem, w_gmem, u_gmem, *m_gmem, H, diagonal_inverted):
  n, bh = lax.axis_index("n"), lax.axis_index("bh")
  b, h, rows = bh // H, bh % H, pl.ds(n * CHUNK, CHUNK)
  K, V = kgb_gmem.shape[-1], v_gmem.shape[-1]
  square = lambda dtype: plgpu.SMEM((CHUNK, CHUNK), dtype, transforms=swizzled(dtype))
  wide = lambda d: plgpu.SMEM((CHUNK, d), BF16, transforms=swizzled(BF16))

  # M, W and U overwrite B, βΓK and V once read: 80 KB at K = V = 128, two programs per SM.
  def scoped(kk, beta, kgb, v, a_hi, a_lo, b_hi, b_lo, loaded):
    copies = ((kk_gmem.at[b, rows, h], kk), (beta_gmem.at[b, h, rows], beta), (kgb_gmem.at[b, rows, h], kgb),
              (v_gmem.at[b, rows, h], v))
    for i, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    for i in range(len(copies)):
      plgpu.barrier_wait(loaded.at[i])
    _solve_in_place(plgpu.load(kk, layout=WGMMA), beta, (a_hi, a_lo, b_hi, b_lo), v, kgb, kk if m_gmem else None,
                    diagonal_inverted)
    plgpu.commit_smem()
    for src, dst in ((v, u_gmem), (kgb, w_gmem)) + (((kk, m_gmem[0]),) if m_gmem else ()):
      plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(scoped, square(F32), plgpu.SMEM((CHUNK,), F32), wide(K), wide(V), *[square(BF16)] * 4,
                plgpu.Barrier(num_barriers=4))
