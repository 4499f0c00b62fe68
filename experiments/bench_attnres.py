"""The AttnRes read-out, forward and forward + backward: the op with its hand-written backward pass
(`k3jax.ops.attnres.readout`) against autodiff of the same formula (`readout_reference`), at small's shapes:

  python -m experiments.bench_attnres                 # GPU: small's read-outs at 4K (B·T = 65,536, d = 768)
  python -m experiments.bench_attnres --small         # CPU: tiny shapes, checks only

"autodiff" is the formula at the matrix units' default precision, as the model ran it before the op; both are
checked against the formula in full fp32 (`readout_reference`). Two read-outs, as the model has them: a scanned
group's (a buffer of 5 slots, 3 valid, then a closed sum that did not close and the partial sum) and an unrolled
layer's (3 single values). Each row: device time per call (pipelined), kernel launches, and GB/s counting the valid
values read once. Rows to $OUT/bench_attnres.json; the op failing its check fails the command.
"""
import functools
import os

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import harness
from k3jax.ops import attnres as attnres_ops

FLAGS = flags.FLAGS
flags.DEFINE_integer("tokens", 65536, "B·T")
flags.DEFINE_integer("d_model", 768, "d")
flags.DEFINE_integer("repeats", 10, "timed repetitions (median)")
flags.DEFINE_bool("small", False, "tiny shapes on the CPU: checks, no meaningful times")
flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "bench_attnres.json") if os.environ.get("OUT") else "",
                    "JSON file for the rows")

EPS = 1e-6
# (name, buffer slots, valid slots, single values' valid flags)
CASES = (("scanned group", 5, 3, (False, True)), ("unrolled layer", 0, 0, (True, True, True)))
IMPLS = {"op": attnres_ops.readout,
         "autodiff": functools.partial(attnres_ops.readout_reference, precision=jax.lax.Precision.DEFAULT)}


def inputs(tokens: int, d: int, C: int, count: int, valid_E):
  keys = jax.random.split(jax.random.PRNGKey(0), 4 + len(valid_E))
  B = 16 if tokens % 16 == 0 else 1
  T = tokens // B
  q = jax.random.normal(keys[0], (d,))
  g = 1.0 + 0.1 * jax.random.normal(keys[1], (d,))
  buffer = jax.random.normal(keys[2], (C, B, T, d))
  values = tuple(jax.random.normal(k, (B, T, d)) for k in keys[4:])
  dh = jax.random.normal(keys[3], (B, T, d))
  return q, g, buffer, jnp.arange(C) < count, values, jnp.asarray(valid_E), dh


def programs(readout):
  fn = lambda q, g, buf, vc, vals, ve: readout(q, g, buf, vc, vals, ve, eps=EPS)
  fwd = jax.jit(fn)

  @jax.jit
  def fwd_bwd(q, g, buf, vc, vals, ve, dh):
    h, vjp = jax.vjp(lambda q, g, buf, vals: fn(q, g, buf, vc, vals, ve), q, g, buf, vals)
    return h, vjp(dh)
  return fwd, fwd_bwd


def main(argv):
  harness.check_argv(argv)
  tokens, d = (64, 32) if FLAGS.small else (FLAGS.tokens, FLAGS.d_model)
  rows = []
  for name, C, count, valid_E in CASES:
    q, g, buf, vc, vals, ve, dh = inputs(tokens, d, C, count, valid_E)
    valid_bytes = 4 * tokens * d * (count + sum(valid_E))
    reference = programs(functools.partial(attnres_ops.readout_reference, precision=jax.lax.Precision.HIGHEST))[1]
    want = jax.tree.leaves(reference(q, g, buf, vc, vals, ve, dh))
    for impl, fn in IMPLS.items():
      fwd, fwd_bwd = programs(fn)
      got = jax.tree.leaves(fwd_bwd(q, g, buf, vc, vals, ve, dh))
      # max |error| / max |value| over h and every gradient
      err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) for a, b in zip(got, want) if b.size)
      row = {"case": name, "impl": impl, "tokens": tokens, "d": d, "max_rel_err": err}
      if not FLAGS.small:
        programs_args = (("fwd", fwd, (q, g, buf, vc, vals, ve)), ("fwd_bwd", fwd_bwd, (q, g, buf, vc, vals, ve, dh)))
        for label, f, args in programs_args:
          s = harness.pipelined_seconds(f, *args, repeats=FLAGS.repeats)
          row[f"{label}_ms"] = 1e3 * s
          row[f"{label}_launches"] = sum(n for _, n, _ in harness.device_kernel_times(f, *args))
        row["fwd_gb_s"] = valid_bytes / (row["fwd_ms"] / 1e3) / 1e9
      rows.append(row)
      print(f"{name}: {impl} against fp32 autodiff, max |error| / max |value| over h and every gradient: {err:.2e}",
            flush=True)
  harness.write_json(FLAGS.out, rows)
  for r in rows:
    if "fwd_ms" in r:
      print(f"{r['case']:<15} {r['impl']:<9} fwd {r['fwd_ms']:7.3f} ms ({r['fwd_launches']:.0f} launches, "
            f"{r['fwd_gb_s']:6.0f} GB/s)  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms ({r['fwd_bwd_launches']:.0f} launches)")
  bad = [f"{r['case']} {r['impl']}" for r in rows if r["impl"] == "op" and not r["max_rel_err"] < 1e-5]
  if bad:
    raise SystemExit(f"the op differs from fp32 autodiff: {bad}")


if __name__ == "__main__":
  app.run(main)
