"""The research-fidelity table (docs/results.md) from the notebooks' JSON: one row per claim, what was run, the
numbers with their spread, and a one-word verdict (reproduced / not reproduced / inconclusive) by rules fixed before
the runs (`VERDICT_RULES`), with what the rule found beside it.

Numbers are means over seeds, ± the sample standard deviation and [min, max] when there are several. The noise of
a comparison is the largest seed-to-seed range (max − min) among the variants compared; with one seed there is no
noise estimate, and a comparison that needs one is inconclusive, but a failing clause that needs none (slower, not
below, worse balanced) still says "not reproduced". The same rules apply at both scales (the CPU
scale's models are far too small for its verdicts to be evidence: docs/results.md says so above its table).
The RL rule's noise is the held-out sampling error of the change, the problems paired before and after
(`k3jax.rl.evaluate.paired_change`), which one seed has.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

from experiments.ablations import records
from k3jax.rl.evaluate import paired_change

# The rules, fixed before the research-scale runs (docs/results.md lists them: `rules_text`).
VERDICT_RULES = {
    "Bounded gate, speed": "judged like with like on FLA's GPU kernels, which run both gates: reproduced if the "
                           "op's forward+backward with the bounded gate (safe_gate, GEMM diagonal tiles) is at "
                           "least 1.1x faster than with the softplus gate (diagonal tiles position by position) at "
                           "every timed shape; not reproduced if it is not faster at some shape; otherwise, or "
                           "without FLA's kernels timed (no GPU, no fla-core), inconclusive. Our kernels (bounded "
                           "gate only) are shown beside FLA's bounded gate",
    "Bounded gate, quality": "reproduced if the bounded gate's held-out loss is at most the softplus gate's plus the "
                             "noise; not reproduced if it is higher by more than twice the noise; otherwise "
                             "inconclusive",
    "Bounded gate, finiteness": "reproduced if o, the final state and every gradient are finite with the bounded "
                                "gate at saturation and o is within 5e-3 of the fp32 recurrence, while the softplus "
                                "gate forced through the same factorised tiles is not (the contrast the bound "
                                "buys); not reproduced if the bounded gate fails; inconclusive if the unbounded one "
                                "does not fail either",
    "Quantile balancing": "reproduced if the article's method holds MaxVio (mean over the last half of training) "
                          "below every baseline's (none, aux loss, sign) and its held-out loss is at most the best "
                          "baseline's plus the noise; not reproduced if a baseline balances better or its loss is "
                          "above the best baseline's by more than twice the noise; otherwise inconclusive (the "
                          "project's cut-off quantile is shown beside it)",
    "Block AttnRes": "reproduced if its held-out loss is below the pre-norm residual's by more than the noise; not "
                     "reproduced if it is not below it (full AttnRes is reported beside it, claimed lower still); "
                     "otherwise inconclusive",
    "Staged context extension": "reproduced if the staged run's held-out loss is at most the direct run's plus the "
                                "noise and its mean retrieval accuracy at every evaluated length (the final one and "
                                "its multiples) at least the direct run's minus the noise; not reproduced if the "
                                "loss or the accuracy at some length is worse by more than twice the noise; "
                                "otherwise inconclusive. While both runs retrieve at or below chance at every "
                                "length the accuracies count for nothing and the rule cannot pass",
    "3:1 hybrid": "reproduced if its prefill is at least 1.5x all-MLA's tokens/s at the longest length, its MQAR "
                  "accuracy exceeds all-KDA's by more than the noise and is at least all-MLA's minus the noise "
                  "(speed of linear attention, recall of attention); not reproduced if it is slower than all-MLA "
                  "there, recalls no better than all-KDA, or recalls below all-MLA by more than twice the noise; "
                  "otherwise inconclusive",
    "RL over SFT": "reproduced if the held-out success (greedy, problems no step saw), averaged over the evaluation "
                   "points, is higher after RL than the SFT policy's by more than the noise and no point falls by "
                   "more than its own noise; not reproduced if it is lower by more than the noise; otherwise "
                   "inconclusive (a change within the noise says nothing either way). The noise "
                   "is twice the standard error of the change over the same held-out problems, before and after "
                   "(paired: the problems whose outcome changed; so it exists with one seed, and leaves out how "
                   "another seed's RL run would differ), or the seed-to-seed range of the change where that is "
                   "larger",
}
ONE_SEED = "one seed: no noise estimate"
BALANCE_BASELINES = ("none", "aux_loss", "sign")   # the balancing study's methods that are not quantile balancing
MARKERS = "<!-- results:{scale}:begin -->", "<!-- results:{scale}:end -->"
SETTINGS_MARKERS = "<!-- settings:{scale}:begin -->", "<!-- settings:{scale}:end -->"
RULES_MARKERS = "<!-- rules:begin -->", "<!-- rules:end -->"


def fmt(s: dict | None, digits: int = 4) -> str:
  """A runs.spread summary as text: mean, ± std and [min, max] with several seeds."""
  if s is None:
    return "—"
  if s["n"] == 1:
    return f"{s['mean']:.{digits}f}"
  return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def noise(*summaries) -> float | None:
  """The largest seed-to-seed range of the summaries; None with a single seed."""
  if any(s["n"] < 2 for s in summaries):
    return None
  return max(s["max"] - s["min"] for s in summaries)


def _verdict(good: bool | None, bad: bool | None, why: str) -> dict:
  """{"verdict", "why"}: not reproduced if `bad`, reproduced if `good`, else inconclusive. None: not decidable
  with one seed; a `bad` that is True (a clause needing no noise failed) decides all the same."""
  if bad:
    return {"verdict": "not reproduced", "why": why}
  if good is None or bad is None:
    return {"verdict": "inconclusive", "why": f"{ONE_SEED}; {why}"}
  return {"verdict": "reproduced" if good else "inconclusive", "why": why}


def _num(x: float | None, digits: int) -> str:
  """`x` to `digits` decimals; "—" for a noise that one seed does not give."""
  return "—" if x is None else f"{x:.{digits}f}"


def _either(*clauses: bool | None) -> bool | None:
  """True if any clause is True; else None if any is None (undecided); else False."""
  if any(c is True for c in clauses):
    return True
  return None if any(c is None for c in clauses) else False


def gate_rows(r: dict) -> list[dict]:
  rows = []
  if "speed" in r:
    by_shape = {}
    for x in r["speed"]:
      by_shape.setdefault(x["shape"], {})[(x["gate"], x["backend"])] = x["ms"]
    fla = {s: t[("softplus", "fla")] / t[("bounded", "fla")] for s, t in by_shape.items()
           if ("softplus", "fla") in t and ("bounded", "fla") in t}
    beside = lambda t: (f"; ours (bounded, kernels) / FLA's {t[('bounded', 'auto')] / t[('bounded', 'fla')]:.2f}x"
                        if ("bounded", "auto") in t and ("bounded", "fla") in t else "")
    text = "; ".join(f"{s}: " + ", ".join(f"{g}/{b} {ms:.3f} ms" for (g, b), ms in t.items())
                     + (f" (FLA softplus / bounded {fla[s]:.2f}x{beside(t)})" if s in fla else "")
                     for s, t in by_shape.items())
    if by_shape and len(fla) == len(by_shape):
      low = min(fla.values())
      verdict = _verdict(low >= 1.1, low <= 1.0, f"FLA's softplus / bounded at least {low:.2f}x (rule: 1.1x)")
    else:
      verdict = {"verdict": "inconclusive", "why": "FLA's kernels were not timed with both gates (no GPU or no "
                                                   "fla-core): the XLA path alone says nothing of the kernels"}
    rows.append({"claim": "bounded gate: faster KDA op (fwd+bwd)", "run": f"{r['device']}, {r['speed'][0]['dtype']}",
                 "numbers": text, **verdict})
  if "training" in r:
    b, s = r["training"]["bounded"]["heldout_loss"], r["training"]["softplus"]["heldout_loss"]
    n = noise(b, s)
    delta = b["mean"] - s["mean"]
    rows.append({"claim": "bounded gate: no loss in quality", "run": r["run"],
                 "numbers": f"held-out loss bounded {fmt(b)}, softplus {fmt(s)}",
                 **_verdict(None if n is None else delta <= n, None if n is None else delta > 2 * n,
                            f"bounded − softplus {delta:+.4f}, noise {_num(n, 4)}")})
  if "finiteness" in r:
    bounded = r["finiteness"][0]
    ok = bounded["finite_o"] and bounded["finite_state"] and all(bounded["finite_grads"].values())
    ok = ok and bounded["rel_err_o"] <= 5e-3
    text = "; ".join(f"{x['case']}: " + ("all finite" if x["finite_o"] and x["finite_state"]
                                         and all(x["finite_grads"].values()) else "non-finite")
                     + f", rel err o {x['rel_err_o']:.1e}" for x in r["finiteness"])
    forced = [x for x in r["finiteness"][1:] if "forced" in x["case"]]
    contrast = any(not (x["finite_o"] and x["finite_state"] and all(x["finite_grads"].values())) for x in forced)
    shape = f"B={bounded['B']} T={bounded['T']} H={bounded['H']} D={bounded['D']} {bounded['dtype']}, saturated gates"
    why = (f"bounded gate {'finite' if ok else 'not finite or not accurate'} at T={bounded['T']}; the unbounded gate "
           f"through the same tiles {'fails' if contrast else 'does not fail (no contrast)'}")
    rows.append({"claim": "bounded gate: finite at long T", "run": shape, "numbers": text,
                 **_verdict(ok and contrast, not ok, why)})
  return rows


def balance_rows(r: dict) -> list[dict]:
  m = r["methods"]
  vio = {k: v["summary"]["mean_max_vio_last_half"] for k, v in m.items()}
  loss = {k: v["summary"]["heldout_loss"] for k, v in m.items()}
  baselines = [k for k in m if k in BALANCE_BASELINES]
  quantile = ["article"] if "article" in m else [k for k in m if k not in baselines]   # older runs: every other
  n = noise(*loss.values())
  good = None
  worst_q = max(vio[q]["mean"] for q in quantile)
  best_b = min(baselines, key=lambda b: vio[b]["mean"])
  d_loss = max(loss[q]["mean"] for q in quantile) - min(loss[b]["mean"] for b in baselines)
  balances_worse = worst_q >= vio[best_b]["mean"]
  if n is not None:
    good = not balances_worse and d_loss <= n
  bad = _either(balances_worse, None if n is None else d_loss > 2 * n)
  text = "; ".join(f"{k}: MaxVio {fmt(vio[k], 3)}, held-out {fmt(loss[k])}" for k in m)
  claimed = "article" if quantile == ["article"] else "worst quantile"
  why = (f"{claimed} MaxVio {worst_q:.3f} vs best baseline ({best_b}) {vio[best_b]['mean']:.3f}; held-out loss vs "
         f"best baseline {d_loss:+.4f}, noise {_num(n, 4)}")
  return [{"claim": "quantile balancing: balanced load, no aux loss", "run": r["run"], "numbers": text,
           **_verdict(good, bad, why)}]


def residual_rows(r: dict) -> list[dict]:
  t = {k: v["heldout_loss"] for k, v in r["training"].items()}
  n = noise(*t.values())
  delta = t["prenorm"]["mean"] - t["block"]["mean"]
  return [{"claim": "Block AttnRes: lower loss than pre-norm (full AttnRes lower still)", "run": r["run"],
           "numbers": "; ".join(f"{k} {fmt(v)}" for k, v in t.items()),
           **_verdict(None if n is None else delta > n, _either(delta <= 0, None if n is None else False),
                      f"pre-norm − block {delta:+.4f}, noise {_num(n, 4)}")}]


def context_rows(r: dict) -> list[dict]:
  s = r["summary"]
  staged, direct = s["staged"], s["direct"]
  length = lambda key: int(key.split("@")[1])
  lengths = sorted({length(k) for k in staged["accuracy"]})
  final = lengths[0]
  acc = {v: {L: [a for k, a in s[v]["accuracy"].items() if length(k) == L] for L in lengths}
         for v in ("staged", "direct")}
  mean_acc = {v: {L: sum(a["mean"] for a in x) / len(x) for L, x in by_L.items()} for v, by_L in acc.items()}
  chance = staged.get("chance")
  at_chance = chance is not None and all(a["mean"] <= chance[k.split("@")[0]] for v in ("staged", "direct")
                                         for k, a in s[v]["accuracy"].items())
  n_loss = noise(staged["heldout_loss"], direct["heldout_loss"])
  n_acc = noise(*(a for v in acc.values() for x in v.values() for a in x))
  d_loss = staged["heldout_loss"]["mean"] - direct["heldout_loss"]["mean"]
  d_acc = {L: mean_acc["direct"][L] - mean_acc["staged"][L] for L in lengths}
  good = None
  if n_loss is not None and n_acc is not None:
    good = not at_chance and d_loss <= n_loss and all(d <= n_acc for d in d_acc.values())
  acc_worse = False if at_chance else None if n_acc is None else any(d > 2 * n_acc for d in d_acc.values())
  bad = _either(None if n_loss is None else d_loss > 2 * n_loss, acc_worse)
  stages = " → ".join(str(e["seq_len"]) for e in staged["stage_evals"][0])
  text = (f"held-out loss staged {fmt(staged['heldout_loss'])}, direct {fmt(direct['heldout_loss'])}; accuracy "
          + "; ".join(f"{k} staged {fmt(staged['accuracy'][k], 3)} / direct {fmt(direct['accuracy'][k], 3)}"
                      for k in staged["accuracy"]))
  why = (f"staged − direct: held-out loss {d_loss:+.4f} (noise {_num(n_loss, 4)}), accuracy "
         + ", ".join(f"at {L} {-d:+.3f}" for L, d in d_acc.items()) + f" (noise {_num(n_acc, 3)})"
         + ("; both at or below chance at every length" if at_chance else ""))
  return [{"claim": "staged context extension: as good as direct at equal tokens",
           "run": f"{r['run']}; staged {stages} vs direct {final}", "numbers": text, **_verdict(good, bad, why)}]


def hybrid_rows(r: dict) -> list[dict]:
  speed = {k: {x["seq_len"]: x["tokens_per_s"] for x in rows} for k, rows in r.get("forward_tokens_per_s", {}).items()}
  recall = {k: v["accuracy"] for k, v in r["recall"].items()}
  key = max(recall["3to1"], key=lambda k: int(k.split("@")[1]))
  n = noise(*(recall[v][key] for v in recall))
  longest = max(speed["3to1"])
  ratio = speed["3to1"][longest] / speed["all_mla"][longest]
  d_recall = recall["3to1"][key]["mean"] - recall["all_kda"][key]["mean"]
  d_attention = recall["3to1"][key]["mean"] - recall["all_mla"][key]["mean"]
  good = None
  if n is not None:
    good = ratio >= 1.5 and d_recall > n and d_attention >= -n
  bad = _either(ratio < 1.0, d_recall <= 0, None if n is None else d_attention < -2 * n)
  text = "; ".join(f"{k}: " + ", ".join(f"T={t} {v:,.0f} tok/s" for t, v in speed.get(k, {}).items())
                   + f"; MQAR {key} {fmt(recall[k][key], 3)}" for k in recall)
  why = (f"3:1 / all-MLA tokens/s at T={longest} {ratio:.2f}x (rule: 1.5x); 3:1 − all-KDA recall {d_recall:+.3f}, "
         f"3:1 − all-MLA {d_attention:+.3f}, noise {_num(n, 3)}")
  return [{"claim": "3:1 hybrid: fast at long context, recalls like attention", "run": r["run"], "numbers": text,
           **_verdict(good, bad, why)}]


def success_error(p, n: int):
  """Twice the standard error of a success rate `p` (a float or an array) measured on `n` problems, the rate taken
  as (successes + 1) / (n + 2) so that a rate of 0 or 1 still has an error."""
  q = (p * n + 1) / (n + 2)
  return 2 * (q * (1 - q) / n) ** 0.5


def heldout_outcomes(runs: list[dict], when: str, points) -> list[list[int]]:
  """The RL runs' held-out outcomes `when` ("before" / "after" RL), `[P, seeds·N]`: each seed's problems in turn, so
  that before and after pair up problem by problem (each seed with its own SFT policy)."""
  return [sum((x[when][p]["correct"] for x in runs), []) for p in points]


def rl_rows(r: dict) -> list[dict]:
  points, runs = r["points"], r["runs"]
  s = r["success"]
  n = r["eval_examples"] * len(runs)   # held-out problems per point, over the seeds
  outcomes = {when: heldout_outcomes(runs, when, points) for when in ("before", "after")}
  own = {p: paired_change(outcomes["before"][i], outcomes["after"][i]) for i, p in enumerate(points)}
  delta, noise_delta = paired_change(outcomes["before"], outcomes["after"])
  per_seed = [paired_change([x["before"][p]["correct"] for p in points], [x["after"][p]["correct"] for p in points])[0]
              for x in runs]
  noise_delta = max(noise_delta, max(per_seed) - min(per_seed))
  falls = [p for p in points if own[p][0] < -own[p][1]]
  text = "; ".join(f"{p} {fmt(s[p]['before'], 3)} → {fmt(s[p]['after'], 3)}" for p in points)
  why = (f"after − before, mean over points {delta:+.3f}, noise {noise_delta:.3f} ({n} held-out problems per point"
         + (", one seed" if len(runs) == 1 else "") + ")"
         + (f"; falls beyond its noise at {', '.join(falls)}" if falls else ""))
  return [{"claim": "RL raises held-out success over the SFT policy", "run": f"{r['run']} (SFT); then {r['rl_run']}",
           "numbers": f"held-out success SFT → RL: {text}",
           **_verdict(delta > noise_delta and not falls, delta < -noise_delta, why)}]


ROWS = {"01_gate": gate_rows, "02_balance": balance_rows, "03_residual": residual_rows, "04_context": context_rows,
        "05_hybrid": hybrid_rows, "06_rl": rl_rows}


def table(results_dir, scale: str) -> str:
  """The markdown table of the notebooks' JSON under `results_dir/scale/`; a notebook without JSON is "not run
  yet". Its last column names the commits and device kinds of the notebook's recorded runs (`records.provenance`),
  else the device of the notebook's own run."""
  lines = ["| notebook | claim | what was run | numbers (mean ± std [min, max] over seeds) | verdict | why | "
           "commit, device |", "|---|---|---|---|---|---|---|"]
  for name, make in ROWS.items():
    path = pathlib.Path(results_dir) / scale / f"{name}.json"
    if not path.exists():
      lines.append(f"| {name} | see notebooks/{name}.ipynb | — | — | not run yet | | |")
      continue
    results = json.loads(path.read_text())
    source = (records.provenance(pathlib.Path(results_dir) / scale / "records" / name)
              or f"commit not recorded, {results.get('device', 'device not recorded')}")
    for row in make(results):
      lines.append(f"| {name} | {row['claim']} | {row['run']} | {row['numbers']} | {row['verdict']} | {row['why']} "
                   f"| {source} |")
  return "\n".join(lines)


def settings_table(notebooks: Mapping, scale: str) -> str:
  """The markdown table of what each notebook runs at `scale`: `notebooks` maps a notebook's name to its study's
  maker, `make(scale)` (experiments/configs/ablations.py's NOTEBOOKS)."""
  lines = ["| notebook | variants | model and training per variant | also measured |", "|---|---|---|---|"]
  for name, make in notebooks.items():
    study = make(scale)
    also = "; ".join(f"{k} {v}" for k, v in study.settings.items())
    lines.append(f"| {name} | {', '.join(study.variants)} | {study.summary()} | {also or '—'} |")
  return "\n".join(lines)


def rules_text() -> str:
  """`VERDICT_RULES` as a markdown list, and the one-seed rule."""
  return "\n".join([*(f"- **{claim}**: {rule}." for claim, rule in VERDICT_RULES.items()),
                    "- With one seed, a comparison that needs the seed-to-seed noise is inconclusive; a failing "
                    "clause that needs none (slower, not below, worse balanced, recalls no better) decides."])


def write_into(doc: pathlib.Path, scale: str, text: str, markers=MARKERS) -> None:
  """Replaces the text between the scale's `markers` in `doc`."""
  begin, end = (m.format(scale=scale) for m in markers)
  page = doc.read_text()
  if page.count(begin) != 1 or page.count(end) != 1:
    raise ValueError(f"{doc} needs one {begin} and one {end} line")
  head, rest = page.split(begin)
  _, tail = rest.split(end)
  doc.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
