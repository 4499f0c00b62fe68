"""What the MoE benchmark does (`bench_moe.py` parses flags and calls `run`): the grouped-GEMM kernels and the
LatentMoE layer on one device, in one run.

1. check: the grouped GEMM's forward, dX and dW (Mosaic-GPU kernels on a Hopper GPU, else XLA) against
   `jax.lax.ragged_dot` in fp32 on random bf16 inputs with empty groups, an unaligned row count and rows past the
   groups; fails when a relative error exceeds MAX_REL_ERR.
2. gemm: each expert GEMM (gate/up ℓ -> 2h, down h -> ℓ) at M = tokens·k rows with the group sizes of a random
   router's top-k: forward, dX, dW against a dense GEMM of the same FLOPs, and the forward against
   `jax.lax.ragged_dot` (at fewer rows when ragged_dot runs out of memory: the rows used are printed).
3. layer: LatentMoE forward+backward against a dense SiTU-GLU FFN with the same activated FLOPs per token.
4. dispatch (first E): the routed part (sort, dispatch, experts, combine) with the custom-VJP dispatch of
   k3jax.ops.moe_dispatch and with autodiff of the gather / scatter / einsum it replaced, forward and forward+backward,
   with the expert GEMMs and without (the data movement alone, against the bytes it must move); checks they agree.
5. glu (first E): the routed experts (`expert_ffn`, every row a group's) forward+backward with the SiTU-GLU between
   the grouped GEMMs and in their epilogues (`glu_ffn`, where the Mosaic kernels run), timed back to back, and each
   one's largest error (output, three gradients) against the fp32 formula on the check's rows.
6. sweep (GPU, first): tile configurations on both GEMMs at the first E; the sections use the best of each product.
Times: host timer around `block_until_ready`, median of `Shapes.repeats` after warm-up (dispatch, glu: back-to-back
calls).
"""
from __future__ import annotations

import dataclasses
import time
import traceback

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from experiments import harness
from k3jax.layers.ffn import SiTU, SiTUGLU
from k3jax.layers.moe import LatentMoE, expert_ffn
from k3jax.numerics import rel_err
from k3jax.ops import moe_dispatch
from pallas_kernels.grouped_gemm import Configs, GroupedGemmOptions, TileConfig, mosaic, ops

SECTIONS = ("gemm", "layer", "dispatch", "glu")
MAX_REL_ERR = 1e-2
LAYER_MAX_REL_ERR = 2e-2  # two bf16 layers differing only in GEMM accumulation order
# Candidates: the best tiles of a full sweep at E = 256, gate/up (two consumer warpgroups won there).
SWEEP_RAGGED = [TileConfig(128, 128, 64, 3, 8, 2), TileConfig(128, 128, 64, 3, 4, 2), TileConfig(128, 64, 64, 6, 8, 2)]
SWEEP_TRANSPOSED = [TileConfig(128, 128, 64, 4, 1), TileConfig(128, 128, 64, 4, 8)]
# The routed part's two dispatch implementations: the op's custom VJPs, and autodiff of the path they replaced.
DISPATCH_IMPLS = {"custom_vjp": (moe_dispatch.dispatch, moe_dispatch.combine),
                  "autodiff": (moe_dispatch.dispatch_reference, moe_dispatch.combine_reference)}
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


@dataclasses.dataclass(frozen=True)
class Shapes:
  """One run: the layer's sizes (E values, tokens per call, top-k, d, ℓ, h, shared experts and their width), the
  timed calls per measurement, the rows of the ragged_dot comparison and of the check, the tile sweep, the
  sections."""
  experts: tuple[int, ...]
  tokens: int
  top_k: int
  d_model: int
  latent_dim: int
  expert_hidden: int
  num_shared: int
  shared_hidden: int
  repeats: int
  ragged_rows: int
  check_rows: int
  sweep: bool
  sections: tuple[str, ...] = SECTIONS


# Tiny shapes for a CPU run: every section runs and checks, the times mean nothing.
SMALL = Shapes(experts=(8, 16), tokens=256, top_k=2, d_model=64, latent_dim=32, expert_hidden=32, num_shared=1,
               shared_hidden=32, repeats=2, ragged_rows=512, check_rows=500, sweep=False)


def routed_group_sizes(key, tokens: int, experts: int, top_k: int):
  """Group sizes of a random sigmoid router's top-k (what an untrained layer sends to each expert)."""
  scores = jax.random.normal(key, (tokens, experts))
  _, ids = jax.lax.top_k(scores, top_k)
  return moe_dispatch.expert_counts(ids, experts)


def check_products(products, rows: int, k: int, n: int, experts: int, key) -> dict:
  """Relative errors of the three products (bf16) against XLA's ragged dots in fp32, with empty groups and the
  last 100 rows outside every group (finite junk there must not leak into dW)."""
  kx, kw, kd, kg = jax.random.split(key, 4)
  x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (experts, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (rows, n), jnp.bfloat16)
  sizes = routed_group_sizes(kg, (rows - 100) // 2, experts, 2).at[:3].set(0)
  sizes = sizes.at[-1].add(rows - 100 - sizes.sum())  # the zeroed groups' rows go to the last group
  inside = jnp.arange(rows)[:, None] < rows - 100
  x = jnp.where(inside, x, 1e3)
  dy = jnp.where(inside, dy, -1e3)
  ref = ops.XlaProducts()
  f32 = lambda a: a.astype(jnp.float32)
  got = {"fwd": products.fwd(x, w, sizes), "dx": products.dx(dy, w, sizes), "dw": products.dw(x, dy, sizes)}
  want = {"fwd": ref.fwd(f32(x), f32(w), sizes), "dx": ref.dx(f32(dy), f32(w), sizes),
          "dw": ref.dw(f32(jnp.where(inside, x, 0)), f32(jnp.where(inside, dy, 0)), sizes)}
  keep = lambda name, a: a[: rows - 100] if name in ("fwd", "dx") else a
  errs = {name: rel_err(keep(name, got[name]), keep(name, want[name])) for name in got}
  errs["finite"] = all(bool(jnp.all(jnp.isfinite(keep(name, got[name])))) for name in got)
  return errs


def glu_times(shapes: Shapes, experts: int, key, options: GroupedGemmOptions) -> dict:
  """The routed experts' forward+backward (ms) with the SiTU-GLU between the grouped GEMMs ("between") and in their
  epilogues ("epilogue", where `options.fuses_glu`), and each one's largest relative error over the output and the
  three gradients against autodiff of the fp32 formula on `check_rows` rows (all of them in groups)."""
  l, h = shapes.latent_dim, shapes.expert_hidden
  runs = {"between": dataclasses.replace(options, glu_tiles=None)}
  if options.fuses_glu(l, h, jnp.bfloat16):
    runs["epilogue"] = options
  kx, kw, kd, ky = jax.random.split(key, 4)

  def operands(rows, sizes):
    return ((jax.random.normal(kx, (rows, l)).astype(jnp.bfloat16),
             (l ** -0.5 * jax.random.normal(kw, (experts, l, 2 * h))).astype(jnp.bfloat16),
             (h ** -0.5 * jax.random.normal(kd, (experts, h, l))).astype(jnp.bfloat16),
             jax.random.normal(ky, (rows, l)).astype(jnp.bfloat16)), sizes)

  def forward_backward(options, sizes):
    def run(x, w, w_down, dy):
      y, vjp = jax.vjp(lambda *a: expert_ffn(a[0], sizes, a[1], a[2], options=options, rows_past_groups=False),
                       x, w, w_down)
      return (y, *vjp(dy))
    return jax.jit(run)

  rows = shapes.check_rows   # two empty groups; every row in one
  sizes = routed_group_sizes(jax.random.fold_in(key, 1), rows, experts, 1).at[:2].set(0)
  args, sizes = operands(rows, sizes.at[-1].add(rows - sizes.sum()))
  f32 = [a.astype(jnp.float32) for a in args]
  want_y, want_vjp = jax.vjp(lambda x, w, wd: ops.glu_ffn_reference(
      x, w.reshape(experts, l, 2, h), wd, sizes, SiTU()), *f32[:3])
  wants = (want_y, *want_vjp(f32[3]))
  out = {"applies": "epilogue" in runs, "errors": {}, "ms": {}}
  for name, o in runs.items():
    got = forward_backward(o, sizes)(*args)
    out["errors"][name] = max(rel_err(g, w) for g, w in zip(got, wants))
  m = shapes.tokens * shapes.top_k
  args, sizes = operands(m, routed_group_sizes(key, shapes.tokens, experts, shapes.top_k))
  for name, o in runs.items():
    out["ms"][name] = harness.pipelined_seconds(forward_backward(o, sizes), *args, repeats=shapes.repeats) * 1e3
  return out


def gemm_times(products, m: int, k: int, n: int, sizes, key, repeats: int) -> dict:
  """Seconds of the forward, dX and dW products and of dense GEMMs with the same FLOPs (2·m·k·n)."""
  kx, kw, kd = jax.random.split(key, 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (sizes.shape[0], k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
  w0 = w[0]
  return {
      "fwd": harness.median_seconds(jax.jit(products.fwd), x, w, sizes, repeats=repeats),
      "dx": harness.median_seconds(jax.jit(products.dx), dy, w, sizes, repeats=repeats),
      "dw": harness.median_seconds(jax.jit(products.dw), x, dy, sizes, repeats=repeats),
      "dense_fwd": harness.median_seconds(jax.jit(lambda a, b: a @ b), x, w0, repeats=repeats),
      "dense_dx": harness.median_seconds(jax.jit(lambda a, b: a @ b.T), dy, w0, repeats=repeats),
      "dense_dw": harness.median_seconds(jax.jit(lambda a, b: a.T @ b), x, dy, repeats=repeats),
  }


def ragged_dot_comparison(products, m: int, k: int, n: int, experts: int, top_k: int, key, repeats: int) -> dict:
  """Forward seconds of `jax.lax.ragged_dot` and of `products` at the most rows (m, m/2, ...) ragged_dot fits."""
  rows = m
  while True:  # ragged_dot runs ~50x slower than the kernels on GPU: a few calls only
    sizes = routed_group_sizes(key, rows // top_k, experts, top_k)
    x = jax.random.normal(key, (rows, k), jnp.bfloat16)
    w = jax.random.normal(key, (experts, k, n), jnp.bfloat16)
    try:
      ragged = harness.median_seconds(jax.jit(ops.XlaProducts().fwd), x, w, sizes, repeats=max(2, repeats // 3))
      break
    except Exception as e:  # out of memory: XLA expands ragged_dot densely over the groups on GPU
      del x, w
      out_of_memory = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
      if not out_of_memory or rows <= m // 16 or rows <= top_k:
        raise
      rows //= 2
  return {"rows": rows, "ragged_dot_fwd": ragged,
          "grouped_fwd": harness.median_seconds(jax.jit(products.fwd), x, w, sizes, repeats=repeats)}


def moe_config(shapes: Shapes, experts: int) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      enabled=True, num_experts=experts, top_k=shapes.top_k, num_shared_experts=shapes.num_shared,
      expert_hidden=shapes.expert_hidden, shared_hidden=shapes.shared_hidden, latent_dim=shapes.latent_dim,
      routed_scaling=1.0, balancer="quantile", balancer_eta=1.0, balancer_method="exact", aux_loss_coef=0.0,
      sign_update_rate=1e-3, first_dense_layers=1))


def activated_flops_per_token(shapes: Shapes, experts: int) -> int:
  """Forward FLOPs per token of the MoE layer: router, latent down/up, k routed experts, shared experts."""
  d, l, h = shapes.d_model, shapes.latent_dim, shapes.expert_hidden
  return 2 * (d * experts + 2 * d * l + shapes.top_k * 3 * l * h + 3 * d * shapes.num_shared * shapes.shared_hidden)


def layer_times(shapes: Shapes, experts: int, key, options: GroupedGemmOptions = GroupedGemmOptions()) -> dict:
  """Forward+backward seconds of LatentMoE (its grouped GEMMs as `options` says) and of the dense SiTU-GLU FFN with
  its activated FLOPs (bf16)."""
  dense_hidden = max(128, round(activated_flops_per_token(shapes, experts) / (6 * shapes.d_model) / 128) * 128)
  x = jax.random.normal(key, (8, shapes.tokens // 8, shapes.d_model), jnp.bfloat16)
  cot = jax.random.normal(jax.random.fold_in(key, 1), x.shape, jnp.bfloat16)
  out = {"dense_hidden": dense_hidden}
  builders = {"moe": lambda: LatentMoE(shapes.d_model, moe_config(shapes, experts), rngs=nnx.Rngs(0),
                                       grouped_gemm=options),
              "dense": lambda: SiTUGLU(shapes.d_model, dense_hidden, rngs=nnx.Rngs(0))}
  for name, build in builders.items():
    graph, params, rest = nnx.split(nnx.jit(build)(), nnx.Param, ...)

    def forward_backward(params, x, graph=graph, rest=rest):
      def apply(params, x):
        y = nnx.merge(graph, params, rest)(x)
        return y[0] if isinstance(y, tuple) else y
      y, pullback = jax.vjp(apply, params, x)  # y returned: XLA would drop the forward of a dead output
      return y, pullback(cot)
    out[name] = harness.median_seconds(jax.jit(forward_backward), params, x, repeats=shapes.repeats)
  return out


def layer_check(shapes: Shapes, experts: int, key, options: GroupedGemmOptions = GroupedGemmOptions(),
                tokens: int = 1024) -> dict:
  """LatentMoE output and gradients (bf16) with its grouped GEMMs as `options` says against the same weights on XLA's
  ragged dots."""
  build = lambda o: LatentMoE(shapes.d_model, moe_config(shapes, experts), rngs=nnx.Rngs(1), grouped_gemm=o)
  state = nnx.state(nnx.jit(lambda: build(options))())
  x = jax.random.normal(key, (2, tokens // 2, shapes.d_model), jnp.bfloat16)
  cot = jax.random.normal(jax.random.fold_in(key, 2), x.shape, jnp.float32)
  outputs = {}
  for name, o in (("auto", options), ("xla", GroupedGemmOptions("xla"))):
    layer = nnx.eval_shape(lambda: build(o))
    nnx.update(layer, state)
    graph, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x, graph=graph, rest=rest):
      y = nnx.merge(graph, params, rest)(x)[0]
      return jnp.sum(y.astype(jnp.float32) * cot), y
    outputs[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  (_, y), grads = outputs["auto"]
  (_, y_ref), grads_ref = outputs["xla"]
  leaves = list(zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)))
  return {"output": rel_err(y, y_ref), "grads": max(rel_err(g, r) for g, r in leaves),
          "finite": all(bool(jnp.all(jnp.isfinite(g))) for g, _ in leaves)}


def dispatch_times(shapes: Shapes, experts: int, key) -> dict:
  """The routed part of the layer in bf16 (plan, dispatch, experts, combine) with each of DISPATCH_IMPLS: forward
  and forward+backward seconds, with the expert GEMMs ("experts") and with identity experts ("movement": the data
  movement alone); the custom VJP's relative errors against autodiff (outputs and gradients, with the GEMMs); the
  bytes the movement must touch (each row read or written once); and, on a GPU, each variant's slowest kernels."""
  t, k, l, h = shapes.tokens, shapes.top_k, shapes.latent_dim, shapes.expert_hidden
  keys = jax.random.split(key, 6)
  _, ids = jax.lax.top_k(jax.random.normal(keys[0], (t, experts)), k)
  w = jax.nn.softmax(jax.random.normal(keys[1], (t, k)), axis=-1)
  args = (jax.random.normal(keys[2], (t, l), jnp.bfloat16), w,
          (jax.random.normal(keys[3], (experts, l, 2 * h)) * l ** -0.5).astype(jnp.bfloat16),
          (jax.random.normal(keys[4], (experts, h, l)) * h ** -0.5).astype(jnp.bfloat16),
          jax.random.normal(keys[5], (t, l), jnp.bfloat16), ids)  # ids an argument: XLA would fold a constant's sort
  runs = {"experts": expert_ffn, "movement": lambda x_ML, group_sizes_G, *_: x_ML}
  out, results = {}, {}
  for run, expert_fn in runs.items():
    for impl, (dispatch, combine) in DISPATCH_IMPLS.items():
      def forward(z, w, w_gate_up, w_down, ids, dispatch=dispatch, combine=combine, expert_fn=expert_fn):
        p = moe_dispatch.plan(ids, experts)
        return combine(expert_fn(dispatch(z, p), p.group_sizes_E, w_gate_up, w_down), w, p)

      def forward_backward(z, w, w_gate_up, w_down, du, ids, forward=forward):
        u, pullback = jax.vjp(lambda *a: forward(*a, ids), z, w, w_gate_up, w_down)
        return u, pullback(du.astype(u.dtype))
      fwd = jax.jit(lambda z, w, wg, wd, du, ids, forward=forward: forward(z, w, wg, wd, ids))
      fwd_bwd = jax.jit(forward_backward)
      entry = out.setdefault(run, {}).setdefault(impl, {})
      entry["fwd"] = harness.pipelined_seconds(fwd, *args, repeats=shapes.repeats)
      entry["fwd_bwd"] = harness.pipelined_seconds(fwd_bwd, *args, repeats=shapes.repeats)
      if run == "movement":
        entry["kernels"] = harness.device_kernel_times(fwd_bwd, *args)[:8]
      else:
        results[impl] = fwd_bwd(*args)
  (u, grads), (u_ref, grads_ref) = results["custom_vjp"], results["autodiff"]
  out["errors"] = {"output": rel_err(u, u_ref), **{name: rel_err(g, r) for name, g, r in
                                                   zip(("dz", "dw", "dw_gate_up", "dw_down"), grads, grads_ref)}}
  m, bf16 = t * k, 2
  out["movement_bytes"] = {"fwd": 2 * (t + m) * l * bf16, "fwd_bwd": (4 * t + 5 * m) * l * bf16}
  return out


def report_dispatch(tag: str, d: dict) -> None:
  for run in ("experts", "movement"):
    new, old = d[run]["custom_vjp"], d[run]["autodiff"]
    print(f"{tag} routed part ({run}): " + "  ".join(
        f"{mode} {new[mode] * 1e3:.3f} ms custom VJP vs {old[mode] * 1e3:.3f} ms autodiff "
        f"({old[mode] / new[mode]:.2f}x)" for mode in ("fwd", "fwd_bwd")), flush=True)
  kind = jax.devices()[0].device_kind
  peak = next((v for name, v in HBM_BYTES_PER_S.items() if name in kind), None)
  for mode, nbytes in d["movement_bytes"].items():
    rate = nbytes / d["movement"]["custom_vjp"][mode]
    print(f"{tag} movement {mode}: {nbytes / 1e6:.0f} MB at {rate / 1e9:.0f} GB/s"
          + (f" ({rate / peak:.0%} of HBM peak)" if peak else ""), flush=True)
  print(f"{tag} custom VJP vs autodiff (bf16 rel err): "
        + " ".join(f"{name} {err:.1e}" for name, err in d["errors"].items()), flush=True)
  for impl in DISPATCH_IMPLS:
    for name, launches, ms in d["movement"][impl]["kernels"]:
      print(f"{tag} [profile] {impl:<10} {ms:8.3f} ms x{launches:g} {name[:90]}", flush=True)


def sweep(shapes: Shapes, experts: int, key) -> dict:
  """Times of each candidate tiling on both expert GEMMs; a config that fails to build is reported, not fatal."""
  m = shapes.tokens * shapes.top_k
  sizes = routed_group_sizes(key, shapes.tokens, experts, shapes.top_k)
  result = {"fwd": [], "dx": [], "dw": []}
  for name, (k, n) in gemm_shapes(shapes).items():
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(key, (experts, k, n), jnp.bfloat16)
    dy = jax.random.normal(key, (m, n), jnp.bfloat16)
    args = {"fwd": (x, w, sizes), "dx": (dy, w, sizes), "dw": (x, dy, sizes)}
    for product, candidates in (("fwd", SWEEP_RAGGED), ("dx", SWEEP_RAGGED), ("dw", SWEEP_TRANSPOSED)):
      for config in candidates:
        row = {"gemm": name, "config": dataclasses.asdict(config)}
        try:
          run = getattr(ops.MosaicProducts(Configs(config, config, config)), product)  # the op's own product
          row["seconds"] = harness.median_seconds(jax.jit(run), *args[product], repeats=shapes.repeats)
          row["tflops"] = 2 * m * k * n / row["seconds"] / 1e12
        except Exception as e:
          row["error"] = str(e).splitlines()[0][:200]
        result[product].append(row)
        print(f"  sweep {name} {product} {dataclasses.astuple(config)}: "
              + (f"{row['tflops']:.0f} TFLOP/s" if "tflops" in row else row["error"]), flush=True)
    del x, w, dy
  return result


def best_configs(sweep_result: dict, default: Configs) -> Configs:
  """For each product, the tiling with the least time summed over both GEMMs (the default where none ran on both)."""
  def best(product, fallback):
    total = {}
    for row in sweep_result[product]:
      key = tuple(row["config"].items())
      total[key] = total.get(key, 0.0) + row.get("seconds", float("inf"))
    finite = {key: t for key, t in total.items() if t < float("inf")}
    return TileConfig(**dict(min(finite, key=finite.get))) if finite else fallback
  return Configs(fwd=best("fwd", default.fwd), dx=best("dx", default.dx), dw=best("dw", default.dw))


def run(shapes: Shapes) -> tuple[dict, bool]:
  """All sections; returns (results, ok). A failing section is recorded and the others still run."""
  key = jax.random.key(0)
  device = jax.devices()[0]
  results = {"device": str(device.device_kind), "jax": jax.__version__, "shapes": dataclasses.asdict(shapes),
             "errors": {}}
  ok = True
  print(f"device {device.device_kind}, jax {jax.__version__}; shapes {dataclasses.asdict(shapes)}", flush=True)
  preferred = ()   # tilings tried before the defaults, for each product of each GEMM (`mosaic.default_configs`)
  default = mosaic.default_configs(shapes.latent_dim, 2 * shapes.expert_hidden, jnp.bfloat16)
  if shapes.sweep and mosaic.unsupported_reason(shapes.latent_dim, 2 * shapes.expert_hidden, jnp.bfloat16,
                                                default) is None:
    print(f"tile sweep, both GEMMs at E={shapes.experts[0]}:", flush=True)
    results["sweep"] = sweep(shapes, shapes.experts[0], key)
    preferred = (best_configs(results["sweep"], default),)
    print(f"the sections below use the sweep's best tiles where they fit: {preferred[0]}", flush=True)
  tile_configs = {name: mosaic.default_configs(k, n, jnp.bfloat16, preferred)
                  for name, (k, n) in gemm_shapes(shapes).items()}
  results["tile_configs"] = {name: dataclasses.asdict(c) for name, c in tile_configs.items()}
  layer_options = GroupedGemmOptions(tiles=preferred)
  for experts in shapes.experts:
    results.setdefault(f"E{experts}", {})
    for name, (k, n) in gemm_shapes(shapes).items() if "gemm" in shapes.sections else ():
      configs = tile_configs[name]
      products = ops.products("auto", k, n, jnp.bfloat16, configs)
      tag = f"E={experts} {name} [{shapes.tokens * shapes.top_k}x{k}]x[{k}x{n}]"
      backend = type(products).__name__
      if backend != "MosaicProducts":
        print(f"{tag}: Mosaic kernels unavailable ({mosaic.unsupported_reason(k, n, jnp.bfloat16, configs)}); "
              "timing the XLA ragged dots", flush=True)
      entry = results.setdefault(f"E{experts}", {}).setdefault(name, {"backend": backend})
      sections = {
          "check": lambda: check_products(products, shapes.check_rows, k, n, experts, key),
          "times": lambda: gemm_times(products, shapes.tokens * shapes.top_k, k, n,
                                      routed_group_sizes(key, shapes.tokens, experts, shapes.top_k), key,
                                      shapes.repeats),
          "vs_ragged_dot": lambda: ragged_dot_comparison(products, min(shapes.ragged_rows, shapes.tokens *
                                                         shapes.top_k), k, n, experts, shapes.top_k, key,
                                                         shapes.repeats),
      }
      for section, fn in sections.items():
        start = time.perf_counter()
        try:
          entry[section] = fn()
          print(f"{tag} {section}: {time.perf_counter() - start:.0f} s", flush=True)
        except Exception:
          ok = False
          results["errors"][f"E{experts}/{name}/{section}"] = traceback.format_exc()
          print(f"{tag} {section} FAILED:\n{traceback.format_exc()}", flush=True)
      if "check" in entry:
        bad = [p for p in ("fwd", "dx", "dw") if not entry["check"][p] <= MAX_REL_ERR] + (
            [] if entry["check"]["finite"] else ["non-finite"])
        ok &= not bad
        print(f"{tag} check vs fp32 ragged_dot: "
              + " ".join(f"{p} {entry['check'][p]:.2e}" for p in ("fwd", "dx", "dw"))
              + ("  OK" if not bad else f"  FAILED ({', '.join(bad)} > {MAX_REL_ERR})"), flush=True)
      report_gemm(tag, entry, 2 * shapes.tokens * shapes.top_k * k * n)
    if "dispatch" in shapes.sections and experts == shapes.experts[0]:
      try:
        results[f"E{experts}"]["dispatch"] = d = dispatch_times(shapes, experts, key)
        report_dispatch(f"E={experts}", d)
        bad = not max(d["errors"].values()) <= LAYER_MAX_REL_ERR
        ok &= not bad
        if bad:
          print(f"E={experts} dispatch check FAILED (> {LAYER_MAX_REL_ERR})", flush=True)
      except Exception:
        ok = False
        results["errors"][f"E{experts}/dispatch"] = traceback.format_exc()
        print(f"E={experts} dispatch FAILED:\n{traceback.format_exc()}", flush=True)
    if "glu" in shapes.sections and experts == shapes.experts[0]:
      try:
        results[f"E{experts}"]["glu"] = g = glu_times(shapes, experts, key, layer_options)
        bad = not max(g["errors"].values()) <= LAYER_MAX_REL_ERR
        ok &= not bad
        print(f"E={experts} routed experts fwd+bwd, the GLU " + ", ".join(
            f"{n} {g['ms'][n]:.3f} ms (error {g['errors'][n]:.2e})" for n in g["ms"])
            + ("" if g["applies"] else "; in the epilogues: not here (the Mosaic kernels do not run)")
            + (f"  FAILED (> {LAYER_MAX_REL_ERR})" if bad else ""), flush=True)
      except Exception:
        ok = False
        results["errors"][f"E{experts}/glu"] = traceback.format_exc()
        print(f"E={experts} glu FAILED:\n{traceback.format_exc()}", flush=True)
    if "layer" not in shapes.sections:
      continue
    try:
      results[f"E{experts}"]["layer_check"] = check = layer_check(shapes, experts, key, layer_options)
      bad = not (check["output"] <= LAYER_MAX_REL_ERR and check["grads"] <= LAYER_MAX_REL_ERR and check["finite"])
      ok &= not bad
      print(f"E={experts} layer, auto grouped GEMM vs XLA ragged dots (bf16): output {check['output']:.2e} "
            f"gradients {check['grads']:.2e} finite {check['finite']}"
            + (f"  FAILED (> {LAYER_MAX_REL_ERR})" if bad else "  OK"), flush=True)
    except Exception:
      ok = False
      results["errors"][f"E{experts}/layer_check"] = traceback.format_exc()
      print(f"E={experts} layer check FAILED:\n{traceback.format_exc()}", flush=True)
    try:
      results[f"E{experts}"]["layer"] = times = layer_times(shapes, experts, key, layer_options)
      flop = 3 * activated_flops_per_token(shapes, experts) * shapes.tokens
      print(f"E={experts} layer fwd+bwd: LatentMoE {times['moe'] * 1e3:.2f} ms ({flop / times['moe'] / 1e12:.3g} "
            f"activated TFLOP/s), dense SiTU-GLU (hidden {times['dense_hidden']}) {times['dense'] * 1e3:.2f} ms "
            f"({flop / times['dense'] / 1e12:.3g} TFLOP/s); MoE/dense time {times['moe'] / times['dense']:.2f}x",
            flush=True)
    except Exception:
      ok = False
      results["errors"][f"E{experts}/layer"] = traceback.format_exc()
      print(f"E={experts} layer FAILED:\n{traceback.format_exc()}", flush=True)
  return results, ok


def report_gemm(tag: str, entry: dict, flop: int) -> None:
  if "times" in entry:
    t = entry["times"]
    line = "  ".join(f"{p} {flop / t[p] / 1e12:.3g} TFLOP/s ({t['dense_' + p] / t[p]:.2f} of dense "
                     f"{flop / t['dense_' + p] / 1e12:.3g})" for p in ("fwd", "dx", "dw"))
    print(f"{tag}: {line}", flush=True)
  if "vs_ragged_dot" in entry:
    r = entry["vs_ragged_dot"]
    print(f"{tag}: fwd at {r['rows']} rows: grouped {r['grouped_fwd'] * 1e3:.3f} ms, ragged_dot "
          f"{r['ragged_dot_fwd'] * 1e3:.3f} ms: {r['ragged_dot_fwd'] / r['grouped_fwd']:.1f}x", flush=True)


def summary(results: dict, shapes: Shapes) -> str:
  """The headline tables: grouped-GEMM TFLOP/s and ratios with the layer against the dense FFN, and the routed
  part's milliseconds by dispatch implementation."""
  lines = []
  if "gemm" in shapes.sections or "layer" in shapes.sections:
    lines += ["| E | GEMM | fwd TFLOP/s (x dense) | dX | dW | fwd vs ragged_dot | layer fwd+bwd ms (MoE / dense) |",
              "|---|---|---|---|---|---|---|"]
  for experts in shapes.experts if lines else ():
    entry = results.get(f"E{experts}", {})
    layer = entry.get("layer")
    layer_cell = (f"{layer['moe'] * 1e3:.2f} / {layer['dense'] * 1e3:.2f} = {layer['moe'] / layer['dense']:.2f}x"
                  if layer else "-")
    for name, (k, n) in gemm_shapes(shapes).items():
      flop = 2 * shapes.tokens * shapes.top_k * k * n
      t, r = entry.get(name, {}).get("times"), entry.get(name, {}).get("vs_ragged_dot")
      cells = [f"{flop / t[p] / 1e12:.3g} ({t['dense_' + p] / t[p]:.2f})" if t else "-" for p in ("fwd", "dx", "dw")]
      vs = f"{r['ragged_dot_fwd'] / r['grouped_fwd']:.1f}x at {r['rows']} rows" if r else "-"
      lines.append(f"| {experts} | {name} {k}->{n} | {' | '.join(cells)} | {vs} | {layer_cell} |")
  if "dispatch" in shapes.sections:
    lines += ["", "| E | routed part | fwd ms: custom VJP / autodiff | fwd+bwd ms: custom VJP / autodiff |",
              "|---|---|---|---|"]
    for experts in shapes.experts[:1]:
      d = results.get(f"E{experts}", {}).get("dispatch")
      for run in ("experts", "movement"):
        cells = [f"{d[run]['custom_vjp'][m] * 1e3:.3f} / {d[run]['autodiff'][m] * 1e3:.3f}" if d else "failed"
                 for m in ("fwd", "fwd_bwd")]
        lines.append(f"| {experts} | {run} | {' | '.join(cells)} |")
  if "glu" in shapes.sections:
    g = results.get(f"E{shapes.experts[0]}", {}).get("glu")
    cell = lambda n: f"{g['ms'][n]:.3f}" if g and n in g["ms"] else "-"
    lines += ["", "| E | routed experts fwd+bwd ms: GLU between the GEMMs / in their epilogues |", "|---|---|",
              f"| {shapes.experts[0]} | {cell('between')} / {cell('epilogue')} |"]
  return "\n".join(lines)


def gemm_shapes(shapes: Shapes) -> dict:
  """(K, N) of the two expert GEMMs."""
  return {"gate_up": (shapes.latent_dim, 2 * shapes.expert_hidden), "down": (shapes.expert_hidden, shapes.latent_dim)}
