"""Model FLOPs per trained token and MFU.

    flops/token = 6·N_active                                   matmuls, forward + backward (2 + 4 per weight)
                + Σ_MLA 3·T·H·(d_qk + d_v)                     causal attention: T/2 keys on average, QKᵀ and PV
                + Σ_KDA 3·H·(6·K·V + 3·C·K + C²)               chunked KDA (docs/design.md, KDA; ×3), C = 64

N_active counts every weight matrix applied to each token (`sizing.param_rows`): embeddings are a lookup and are
left out (a tied head counts once), as are the short convolutions and the elementwise vectors; routed experts
count top_k/E of their weights.
MFU = tokens/s · flops/token / (peak bf16 dense FLOP/s · devices); peaks are the vendors' dense bf16 numbers.
"""
from __future__ import annotations

from k3jax import config as config_lib, spec as spec_lib
from k3jax.ops.kda import chunk as kda_chunk
from k3jax.train import sizing

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def active_matmul_params(model_cfg) -> tuple[int, int]:
  """(active, total) weights of the matrices applied to each token (see the module docstring)."""
  rows = [r for r in sizing.param_rows(model_cfg) if r.matmul]
  tied = model_cfg.vocab_size * model_cfg.d_model if model_cfg.tie_embeddings else 0
  return sum(r.active for r in rows) + tied, sum(r.size for r in rows) + tied


def flops_per_token(model_cfg, seq_len: int) -> float:
  """Training FLOPs per token at sequence length `seq_len`."""
  flops = 6.0 * active_matmul_params(model_cfg)[0]
  types = spec_lib.model_spec(model_cfg).mixers
  if "mla" in types:
    qk, v = config_lib.mla_head_dims(model_cfg)
    flops += types.count("mla") * 3.0 * seq_len * model_cfg.mla.num_heads * (qk + v)
  if "kda" in types:
    k, c = config_lib.kda_head_dim(model_cfg), kda_chunk.CHUNK
    flops += types.count("kda") * 3.0 * model_cfg.kda.num_heads * (6 * k * k + 3 * c * k + c * c)
  return flops


def peak_flops(device) -> float | None:
  """Peak dense bf16 FLOP/s of one device, None when unknown (e.g. CPU)."""
  for name, peak in PEAK_BF16_FLOPS.items():
    if name in device.device_kind:
      return peak
  return None


def mfu(tokens_per_s: float, flops_token: float, devices) -> float | None:
  peak = peak_flops(devices[0])
  return None if peak is None else tokens_per_s * flops_token / (peak * len(devices))
