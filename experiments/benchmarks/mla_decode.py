"""What the MLA decode benchmark does (`bench_mla_decode.py` parses flags and calls `run`): MLA decode attention
over a long latent cache, the split-K Pallas kernel against XLA's einsums and JAX's own Pallas decode kernel
(`jax.experimental.pallas.ops.gpu.decode_attention.mqa`, given the latents as keys and values).

Each shape is q̃ `[B, H, R]` against a bf16 cache `[B, L, R]`, every row full (`ragged`: row lengths drawn in
[1, L]). Every implementation is first checked against the fp32 reference on the same inputs (bf16 within the
bound of docs/design.md's tolerances for this path: CHECK_TOL), then timed as device time per call
(`harness.pipelined_seconds`). GB/s counts the latents each row must read once (its length × R × 2 bytes); the
H200's HBM gives ~4.8 TB/s. `sweep` also times the launch configurations of SWEEP at the first shape.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments import harness
from k3jax.numerics import rel_err
from k3jax.ops.mla import decode_attention_xla
from pallas_kernels.mla_decode import DecodeConfig, mla_decode, mla_decode_reference

IMPLS = ("pallas", "xla", "jax_mqa")
CHECK_TOL = 1e-2
SWEEP = [DecodeConfig(block_l=b, num_warps=w, num_stages=s) for b in (64, 128) for w in (4, 8) for s in (2, 3)]
# Tiny shapes on the CPU (interpret mode): checks, no meaningful times (one call each).
SMALL = dict(lengths=[37, 256], batches=[1, 3], H=6, R=32, repeats=1)


def implementations(scale: float) -> dict:
  """IMPLS by name, each `(q_BHR, ckv_BLR, lengths_B) -> out_BHR` with softmax scale `scale`."""
  def jax_mqa(q, ckv, lengths):
    from jax.experimental.pallas.ops.gpu import decode_attention
    return decode_attention.mqa(q, ckv, ckv, kv_seq_len=lengths, sm_scale=scale,
                                interpret=jax.default_backend() != "gpu")
  return {"pallas": lambda q, ckv, n: mla_decode(q, ckv, n, scale=scale),
          "xla": lambda q, ckv, n: decode_attention_xla(q, ckv, n, scale=scale),
          "jax_mqa": jax_mqa}


def inputs(B, H, R, L, ragged: bool, seed=0):
  """(q `[B, H, R]`, cache `[B, L, R]`, lengths `[B]`) in bf16: every row full, or (`ragged`) lengths drawn in
  [1, L]."""
  kq, kc, kn = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (B, H, R), jnp.bfloat16)
  ckv = jax.random.normal(kc, (B, L, R), jnp.bfloat16)
  lengths = jax.random.randint(kn, (B,), 1, L + 1) if ragged else jnp.full((B,), L, jnp.int32)
  return q, ckv, lengths.astype(jnp.int32)


def measure(name, fn, q, ckv, lengths, ref, repeats) -> dict:
  """`fn`'s row: its error against `ref` and whether it is within CHECK_TOL, µs per call and GB/s of the latents
  the rows must read; {"impl", "error"} when it cannot run the shape."""
  f = jax.jit(fn)
  try:
    err = rel_err(f(q, ckv, lengths), ref)
    calls = 10 if repeats > 1 else 1                           # one call, once: a CPU run checks, it does not time
    seconds = harness.pipelined_seconds(f, q, ckv, lengths, repeats=repeats, calls=calls, warmup=min(2, repeats))
  except Exception as e:  # noqa: BLE001 (an implementation that cannot run a shape is reported, not fatal)
    return {"impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
  read = int(jnp.sum(lengths)) * ckv.shape[2] * ckv.dtype.itemsize
  return {"impl": name, "us": seconds * 1e6, "gb_per_s": read / seconds / 1e9, "err": err, "ok": err < CHECK_TOL}


def run(lengths, batches, H, R, impls, ragged, sweep, repeats) -> list[dict]:
  """A row per (shape, implementation of `impls`), each printed as it comes: full rows at every (B, L), ragged
  ones at B > 1 with `ragged`, and with `sweep` the Pallas kernel at each of SWEEP at the first shape."""
  bad = [i for i in impls if i not in IMPLS]
  if bad:
    raise ValueError(f"impls {bad}: each must be one of {IMPLS}")
  scale = 128 ** -0.5                     # 1/sqrt(d_qk), small's and K3's head dim
  fns = implementations(scale)
  rows = []
  cases = [(B, L, False) for L in lengths for B in batches] + [(B, L, True) for L in lengths for B in batches
                                                                if ragged and B > 1]
  for B, L, rag in cases:
    q, ckv, n = inputs(B, H, R, L, rag)
    ref = jax.jit(lambda q, c, n: mla_decode_reference(q, c, n, scale=scale))(q, ckv, n)
    for name in impls:
      row = {"B": B, "L": L, "ragged": rag, **measure(name, fns[name], q, ckv, n, ref, repeats)}
      rows.append(row)
      print(row, flush=True)
    del q, ckv, ref
  if sweep:
    B, L = batches[0], lengths[0]
    q, ckv, n = inputs(B, H, R, L, False)
    ref = mla_decode_reference(q, ckv, n, scale=scale)
    for config in SWEEP:
      row = {"B": B, "L": L, "ragged": False, "config": str(config),
             **measure("pallas", lambda q, c, n, config=config: mla_decode(q, c, n, scale=scale, config=config),
                       q, ckv, n, ref, repeats)}
      rows.append(row)
      print(row, flush=True)
  return rows


def format_table(rows) -> str:
  """The rows as a table, each with its speed-up over XLA's at the same shape."""
  lines = [f"{'B':>3} {'L':>8} {'ragged':>6} {'impl':>8} {'us':>9} {'GB/s':>7} {'rel err':>8}  vs xla"]
  xla = {(r["B"], r["L"], r["ragged"]): r.get("us") for r in rows if r["impl"] == "xla" and "config" not in r}
  for r in rows:
    if "error" in r:
      lines.append(f"{r['B']:>3} {r['L']:>8} {str(r['ragged']):>6} {r['impl']:>8}  error: {r['error'][:80]}")
      continue
    base = xla.get((r["B"], r["L"], r["ragged"]))
    ratio = f"{base / r['us']:.2f}x" if base else ""
    tag = f"  {r['config']}" if "config" in r else ""
    lines.append(f"{r['B']:>3} {r['L']:>8} {str(r['ragged']):>6} {r['impl']:>8} {r['us']:>9.1f} "
                 f"{r['gb_per_s']:>7.0f} {r['err']:>8.1e}  {ratio}{tag}")
  return "\n".join(lines)


def failed_rows(rows) -> list[dict]:
  """The Pallas kernel's rows that failed their check or did not run."""
  return [r for r in rows if r["impl"] == "pallas" and not r.get("ok")]
