"""rl_small: the agentic RL pipeline on the small model (about 100M activated parameters) for one H200.

SFT on the solvers' demonstrations at 4K tokens per episode, then GRPO from its final checkpoint; held-out
success (greedy) for lookup at 4K and 16K (4x the trained length) and for the calculator at 4K. The rollouts
use the reference sampler (`k3jax.rl.sampler.ReprefillSampler`: each turn re-runs the whole context), so
generation time is an upper bound until the cache-continuing sampler lands.
"""
import ml_collections

from experiments.configs import small
from k3jax.rl.config import rl_config


def get_config():
  c = small.get_config()
  c.mesh = "data:1,expert:1"
  with c.unlocked():
    c.rl = rl_config()
  r = c.rl
  r.length = 4096
  r.iterations = 200
  r.prompts, r.group_size = 16, 8
  r.minibatches = 4
  r.lr = 1e-5
  r.turn_tokens = 64
  r.checkpoint_every = 20
  r.eval_at = ("lookup@4096", "lookup@16384", "calc@4096")
  r.eval_examples, r.eval_batch = 128, 32
  r.eval_every = 50
  # The SFT stage: one stage at the RL length on demonstrations only.
  c.stages = ()
  c.steps, c.seq_len, c.batch_size = 2000, r.length, 16
  c.optimizer.lr = 1e-3
  c.data.mix = ml_collections.ConfigDict({name: 1.0 for name in r.envs})
  c.data.task_length = r.length
  c.log_every, c.checkpoint_every = 50, 500
  c.eval.batches = 0
  c.eval.lengths, c.eval.examples = (r.length,), 64
  return c.lock()
