"""The held-out evaluation's statistics: the paired change of success and its noise, and the before/after table."""
import numpy as np
import pytest

from k3jax.rl import evaluate


def outcomes(rng, n, p):
  return (rng.random(n) < p).astype(int)


def test_paired_noise_counts_the_problems_whose_outcome_changed():
  before = [1, 1, 0, 0, 1, 0, 1, 0, 0, 1]
  after = [1, 0, 1, 1, 1, 0, 1, 1, 0, 1]   # three up, one down, six unchanged
  delta, noise = evaluate.paired_change(before, after)
  assert delta == pytest.approx((3 - 1) / 10)
  assert noise == pytest.approx(2 * np.sqrt(3 + 1 + 1) / 10)
  # Problems both policies solve (or both fail) add nothing: the noise is far below two independent rates' errors.
  rng = np.random.default_rng(0)
  b = outcomes(rng, 256, 0.6)
  a = b.copy()
  a[rng.choice(256, 10, replace=False)] ^= 1
  unpaired = 2 * np.sqrt(b.mean() * (1 - b.mean()) / 256 + a.mean() * (1 - a.mean()) / 256)
  assert evaluate.paired_change(b, a)[1] < 0.5 * unpaired


def test_change_beyond_the_noise_is_rare_without_an_effect_and_usual_with_one():
  rng = np.random.default_rng(1)
  n, trials = 128, 2000

  def beyond(p_up, p_down):
    hits = 0
    for _ in range(trials):
      b = outcomes(rng, n, 0.6)
      u = rng.random(n)
      a = np.where(b == 0, (u < p_up).astype(int), (u >= p_down).astype(int))
      delta, noise = evaluate.paired_change(b, a)
      hits += abs(delta) > noise
    return hits / trials

  assert 0.01 <= beyond(0.1, 0.1 * 0.4 / 0.6) <= 0.08   # as many problems flip each way: ≈ 5% (two errors)
  assert beyond(0.3, 0.02) >= 0.9                        # a rise of ≈ 0.11: nearly always beyond it


def test_points_averaged_per_problem_so_a_repeated_point_is_not_counted_as_new_evidence():
  rng = np.random.default_rng(2)
  b, a = outcomes(rng, 64, 0.5), outcomes(rng, 64, 0.5)
  one = evaluate.paired_change(b, a)
  assert evaluate.paired_change([b, b], [a, a]) == pytest.approx(one)
  with pytest.raises(ValueError, match="same problems"):
    evaluate.paired_change([b, b], [a])


def test_table_marks_changes_beyond_the_noise_and_says_when_outcomes_were_not_kept():
  point = lambda c: {"success_rate": float(np.mean(c)), "correct": c,
                     "success_by_links": {"1": {"success_rate": float(np.mean(c)), "episodes": len(c)}}}
  before = {"lookup@4096": point([0] * 40 + [1] * 60), "calc@4096": point([0] * 50 + [1] * 50)}
  after = {"lookup@4096": point([1] * 100), "calc@4096": point([1] * 49 + [0] * 51)}
  lines = evaluate.format_table(before, after, 4096).splitlines()
  assert lines[1].split() == ["lookup@4096", "0.600", "1.000", "+0.400", "0.128*"]
  calc = next(line for line in lines if line.startswith("calc@4096"))
  assert calc.split()[3:] == ["-0.010", "0.200"]   # 49 up, 50 down: 99 changed problems, within the noise
  old = {"lookup@16384": {"success_rate": 0.5}}
  line = evaluate.format_table(old, {"lookup@16384": {"success_rate": 0.6}}, 4096).splitlines()[1]
  assert line.split()[:5] == ["lookup@16384", "0.500", "0.600", "—", "—"] and "4x the trained length" in line
