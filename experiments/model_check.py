"""What the model check does (`check_model.py` parses flags and calls `run`): the model at a research config, its bf16
fast paths against references, then timings.

Checks (rel = `k3jax.numerics.rel_err`, RMS(out − ref) / RMS(ref); the reference shares the parameters):
  kda_layer   the KDA layer in bf16 (backend auto: Pallas on GPU) against backend xla in fp32, packed documents
  mla_layer   gated MLA in bf16 (cuDNN on GPU), packed documents, against XLA attention in fp32
  model_fp32  whole model, fp32, XLA paths at "highest" matmul precision: logits of prefill + decode steps against
              the full forward
  model_bf16  the same in bf16 with the fast paths (Pallas KDA, cuDNN attention) in the full forward and prefill
  generate    greedy tokens against the argmax of one full forward (fp32)
Times (medians): forward, forward+backward of the mean cross-entropy (tokens/s), prefill + decode of N tokens.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from experiments import harness
from k3jax import generate as gen
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.model import K3Model
from k3jax.numerics import rel_err
from k3jax.train import step as step_lib

TOL = {"kda_layer": 3e-2, "mla_layer": 3e-2, "model_fp32": 1e-4, "model_bf16": 5e-2}
TIMES = ("fwd_s", "fwd_bwd_s", "train_tokens_per_s", "generate_s", "decode_tokens_per_s", "peak_memory_gib")
MODEL_CHECK_TOKENS = 512   # the whole-model checks run at most this many tokens per sequence
DECODE_CHECKED = 8         # ... the last of them one decode step at a time


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Sequences per step, tokens per sequence, tokens generated after a prompt of seq_len/2 in the timing, timed
  repetitions (median)."""
  batch: int
  seq_len: int
  decode_tokens: int
  repeats: int


def as_dtype(module_fn, model_cfg, dtype, **changes):
  """`module_fn(cfg)` built with the given compute dtype (and config changes); the parameters are shared."""
  cfg = model_cfg.copy_and_resolve_references()
  cfg.dtype = dtype
  for dotted, value in changes.items():
    section, field = dotted.split(".")
    cfg[section][field] = value
  return nnx.eval_shape(lambda: module_fn(cfg, nnx.Rngs(0)))


def with_params(abstract, params):
  graphdef, _ = nnx.split(abstract)
  return nnx.merge(graphdef, params)


def layer_checks(m, key, sizes: Sizes) -> dict:
  """kda_layer and mla_layer: each layer in bf16 against its XLA path in fp32, on three packed documents."""
  B, T, d = sizes.batch, sizes.seq_len, m.d_model
  x = jax.random.normal(key, (B, T, d), jnp.float32)
  seg = jnp.broadcast_to((jnp.arange(T) >= T // 3).astype(jnp.int32) + (jnp.arange(T) >= 2 * T // 3), (B, T))
  out = {}
  for name, make, changes in (("kda_layer", lambda c, r: KDALayer(c, rngs=r), {"kda.backend": "xla"}),
                              ("mla_layer", lambda c, r: GatedMLA(c, rngs=r), {"mla.attention_impl": "xla"})):
    state = nnx.split(nnx.jit(lambda: make(m, nnx.Rngs(1)))())[1]
    fast = with_params(as_dtype(make, m, "bfloat16"), state)
    ref = with_params(as_dtype(make, m, "float32", **changes), state)
    run = nnx.jit(lambda mod, x, s: mod(x, segment_ids_BT=s))
    with jax.default_matmul_precision("highest"):
      want = run(ref, x, seg)
    out[name] = rel_err(run(fast, x, seg), want)
  return out


def model_checks(m, params, key, sizes: Sizes) -> dict:
  """model_fp32 and model_bf16: the largest error of the prefill's and DECODE_CHECKED decode steps' logits against
  the full forward; generate_agree: the share of greedy tokens equal to the argmax of one full forward (fp32)."""
  B, T = sizes.batch, min(sizes.seq_len, MODEL_CHECK_TOKENS)
  tokens = jax.random.randint(key, (B, T), 0, m.vocab_size)
  n_dec = DECODE_CHECKED
  out = {}
  # fp32: XLA paths at full matmul precision (no TF32), so only the algorithms differ; bf16: the fast paths.
  fp32 = dict(precision="highest", changes={"kda.backend": "xla", "mla.attention_impl": "xla"})
  for name, dtype, opts in (("model_fp32", "float32", fp32),
                            ("model_bf16", "bfloat16", dict(precision="default", changes={}))):
    model = with_params(as_dtype(lambda c, r: K3Model(c, rngs=r), m, dtype, **opts["changes"]), params)
    with jax.default_matmul_precision(opts["precision"]):
      full = nnx.jit(lambda mod, t: mod(t)[0])(model, tokens)
      logits, cache = nnx.jit(lambda mod, t: mod.prefill(t, T))(model, tokens[:, :T - n_dec])
      errs = [rel_err(logits, full[:, T - n_dec - 1])]
      step = nnx.jit(lambda mod, tok, c: mod.decode(tok, c))
      for t in range(T - n_dec, T):
        logits, cache = step(model, tokens[:, t], cache)
        errs.append(rel_err(logits, full[:, t]))
      out[name] = max(errs)
      if dtype == "float32":
        new = gen.generate(model, tokens[:, :T - n_dec], n_dec)
        whole = nnx.jit(lambda mod, t: mod(t)[0])(model, jnp.concatenate([tokens[:, :T - n_dec], new], axis=1))
        out["generate_agree"] = float(jnp.mean(jnp.argmax(whole[:, T - n_dec - 1:T - 1], -1) == new))
  return out


def timings(m, params, key, sizes: Sizes) -> dict:
  """TIMES of the model in bf16: forward and forward+backward of the mean cross-entropy plus the model's auxiliary
  losses, generation of `decode_tokens` after a prompt of seq_len/2, and the device's peak memory."""
  B, T = sizes.batch, sizes.seq_len
  model = with_params(as_dtype(lambda c, r: K3Model(c, rngs=r), m, "bfloat16"), params)
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(key, (B, T + 1), 0, m.vocab_size)

  def loss(state, tokens):
    logits, aux = nnx.merge(graphdef, state)(tokens[:, :-1])
    targets = tokens[:, 1:]
    ce_sum, _ = step_lib.token_losses(logits, targets, jnp.ones(targets.shape, jnp.float32))
    return ce_sum / targets.size + aux["z_loss"] + sum(s.aux_loss for s in aux["moe"])

  timed = lambda fn, *args: harness.median_seconds(fn, *args, repeats=sizes.repeats, warmup=1)
  fwd = jax.jit(loss)
  fwd_bwd = jax.jit(jax.value_and_grad(loss))
  t_fwd, t_bwd = timed(fwd, state, tokens), timed(fwd_bwd, state, tokens)
  prompt = tokens[:, :T // 2]
  t_gen = timed(lambda p: gen.generate(model, p, sizes.decode_tokens), prompt)
  stats = jax.devices()[0].memory_stats() or {}
  return {"fwd_s": t_fwd, "fwd_bwd_s": t_bwd, "train_tokens_per_s": B * T / t_bwd,
          "generate_s": t_gen, "decode_tokens_per_s": B * sizes.decode_tokens / t_gen,
          "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2 ** 30}


def run(model_cfg, sizes: Sizes) -> dict:
  """The checks and times of a model config (random parameters, seed 0), with the device and the sizes."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = nnx.split(nnx.jit(lambda: K3Model(model_cfg, rngs=nnx.Rngs(0)))())[1]
  return {"device": str(jax.devices()[0]), "batch": sizes.batch, "seq_len": sizes.seq_len,
          **layer_checks(model_cfg, k1, sizes), **model_checks(model_cfg, params, k2, sizes),
          **timings(model_cfg, params, k3, sizes)}


def failed_checks(results: dict) -> list[str]:
  """The checks whose relative error is past its tolerance (TOL)."""
  return [name for name, tol in TOL.items() if not results[name] <= tol]


def format_report(results: dict, config_name: str) -> str:
  """The checks against their tolerances, the greedy agreement, then the times."""
  lines = [f"{'check':<14}{'rel err':>12}{'tol':>10}  ok"]
  lines += [f"{name:<14}{results[name]:>12.2e}{tol:>10.0e}  {results[name] <= tol}" for name, tol in TOL.items()]
  lines.append(f"{'generate':<14}{results['generate_agree']:>12.2%} of greedy tokens = argmax of the full forward")
  lines.append(f"\n{config_name} on {results['device']}, batch {results['batch']} x {results['seq_len']} tokens")
  lines += [f"  {k:<22}{results[k]:>14.4g}" for k in TIMES]
  return "\n".join(lines)
