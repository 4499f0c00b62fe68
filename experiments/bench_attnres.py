"""The AttnRes read-out, forward and forward + backward: the op with its hand-written backward pass
(`k3jax.ops.attnres.readout`, as XLA fuses it) against autodiff of the same formula (`readout_reference`) and, for
a buffer, its summary (`summarize_buffer` once, then `readout_from_summary` per read-out), at small's shapes:

  python -m experiments.bench_attnres                 # GPU: small's read-outs at 4K (B·T = 65,536, d = 768)
  python -m experiments.bench_attnres --small         # CPU: tiny shapes, checks only

"autodiff" is the formula at the matrix units' default precision, as the model ran it before the op; both are
checked against the formula in full fp32 (`readout_reference`). The read-outs, as the model has them: a scanned
group's (a buffer of 5 slots, 3 valid, then a closed sum that did not close and the partial sum), all 8 of a
scanned group of 4 layers (one buffer, each read-out its own query and single values), and an unrolled layer's (3
single values). Each row: device time per call (pipelined), kernel launches, and GB/s counting the valid values
read once. Rows to $OUT/bench_attnres.json; the op or the summary failing its check fails the command. (Alone, the
8 read-outs' buffer cotangents may fuse into one sum; in the train step each layer's backward pass is its own.)
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
# (name, buffer slots, valid slots, single values' valid flags, read-outs of the buffer)
CASES = (("scanned group", 5, 3, (False, True), 1), ("scanned group, 8 read-outs", 5, 3, (False, True), 8),
         ("unrolled layer", 0, 0, (True, True, True), 1))


def each(readout):
  """J read-outs `readout(q, g, buffer, valid_C, values, valid_E)`, one per row of the queries."""
  return lambda qs, gs, buf, vc, vals, ve: tuple(readout(qs[j], gs[j], buf, vc, vals[j], ve, eps=EPS)
                                                 for j in range(qs.shape[0]))


def summarized(qs, gs, buf, vc, vals, ve):
  summary = attnres_ops.summarize_buffer(qs, gs, buf, vc, eps=EPS)
  return tuple(attnres_ops.readout_from_summary(qs[j], gs[j], summary.part(j), vals[j], ve, eps=EPS)
               for j in range(qs.shape[0]))


IMPLS = {"op": each(attnres_ops.readout),
         "autodiff": each(functools.partial(attnres_ops.readout_reference, precision=jax.lax.Precision.DEFAULT)),
         "summary": summarized}
CHECKED = ("op", "summary")   # held to fp32 autodiff of the formula


def inputs(tokens: int, d: int, C: int, count: int, valid_E, J: int):
  keys = jax.random.split(jax.random.PRNGKey(0), 4 + len(valid_E))
  B = 16 if tokens % 16 == 0 else 1
  T = tokens // B
  qs = jax.random.normal(keys[0], (J, d))
  gs = 1.0 + 0.1 * jax.random.normal(keys[1], (J, d))
  buffer = jax.random.normal(keys[2], (C, B, T, d))
  values = tuple(tuple(jax.random.normal(jax.random.fold_in(k, j), (B, T, d)) for k in keys[4:]) for j in range(J))
  dh = tuple(jax.random.normal(jax.random.fold_in(keys[3], j), (B, T, d)) for j in range(J))
  return qs, gs, buffer, jnp.arange(C) < count, values, jnp.asarray(valid_E), dh


def programs(fn):
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
  for name, C, count, valid_E, J in CASES:
    q, g, buf, vc, vals, ve, dh = inputs(tokens, d, C, count, valid_E, J)
    valid_bytes = 4 * tokens * d * (count + J * sum(valid_E))   # the buffer read once
    reference = programs(each(functools.partial(attnres_ops.readout_reference,
                                                precision=jax.lax.Precision.HIGHEST)))[1]
    want = jax.tree.leaves(reference(q, g, buf, vc, vals, ve, dh))
    for impl, fn in IMPLS.items():
      if impl == "summary" and not C:
        continue   # no buffer to summarize
      fwd, fwd_bwd = programs(fn)
      got = jax.tree.leaves(fwd_bwd(q, g, buf, vc, vals, ve, dh))
      # max |error| / max |value| over h and every gradient
      err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) for a, b in zip(got, want) if b.size)
      row = {"case": name, "impl": impl, "tokens": tokens, "d": d, "read_outs": J, "max_rel_err": err}
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
      print(f"{r['case']:<26} {r['impl']:<10} fwd {r['fwd_ms']:7.3f} ms ({r['fwd_launches']:.0f} launches, "
            f"{r['fwd_gb_s']:6.0f} GB/s)  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms ({r['fwd_bwd_launches']:.0f} launches)")
  bad = [f"{r['case']} {r['impl']}" for r in rows if r["impl"] in CHECKED and not r["max_rel_err"] < 1e-5]
  if bad:
    raise SystemExit(f"differs from fp32 autodiff: {bad}")


if __name__ == "__main__":
  app.run(main)
