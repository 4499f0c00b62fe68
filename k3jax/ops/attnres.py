"""The AttnRes read-out (docs/design.md, AttnRes) as one op with a hand-written backward pass.

    s_n = qᵀ RMSNorm_g(v_n) = a_n · r_n,     a_n = (q ⊙ g)ᵀ v_n,   r_n = (mean_d v_n² + ε)^-½
    w   = softmax of s over the valid n,     h = Σ_n w_n v_n

The values are a stacked buffer `[C,B,T,D]` (valid where `valid_C`) and single arrays `[B,T,D]` (valid where
`valid_E`), all fp32; what is not valid has weight exactly 0 and a zero cotangent.

The backward pass, from `w`, `a` and `r` kept per value and token (`[N,B,T]`, small beside the values):

    dw_n = dhᵀ v_n,   ds_n = w_n (dw_n − Σ_m w_m dw_m)
    dv_n = w_n dh + ds_n r_n (q ⊙ g) − ds_n a_n r_n³ / D · v_n
    dq = g ⊙ u,   dg = q ⊙ u,   u = Σ_{n, tokens} ds_n r_n v_n

Each line is one elementwise-and-reduce pass over the values, which XLA fuses (the buffer's cotangent with the sum
it is added to). Autodiff of the same formula goes through the normalised keys and the softmax's own VJP and reads
and writes the values several more times (`experiments/bench_attnres.py` times the two).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def readout(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, *, eps: float):
  """h `[B,T,D]` fp32. `query_D`, `scale_D`: the pseudo-query and the key RMSNorm's weight; `buffer_CBTD` fp32 (C
  may be 0) with `valid_C` bool `[C]`; `values` a tuple of E fp32 `[B,T,D]` with `valid_E` bool `[E]`. At least one
  value must be valid (else the weights are NaN)."""
  return _readout(query_D, scale_D, buffer_CBTD, valid_C, tuple(values), valid_E, eps)


def weights(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, *, eps: float):
  """The read-out's softmax weights `[C+E,B,T]`: the buffer's slots, then `values` in order."""
  return _forward(query_D, scale_D, buffer_CBTD, valid_C, tuple(values), valid_E, eps)[1]


def readout_reference(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, *, eps: float,
                      precision=jax.lax.Precision.HIGHEST):
  """`readout` as the formula reads, left to autodiff: every value stacked, RMS-normalised and scored (the test
  reference; at `precision=DEFAULT`, which may be TF32 on a GPU, what the model ran before the op, timed by
  `experiments/bench_attnres.py`)."""
  v_NBTD = jnp.concatenate([buffer_CBTD, *(v[None] for v in values)])
  valid_N = jnp.concatenate([valid_C, valid_E])
  keys_NBTD = v_NBTD * jax.lax.rsqrt(jnp.mean(v_NBTD * v_NBTD, axis=-1, keepdims=True) + eps) * scale_D
  s_NBT = jnp.einsum("d,nbtd->nbt", query_D, keys_NBTD, precision=precision)
  w_NBT = jax.nn.softmax(jnp.where(valid_N[:, None, None], s_NBT, -jnp.inf), axis=0)
  return jnp.einsum("nbt,nbtd->btd", w_NBT, jnp.where(valid_N[:, None, None, None], v_NBTD, 0.0), precision=precision)


def _forward(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps):
  qg = query_D * scale_D
  stats = lambda v: (jnp.sum(v * qg, axis=-1), jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps))
  a_C, r_C = stats(buffer_CBTD)
  a_E, r_E = zip(*map(stats, values)) if values else ((), ())
  a_N = jnp.concatenate([a_C, *(a[None] for a in a_E)])
  r_N = jnp.concatenate([r_C, *(r[None] for r in r_E)])
  valid_N = jnp.concatenate([valid_C, valid_E])
  s_N = jnp.where(valid_N[:, None, None], a_N * r_N, -jnp.inf)
  w_N = jax.nn.softmax(s_N, axis=0)
  # Summed value by value in order (one fusion; no matrix unit, whose fp32 may be TF32): a `Stream` and the `Carry`
  # holding the same sources give the same sum, since a slot that is not valid adds an exact 0. (One reduction over
  # the buffer's slot axis compiles faster, through XLA's priority fusion, but runs slower on the GPU.)
  all_values = [buffer_CBTD[i] for i in range(buffer_CBTD.shape[0])] + list(values)
  h = sum(w_N[i][..., None] * v for i, v in enumerate(all_values))
  return h, w_N, a_N, r_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _readout(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps):
  return _forward(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps)[0]


def _readout_fwd(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps):
  h, w_N, a_N, r_N = _forward(query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, eps)
  return h, (query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, w_N, a_N, r_N)


def _readout_bwd(eps, residuals, dh):
  del eps
  query_D, scale_D, buffer_CBTD, valid_C, values, valid_E, w_N, a_N, r_N = residuals
  c, d = buffer_CBTD.shape[0], query_D.shape[0]
  dw_C = jnp.sum(dh * buffer_CBTD, axis=-1)
  dw_N = jnp.concatenate([dw_C, *(jnp.sum(dh * v, axis=-1)[None] for v in values)])
  ds_N = w_N * (dw_N - jnp.sum(w_N * dw_N, axis=0))    # 0 where not valid (w = 0)
  c_N = ds_N * r_N                                            # coefficient of q ⊙ g
  k_N = -ds_N * a_N * r_N ** 3 / d                            # coefficient of v itself
  qg = query_D * scale_D

  def dv(i, v):
    return w_N[i][..., None] * dh + c_N[i][..., None] * qg + k_N[i][..., None] * v

  d_buffer = jnp.where(valid_C[:, None, None, None], dv(slice(0, c), buffer_CBTD), 0.0)
  d_values = tuple(jnp.where(valid_E[i], dv(c + i, v), 0.0) for i, v in enumerate(values))
  u = jnp.sum(c_N[:c, ..., None] * buffer_CBTD, axis=(0, 1, 2))
  u = u + sum(jnp.sum(c_N[c + i][..., None] * v, axis=(0, 1)) for i, v in enumerate(values))
  return scale_D * u, query_D * u, d_buffer, None, d_values, None


_readout.defvjp(_readout_fwd, _readout_bwd)
