"""small: about 100M activated parameters (of ~0.5B) for one H200 at 4K tokens per sequence.

12 layers (9 KDA, 3 MLA; 3:1 with the last layer MLA), d = 768, 64 routed experts top-4 in a latent space of
ℓ = d/2, one shared expert, Block AttnRes with 4 blocks of 3 layers. `python -m experiments.plan --config=small`
prints the exact counts.
"""
from experiments.configs.common import base_config, set_stages
from k3jax.config import model_config
from k3jax.data.tokenizer import VOCAB_SIZE


def get_config():
  c = base_config()
  m = model_config()
  m.vocab_size = VOCAB_SIZE
  m.d_model = 768
  m.num_layers = 12
  m.dtype = "bfloat16"
  # Every layer unrolled, keeping all its VJP's residuals: at 65,536 tokens a step this fits one GPU and spares
  # both the recomputation and the scan's copies into and out of its stacked residuals (BUILD_NOTES, issue 35).
  m.scan_layers = False
  m.remat = "none"
  m.ffn_hidden = 2048                   # layer 0's dense FFN
  m.kda.num_heads = 6                   # head dim 128, Kimi Linear's
  m.mla.num_heads = 6                   # head dims 128
  m.mla.kv_lora_rank = 256
  m.moe.enabled = True
  m.moe.balancer_method = "article"      # the K3 article's quantile balancing (docs/design.md)
  m.moe.num_experts = 64
  m.moe.top_k = 4
  m.moe.num_shared_experts = 1
  m.moe.latent_dim = 384
  m.moe.expert_hidden = 512
  m.moe.shared_hidden = 1024
  m.moe.routed_scaling = 2.5
  m.residual.block_size = 3
  m.residual.source_dtype = "compute"   # AttnRes sources stored in bf16: half the read-outs' reads
  # Unrolled, XLA fuses each source's cotangent sum over its read-outs into one slow reduction; behind barriers the
  # read-outs' reductions stay apart (BUILD_NOTES, issue 35).
  m.residual.backward = "barrier"
  c.model = m
  c.seq_len = 4096
  c.batch_size = 16
  # Staged context extension (docs/design.md, training), research scale: 1K -> 4K -> 16K -> 64K at 65,536 tokens a step.
  set_stages(c, [(1024, 4000, 64), (4096, 1000, 16), (16384, 500, 4), (65536, 250, 1)])
  return c.lock()   # unknown fields are errors, as on the command line
