"""The article balancer's step on synthetic routers of several score spreads (`experiments.ablations.router_sim`):
the step in cut-off gaps against a fixed step in score units, each at a rate and a load unit.

  python -m experiments.balance_synthetic [--experts=64 --top_k=4 --tokens=16384 --steps=60] \
      [--spreads=0.05,0.3,1,3] [--forms=gap:16:8,gap:2:1,fixed:0.05:1]

Prints, per step form and spread, MaxVio's largest value over the ten steps before the preferences reverse and over
the last ten, and the first step below 0.5.
"""
from absl import app, flags

from experiments import harness
from experiments.ablations import router_sim

_EXPERTS = flags.DEFINE_integer("experts", 64, "routed experts E")
_TOP_K = flags.DEFINE_integer("top_k", 4, "experts per token k")
_TOKENS = flags.DEFINE_integer("tokens", 16384, "tokens per step")
_STEPS = flags.DEFINE_integer("steps", 60, "balancer steps; the preferences reverse halfway")
_SPREADS = flags.DEFINE_list("spreads", ["0.05", "0.3", "1", "3"], "scales σ of the logits' preference and noise")
_FORMS = flags.DEFINE_list("forms", ["gap:16:8", "gap:2:1", "gap:3:1", "fixed:0.05:1", "fixed:0.01:1"],
                           "step forms as form:rate:unit, form 'gap' (the library's) or 'fixed' (score units), unit "
                           "the load unit of the correction (balancer.article_correction)")
_OUT = flags.DEFINE_string("out", "", "also write the rows as JSON here")


def main(argv):
  harness.check_argv(argv)
  forms = []
  for f in _FORMS.value:
    parts = f.split(":")
    if len(parts) != 3:
      raise app.UsageError(f"--forms takes form:rate:unit, got {f!r}")
    forms.append((parts[0], float(parts[1]), float(parts[2])))
  rows = router_sim.study([float(s) for s in _SPREADS.value], forms, experts=_EXPERTS.value, top_k=_TOP_K.value,
                          tokens=_TOKENS.value, steps=_STEPS.value)
  harness.write_json(_OUT.value, rows)
  print(router_sim.format_table(rows), flush=True)


if __name__ == "__main__":
  app.run(main)
