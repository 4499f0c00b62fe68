"""The model check's library (experiments/model_check.py): the reference it builds shares the checked module's
parameters in another dtype and with the config's changes, and the report marks a check past its tolerance."""
import jax
import jax.numpy as jnp
from flax import nnx

from experiments import model_check
from experiments.configs import tiny
from k3jax.layers.kda import KDALayer


def test_as_dtype_with_params_shares_the_parameters_and_changes_only_the_dtype_and_the_named_fields():
  m = tiny.get_config().model
  make = lambda c, r: KDALayer(c, rngs=r)
  state = nnx.split(make(m, nnx.Rngs(1)))[1]
  ref = model_check.with_params(model_check.as_dtype(make, m, "bfloat16", **{"kda.backend": "xla"}), state)
  assert ref.dtype == jnp.bfloat16 and ref.backend == "xla" and m.kda.backend != "xla" and m.dtype == "float32"
  same = jax.tree.map(lambda a, b: a is b, nnx.state(ref), state)
  assert all(jax.tree.leaves(same))


def test_report_marks_each_check_against_its_tolerance_lists_the_times_and_the_failures():
  results = {"device": "cpu:0", "batch": 2, "seq_len": 64, "kda_layer": 1e-2, "mla_layer": 4e-2, "model_fp32": 1e-5,
             "model_bf16": 1e-2, "generate_agree": 0.75, **{k: 1.5 for k in model_check.TIMES}}
  lines = model_check.format_report(results, "tiny").splitlines()
  assert [line.split()[-1] for line in lines[1:5]] == ["True", "False", "True", "True"]
  assert lines[2].split() == ["mla_layer", "4.00e-02", "3e-02", "False"]
  assert lines[5].split()[1] == "75.00%"
  assert lines[7] == "tiny on cpu:0, batch 2 x 64 tokens"
  assert [line.split()[0] for line in lines[8:]] == list(model_check.TIMES)
  assert model_check.failed_checks(results) == ["mla_layer"]                  # check_model exits non-zero on it
