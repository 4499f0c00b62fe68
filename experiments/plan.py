"""Parameter counts and a per-device memory plan for a config, without allocating anything.

    python -m experiments.plan --config=k3_full --mesh=data:64,expert:16 --seq_len=8192

The model is built with `nnx.eval_shape` (shapes only). Prints `total_params=<int> active_params=<int>`, a breakdown
by layer type, and for the mesh the per-device memory of parameters, optimizer state and activations (the
assumptions are printed with the numbers). `--config` takes a name under experiments/configs/ or a .py path.
"""
from __future__ import annotations

import collections
import importlib
import importlib.util
import math

import jax
from absl import app, flags
from flax import nnx

from experiments import harness
from k3jax import config as config_lib
from k3jax.layers import attnres
from k3jax.model import K3Model

GiB = 2 ** 30
CATEGORIES = ("embedding", "lm_head", "kda", "mla", "dense_ffn", "moe_routed_experts", "moe_shared_experts",
              "moe_router_and_latent", "norms_and_attnres")


def load_config(name_or_path: str):
  """`get_config()` of experiments/configs/<name>.py, or of a .py file."""
  if name_or_path.endswith(".py"):
    spec = importlib.util.spec_from_file_location("plan_config", name_or_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    module = importlib.import_module(f"experiments.configs.{name_or_path}")
  return module.get_config()


def abstract_model(model_cfg):
  """The model with ShapeDtypeStructs for arrays: nothing is allocated or computed."""
  return nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(0)))


def count_params(model_cfg) -> dict:
  """{category: (total, active)} Param counts; active counts top_k of the E routed experts in each MoE layer."""
  model = abstract_model(model_cfg)
  E = model_cfg.moe.num_experts
  counts = collections.defaultdict(lambda: [0, 0])
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shape = var.get_value().shape
    n = math.prod(shape)
    category, active = _category(path, shape, model.plan, model_cfg), n
    if category == "moe_routed_experts":
      active = n * model_cfg.moe.top_k // E
    counts[category][0] += n
    counts[category][1] += active
  return {c: tuple(counts[c]) for c in CATEGORIES if c in counts}


def _category(path, shape, layer_plan, m):
  head = path[0]
  if head == "embed":
    return "embedding"
  if head == "lm_head":
    return "lm_head"
  if head not in ("layers", "groups"):
    return "norms_and_attnres"
  if head == "layers":
    layer = layer_plan.unrolled[path[1]]
  else:  # one position of the scanned group: every group's copy, stacked on a leading axis
    layer, shape = layer_plan.position(path[1])[0], shape[1:]
  part = path[2]
  if part == "mixer":
    return config_lib.layer_types(m)[layer]
  if part != "ffn":
    return "norms_and_attnres"
  if not config_lib.uses_moe(m, layer):
    return "dense_ffn"
  if path[3] == "shared":
    return "moe_shared_experts"
  if len(shape) >= 3 and shape[0] == m.moe.num_experts:     # expert-stacked weights [E, ...]
    return "moe_routed_experts"
  return "moe_router_and_latent"


def _layers_of(category, m) -> int:
  """How many decoder layers hold the category (0 for the embedding, head and norms)."""
  types = config_lib.layer_types(m)
  n_moe = sum(config_lib.uses_moe(m, i) for i in range(m.num_layers))
  return {"kda": types.count("kda"), "mla": types.count("mla"), "dense_ffn": m.num_layers - n_moe}.get(
      category, n_moe if category.startswith("moe") else 0)


def parse_mesh(spec: str) -> dict:
  sizes = {}
  for part in spec.split(","):
    name, _, size = (x.strip() for x in part.partition(":"))
    if not name or not size.isdigit() or int(size) < 1 or name in sizes:
      raise ValueError(f"--mesh {spec!r}: expected 'axis:N,...' with distinct axes and sizes >= 1, got {part!r}")
    sizes[name] = int(size)
  return sizes


def memory_plan(model_cfg, counts: dict, mesh: dict, seq_len: int, micro_batch: int) -> list[tuple[str, float]]:
  """[(item, bytes per device)]: states fully sharded, activations for one micro-batch, remat per layer / group."""
  m = model_cfg
  n_dev = math.prod(mesh.values())
  ep = mesh.get("expert", 1)
  total = sum(t for t, _ in counts.values())
  routed = counts.get("moe_routed_experts", (0, 0))[0]
  t, d, V = micro_batch * seq_len, m.d_model, m.vocab_size
  types = config_lib.layer_types(m)
  n_moe = sum(config_lib.uses_moe(m, i) for i in range(m.num_layers))
  n_blocks = {"block": math.ceil(m.num_layers / m.residual.block_size), "full": 2 * m.num_layers, "none": 0}[
      m.residual.mode]

  # One decoder layer's weights in bf16, gathered for its forward / backward: non-expert weights whole, expert
  # weights only for this device's E/expert experts (FSDP gathers over `data`); two layers in flight (prefetch).
  per_layer = (total - routed) / m.num_layers + (routed / max(n_moe, 1)) / ep
  gathered = 2 * 2 * per_layer

  # Saved between remat units, fp32 [t, d]: each unrolled layer's input partial sum, each scanned group's input
  # carry (the source buffer, with room for every source the scan holds, and the partial sum), the completed
  # block sums and the embedding.
  layer_plan = config_lib.layer_plan(m)
  closes = attnres.closes(m.residual.mode, m.residual.block_size, m.num_layers)
  capacity = attnres.num_sources(m.residual.mode, [c for layer in closes[:layer_plan.end] for c in layer])
  saved = 4 * t * d * (len(layer_plan.unrolled) + layer_plan.num_groups * (capacity + 1) + n_blocks + 1)
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
  # A scanned group is one remat unit: its backward holds all its layers' recomputed activations at once.
  unit = layer_plan.group_size if layer_plan.num_groups else 1
  working = attnres_bytes + 2 * (2 * t * d) + unit * (max(mixers) + max(ffns))
  logits = 2 * 4 * t * V                     # fp32 logits and their gradient (no chunked cross-entropy)
  return [
      ("params bf16, sharded over all devices", 2 * total / n_dev),
      ("fp32 master params, sharded", 4 * total / n_dev),
      ("Adam m and v (fp32), sharded", 8 * total / n_dev),
      ("gradients (fp32, reduce-scattered), sharded", 4 * total / n_dev),
      ("gathered bf16 weights of 2 layers (FSDP prefetch)", gathered),
      ("saved activations (remat per layer / group, fp32 stream)", saved),
      ("one remat unit's recompute working set", working),
      ("logits + logit gradient (fp32)", logits),
  ]


ASSUMPTIONS = """assumptions:
  - every weight is sharded over all devices (ZeRO-3 / FSDP): routed experts split over `expert` (E/expert experts
    per device) and each expert's weights FSDP-split over `data`; every other weight FSDP-split over data × expert.
  - per parameter: bf16 working copy (2 B), fp32 master (4 B), Adam m and v (8 B), fp32 gradient (4 B).
  - a layer's weights are all-gathered (bf16) just before use, two layers in flight.
  - activations for one micro-batch per device, each unrolled layer and each scanned group of layers rematerialised
    in the backward pass: kept are the fp32 residual stream at every unit's input (a scanned group's: the AttnRes
    source buffer and the partial sum) plus the block sums; the peak adds one unit's working set.
  - the fp32 logits of the micro-batch and their gradient are materialised (a chunked cross-entropy removes this).
  - not counted: XLA temporaries and fragmentation, communication buffers beyond the MoE dispatch, the data
    pipeline; keep ~10-15% of the device free for them."""


def report(cfg_name: str, model_cfg, mesh_spec: str, seq_len: int, micro_batch: int, device_gib: float) -> str:
  counts = count_params(model_cfg)
  total = sum(t for t, _ in counts.values())
  active = sum(a for _, a in counts.values())
  lines = [f"config={cfg_name} total_params={total} active_params={active}",
           f"  ({_human(total)} total, {_human(active)} activated per token)", "",
           f"  {'layer type':<24}{'layers':>7}{'per layer':>16}{'total':>19}{'active':>18}{'share':>7}"]
  for c, (t, a) in counts.items():
    n = _layers_of(c, model_cfg)
    per = f"{t // n:,}" if n else ""
    lines.append(f"  {c:<24}{n or '':>7}{per:>16}{t:>19,}{a:>18,}{t / total:>7.1%}")
  mesh = parse_mesh(mesh_spec)
  n_dev = math.prod(mesh.values())
  items = memory_plan(model_cfg, counts, mesh, seq_len, micro_batch)
  need = sum(b for _, b in items)
  lines += ["", f"memory plan: mesh {mesh_spec} ({n_dev} devices), seq_len={seq_len}, micro_batch={micro_batch} "
            f"({seq_len * micro_batch} tokens per device)", f"  {'per device':<52}{'GiB':>10}"]
  lines += [f"  {name:<52}{b / GiB:>10.2f}" for name, b in items]
  verdict = "fits" if need <= device_gib * GiB else "does NOT fit"
  lines.append(f"  {'total':<52}{need / GiB:>10.2f}   {verdict} in {device_gib:g} GiB")
  states = 18 * total / GiB
  lines.append(f"  parameter + optimizer + gradient state alone: {states:,.0f} GiB in all, at least "
               f"{math.ceil(states / device_gib)} devices of {device_gib:g} GiB")
  lines += ["", ASSUMPTIONS]
  return "\n".join(lines)


def _human(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def define_flags():
  """The script's flags, defined only when it runs (so that importing this module defines none)."""
  flags.DEFINE_string("config", "k3_full", "config name under experiments/configs/, or a path to a .py file")
  flags.DEFINE_string("mesh", "data:64,expert:16", "mesh to plan for, 'data:N,expert:M'")
  flags.DEFINE_integer("seq_len", 8192, "tokens per sequence")
  flags.DEFINE_integer("micro_batch", 1, "sequences per device per micro-batch")
  flags.DEFINE_float("device_memory_gib", 140.0, "memory of one device (H200: 143,771 MiB)")


def main(argv):
  harness.check_argv(argv)
  f = flags.FLAGS
  print(report(f.config, load_config(f.config).model, f.mesh, f.seq_len, f.micro_batch, f.device_memory_gib))


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")   # shapes only: never touch an accelerator
  define_flags()
  app.run(main)
