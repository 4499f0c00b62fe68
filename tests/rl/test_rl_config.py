"""The RL config (k3jax/rl/config.py): the shipped configs validate and derive their SFT config; a bad field is named."""
import ml_collections
import numpy as np
import pytest

from experiments import configs
from k3jax.data import pipeline
from k3jax.rl import config as rl_config


@pytest.mark.parametrize("module", ["rl_tiny", "rl_small"])
def test_rl_configs_validate(module):
  c = configs.load(module)
  rl_config.validate(c.rl)
  sft = rl_config.sft_config(c)
  assert "rl" not in sft and sft.is_locked and set(c.rl.envs) <= set(sft.data.mix)   # SFT shows every RL task
  pipeline.Mixture(sft.data, sft.seq_len, 0, vocab_size=sft.model.vocab_size)  # the demonstrations fit the SFT rows
  assert 4 * c.rl.length in {n for _, n in rl_config.eval_points(c.rl)}
  with pytest.raises(AttributeError):
    c.rl.kl_coeff = 0.1   # locked: a misspelled field is an error


@pytest.mark.parametrize("field,value,match", [
    ("envs", {"maze": 1.0}, "config.rl.envs"), ("group_size", 1, "group_size"), ("minibatches", 3, "minibatches"),
    ("length", 100, "needs lengths >="), ("max_turns", 2, "max_turns"), ("eval_at", ("lookup:9",), "eval_at"),
    ("eval_examples", 10, "eval_batch"), ("clip_eps", 0.0, "clip_eps"),
    ("advantage_scale", "rank", "advantage_scale"),
])
def test_rl_config_names_the_bad_field(field, value, match):
  r = rl_config.rl_config()
  r[field] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
  with pytest.raises(ValueError, match=match):
    rl_config.validate(r)



def test_rl_stage_counts_iterations_and_the_schedule_warms_up_over_optimizer_steps():
  """The RL stage is `iterations` steps of `prompts × group_size` episodes; its learning rate rises linearly over
  `warmup_fraction` of the `iterations × minibatches` optimizer steps to `rl.lr`, then stays; the resume guard's
  rate is that schedule at each iteration's first optimizer step."""
  c = configs.load("rl_tiny")
  r = c.rl
  stage = rl_config.rl_stage(c, 3)
  assert (stage.index, stage.seq_len, stage.steps) == (3, r.length, r.iterations)
  assert stage.batch_size == r.prompts * r.group_size and stage.lr == r.lr
  schedule, steps = rl_config.optimizer_schedule(c), r.iterations * r.minibatches
  warmup = max(round(r.warmup_fraction * steps), 1)
  values = np.array([float(schedule(s)) for s in range(steps)])
  np.testing.assert_allclose(values[:warmup], r.lr * np.arange(1, warmup + 1) / warmup, rtol=1e-6)
  np.testing.assert_allclose(values[warmup:], r.lr, rtol=1e-6)
  per_iteration = rl_config.learning_rate(c)
  np.testing.assert_allclose([float(per_iteration(i)) for i in range(r.iterations)],
                             values[::r.minibatches], rtol=1e-6)
