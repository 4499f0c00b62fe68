"""The error measure of the tests and benchmarks (docs/design.md, tolerances)."""
import numpy as np


def rel_err(out, ref) -> float:
  """RMS(out − ref) / RMS(ref) in float64; NaN or Inf anywhere in `out` gives inf."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(out)):
    return float("inf")
  return float(np.sqrt(np.mean((out - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))
