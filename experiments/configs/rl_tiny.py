"""rl_tiny: the agentic RL pipeline on the tiny model, on a CPU in minutes.

SFT on the solvers' demonstrations (lookup and calculator episodes of 320 tokens; the tiny model learns to copy
keys and numbers into its calls after about 250 steps, and solves lookup by 400), then GRPO from its final
checkpoint, on calculator problems mostly (what SFT leaves unsolved); held-out success (greedy) at the trained
length and, for lookup, at 4x it.
"""
import ml_collections

from experiments.configs import tiny
from k3jax.rl.config import rl_config


def get_config():
  c = tiny.get_config()
  c.mesh = "data:1,expert:1"
  with c.unlocked():
    c.rl = rl_config()
  r = c.rl
  r.envs = ml_collections.ConfigDict({"lookup": 0.25, "calc": 0.75})
  r.length = 320
  r.iterations = 30
  r.prompts, r.group_size = 8, 4
  r.minibatches = 2
  r.lr = 3e-4
  r.checkpoint_every = 10
  r.eval_at = ("lookup@320", "lookup@1280", "calc@320")
  r.eval_examples, r.eval_batch = 32, 16
  # The SFT stage: demonstrations only, one episode per row.
  c.steps, c.seq_len, c.batch_size = 400, r.length, 16
  c.data.mix = ml_collections.ConfigDict({name: 1.0 for name in r.envs})
  c.data.task_length = r.length
  c.checkpoint_every = 200
  c.eval.batches = 0                    # no text held-out loss: the SFT data is demonstrations only
  c.eval.lengths, c.eval.examples = (r.length,), 16
  return c.lock()
