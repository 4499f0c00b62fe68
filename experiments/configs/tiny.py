"""tiny: the whole K3 stack at toy size (KDA ×3 + MLA, LatentMoE, Block AttnRes), for CPU tests and debugging.

A compiled CPU train step takes well under a second. Byte-level vocabulary (k3jax/data/tokenizer.py).
"""
from experiments.configs.common import base_config
from k3jax.config import model_config
from k3jax.data.tokenizer import VOCAB_SIZE


def get_config():
  c = base_config()
  m = model_config()
  m.vocab_size = VOCAB_SIZE
  m.d_model = 64
  m.num_layers = 4                      # KDA, KDA, KDA, MLA
  m.dtype = "float32"                   # CPU: bf16 matmuls are emulated and slower
  m.ffn_hidden = 128                    # layer 0's dense FFN
  m.kda.num_heads = 2                   # head dim 32
  m.mla.num_heads = 2
  m.mla.kv_lora_rank = 32
  m.moe.enabled = True
  m.moe.balancer_method = "article"      # the K3 article's quantile balancing (docs/design.md)
  m.moe.num_experts = 8
  m.moe.top_k = 2
  m.moe.num_shared_experts = 1
  m.moe.latent_dim = 32                 # ℓ = d/2 (assumed for K3)
  m.moe.expert_hidden = 32
  m.moe.shared_hidden = 64
  m.residual.block_size = 2             # two AttnRes blocks
  c.model = m
  return c.lock()   # unknown fields are errors, as on the command line
