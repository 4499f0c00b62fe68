"""experiments.ablations.router_sim: the article balancer's two step forms on synthetic routers."""
import pytest

from experiments.ablations import router_sim


def test_fixed_step_swings_where_scores_are_nearly_equal_and_the_gap_step_balances():
  rows = router_sim.study([0.05], [("gap", 16.0, 8.0), ("gap", 2.0, 1.0), ("fixed", 0.05, 1.0)], experts=16,
                          top_k=2, tokens=2048, steps=60)
  wide, first, fixed = rows
  assert [r["step"] for r in rows] == ["gap", "gap", "fixed"] and {r["spread"] for r in rows} == {0.05}
  for gap in (wide, first):
    assert gap["max_vio_before_reversal"] < 0.5 and gap["max_vio_last"] < 0.5 and gap["first_below_half"] < 10
  assert fixed["max_vio_before_reversal"] > 2.0
  table = router_sim.format_table(rows).splitlines()
  assert len(table) == 4 and table[1].split()[:4] == ["gap", "16.000", "8.0", "0.05"]


def test_the_wide_load_unit_follows_a_reversal_of_saturated_scores_better_than_the_first_defaults():
  """At σ = 3 (most scores near 0 or 1) a step in proportion to the deviation over eight shares recovers from the
  preferences' reversal where two gaps at one share stay unbalanced (BUILD_NOTES, Balancer)."""
  wide, first = router_sim.study([3.0], [("gap", 16.0, 8.0), ("gap", 2.0, 1.0)], experts=64, top_k=4, tokens=4096,
                                 steps=60)
  assert wide["max_vio_last"] < first["max_vio_last"]


def test_run_refuses_an_unknown_step_form():
  with pytest.raises(ValueError, match="step must be"):
    router_sim.run(0.1, step="exact", rate=1.0, experts=8, top_k=2, tokens=64, steps=2)
