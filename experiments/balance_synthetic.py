"""The article balancer's step on synthetic routers of several score spreads (`experiments.ablations.router_sim`):
the step in cut-off gaps against a fixed step in score units.

  python -m experiments.balance_synthetic [--experts=64 --top_k=4 --tokens=16384 --steps=60] \
      [--spreads=0.05,0.3,1,3] [--steps_and_rates=gap:2,fixed:0.05]

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
_FORMS = flags.DEFINE_list("steps_and_rates", ["gap:2", "gap:3", "fixed:0.05", "fixed:0.01"],
                           "step forms as form:rate, form 'gap' (the library's) or 'fixed' (score units)")
_OUT = flags.DEFINE_string("out", "", "also write the rows as JSON here")


def main(argv):
  harness.check_argv(argv)
  forms = [(f.split(":")[0], float(f.split(":")[1])) for f in _FORMS.value]
  rows = router_sim.study([float(s) for s in _SPREADS.value], forms, experts=_EXPERTS.value, top_k=_TOP_K.value,
                          tokens=_TOKENS.value, steps=_STEPS.value)
  harness.write_json(_OUT.value, rows)
  print(router_sim.format_table(rows), flush=True)


if __name__ == "__main__":
  app.run(main)
