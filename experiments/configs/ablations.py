"""The ablation notebooks' settings (notebooks/), one function per study, each at two scales:

- "cpu": a smoke run, a minute or two per notebook on a 2-core CPU: it shows that the notebook runs end to end, not
  what the answer is (a model this small, trained this briefly, says nothing about K3's claims).
- "gpu": research scale on one H200: a 3:1 KDA/MLA model of d = 512 and 8 layers (about 25M parameters besides the
  embeddings; dense FFNs, except in the balancing study) trained on 32,768 tokens per step, each comparison sized to
  run in minutes. The tokens and steps of every variant are printed by `Study.describe`.

Every variant of a study differs from its base config only in the overrides listed, and trains from the same
seeds, hence the same initial model (where the variant does not change its shape) and the same batches.
"""
from __future__ import annotations

from experiments.configs.common import base_config
from k3jax.ablations.balance import METHODS, ablation_config
from k3jax.ablations.runs import Study
from k3jax.config import model_config
from k3jax.data.tokenizer import VOCAB_SIZE

SCALES = ("cpu", "gpu")
KDA, MLA = "kda", "mla"


def model_and_training(scale: str, *, num_layers: int | None = None, pattern=(KDA, KDA, KDA, MLA),
                       last_layer: str | None = MLA):
  """The base config of the studies at `scale`: dense, Block AttnRes, the given layer pattern; training sized
  for the scale, one checkpoint at the end."""
  _check(scale)
  c = base_config()
  m = model_config()
  m.vocab_size = VOCAB_SIZE
  m.layer_pattern, m.last_layer = tuple(pattern), last_layer
  m.moe.enabled = False
  m.residual.mode = "block"
  m.residual.block_size = 2
  if scale == "cpu":
    m.d_model, m.num_layers = 64, num_layers or 2
    m.dtype = "float32"               # CPU: bf16 matmuls are emulated and slower
    m.ffn_hidden = 128
    m.kda.num_heads = m.mla.num_heads = 2
    m.mla.kv_lora_rank = 32
    c.seq_len, c.batch_size, c.steps = 64, 8, 60
    c.log_every = 1
    c.eval.batches, c.eval.batch_size, c.eval.examples = 2, 8, 0
  else:
    m.d_model, m.num_layers = 512, num_layers or 8
    m.dtype = "bfloat16"
    m.ffn_hidden = 1536
    m.kda.num_heads = m.mla.num_heads = 4   # head dims 128, as in K3
    m.mla.kv_lora_rank = 128
    c.seq_len, c.batch_size, c.steps = 1024, 32, 400
    c.log_every = 5
    c.eval.batches, c.eval.batch_size, c.eval.examples = 8, 16, 0
  c.model = m
  c.mesh = "data:-1,expert:1"
  c.checkpoint_every = 10 ** 9          # a run saves at its end anyway
  c.keep_checkpoints = 1
  c.data.mix = {"stdlib": 1.0}
  return c


def gate(scale: str) -> Study:
  """Bounded (K3) vs softplus (Kimi Linear) decay gate: training loss at equal steps; the op's speed; finiteness at
  long T with saturated gates."""
  if scale == "cpu":
    c = model_and_training(scale, num_layers=2, pattern=(KDA,), last_layer=None)   # the gate acts in KDA layers
    settings = {"timed_shapes": [(1, 1024, 2, 32)], "timed_dtype": "float32", "repeats": 5,
                "long_shape": (1, 1024, 2, 32), "long_dtype": "float32"}
    seeds = (0,)
  else:
    c = model_and_training(scale)
    c.steps = 300
    settings = {"timed_shapes": [(8, 4096, 16, 128)], "timed_dtype": "bfloat16",
                "repeats": 20, "long_shape": (1, 65536, 16, 128), "long_dtype": "bfloat16"}
    seeds = (0, 1)
  return Study("gate", scale, c, {"bounded": {"model.kda.gate": "bounded"},
                                  "softplus": {"model.kda.gate": "softplus"}}, seeds, settings)


def balance(scale: str) -> Study:
  """MoE balancing on skewed data (k3jax.ablations.balance): none, Switch aux loss, DeepSeek sign, quantile exact
  and histogram."""
  if scale == "cpu":
    c = model_and_training(scale, num_layers=2, pattern=(MLA,), last_layer=None)  # dense FFN, then one MoE layer
    c.steps = 40
    moe = dict(num_experts=8, top_k=2, latent_dim=32, expert_hidden=32, shared_hidden=64)
    seeds = (0,)
  else:
    c = model_and_training(scale, num_layers=4)
    c.steps = 300
    moe = dict(num_experts=64, top_k=4, latent_dim=256, expert_hidden=256, shared_hidden=512, routed_scaling=2.5)
    seeds = (0, 1)
  c.model.moe.enabled = True
  c.model.moe.num_shared_experts = 1
  c.model.moe.first_dense_layers = 1
  for k, v in moe.items():
    c.model.moe[k] = v
  c.data.mix = {"stdlib": 0.0, "shards": 1.0}
  return Study("balance", scale, ablation_config(c), METHODS, seeds, {"steps": c.steps, "data_seed": 0})


def residual(scale: str) -> Study:
  """Block AttnRes vs full AttnRes vs the plain pre-norm residual: loss curves and the learned depth weights."""
  if scale == "cpu":
    # Two AttnRes blocks of two layers; MLA layers, which compile faster than KDA on a CPU (the mixer is not ablated).
    c = model_and_training(scale, num_layers=4, pattern=(MLA,), last_layer=None)
    c.steps = 40
    seeds = (0,)
  else:
    c = model_and_training(scale)                   # four blocks of two layers
    c.steps = 400
    seeds = (0, 1)
  variants = {"block": {"model.residual.mode": "block"}, "full": {"model.residual.mode": "full"},
              "prenorm": {"model.residual.mode": "none"}}
  return Study("residual", scale, c, variants, seeds, {"depth_weight_rows": 8})


def context(scale: str) -> Study:
  """Staged context extension vs direct training at the final length, at equal tokens (equal tokens per step and
  equal steps): loss, and MQAR / passkey accuracy at and beyond the final training length."""
  c = model_and_training(scale, num_layers=2, pattern=(KDA, MLA)) if scale == "cpu" else model_and_training(scale)
  c.data.mix = {"stdlib": 0.5, "mqar": 0.25, "passkey": 0.25}
  c.eval.tasks = ("mqar", "passkey")
  if scale == "cpu":
    lengths, rows, steps = (64, 128, 256), (32, 16, 8), (30, 15, 15)
    c.eval.examples, c.eval.batches = 16, 1
  else:
    lengths, rows, steps = (1024, 4096, 16384), (32, 8, 2), (300, 100, 100)
    c.eval.examples, c.eval.batch_size, c.eval.batches = 32, 8, 4
  final = lengths[-1]
  c.eval.lengths = (final, 2 * final, 4 * final)
  staged = tuple(dict(seq_len=t, steps=n, batch_size=b) for t, b, n in zip(lengths, rows, steps))
  direct = (dict(seq_len=final, steps=sum(steps), batch_size=rows[-1]),)
  variants = {"staged": {"stages": staged, "steps": sum(steps)}, "direct": {"stages": direct, "steps": sum(steps)}}
  return Study("context", scale, c, variants, (0,) if scale == "cpu" else (0, 1), {"eval_lengths": c.eval.lengths})


def hybrid(scale: str) -> Study:
  """KDA:MLA ratio: 3:1 (K3) vs all-MLA, all-KDA and 7:1 over 8 layers: forward tokens/s against length, and MQAR
  recall after the same training."""
  c = model_and_training(scale, num_layers=8)
  c.data.mix = {"mqar": 1.0}
  c.eval.tasks = ("mqar",)
  if scale == "cpu":
    c.model.d_model, c.model.ffn_hidden, c.model.mla.kv_lora_rank = 32, 64, 16
    c.model.residual.mode = "none"    # eight layers compile a third faster without AttnRes on a CPU
    c.steps = 24
    c.eval.examples, c.eval.batches = 16, 0
    c.eval.lengths = (64,)
    settings = {"throughput_lengths": (64, 256), "throughput_tokens": 2048, "repeats": 3}
    seeds = (0,)
  else:
    c.steps = 300
    c.eval.examples, c.eval.batches = 64, 0
    c.eval.lengths = (1024, 4096)
    settings = {"throughput_lengths": (2048, 8192, 32768), "throughput_tokens": 65536, "repeats": 10}
    seeds = (0, 1)
  variants = {"3to1": {"model.layer_pattern": (KDA, KDA, KDA, MLA), "model.last_layer": MLA},
              "7to1": {"model.layer_pattern": (KDA,) * 7 + (MLA,), "model.last_layer": MLA},
              "all_kda": {"model.layer_pattern": (KDA,), "model.last_layer": None},
              "all_mla": {"model.layer_pattern": (MLA,), "model.last_layer": None}}
  return Study("hybrid", scale, c, variants, seeds, settings)


def _check(scale):
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
