"""Fields every experiment config shares; each config file starts from `base_config()`, fills `model` and returns
the config locked (`c.lock()`): setting a field it does not have is then an error, from Python as on the command
line (`with c.unlocked():` adds one deliberately).

Training defaults suit the `tiny` config on a CPU (a few minutes: Python source and the stack task, on which a tiny
model beats chance within a hundred steps); bigger configs override them. Overrides on the command line:
`--config.steps=100 --config.optimizer.lr=1e-3 --config.data.mix.mqar=0.5`.
"""
import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.steps = 250                 # optimizer steps in all; with stages, the sum of theirs
  c.log_every = 10
  c.checkpoint_every = 50
  c.keep_checkpoints = 3
  c.mesh = "data:-1,expert:1"   # device mesh; -1: every device the other axis leaves
  c.seq_len = 64                # without stages: the one stage's row length and rows per step
  c.batch_size = 16
  c.micro_batches = 1           # gradient accumulation: each step's batch runs as this many micro-batches
  # Staged context extension: dicts with seq_len, steps, batch_size (seq_len·batch_size constant) and optionally
  # lr, warmup_fraction, decay_fraction. Empty: one stage from seq_len, batch_size, steps. See `set_stages`.
  c.stages = ()

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"    # or "muon" (hidden matrices; AdamW for the rest)
  c.optimizer.lr = 3e-3         # peak learning rate
  c.optimizer.warmup_fraction = 0.05   # warmup-stable-decay, per stage, as fractions of the stage's steps
  c.optimizer.decay_fraction = 0.2
  c.optimizer.final_lr_fraction = 0.1
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.1
  c.optimizer.grad_clip = 1.0   # global gradient norm

  c.data = ml_collections.ConfigDict()
  # Sampling weight of each source per row: the stdlib's Python source, user token shards, synthetic tasks.
  c.data.mix = ml_collections.ConfigDict(
      {"stdlib": 0.5, "shards": 0.0, "mqar": 0.0, "passkey": 0.0, "palindrome": 0.0, "stack": 0.5})
  c.data.task_length = 0        # tokens per synthetic example in training (several per row); 0: the row length
  c.data.shards = ""            # comma-separated .npy/.bin paths or globs, for the "shards" source
  c.data.heldout_shards = ""    # their held-out counterpart (for the held-out loss)
  c.data.cache_dir = ""         # where the stdlib shards are written; "": $K3JAX_CACHE or ~/.cache/k3jax

  c.eval = ml_collections.ConfigDict()
  c.eval.batches = 4            # held-out loss over batches × batch_size rows
  c.eval.batch_size = 8
  c.eval.examples = 32          # per task and length; 0: no task accuracy
  c.eval.lengths = ()           # task lengths; (): the stage's seq_len × (1, 2, 4)
  c.eval.tasks = ()             # (): the synthetic tasks of data.mix

  c.model = ml_collections.ConfigDict()
  return c


def set_stages(c: ml_collections.ConfigDict, stages) -> ml_collections.ConfigDict:
  """Sets `c.stages` from `(seq_len, steps, batch_size)` triples or dicts, and `c.steps` to their sum."""
  c.stages = tuple(dict(zip(("seq_len", "steps", "batch_size"), s)) if isinstance(s, (tuple, list)) else dict(s)
                   for s in stages)
  c.steps = sum(s["steps"] for s in c.stages)
  return c
