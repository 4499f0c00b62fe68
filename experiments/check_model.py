"""GPU check of the model at a research config: bf16 fast paths against references, then timings, in one call.

  python -m experiments.check_model --config=small --batch=2 --seq_len=4096

Checks (rel = RMS(out − ref) / RMS(ref); the reference shares the parameters):
  kda_layer   the KDA layer in bf16 (backend auto: Pallas on GPU) against backend xla in fp32, packed documents
  mla_layer   gated MLA in bf16 (cuDNN on GPU), packed documents, against XLA attention in fp32
  model_fp32  whole model, fp32, XLA paths at "highest" matmul precision: logits of prefill + decode steps against
              the full forward
  model_bf16  the same in bf16 with the fast paths (Pallas KDA, cuDNN attention) in the full forward and prefill
  generate    greedy tokens against the argmax of one full forward (fp32)
Times (medians): forward, forward+backward of the mean cross-entropy (tokens/s), prefill + decode of N tokens.
Writes $OUT/check_model.json when $OUT is set.
"""
import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from experiments import configs
from experiments import harness
from k3jax import generate as gen
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.model import K3Model

_CONFIG = flags.DEFINE_string("config", "small", "config name under experiments/configs/, or a .py path")
_BATCH = flags.DEFINE_integer("batch", 2, "sequences per step")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "tokens per sequence")
_DECODE = flags.DEFINE_integer("decode_tokens", 64, "tokens generated after a prompt of seq_len/2 in the timing")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed repetitions (median)")
_OUT = flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "check_model.json") if os.environ.get("OUT")
                           else "", "JSON file for the results")

TOL = {"kda_layer": 3e-2, "mla_layer": 3e-2, "model_fp32": 1e-4, "model_bf16": 5e-2}


def rel(out, ref):
  out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
  if not bool(jnp.all(jnp.isfinite(out))):
    return float("inf")
  return float(jnp.sqrt(jnp.mean((out - ref) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(ref ** 2)), 1e-30))


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


def timed(fn, *args):
  return harness.median_seconds(fn, *args, repeats=_REPEATS.value, warmup=1)


def layer_checks(m, key):
  B, T, d = _BATCH.value, _SEQ_LEN.value, m.d_model
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
    out[name] = rel(run(fast, x, seg), want)
  return out


def model_checks(m, params, key):
  B, T = _BATCH.value, min(_SEQ_LEN.value, 512)
  tokens = jax.random.randint(key, (B, T), 0, m.vocab_size)
  n_dec = 8
  out = {}
  # fp32: XLA paths at full matmul precision (no TF32), so only the algorithms differ; bf16: the fast paths.
  fp32 = dict(precision="highest", changes={"kda.backend": "xla", "mla.attention_impl": "xla"})
  for name, dtype, opts in (("model_fp32", "float32", fp32),
                            ("model_bf16", "bfloat16", dict(precision="default", changes={}))):
    model = with_params(as_dtype(lambda c, r: K3Model(c, rngs=r), m, dtype, **opts["changes"]), params)
    with jax.default_matmul_precision(opts["precision"]):
      full = nnx.jit(lambda mod, t: mod(t)[0])(model, tokens)
      logits, cache = nnx.jit(lambda mod, t: mod.prefill(t, T))(model, tokens[:, :T - n_dec])
      errs = [rel(logits, full[:, T - n_dec - 1])]
      step = nnx.jit(lambda mod, tok, c: mod.decode(tok, c))
      for t in range(T - n_dec, T):
        logits, cache = step(model, tokens[:, t], cache)
        errs.append(rel(logits, full[:, t]))
      out[name] = max(errs)
      if dtype == "float32":
        new = gen.generate(model, tokens[:, :T - n_dec], n_dec)
        whole = nnx.jit(lambda mod, t: mod(t)[0])(model, jnp.concatenate([tokens[:, :T - n_dec], new], axis=1))
        out["generate_agree"] = float(jnp.mean(jnp.argmax(whole[:, T - n_dec - 1:T - 1], -1) == new))
  return out


def timings(m, params, key):
  B, T = _BATCH.value, _SEQ_LEN.value
  model = with_params(as_dtype(lambda c, r: K3Model(c, rngs=r), m, "bfloat16"), params)
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(key, (B, T + 1), 0, m.vocab_size)

  def loss(state, tokens):
    logits, aux = nnx.merge(graphdef, state)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return ce + aux["z_loss"] + sum(s.aux_loss for s in aux["moe"])

  fwd = jax.jit(loss)
  fwd_bwd = jax.jit(jax.value_and_grad(loss))
  t_fwd, t_bwd = timed(fwd, state, tokens), timed(fwd_bwd, state, tokens)
  prompt = tokens[:, :T // 2]
  t_gen = timed(lambda p: gen.generate(model, p, _DECODE.value), prompt)
  stats = jax.devices()[0].memory_stats() or {}
  return {"fwd_s": t_fwd, "fwd_bwd_s": t_bwd, "train_tokens_per_s": B * T / t_bwd,
          "generate_s": t_gen, "decode_tokens_per_s": B * _DECODE.value / t_gen,
          "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2 ** 30}


def main(argv):
  harness.check_argv(argv)
  m = configs.load(_CONFIG.value).model
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = nnx.split(nnx.jit(lambda: K3Model(m, rngs=nnx.Rngs(0)))())[1]
  results = {"config": _CONFIG.value, "device": str(jax.devices()[0]), "batch": _BATCH.value,
             "seq_len": _SEQ_LEN.value, **layer_checks(m, k1), **model_checks(m, params, k2), **timings(m, params, k3)}
  print(f"{'check':<14}{'rel err':>12}{'tol':>10}  ok")
  for name, tol in TOL.items():
    print(f"{name:<14}{results[name]:>12.2e}{tol:>10.0e}  {results[name] <= tol}")
  print(f"{'generate':<14}{results['generate_agree']:>12.2%} of greedy tokens = argmax of the full forward")
  print(f"\n{_CONFIG.value} on {results['device']}, batch {_BATCH.value} x {_SEQ_LEN.value} tokens")
  for k in ("fwd_s", "fwd_bwd_s", "train_tokens_per_s", "generate_s", "decode_tokens_per_s", "peak_memory_gib"):
    print(f"  {k:<22}{results[k]:>14.4g}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
