"""rl_tiny: the agentic RL pipeline on the tiny model, on a CPU.

SFT on the solvers' demonstrations (lookup and calculator episodes of 320 tokens, 400 steps: the tiny model learns
to copy keys into its calls after about 250 steps), then GRPO from its final checkpoint on both environments;
held-out success (greedy, 64 problems per point) at the trained length and, for lookup, at 4x it.
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
  r.envs = ml_collections.ConfigDict({"lookup": 0.5, "calc": 0.5})
  r.length = 320
  r.iterations = 40
  r.prompts, r.group_size = 4, 8         # 32 episodes an iteration
  r.minibatches = 2
  r.lr = 3e-4
  r.temperature = 0.7                    # at 1.0 the tiny policy rarely finishes an episode right: few groups differ
  r.checkpoint_every = 10
  r.eval_at = ("lookup@320", "lookup@1280", "calc@320")
  r.eval_examples, r.eval_batch = 64, 32  # the rollouts' 32 rows: the 320-token evaluation shares their programs
  # The SFT stage: demonstrations only, one episode per row.
  c.steps, c.seq_len, c.batch_size = 400, r.length, 16
  c.data.mix = ml_collections.ConfigDict({name: 1.0 for name in r.envs})
  c.data.task_length = r.length
  c.checkpoint_every = 200
  c.eval.batches, c.eval.examples = 0, 0  # no text held-out loss or task accuracy: RL's step-0 evaluation is SFT's
  return c.lock()
