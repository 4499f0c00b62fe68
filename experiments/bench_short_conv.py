"""The KDA layer's short conv backward pass (`k3jax.ops.short_conv`) at small's shapes: XLA's fused formulas against
the Pallas kernel (dx and dw in one pass), over the kernel's tilings and its two forms (`Blocks.dpre`: dpre recomputed
at dx's W row shifts, or computed once and read back from a scratch):

  python -m experiments.bench_short_conv            # GPU: B·T = 16 × 4,096, q|k|v of 768 channels each, bf16
  python -m experiments.bench_short_conv --small    # CPU: tiny shapes, checks only (the kernel interpreted, the
                                                    # default tiling in both forms)

Each row: device time per backward call (pipelined), on one document per row and on packed documents, and the
largest difference from the fused backward over dx, the state's gradient and dw (max |error| / max |value|). Rows to
$OUT/bench_short_conv.json; a tiling whose dx (in x's dtype, as the op returns it) differs from the fused backward's
by more than one rounding to that dtype, or whose dstate or dw (fp32) by more than 1e-5, fails the command.
"""
import functools
import os

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import harness
from k3jax.ops import short_conv as conv_ops
from pallas_kernels import short_conv as conv_kernels

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 5, "timed repetitions (median)")
flags.DEFINE_bool("small", False, "tiny shapes on the CPU: checks, no meaningful times")
flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "bench_short_conv.json") if os.environ.get("OUT") else "",
                    "JSON file for the rows")

W = 4
PARTS = (768, 768, 768)
# (rows, channels, splits, num_warps, dpre) as `conv_kernels.Blocks` takes them: the default first, then the default
# tiling in the other form (--small checks these two)
TILINGS = ((8, 128, 16, 4, "stored"), (8, 128, 16, 4, "recomputed"), (8, 128, 8, 4, "stored"),
           (16, 128, 16, 4, "stored"), (16, 128, 8, 8, "stored"), (32, 128, 16, 8, "stored"), (8, 64, 16, 4, "stored"),
           (8, 64, 16, 4, "recomputed"), (16, 64, 4, 4, "recomputed"), (8, 128, 4, 4, "recomputed"))


def inputs(B: int, T: int, documents: bool):
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  C = sum(PARTS)
  x = jax.random.normal(keys[0], (B, T, C), jnp.bfloat16)
  state = jax.random.normal(keys[1], (B, W - 1, C), jnp.bfloat16)
  w = 0.5 * jax.random.normal(keys[2], (W, C), jnp.float32)
  dys = tuple(jax.random.normal(jax.random.fold_in(keys[3], i), (B, T, c), jnp.bfloat16) for i, c in enumerate(PARTS))
  seg_p = None
  if documents:   # about four documents a row
    seg = jnp.cumsum(jax.random.bernoulli(keys[4], 4 / T, (B, T)), axis=1).astype(jnp.int32)
    seg_p = conv_ops.segments_with_state(seg, W)
  return x, state, w, seg_p, dys


def rel_errs(got, want):
  """max |error| / max |value| of each of (dx, dstate, dw)."""
  return [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-30)) for a, b in zip(got, want)]


def within_bounds(errs, x_dtype) -> bool:
  """dx within one rounding to x's dtype of the fused backward's, dstate and dw (fp32) within 1e-5."""
  return errs[0] <= 0.5 * float(jnp.finfo(x_dtype).eps) + 1e-5 and max(errs[1:]) < 1e-5


def main(argv):
  harness.check_argv(argv)
  (B, T), tilings = ((1, 128), TILINGS[:2]) if FLAGS.small else ((16, 4096), TILINGS)
  rows = []
  for documents in (False, True):
    args = inputs(B, T, documents)
    fused = jax.jit(conv_ops._fused_backward)
    want = fused(*args)
    kernel = lambda t: jax.jit(functools.partial(conv_ops._kernel_backward, blocks=conv_kernels.Blocks(*t)))
    impls = [("fused", None, fused)] + [(f"kernel {t}", t, kernel(t)) for t in tilings]
    for name, tiling, fn in impls:
      row = {"impl": name, "tiling": tiling, "documents": documents, "B": B, "T": T,
             "rel_errs": rel_errs(fn(*args), want)}
      row["max_rel_err"], row["ok"] = max(row["rel_errs"]), within_bounds(row["rel_errs"], args[0].dtype)
      if not FLAGS.small:
        row["ms"] = 1e3 * harness.pipelined_seconds(fn, *args, repeats=FLAGS.repeats)
      rows.append(row)
      print(f"{'documents' if documents else 'one document':<13} {name:<36} "
            f"{row.get('ms', float('nan')):8.3f} ms   differs from fused (dx, dstate, dw) "
            f"{', '.join(f'{e:.1e}' for e in row['rel_errs'])}", flush=True)
  harness.write_json(FLAGS.out, rows)
  bad = [f"{r['impl']} (documents={r['documents']})" for r in rows if not r["ok"]]
  if bad:
    raise SystemExit(f"differs from the fused backward: {bad}")


if __name__ == "__main__":
  app.run(main)
