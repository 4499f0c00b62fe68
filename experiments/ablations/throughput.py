"""Forward (prefill) throughput of models against sequence length, at a constant number of tokens per call.

The cost of a KDA layer per token does not depend on the length; an MLA layer's attention grows with it. Every
(model, length) pair is its own program: all are lowered first, then compiled (`benchmark.compile_lowered`: at
once on threads on a GPU, where a program takes tens of seconds), then timed one after another. A call runs
`tokens // length` rows of random tokens through the model to its logits and reduces them to one number, so the
whole forward is timed.
A dense model's forward takes the same time whatever its weights, so `models_at_init` gives models to time without
a trained checkpoint (an MoE model's routing, and so its expert loads, would differ from a trained one's).
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import K3Model
from k3jax.train import benchmark, workdir as workdir_lib


def models_at_init(configs: Mapping) -> dict:
  """{name: the model of `configs[name]` (a training config) as its run initialises it from `config.seed`}, on
  one device; ValueError for a config with MoE layers, whose time depends on where training routes the tokens."""
  moe = [name for name, c in configs.items() if c.model.moe.enabled]
  if moe:
    raise ValueError(f"models at init are timed as trained ones only without MoE; {moe} route tokens to experts")
  return {name: nnx.jit(lambda c=c: K3Model(c.model, rngs=nnx.Rngs(c.seed)))() for name, c in configs.items()}


def described(configs: Mapping) -> dict:
  """{name: what `models_at_init` builds from `configs[name]`: its model config and seed}, as JSON values (what a
  recorded timing of those models must match)."""
  return {name: {"model": workdir_lib.as_json(c.model), "seed": c.seed} for name, c in configs.items()}


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BT):
  logits_BTV, _ = nnx.merge(graphdef, state)(tokens_BT)
  return jnp.mean(jax.nn.logsumexp(logits_BTV, axis=-1))


def forward_tokens_per_s(models: Mapping, lengths, *, tokens: int, repeats: int = 5, seed: int = 0) -> dict:
  """{name: one row per length: {"seq_len", "rows", "compile_s" (wall time of the compile that built it),
  "ms" (median of `repeats` calls after one untimed), "tokens_per_s"}} for `models` ({name: model}). `tokens` must
  be a multiple of every length."""
  lengths = list(lengths)
  bad = [t for t in lengths if t < 1 or tokens % t]
  if bad or repeats < 1 or not lengths or not models:
    raise ValueError(f"tokens={tokens} must be a multiple of every length (not of {bad}); repeats={repeats} >= 1; "
                     f"lengths and models non-empty")
  inputs = {t: jax.random.randint(jax.random.PRNGKey(seed), (tokens // t, t), 0, 256, jnp.int32) for t in lengths}
  split = {name: nnx.split(model) for name, model in models.items()}
  lowered = {(name, t): _forward.lower(graphdef, state, inputs[t])
             for name, (graphdef, state) in split.items() for t in lengths}

  compiled = benchmark.compile_lowered(lowered)
  out = {}
  for name, (_, state) in split.items():
    out[name] = []
    for t in lengths:
      program, compile_s = compiled[(name, t)]
      jax.block_until_ready(program(state, inputs[t]))
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(state, inputs[t]))
        times.append(time.perf_counter() - start)
      seconds = statistics.median(times)
      out[name].append({"seq_len": t, "rows": tokens // t, "compile_s": compile_s, "ms": 1e3 * seconds,
                        "tokens_per_s": tokens / seconds})
  return out
