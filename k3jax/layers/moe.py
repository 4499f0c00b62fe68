"""Stable LatentMoE (docs/design.md, LatentMoE): sigmoid router with a balancer bias, SiTU-GLU experts in latent space.

    s = σ(x W_r) (fp32),  sel = top_k(s + b),  p = s[sel] / Σ s[sel] · routed_scaling
    y = Shared(x) + W_up RMSNorm(Σ_{i∈sel} p_i E_i(W_down x))

Dropless: token-slots are sorted by expert once (`k3jax.ops.moe_dispatch`), run through grouped GEMMs
(`pallas_kernels.grouped_gemm`) and combined per token in fp32, returned in the compute dtype; with a mesh, experts
are sharded over its `expert` axis (`k3jax.parallel`). A call of few tokens (a decode step: T <= E <= T·k, so
nearly every expert has a token anyway) runs every expert on every token instead (`dense_routed_outputs`): the same
weights read, no sort, no dispatch, two batched GEMMs (`moe.routing` chooses). The shared experts are one SiTU-GLU of
width `num_shared_experts · shared_hidden`: a sum of GLUs on the same input is one GLU over their concatenated
hidden units.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx, struct

from k3jax import balancer, config as config_lib, parallel
from k3jax.layers.common import Linear, RMSNorm
from k3jax.layers.ffn import SiTU, SiTUGLU, situ_glu
from pallas_kernels.grouped_gemm import GroupedGemmOptions

@struct.dataclass
class MoEStats:
  scores_TE: jax.Array  # fp32 router scores of every token, [B*T, E]
  aux_loss: jax.Array   # scalar; 0 unless balancer == "aux_loss" (already times aux_loss_coef)
  load_E: jax.Array     # fp32 token-slots routed to each expert in this call, [E] (real tokens only)
  weights_T: jax.Array | None = None   # fp32 1 for a real token, 0 for padding, [B*T]; None: every token is real


def check_config(d_model: int, cfg: ml_collections.ConfigDict, mesh=None) -> None:
  """ValueErrors for a MoE config (`k3jax.config.validate_moe`) and mesh the layer cannot be built from, naming
  the field."""
  if not isinstance(d_model, int) or d_model < 1:
    raise ValueError(f"d_model must be a positive int, got {d_model!r}")
  config_lib.validate_moe(cfg, root="moe")
  if mesh is not None and cfg.num_experts % parallel.expert_parallel_size(mesh):
    raise ValueError(f"moe.num_experts={cfg.num_experts} is not divisible by the expert-parallel size "
                     f"{parallel.expert_parallel_size(mesh)}")
  if mesh is not None and cfg.get("routing", "auto") == "dense" and parallel.expert_parallel_size(mesh) > 1:
    raise ValueError("moe.routing='dense' runs every expert on one device; with experts sharded over the mesh's "
                     "expert axis use 'sorted' or 'auto'")


def expert_ffn(x_ML, group_sizes_G, w_gate_up_GLF, w_down_GHL, *, options: GroupedGemmOptions = GroupedGemmOptions(),
               rows_past_groups: bool = True):
  """Routed SiTU-GLU experts on rows sorted by expert: `[M, ℓ] -> [M, ℓ]` (rows past the groups: unspecified), the
  grouped GEMMs run as `options` says.

  `w_gate_up_GLF` is `[G, ℓ, 2h]`: the gate units, then the up units. `rows_past_groups=False` promises that the
  groups cover all M rows (every routed slot on this device), which saves zeroing the rows past them, and lets the
  SiTU-GLU run in the grouped GEMMs' epilogues where `options.fuses_glu`.
  """
  (g, l, _), h = w_gate_up_GLF.shape, w_down_GHL.shape[1]
  if not rows_past_groups and options.fuses_glu(l, h, x_ML.dtype):
    return options.glu_ffn(x_ML, w_gate_up_GLF.reshape(g, l, 2, h), w_down_GHL, group_sizes_G, SiTU())
  ab_MF = options.matmul(x_ML, w_gate_up_GLF, group_sizes_G)
  if rows_past_groups:
    # The GPU kernels leave rows past the groups unwritten; zero them so nothing non-finite reaches dW.
    valid_M1 = (jnp.arange(x_ML.shape[0]) < jnp.sum(group_sizes_G))[:, None]
    ab_MF = jnp.where(valid_M1, ab_MF, 0)
  return options.matmul(situ_glu(ab_MF.reshape(-1, 2, h)), w_down_GHL, group_sizes_G)


def dense_routed_outputs(z_TL, expert_ids_TK, weights_TK, w_gate_up_ELF, w_down_EHL):
  """`u[t] = Σ_j w[t, j] · E_{ids[t, j]}(z[t])`, `[T, L]`, with every expert run on every token and the unchosen
  weighted 0: two GEMMs batched over the experts, no sort, no dispatch, no grouped GEMM. It reads every expert's
  weights once (as the sorted path does when every expert has a token) and spends E/k times the expert FLOPs: the
  path for a handful of tokens. Products in z's dtype with fp32 accumulation, rounded to z's dtype as the grouped
  GEMMs' are; the combine in fp32, returned in z's dtype."""
  E, h = w_down_EHL.shape[:2]
  ab_ETF = jnp.einsum("tl,elf->etf", z_TL, w_gate_up_ELF, preferred_element_type=jnp.float32).astype(z_TL.dtype)
  y_ETL = jnp.einsum("eth,ehl->etl", situ_glu(ab_ETF.reshape(*ab_ETF.shape[:-1], 2, h)), w_down_EHL,
                     preferred_element_type=jnp.float32)
  chosen_TKE = expert_ids_TK[..., None] == jnp.arange(E)
  w_ET1 = jnp.sum(jnp.where(chosen_TKE, weights_TK[..., None].astype(jnp.float32), 0.0), axis=1).T[..., None]
  # An unchosen expert's output is masked, not multiplied by 0: 0·inf would be NaN. Elementwise and summed over E
  # (one fusion), not an fp32 dot, which a GPU may run in TF32.
  u_ETL = jnp.where(w_ET1 != 0, w_ET1 * y_ETL.astype(z_TL.dtype).astype(jnp.float32), 0.0)
  return jnp.sum(u_ETL, axis=0).astype(z_TL.dtype)


def dense_routing(routing: str, tokens: int, num_experts: int, top_k: int, mesh=None) -> bool:
  """Whether a call of `tokens` tokens runs every expert on every token (`dense_routed_outputs`): "dense" always,
  "sorted" never, "auto" when T <= E <= T·k on one device (a decode step: nearly every expert has a token, so the
  dense path reads no more weights, and its E/k times the FLOPs on at most E tokens are cheaper than the sort)."""
  if routing != "auto":
    return routing == "dense"
  return mesh is None and tokens <= num_experts <= tokens * top_k


class LatentMoE(nnx.Module):
  """The MoE FFN: `(x_BTD) -> (y_BTD, MoEStats)`. The balancer bias is a `BalancerState`, never a Param."""

  def __init__(self, d_model: int, moe_cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs, dtype=jnp.bfloat16,
               mesh=None, grouped_gemm: GroupedGemmOptions = GroupedGemmOptions()):
    check_config(d_model, moe_cfg, mesh)
    if not moe_cfg.get("glu_epilogue", True):
      grouped_gemm = dataclasses.replace(grouped_gemm, glu_tiles=None)
    e, l, h = moe_cfg.num_experts, moe_cfg.latent_dim, moe_cfg.expert_hidden
    on_experts = lambda ndim: {} if mesh is None else {"out_sharding": (parallel.EXPERT,) + (None,) * (ndim - 1),
                                                       "mesh": mesh}
    self.router = Linear(d_model, e, rngs=rngs, dtype=jnp.float32)
    self.latent_down = Linear(d_model, l, rngs=rngs, dtype=dtype)
    self.w_gate_up = nnx.Param(l ** -0.5 * jax.random.normal(rngs.params(), (e, l, 2, h), jnp.float32),
                               **on_experts(4))
    self.w_down = nnx.Param(h ** -0.5 * jax.random.normal(rngs.params(), (e, h, l), jnp.float32), **on_experts(3))
    self.norm = RMSNorm(l)
    self.latent_up = Linear(l, d_model, rngs=rngs, dtype=dtype)
    self.shared = (SiTUGLU(d_model, moe_cfg.num_shared_experts * moe_cfg.shared_hidden, rngs=rngs, dtype=dtype)
                   if moe_cfg.num_shared_experts else None)
    self.balancer = balancer.BalancerState(balancer.init(e))
    self.cfg = ml_collections.FrozenConfigDict(moe_cfg)  # hashable: it is static module data
    self.dtype, self.mesh, self.grouped_gemm = dtype, mesh, grouped_gemm

  @jax.named_scope("moe")
  def __call__(self, x_BTD, valid_BT=None):
    """`valid_BT` (bool, None: all) marks the real tokens: padding is routed and computed like any token, but
    counts in no statistic (the balancer's update, the load, the auxiliary loss)."""
    b, t, d = x_BTD.shape
    cfg = self.cfg
    x_TD = x_BTD.reshape(b * t, d)
    with jax.named_scope("router"):
      scores_TE = jax.nn.sigmoid(self.router(x_TD))
      weights_TK, ids_TK = balancer.select(scores_TE, self.balancer.get_value().bias, top_k=cfg.top_k,
                                           routed_scaling=cfg.routed_scaling)
    z_TL = self.latent_down(x_TD)
    e, l, _, h = self.w_gate_up.shape
    experts = (self.w_gate_up[...].reshape(e, l, 2 * h).astype(self.dtype), self.w_down[...].astype(self.dtype))
    # Without expert parallelism the T·k sorted slots are exactly the groups' rows (nothing past them to zero).
    exchanged = self.mesh is not None and parallel.expert_parallel_size(self.mesh) > 1
    expert_fn = functools.partial(expert_ffn, options=self.grouped_gemm, rows_past_groups=exchanged)
    with jax.named_scope("routed_experts"):
      if dense_routing(cfg.get("routing", "auto"), b * t, e, cfg.top_k, self.mesh):
        u_TL = dense_routed_outputs(z_TL, ids_TK, weights_TK, *experts)
      elif self.mesh is None:
        u_TL = parallel.local_routed_outputs(z_TL, ids_TK, weights_TK, experts, num_experts=e, expert_fn=expert_fn)
      else:
        u_TL = parallel.expert_parallel_routed_outputs(z_TL, ids_TK, weights_TK, experts, mesh=self.mesh,
                                                       num_experts=e, expert_fn=expert_fn)
    y_BTD = self.latent_up(self.norm(u_TL)).reshape(b, t, d)
    if self.shared is not None:
      with jax.named_scope("shared_experts"):
        y_BTD = y_BTD + self.shared(x_BTD)
    weights_T = None if valid_BT is None else valid_BT.reshape(b * t).astype(jnp.float32)
    aux = (cfg.aux_loss_coef * balancer.switch_aux_loss(scores_TE, ids_TK, weights_T) if cfg.balancer == "aux_loss"
           else jnp.zeros((), jnp.float32))
    stats = MoEStats(scores_TE=scores_TE, aux_loss=aux,
                     load_E=balancer.expert_load(ids_TK, cfg.num_experts, weights_T), weights_T=weights_T)
    return y_BTD, stats

  @jax.named_scope("balancer")
  def update_balance(self, stats_list) -> None:
    """After the optimizer step: the new bias from this step's router scores (a list of stats, or one). A module
    of stacked layers (bias `[..., E]`, the scanned decoder's) takes stats stacked the same way, layer by layer."""
    stats_list = [stats_list] if isinstance(stats_list, MoEStats) else list(stats_list)
    cfg = self.cfg
    if cfg.balancer in ("none", "aux_loss"):
      return
    scores_TE = jax.lax.stop_gradient(jnp.concatenate([s.scores_TE for s in stats_list], axis=-2))
    weights_T = None
    if any(s.weights_T is not None for s in stats_list):
      ones = lambda s: jnp.ones(s.scores_TE.shape[:-1], jnp.float32)
      weights_T = jnp.concatenate([ones(s) if s.weights_T is None else s.weights_T for s in stats_list], axis=-1)
    method = "sign" if cfg.balancer == "sign" else cfg.balancer_method
    update = functools.partial(balancer.update, top_k=cfg.top_k, eta=cfg.get("balancer_eta", 1.0), method=method,
                               sign_rate=cfg.get("sign_update_rate", 1e-3),
                               rate=cfg.get("correction_step", balancer.CORRECTION_STEP),
                               decay=cfg.get("load_decay", 0.5), bound=cfg.get("correction_bound", 1.0),
                               load_unit=cfg.get("load_unit", balancer.LOAD_UNIT))
    for _ in range(self.balancer.get_value().bias.ndim - 1):
      update = jax.vmap(update)
    self.balancer.set_value(update(self.balancer.get_value(), scores_TE, weights_T))
