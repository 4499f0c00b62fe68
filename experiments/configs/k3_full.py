"""k3_full: a Kimi K3 shape, for parameter counting and memory planning (experiments/plan.py).

Sources (docs/design.md, where the numbers come from). From the article: about 2.8T parameters, 104B activated per
token, 896 routed experts, the bounded gate with γ_min = −5, KDA combined with gated MLA, SiTU-GLU experts, context
stages 8K -> 64K -> 256K -> 1M. From Kimi Linear: KDA, KDA, KDA, MLA repeated (3 : 1) with NoPE MLA, the last
layer MLA. From the Attention Residuals paper: Block AttnRes. Assumed: 93 layers (69 KDA, 24 MLA), d = 7168, top-16
of the routed experts plus 2 shared, latent ℓ = d/2 = 3584, layer 0 dense, 8 AttnRes blocks of 12 layers.

The rest by convention (K2 / Kimi Linear / DeepSeek-V3), then the two FFN widths solved from the article's two
totals (taken as 2.78T and 104.2B):
- vocab 163,840 (the Kimi tokenizer of K2); untied LM head (as K2).
- KDA: 64 heads of K = V = 128 (Kimi Linear's head size; H·K = 8192 ≈ 1.14 d), full-rank decay and output gates
  (assumed).
- MLA: 64 heads (K2), q-LoRA rank 1536 and r_kv = 512 (K2 / DeepSeek-V3); NoPE, so q·k uses 128 dims per head
  (K2's 128 non-positional dims; its 64 RoPE dims are dropped) and v 128.
- layer 0 dense SiTU-GLU of width 18,432 (K2's dense layer).
- the two unknown widths then follow from
      total  = rest + 92·E·3·ℓ·h_e + 92·2·3·d·h_s = 2.78T
      active = rest + 92·k·3·ℓ·h_e + 92·2·3·d·h_s = 104.2B
  with rest ≈ 36.1B (attention 28.0B, embeddings 2.3B, latent projections and routers 5.3B, layer 0 0.4B):
  h_e = 3074 -> 3072 (routed expert width, in ℓ-space) and h_s = 4931 -> 4864 (each shared expert, at full d),
  rounded to the nearest multiples of 256. Result (plan.py): 2.778T total (-0.1%), 103.96B activated (-0.2%).
"""
from experiments.configs.common import base_config, set_stages
from k3jax.config import model_config


def get_config():
  c = base_config()
  m = model_config()
  m.vocab_size = 163840
  m.d_model = 7168
  m.num_layers = 93
  m.layer_pattern = ("kda", "kda", "kda", "mla")
  m.last_layer = "mla"
  m.dtype = "bfloat16"
  m.remat = "save_attention"             # keep cuDNN attention's output and statistics; recompute the rest
  m.tie_embeddings = False
  m.ffn_hidden = 18432
  m.kda.num_heads = 64
  m.kda.head_dim = 128
  m.kda.gate = "bounded"
  m.kda.lower_bound = -5.0
  m.mla.num_heads = 64
  m.mla.qk_head_dim = 128
  m.mla.v_head_dim = 128
  m.mla.kv_lora_rank = 512
  m.mla.q_lora_rank = 1536
  m.moe.enabled = True
  m.moe.balancer_method = "article"      # the K3 article's quantile balancing (docs/design.md)
  m.moe.num_experts = 896
  m.moe.top_k = 16
  m.moe.num_shared_experts = 2
  m.moe.latent_dim = 3584
  m.moe.expert_hidden = 3072
  m.moe.shared_hidden = 4864
  m.moe.routed_scaling = 2.827          # K2's (assumed for K3)
  m.moe.first_dense_layers = 1
  m.residual.mode = "block"
  m.residual.block_size = 12            # 8 blocks (the last one of 9 layers); assumed
  m.residual.source_dtype = "compute"   # AttnRes sources stored in bf16: half the read-outs' reads
  c.model = m
  c.mesh = "data:64,expert:16"
  c.seq_len = 8192
  # The article's context stages 8K -> 64K -> 256K -> 1M, at 16.8M tokens per step (assumed). Step counts are not
  # in the article: ours put ~14T tokens in the first stage (K2 trained on 15.5T) and shrink 4x per stage after the
  # next.
  set_stages(c, [(8192, 830_000, 2048), (65536, 40_000, 256), (262144, 10_000, 64), (1048576, 2_500, 16)])
  return c.lock()   # unknown fields are errors, as on the command line
