"""experiments.ablations.verdicts: the verdict rules on made-up results (reproduced, not reproduced, inconclusive, one
seed, no kernels timed), the table's rows, and the write between a scale's markers; experiments.results_table's
table of what each notebook runs."""
import json
import pathlib

import pytest

from experiments.ablations import verdicts as rt
from experiments.ablations import runs


def spread(*xs):
  return runs.spread(xs)


def gate(scale="gpu", fla_softplus_ms=3.0, bounded=(2.00, 2.01), softplus=(2.00, 2.02)):
  """Made-up notebook 01 results; on the GPU FLA's kernels ran both gates (bounded 2.0 ms), ours the bounded gate
  (1.6 ms) and XLA both (the softplus gate there far slower: a comparison the rule must not use)."""
  row = lambda gate, backend, ms: {"gate": gate, "backend": backend, "shape": "8x4096x16x128", "dtype": "bfloat16",
                                   "ms": ms}
  speed = [row("bounded", "auto", 1.6), row("bounded", "xla", 9.0), row("softplus", "xla", 30.0)]
  if scale == "gpu":
    speed += [row("bounded", "fla", 2.0), row("softplus", "fla", fla_softplus_ms)]
  row = {"finite_o": True, "finite_state": True, "finite_grads": {"q": True}, "rel_err_o": 1e-3, "B": 1,
         "T": 65536, "H": 16, "D": 128, "dtype": "bfloat16", "case": "bounded"}
  return {"scale": scale, "platform": "gpu" if scale == "gpu" else "cpu", "device": "H200", "run": "r",
          "speed": speed, "training": {"bounded": {"heldout_loss": spread(*bounded)},
                                       "softplus": {"heldout_loss": spread(*softplus)}},
          "finiteness": [row, {**row, "case": "forced", "finite_o": False, "rel_err_o": float("inf")}]}


def verdicts(rows):
  return [r["verdict"] for r in rows]


def test_gate_rules():
  speed = rt.gate_rows(gate())[0]
  assert verdicts(rt.gate_rows(gate())) == ["reproduced"] * 3
  assert "FLA softplus / bounded 1.50x" in speed["numbers"] and "ours (bounded, kernels) / FLA's 0.80x" in speed["numbers"]
  # Like with like: FLA's softplus gate as fast as its bounded one fails the claim, although XLA's softplus path is
  # 19x slower than our bounded kernels.
  assert verdicts(rt.gate_rows(gate(fla_softplus_ms=1.9)))[0] == "not reproduced"
  assert verdicts(rt.gate_rows(gate(fla_softplus_ms=2.1)))[0] == "inconclusive"   # faster, by less than 1.1x
  assert verdicts(rt.gate_rows(gate(bounded=(2.20, 2.21))))[1] == "not reproduced"
  assert verdicts(rt.gate_rows(gate(bounded=(2.04, 2.05))))[1] == "inconclusive"
  one_seed = rt.gate_rows(gate(bounded=(2.0,), softplus=(2.0,)))[1]
  assert one_seed["verdict"] == "inconclusive" and one_seed["why"].startswith(rt.ONE_SEED)
  on_cpu = rt.gate_rows(gate(scale="cpu"))   # the XLA path only, no FLA: the speed claim is about the kernels
  assert verdicts(on_cpu) == ["inconclusive", "reproduced", "reproduced"] and "not timed" in on_cpu[0]["why"]
  broken = gate()
  broken["finiteness"][0]["finite_grads"] = {"q": False}
  assert verdicts(rt.gate_rows(broken))[2] == "not reproduced"
  both_fail = gate()   # the bounded gate fails as the unbounded one does: not reproduced, not a contrast
  both_fail["finiteness"][0]["finite_o"] = False
  assert verdicts(rt.gate_rows(both_fail))[2] == "not reproduced"
  no_contrast = gate()   # the unbounded gate through the same tiles stays finite: nothing shown
  no_contrast["finiteness"][1]["finite_o"] = True
  row = rt.gate_rows(no_contrast)[2]
  assert row["verdict"] == "inconclusive" and "no contrast" in row["why"]


def test_balance_residual_context_and_hybrid_rules():
  def method(vio, loss):
    return {"summary": {"mean_max_vio_last_half": spread(*vio), "heldout_loss": spread(*loss)}}
  balance = {"scale": "gpu", "run": "r", "methods": {
      "none": method((2.9, 2.95), (1.50, 1.51)), "sign": method((0.5, 0.6), (1.50, 1.52)),
      "quantile": method((0.05, 0.06), (1.50, 1.51)), "quantile_histogram": method((0.07, 0.08), (1.50, 1.515))}}
  assert verdicts(rt.balance_rows(balance)) == ["reproduced"]
  costly = {**balance, "methods": {**balance["methods"], "quantile": method((0.05, 0.06), (1.60, 1.61))}}
  assert verdicts(rt.balance_rows(costly)) == ["not reproduced"]   # balanced, at a loss beyond twice the noise
  one_seed = {**balance, "methods": {k: method((v["summary"]["mean_max_vio_last_half"]["mean"],),
                                               (v["summary"]["heldout_loss"]["mean"],))
                                     for k, v in balance["methods"].items()}}
  assert verdicts(rt.balance_rows(one_seed)) == ["inconclusive"]
  balance["methods"]["sign"] = method((0.01, 0.02), (1.50, 1.52))
  assert verdicts(rt.balance_rows(balance)) == ["not reproduced"]
  one_seed["methods"]["sign"] = method((0.01,), (1.50,))
  assert verdicts(rt.balance_rows(one_seed)) == ["not reproduced"]   # worse balanced: no noise needed

  residual = {"scale": "gpu", "run": "r", "training": {"block": {"heldout_loss": spread(1.70, 1.71)},
                                                       "full": {"heldout_loss": spread(1.69, 1.70)},
                                                       "prenorm": {"heldout_loss": spread(1.75, 1.76)}}}
  assert verdicts(rt.residual_rows(residual)) == ["reproduced"]
  residual["training"]["prenorm"] = {"heldout_loss": spread(1.69, 1.70)}
  assert verdicts(rt.residual_rows(residual)) == ["not reproduced"]
  one_seed = {k: {"heldout_loss": spread(v["heldout_loss"]["mean"])} for k, v in residual["training"].items()}
  assert verdicts(rt.residual_rows({**residual, "training": one_seed})) == ["not reproduced"]   # not below

  def variant(loss, acc, stages, acc_2x=None):
    accuracy = {"mqar@16384": spread(*acc), "mqar@32768": spread(*(acc_2x or acc))}
    return {"heldout_loss": spread(*loss), "accuracy": accuracy,
            "stage_evals": [[{"seq_len": t} for t in stages]], "chance": {"mqar": 0.1}}
  context = {"scale": "gpu", "run": "r", "summary": {"staged": variant((1.0, 1.01), (0.9, 0.92), (1024, 16384)),
                                                     "direct": variant((1.0, 1.02), (0.9, 0.91), (16384,))}}
  assert verdicts(rt.context_rows(context)) == ["reproduced"]
  context["summary"]["staged"] = variant((1.2, 1.21), (0.5, 0.51), (1024, 16384))
  assert verdicts(rt.context_rows(context)) == ["not reproduced"]
  # As good at the final length, far worse at 2x it: the longer length decides.
  context["summary"]["staged"] = variant((1.0, 1.01), (0.9, 0.92), (1024, 16384), acc_2x=(0.3, 0.31))
  assert verdicts(rt.context_rows(context)) == ["not reproduced"]
  # Both at chance (as the CPU runs are): equal losses, equal accuracies, and still no pass.
  chance = {"staged": variant((1.0, 1.01), (0.02, 0.03), (1024, 16384)),
            "direct": variant((1.0, 1.02), (0.02, 0.03), (16384,))}
  row = rt.context_rows({**context, "summary": chance})[0]
  assert row["verdict"] == "inconclusive" and "chance" in row["why"]

  def speed(short, long):
    return [{"seq_len": 2048, "tokens_per_s": short}, {"seq_len": 32768, "tokens_per_s": long}]
  hybrid = {"scale": "gpu", "run": "r",
            "forward_tokens_per_s": {"3to1": speed(9, 8), "all_mla": speed(10, 4), "all_kda": speed(8, 8)},
            "recall": {"3to1": {"accuracy": {"mqar@4096": spread(0.93, 0.95)}},
                       "all_mla": {"accuracy": {"mqar@4096": spread(0.95, 0.96)}},
                       "all_kda": {"accuracy": {"mqar@4096": spread(0.3, 0.32)}}}}
  assert verdicts(rt.hybrid_rows(hybrid)) == ["reproduced"]
  below_attention = {**hybrid, "recall": {**hybrid["recall"], "3to1": {"accuracy": {"mqar@4096": spread(0.6, 0.61)}}}}
  assert verdicts(rt.hybrid_rows(below_attention)) == ["not reproduced"]   # beats all-KDA, far below all-MLA
  # Both linear-attention variants fail to recall (the hybrid no better than all-KDA): fast is not enough.
  no_recall = {**hybrid, "recall": {**hybrid["recall"], "3to1": {"accuracy": {"mqar@4096": spread(0.3, 0.31)}}}}
  assert verdicts(rt.hybrid_rows(no_recall)) == ["not reproduced"]
  one_seed = {**hybrid, "recall": {k: {"accuracy": {"mqar@4096": spread(v["accuracy"]["mqar@4096"]["mean"])}}
                                   for k, v in hybrid["recall"].items()},
              "forward_tokens_per_s": {**hybrid["forward_tokens_per_s"], "3to1": speed(5, 3)}}
  assert verdicts(rt.hybrid_rows(one_seed)) == ["not reproduced"]   # slower than all-MLA: no noise needed
  hybrid["forward_tokens_per_s"]["all_mla"] = speed(10, 9)
  assert verdicts(rt.hybrid_rows(hybrid)) == ["not reproduced"]


def rl(before, after, examples=128):
  """The RL notebook's results: {point: [success rate of each seed]} before and after RL, each rate as per-problem
  outcomes with the solved problems first (so a rise adds solved problems, a fall loses them)."""
  points = list(before)
  seeds = range(len(before[points[0]]))
  solved = lambda rate: [1] * round(rate * examples) + [0] * (examples - round(rate * examples))
  return {"scale": "gpu", "run": "r", "rl_run": "16 RL iterations", "eval_examples": examples, "points": points,
          "runs": [{"seed": k, **{when: {p: {"success_rate": rates[p][k], "correct": solved(rates[p][k])}
                                         for p in points}
                                  for when, rates in (("before", before), ("after", after))}} for k in seeds],
          "success": {p: {"before": spread(*before[p]), "after": spread(*after[p])} for p in points}}


def test_rl_rule_needs_a_rise_beyond_the_paired_heldout_noise():
  sft = {"lookup@4096": [0.3], "lookup@16384": [0.2], "calc@4096": [0.1]}
  better = {"lookup@4096": [0.6], "lookup@16384": [0.4], "calc@4096": [0.3]}
  row = rt.rl_rows(rl(sft, better))[0]
  assert row["verdict"] == "reproduced" and "one seed" in row["why"] and "128 held-out problems" in row["why"]
  assert "lookup@16384 0.200 → 0.400" in row["numbers"] and "16 RL iterations" in row["run"]
  # +0.02 at each point (2-3 problems more of 128): within the paired noise; +0.04 (5-6 more each): beyond it.
  assert verdicts(rt.rl_rows(rl(sft, {p: [x[0] + 0.02] for p, x in sft.items()}))) == ["inconclusive"]
  assert verdicts(rt.rl_rows(rl(sft, {p: [x[0] + 0.04] for p, x in sft.items()}))) == ["reproduced"]
  assert verdicts(rt.rl_rows(rl(better, sft))) == ["not reproduced"]
  nothing = {p: [0.0] for p in sft}   # both policies solve nothing: no rise, no verdict for RL
  assert verdicts(rt.rl_rows(rl(nothing, nothing))) == ["inconclusive"]
  assert verdicts(rt.rl_rows(rl(sft, better, examples=8))) == ["inconclusive"]   # 8 problems: within the noise
  one_falls = rt.rl_rows(rl(sft, {**better, "calc@4096": [0.0], "lookup@4096": [0.9]}))[0]
  assert one_falls["verdict"] == "inconclusive" and "falls beyond its noise at calc@4096" in one_falls["why"]
  two = rl({p: [x[0], x[0]] for p, x in sft.items()}, {p: [x[0] + 0.3, x[0] + 0.3] for p, x in sft.items()})
  assert verdicts(rt.rl_rows(two)) == ["reproduced"]
  gained_nothing = rl({p: [x[0]] for p, x in sft.items()}, {p: [x[0]] for p, x in sft.items()})["runs"][0]
  two["runs"][1]["after"] = gained_nothing["after"]   # the second seed gained nothing
  two["success"] = {p: {"before": spread(x[0], x[0]), "after": spread(x[0] + 0.3, x[0])} for p, x in sft.items()}
  assert verdicts(rt.rl_rows(two)) == ["inconclusive"]   # the seed-to-seed range exceeds the mean rise


def test_table_marks_missing_notebooks_and_write_replaces_only_its_scales_block(tmp_path):
  (tmp_path / "gpu").mkdir()
  (tmp_path / "gpu" / "01_gate.json").write_text(json.dumps(gate()))
  text = rt.table(tmp_path, "gpu")
  assert text.count("| 01_gate |") == 3
  assert "| 02_balance | see notebooks/02_balance.ipynb | — | — | not run yet | | |" in text
  assert all(line.count("|") == 8 for line in text.splitlines())   # seven columns on every row
  assert text.splitlines()[2].endswith(f"| commit not recorded, {gate()['device']} |")   # no records: its own device
  doc = tmp_path / "results.md"
  doc.write_text("head\n<!-- results:cpu:begin -->\nold cpu\n<!-- results:cpu:end -->\n"
                 "<!-- results:gpu:begin -->\nold\n<!-- results:gpu:end -->\ntail\n")
  rt.write_into(doc, "gpu", text)
  page = doc.read_text()
  assert "old cpu" in page and "\nold\n" not in page and text in page and page.endswith("tail\n")
  with pytest.raises(ValueError, match="markers|needs one"):
    rt.write_into(tmp_path / "results.md", "tpu", text)


def test_settings_table_has_a_row_per_notebook_with_its_variants_and_training():
  from experiments.configs import ablations
  text = rt.settings_table(ablations.NOTEBOOKS, "gpu")
  rows = text.splitlines()[2:]
  assert [r.split(" | ")[0] for r in rows] == [f"| {n}" for n in rt.ROWS]
  assert "bounded, softplus" in rows[0] and "seeds 0, 1" in rows[0] and "16,384 tokens" in rows[0]


def test_rules_text_lists_every_rule_and_write_into_fills_scale_free_markers(tmp_path):
  text = rt.rules_text()
  assert text.count("\n- **") == len(rt.VERDICT_RULES) - 1 and "**3:1 hybrid**" in text and "one seed" in text
  doc = tmp_path / "results.md"
  doc.write_text("a\n<!-- rules:begin -->\nold\n<!-- rules:end -->\nb\n")
  rt.write_into(doc, "gpu", text, rt.RULES_MARKERS)
  assert doc.read_text() == f"a\n<!-- rules:begin -->\n{text}\n<!-- rules:end -->\nb\n"


def test_committed_results_page_holds_what_the_tables_compute_from_the_committed_json():
  """docs/results.md's tables are written by `results_table --write`, never typed: a rule or a record changed
  without rewriting them fails here."""
  root = pathlib.Path(__file__).resolve().parents[3]
  page = (root / "docs" / "results.md").read_text()

  def block(markers, scale):
    begin, end = (m.format(scale=scale) for m in markers)
    return page.split(begin)[1].split(end)[0].strip("\n")

  assert block(rt.RULES_MARKERS, "") == rt.rules_text()
  for scale in ("cpu", "gpu"):
    assert block(rt.MARKERS, scale) == rt.table(root / "notebooks" / "results", scale), scale
