"""Parameter counts by kind and a per-device memory plan of a config, without allocating anything.

The model is built with `nnx.eval_shape` (shapes only). Each parameter is classified by the modules that own it
(a KDA or MLA mixer, a dense FFN, a LatentMoE's routed experts, shared experts or router and latent projections,
norms and AttnRes), so the counts do not depend on how the model lays out its layers. `memory_plan` estimates the
bytes per device of the states and activations for a mesh, a sequence length and rows per micro-batch; `report`
prints both (`python -m experiments.plan`).
"""
from __future__ import annotations

import collections
import dataclasses
import math

from flax import nnx

from k3jax import config as config_lib, spec as spec_lib
from k3jax.layers import attnres
from k3jax.layers.attnres import DepthAttention
from k3jax.layers.common import RMSNorm
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.model import K3Model
from k3jax.train import stages as stages_lib

GiB = 2 ** 30
CATEGORIES = ("embedding", "lm_head", "kda", "mla", "dense_ffn", "moe_routed_experts", "moe_shared_experts",
              "moe_router_and_latent", "norms_and_attnres")
# Parameters that are not matrices applied to each token: the embedding is a lookup, the short convolutions are
# depthwise, the KDA decay parameters and the norm and AttnRes vectors are elementwise.
NOT_MATMUL_NAMES = ("embed", "conv", "A_log", "dt_bias")
NOT_MATMUL_OWNERS = (RMSNorm, DepthAttention)
ROUTED_EXPERT_NAMES = ("w_gate_up", "w_down")


@dataclasses.dataclass(frozen=True)
class ParamRow:
  path: tuple
  size: int
  category: str
  active: int          # weights applied to each token: top_k / E of a routed expert tensor, else all of them
  matmul: bool         # a matrix applied to each token (counted in the FLOPs)


def param_rows(model_cfg) -> list[ParamRow]:
  """One row per Param of the model `model_cfg` builds, in graph order."""
  model = nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(0)))
  nodes = dict(nnx.iter_graph(model))
  moe = model_cfg.moe
  rows = []
  for path, node in nodes.items():
    if not isinstance(node, nnx.Param):
      continue
    owners = [type(nodes[path[:i]]) for i in range(len(path)) if isinstance(nodes.get(path[:i]), nnx.Module)]
    category = _category(path, owners)
    size = math.prod(node.get_value().shape)
    active = size * moe.top_k // moe.num_experts if category == "moe_routed_experts" else size
    matmul = path[-1] not in NOT_MATMUL_NAMES and owners[-1] not in NOT_MATMUL_OWNERS
    rows.append(ParamRow(path, size, category, active, matmul))
  return rows


def _category(path, owners) -> str:
  from k3jax.layers.moe import LatentMoE   # imported only where MoE layers exist (as the model does)
  if path[-1] in ("embed", "lm_head") and len(owners) == 1:
    return "embedding" if path[-1] == "embed" else "lm_head"
  if KDALayer in owners:
    return "kda"
  if GatedMLA in owners:
    return "mla"
  if LatentMoE in owners:
    if owners[-1] is LatentMoE and path[-1] in ROUTED_EXPERT_NAMES:
      return "moe_routed_experts"
    return "moe_shared_experts" if SiTUGLU in owners[owners.index(LatentMoE):] else "moe_router_and_latent"
  return "dense_ffn" if SiTUGLU in owners else "norms_and_attnres"


def count_params(model_cfg) -> dict[str, tuple[int, int]]:
  """{category: (total, active)} Param counts, in `CATEGORIES` order."""
  counts = collections.defaultdict(lambda: [0, 0])
  for r in param_rows(model_cfg):
    counts[r.category][0] += r.size
    counts[r.category][1] += r.active
  return {c: tuple(counts[c]) for c in CATEGORIES if c in counts}


def layers_holding(category: str, spec: spec_lib.ModelSpec) -> int:
  """How many decoder layers of `spec` hold the category (0 for the embedding, head and norms)."""
  n_moe = len(spec.moe_layers)
  return {"kda": spec.count("kda"), "mla": spec.count("mla"), "dense_ffn": len(spec.layers) - n_moe}.get(
      category, n_moe if category.startswith("moe") else 0)


def mesh_sizes(spec: str, model_cfg=None) -> tuple[dict[str, int], str]:
  """(`{"data": N, "expert": M}`, a note) of a mesh spec such as `"data:64,expert:16"`. An axis of -1 (all the
  devices there are) counts as 1 device, as the note says. ValueError for a malformed spec or, given the model
  config, an expert axis that does not divide the experts."""
  sizes = {}
  for part in spec.split(","):
    name, _, size = (x.strip() for x in part.partition(":"))
    if name in sizes or not (size.isdigit() or size == "-1"):
      raise ValueError(f"mesh {spec!r}: expected 'data:N,expert:M' with sizes >= 1 (or one -1), got {part!r}")
    sizes[name] = int(size)
  if set(sizes) != {"data", "expert"} or 0 in sizes.values() or list(sizes.values()).count(-1) > 1:
    raise ValueError(f"mesh {spec!r}: expected exactly the axes data and expert, sizes >= 1 (at most one -1)")
  note = ""
  free = [a for a, n in sizes.items() if n == -1]
  if free:
    sizes[free[0]] = 1
    note = f"{free[0]}:-1 counted as 1 (all the devices there are): pass --mesh with sizes to plan for more"
  if model_cfg is not None and model_cfg.moe.enabled and model_cfg.moe.num_experts % sizes["expert"]:
    raise ValueError(f"mesh {spec!r}: the expert axis ({sizes['expert']}) does not divide "
                     f"model.moe.num_experts={model_cfg.moe.num_experts}")
  return sizes, note


def memory_plan(model_cfg, counts: dict, mesh: dict, seq_len: int, micro_batch: int) -> list[tuple[str, float]]:
  """[(item, bytes per device)]: states fully sharded, activations for one micro-batch with per-layer remat."""
  m = model_cfg
  n_dev = math.prod(mesh.values())
  ep = mesh.get("expert", 1)
  total = sum(t for t, _ in counts.values())
  routed = counts.get("moe_routed_experts", (0, 0))[0]
  t, d, V = micro_batch * seq_len, m.d_model, m.vocab_size
  spec = spec_lib.model_spec(m)
  types, n_moe = spec.mixers, len(spec.moe_layers)
  n_blocks = {"block": math.ceil(m.num_layers / m.residual.block_size), "full": 2 * m.num_layers, "none": 0}[
      m.residual.mode]

  # One decoder layer's weights in bf16, gathered for its forward / backward: non-expert weights whole, expert
  # weights only for this device's E/expert experts (FSDP gathers over `data`); two layers in flight (prefetch).
  per_layer = (total - routed) / m.num_layers + (routed / max(n_moe, 1)) / ep
  gathered = 2 * 2 * per_layer

  # Saved between layers (remat per layer), fp32 [t, d]: each layer's input partial sum, the completed block sums,
  # the embedding, and per scanned group its input buffer of sources (with room for every source the scan holds).
  plan = spec.plan
  capacity = attnres.num_sources(m.residual.mode, [c for layer in spec.closes[:plan.end] for c in layer])
  saved = 4 * t * d * (m.num_layers + n_blocks + 1 + plan.num_groups * capacity)
  # Peak of one layer's recompute + backward, bf16 (2 B) unless noted: the AttnRes read-outs (fp32 sources and keys)
  # plus the larger mixer plus the larger FFN.
  n_src = (n_blocks if m.residual.mode != "none" else 0) + 2
  attnres_bytes = 2 * 4 * n_src * t * d
  mixers = [0]
  if "kda" in types:
    HK = m.kda.num_heads * config_lib.kda_head_dim(m)
    # projections, conv in/out, normalised q/k, o, gate (≈13·HK bf16), fp32 g, per-64-token chunk states fp32.
    mixers.append(t * HK * (13 * 2 + 4) + 4 * t * HK * config_lib.kda_head_dim(m) / 64)
  if "mla" in types:
    Dqk, Dv = config_lib.mla_head_dims(m)
    H = m.mla.num_heads
    mixers.append(2 * t * (2 * H * Dqk + 4 * H * Dv + m.mla.kv_lora_rank) + 4 * t * H)
  ffns = [2 * t * 3 * m.ffn_hidden]
  if m.moe.enabled:
    k, l, h = m.moe.top_k, m.moe.latent_dim, m.moe.expert_hidden
    shared = 3 * m.moe.num_shared_experts * m.moe.shared_hidden
    # router scores fp32, latent in/out, k dispatched copies (sent and received), gate/up/product, shared GLU.
    ffns.append(4 * t * m.moe.num_experts + 2 * t * (2 * l + k * (4 * l + 3 * h) + shared))
  working = attnres_bytes + 2 * (2 * t * d) + max(mixers) + max(ffns)
  logits = 2 * 4 * t * V                     # fp32 logits and their gradient (no chunked cross-entropy)
  return [
      ("params bf16, sharded over all devices", 2 * total / n_dev),
      ("fp32 master params, sharded", 4 * total / n_dev),
      ("Adam m and v (fp32), sharded", 8 * total / n_dev),
      ("gradients (fp32, reduce-scattered), sharded", 4 * total / n_dev),
      ("gathered bf16 weights of 2 layers (FSDP prefetch)", gathered),
      ("saved activations (per-layer remat, fp32 stream)", saved),
      ("one layer's recompute working set", working),
      ("logits + logit gradient (fp32)", logits),
  ]


ASSUMPTIONS = """assumptions:
  - every weight is sharded over all devices (ZeRO-3 / FSDP): routed experts split over `expert` (E/expert experts
    per device) and each expert's weights FSDP-split over `data`; every other weight FSDP-split over data × expert.
  - per parameter: bf16 working copy (2 B), fp32 master (4 B), Adam m and v (8 B), fp32 gradient (4 B).
  - a layer's weights are all-gathered (bf16) just before use, two layers in flight.
  - activations for one micro-batch per device, each decoder layer rematerialised in the backward pass: kept are
    the fp32 residual stream at every layer input plus the AttnRes block sums (a scanned group also keeps its
    input buffer of block sums); the peak adds one layer's working set.
  - the fp32 logits of the micro-batch and their gradient are materialised (a chunked cross-entropy removes this).
  - not counted: XLA temporaries and fragmentation, communication buffers beyond the MoE dispatch, the data
    pipeline; keep ~10-15% of the device free for them."""


@dataclasses.dataclass(frozen=True)
class Shape:
  """What one column of the memory plan is planned for: a stage's (or the flags') length and rows per device."""
  name: str
  seq_len: int
  rows: float          # rows per device per micro-batch; not a positive int: the rows do not split over the mesh


def shapes_of(config, n_dev: int, *, seq_len: int | None = None, micro_batch: int | None = None) -> list[Shape]:
  """The plan's columns: one per stage of `config` (its length and its rows per device per micro-batch), or one
  at `seq_len` with `micro_batch` rows (default 1) when `seq_len` is given; `micro_batch` overrides the rows."""
  if seq_len is not None:
    return [Shape("flags", seq_len, micro_batch or 1)]
  return [Shape(f"stage {s.index}", s.seq_len,
                micro_batch or s.batch_size / config.micro_batches / n_dev) for s in stages_lib.training_plan(config).stages]


def report(name: str, config, mesh_spec: str | None = None, *, seq_len: int | None = None,
           micro_batch: int | None = None, device_gib: float = 140.0) -> str:
  """Parameter counts of `config` by kind, and its memory plan on `mesh_spec` (default `config.mesh`) for each
  stage (or for `seq_len` × `micro_batch`)."""
  m = config.model
  mesh_spec = mesh_spec or config.mesh
  mesh, note = mesh_sizes(mesh_spec, m)
  counts = count_params(m)
  total = sum(t for t, _ in counts.values())
  active = sum(a for _, a in counts.values())
  lines = [f"config={name} total_params={total} active_params={active}",
           f"  ({_human(total)} total, {_human(active)} activated per token)", "",
           f"  {'layer type':<24}{'layers':>7}{'per layer':>16}{'total':>19}{'active':>18}{'share':>7}"]
  spec = spec_lib.model_spec(m)
  for c, (t, a) in counts.items():
    n = layers_holding(c, spec)
    per = f"{t // n:,}" if n else ""
    lines.append(f"  {c:<24}{n or '':>7}{per:>16}{t:>19,}{a:>18,}{t / total:>7.1%}")
  n_dev = math.prod(mesh.values())
  shapes = shapes_of(config, n_dev, seq_len=seq_len, micro_batch=micro_batch)
  plans = [memory_plan(m, counts, mesh, s.seq_len, int(s.rows)) if _splits(s.rows) else None for s in shapes]
  width = 16
  lines += ["", f"memory plan: mesh {mesh_spec} ({n_dev} devices){f'; {note}' if note else ''}",
            f"  {'per device (GiB)':<52}" + "".join(f"{s.name:>{width}}" for s in shapes),
            f"  {'tokens per device per micro-batch':<52}"
            + "".join(f"{f'{s.seq_len * int(s.rows)} (T={s.seq_len})' if _splits(s.rows) else '-':>{width}}"
                      for s in shapes)]
  gib = lambda b: f"{'-' if b is None else f'{b / GiB:.2f}':>{width}}"
  for i, (item, _) in enumerate(next((p for p in plans if p), [])):
    lines.append(f"  {item:<52}" + "".join(gib(p[i][1] if p else None) for p in plans))
  needs = [sum(b for _, b in p) if p else None for p in plans]
  lines.append(f"  {'total':<52}" + "".join(gib(n) for n in needs))
  lines.append(f"  {f'fits in {device_gib:g} GiB':<52}" + "".join(
      f"{('yes' if n <= device_gib * GiB else 'NO') if n else '-':>{width}}" for n in needs))
  for s, p in zip(shapes, plans):
    if p is None:
      lines.append(f"  {s.name}: {s.rows * n_dev:g} rows per micro-batch do not split over the {n_dev} devices "
                   f"(one or more whole rows each): not runnable on this mesh")
  states = 18 * total / GiB
  lines.append(f"  parameter + optimizer + gradient state alone: {states:,.0f} GiB in all, at least "
               f"{math.ceil(states / device_gib)} devices of {device_gib:g} GiB")
  lines += ["", ASSUMPTIONS]
  return "\n".join(lines)


def _splits(rows: float) -> bool:
  return rows >= 1 and float(rows).is_integer()


def _human(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
