"""The ablation notebooks' settings (notebooks/), one function per study, each at three scales:

- "cpu": a smoke run, a minute or two per notebook on a 2-core CPU: it shows that the notebook runs end to end, not
  what the answer is (a model this small, trained this briefly, says nothing about K3's claims).
- "gpu": one H200, meant to run in minutes per notebook (`python -m experiments.run_notebooks --scale=gpu`,
  which compiles every notebook's programs at once first; not yet seen to finish: notebook 01's variants compiled
  in 68-77 s and the notebook then ran past a 4-minute limit; its finished runs are recorded, so it continues): a
  3:1 KDA/MLA model of d = 512 and 4 layers (about 12M parameters besides the embeddings; dense FFNs, except in the
  balancing study; 8 narrower layers where depth or the ratio is the question) trained on 16,384 tokens per step
  for 100-150 steps, two seeds. That is a few million tokens per run: enough to separate large effects (load
  balance, retrieval, speed), not the percent-level loss differences some claims are about; the table says which.
  The tokens and steps of every variant are printed by `Study.describe`. The RL notebook (6) runs
  experiments/configs/rl_small.py: SFT of the ~100M-activated small model, then GRPO at 4K tokens.
- "research": for a user with a GPU for hours. A 3:1 model of d = 1024 and 8 layers (about 110M parameters;
  16 narrower layers for the depth study) trained on 65,536 tokens per step for 3,000 steps (about 200M tokens a
  run; the balancing study 1,000 steps with 128 experts, top-8), three seeds; the RL study is rl_small with three
  seeds and four times its RL iterations (160). The sizes are this project's choice (no paper gives them):
  percent-level loss differences between two variants should then stand above the seed-to-seed spread of three
  runs, which the GPU scale's runs are too short to show. `Study.describe` prints each variant's tokens and, once
  the GPU scale's runs are recorded (`notebooks/results/gpu/records/`), the hours a run should take, from the
  training throughput measured there scaled by the FLOPs per token (`notebook.research_hours`).

Every variant of a study differs from its base config only in the overrides listed, and trains from the same
seeds, hence the same initial model (where the variant does not change its shape) and the same batches.
"""
from __future__ import annotations

import functools

from experiments.configs import rl_small, rl_tiny
from experiments.configs.common import base_config
from experiments.ablations import rl as agentic, runs
from experiments.ablations.notebook import SCALES
from experiments.ablations.balance import METHODS, ablation_config, markov_paths, markov_shards
from experiments.ablations.runs import Study
from k3jax.config import model_config
from k3jax.data import corpus
from k3jax.data.tokenizer import VOCAB_SIZE
from k3jax.rl import config as rl_config_lib

KDA, MLA = "kda", "mla"
# The seeds every study but the RL one trains at each scale.
SEEDS = {"cpu": (0,), "gpu": (0, 1), "research": (0, 1, 2)}


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
    c.seq_len, c.batch_size, c.steps = 64, 8, 40
    c.log_every = 2
    c.eval.batches, c.eval.batch_size, c.eval.examples = 2, 8, 0
  elif scale == "gpu":
    m.d_model, m.num_layers = 512, num_layers or 4
    m.dtype = "bfloat16"
    m.ffn_hidden = 1536
    m.kda.num_heads = m.mla.num_heads = 4   # head dims 128, Kimi Linear's
    m.mla.kv_lora_rank = 128
    c.seq_len, c.batch_size, c.steps = 1024, 16, 150
    c.log_every = 5
    c.eval.batches, c.eval.batch_size, c.eval.examples = 4, 16, 0
  else:
    m.d_model, m.num_layers = 1024, num_layers or 8
    m.dtype = "bfloat16"
    m.ffn_hidden = 3072
    m.kda.num_heads = m.mla.num_heads = 8   # head dims 128
    m.mla.kv_lora_rank = 256
    c.seq_len, c.batch_size, c.steps = 4096, 16, 3000
    c.log_every = 20
    c.eval.batches, c.eval.batch_size, c.eval.examples = 16, 16, 0
  c.model = m
  c.mesh = "data:-1,expert:1"
  c.checkpoint_every = 10 ** 9          # a run saves at its end anyway
  c.keep_checkpoints = 1
  c.data.mix = {"stdlib": 1.0}
  return c


def gate(scale: str) -> Study:
  """Bounded (the article's) vs softplus (Kimi Linear) decay gate: training loss at equal steps; the op's speed;
  finiteness at long T with saturated gates."""
  if scale == "cpu":
    c = model_and_training(scale, num_layers=1, pattern=(KDA,), last_layer=None)   # the gate acts in KDA layers
    settings = {"timed_shapes": [(1, 256, 2, 32)], "timed_dtype": "float32", "repeats": 3,
                "long_shape": (1, 1024, 2, 32), "long_dtype": "float32"}
  else:
    c = model_and_training(scale)
    settings = {"timed_shapes": [(8, 4096, 16, 128)], "timed_dtype": "bfloat16",
                "repeats": 20, "long_shape": (1, 65536, 16, 128), "long_dtype": "bfloat16"}
  return Study("gate", scale, c, {"bounded": {"model.kda.gate": "bounded"},
                                  "softplus": {"model.kda.gate": "softplus"}}, SEEDS[scale], settings)


def balance(scale: str) -> Study:
  """MoE balancing on skewed data (experiments.ablations.balance): none, Switch aux loss, DeepSeek sign, the article's
  quantile balancing, the cut-off quantile exact and histogram."""
  if scale == "cpu":
    c = model_and_training(scale, num_layers=1, pattern=(MLA,), last_layer=None)  # one MoE layer
    moe = dict(num_experts=8, top_k=2, latent_dim=32, expert_hidden=32, shared_hidden=64, first_dense_layers=0)
  elif scale == "gpu":
    c = model_and_training(scale)      # a dense FFN, then three MoE layers
    c.steps = 100                      # the balancers act within tens of steps
    moe = dict(num_experts=64, top_k=4, latent_dim=256, expert_hidden=256, shared_hidden=512, routed_scaling=2.5,
               first_dense_layers=1)
  else:
    c = model_and_training(scale)      # a dense FFN, then seven MoE layers
    c.steps = 1000
    moe = dict(num_experts=128, top_k=8, latent_dim=512, expert_hidden=384, shared_hidden=1024, routed_scaling=2.5,
               first_dense_layers=1)
  c.model.moe.enabled = True
  c.model.moe.num_shared_experts = 1
  for k, v in moe.items():
    c.model.moe[k] = v
  c.data.mix = {"stdlib": 0.0, "shards": 1.0}
  c = ablation_config(c)
  data_seed, directory = 0, corpus.default_cache_dir() / "markov"
  c.data.shards, c.data.heldout_shards = markov_paths(data_seed, directory)
  return Study("balance", scale, c, METHODS, SEEDS[scale], {"data_seed": data_seed},
               setup=functools.partial(markov_shards, data_seed, directory))


def residual(scale: str) -> Study:
  """Block AttnRes vs full AttnRes vs the plain pre-norm residual: loss curves and the learned depth weights."""
  if scale == "cpu":
    # Two AttnRes blocks of one layer; MLA layers, which compile faster than KDA on a CPU (the mixer is not ablated).
    c = model_and_training(scale, num_layers=2, pattern=(MLA,), last_layer=None)
    c.model.residual.block_size = 1
  elif scale == "gpu":
    c = model_and_training(scale, num_layers=8)     # four blocks of two layers, narrower: depth is the question
    c.model.d_model, c.model.ffn_hidden = 384, 1024
    c.model.kda.num_heads = c.model.mla.num_heads = 3
  else:
    c = model_and_training(scale, num_layers=16)    # eight blocks of two layers
    c.model.d_model, c.model.ffn_hidden = 768, 2048
    c.model.kda.num_heads = c.model.mla.num_heads = 6
  variants = {"block": {"model.residual.mode": "block"}, "full": {"model.residual.mode": "full"},
              "prenorm": {"model.residual.mode": "none"}}
  return Study("residual", scale, c, variants, SEEDS[scale], {"depth_weight_rows": 8})


def context(scale: str) -> Study:
  """Staged context extension vs direct training at the final length, at equal tokens (equal tokens per step and
  equal steps): loss, and MQAR / passkey accuracy at and beyond the final training length."""
  c = model_and_training(scale, num_layers=2, pattern=(KDA, MLA)) if scale == "cpu" else model_and_training(scale)
  c.data.mix = {"stdlib": 0.5, "mqar": 0.25, "passkey": 0.25}
  c.eval.tasks = ("mqar", "passkey")
  if scale == "cpu":
    lengths, rows, steps = (128, 256), (16, 8), (12, 8)
    c.eval.examples, c.eval.batches = 8, 1
    beyond = (2,)
  else:
    lengths, rows, steps = ((1024, 4096, 16384), (16, 4, 1), (90, 30, 30)) if scale == "gpu" else \
        ((4096, 16384, 65536), (16, 4, 1), (1500, 750, 750))
    # One row per evaluation call, the longest rows up to 4x the final length.
    c.eval.examples, c.eval.batch_size, c.eval.batches = 16, 1, 4
    beyond = (2, 4)
  final = lengths[-1]
  c.eval.lengths = (final, *(k * final for k in beyond))
  staged = tuple(dict(seq_len=t, steps=n, batch_size=b) for t, b, n in zip(lengths, rows, steps))
  direct = (dict(seq_len=final, steps=sum(steps), batch_size=rows[-1]),)
  variants = {"staged": {"stages": staged, "steps": sum(steps)}, "direct": {"stages": direct, "steps": sum(steps)}}
  return Study("context", scale, c, variants, SEEDS[scale], {"eval_lengths": c.eval.lengths})


def hybrid(scale: str) -> Study:
  """KDA:MLA ratio: 3:1 (Kimi Linear's; the article pairs KDA with gated MLA) vs all-MLA, all-KDA and 7:1 over 8
  layers: forward tokens/s against length, and MQAR recall after the same training."""
  c = model_and_training(scale, num_layers=8)
  c.data.mix = {"mqar": 1.0}
  c.eval.tasks = ("mqar",)
  if scale == "cpu":
    c.model.d_model, c.model.ffn_hidden, c.model.mla.kv_lora_rank = 32, 64, 16
    c.model.residual.mode = "none"    # eight layers compile a third faster without AttnRes on a CPU
    c.steps = 8
    c.eval.examples, c.eval.batches = 8, 0
    c.eval.lengths = (64,)
    settings = {"throughput_lengths": (256,), "throughput_tokens": 512, "repeats": 3}   # one program per length
  elif scale == "gpu":
    c.model.d_model, c.model.ffn_hidden, c.model.mla.kv_lora_rank = 256, 768, 64
    c.model.kda.num_heads = c.model.mla.num_heads = 2
    c.steps = 120
    c.eval.examples, c.eval.batches = 64, 0
    c.eval.lengths = (1024, 4096)
    settings = {"throughput_lengths": (2048, 8192, 32768), "throughput_tokens": 65536, "repeats": 10}
  else:
    c.steps = 2000
    c.eval.examples, c.eval.batches = 256, 0
    c.eval.lengths = (4096, 16384)
    settings = {"throughput_lengths": (4096, 16384, 65536, 131072), "throughput_tokens": 131072, "repeats": 10}
  variants = {"3to1": {"model.layer_pattern": (KDA, KDA, KDA, MLA), "model.last_layer": MLA},
              "7to1": {"model.layer_pattern": (KDA,) * 7 + (MLA,), "model.last_layer": MLA},
              "all_kda": {"model.layer_pattern": (KDA,), "model.last_layer": None},
              "all_mla": {"model.layer_pattern": (MLA,), "model.last_layer": None}}
  if scale == "cpu":
    del variants["7to1"]   # the smoke run: the verdict's three (7:1 is one more pattern of the same code)
  return Study("hybrid", scale, c, variants, SEEDS[scale], settings)


def rl(scale: str) -> Study:
  """Agentic RL (k3jax.rl): SFT on the environments' demonstrations, then GRPO from its final checkpoint; held-out
  success (greedy) of the SFT policy and of the RL one. One variant, the RL run: the study is before vs after RL.
  At "gpu" it is experiments/configs/rl_small.py unchanged, at "research" rl_small with four times its RL iterations
  and three seeds; at "cpu" rl_tiny cut to a smoke run (two dense layers, KDA then MLA, a few SFT steps and RL
  iterations, eight held-out problems per point)."""
  _check(scale)
  if scale == "cpu":
    c = runs.override(rl_tiny.get_config(), {
        "model.num_layers": 2, "model.moe.enabled": False, "model.residual.mode": "none", "steps": 12,
        "batch_size": 4, "log_every": 2, "rl.iterations": 4, "rl.prompts": 2, "rl.group_size": 4, "rl.max_turns": 3,
        "rl.eval_at": ("lookup@320", "calc@320"),   # one length: each more compiles its own sampler programs
        "rl.eval_examples": 8, "rl.eval_batch": 8})   # the rollouts' 8 rows: evaluation shares their programs
  else:
    c = rl_small.get_config()
  seeds = (c.seed,)
  if scale == "research":
    c.rl.iterations *= 4
    seeds = (c.seed, c.seed + 1, c.seed + 2)
  r = c.rl
  settings = {"rl": agentic.describe(c), "eval_examples": r.eval_examples,
              "eval_at": tuple(f"{name}@{n}" for name, n in rl_config_lib.eval_points(r))}
  return Study("rl", scale, c, {"grpo": {}}, seeds, settings)


def _check(scale):
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")


# The notebook (notebooks/<name>.ipynb) of each study.
NOTEBOOKS = {"01_gate": gate, "02_balance": balance, "03_residual": residual, "04_context": context,
             "05_hybrid": hybrid, "06_rl": rl}
