"""experiments.ablations.router_sim: the article balancer's two step forms on synthetic routers."""
import pytest

from experiments.ablations import router_sim


def test_fixed_step_swings_where_scores_are_nearly_equal_and_the_gap_step_balances():
  rows = router_sim.study([0.05], [("gap", 2.0), ("fixed", 0.05)], experts=16, top_k=2, tokens=2048, steps=60)
  gap, fixed = rows
  assert (gap["step"], fixed["step"]) == ("gap", "fixed") and gap["spread"] == fixed["spread"] == 0.05
  assert gap["max_vio_before_reversal"] < 0.5 and gap["max_vio_last"] < 0.5 and gap["first_below_half"] < 10
  assert fixed["max_vio_before_reversal"] > 2.0
  table = router_sim.format_table(rows).splitlines()
  assert len(table) == 3 and table[1].split()[:3] == ["gap", "2.000", "0.05"]


def test_run_refuses_an_unknown_step_form():
  with pytest.raises(ValueError, match="step must be"):
    router_sim.run(0.1, step="exact", rate=1.0, experts=8, top_k=2, tokens=64, steps=2)
