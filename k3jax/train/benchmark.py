"""Training throughput: tokens/s and MFU of the jitted train step for config variants (sequence length, layer
pattern), timed after warm-up on rows of the config's data mixture. MFU uses `flops.flops_per_token`."""
from __future__ import annotations

import copy
import time

import jax
import numpy as np

from k3jax.data import pipeline
from k3jax.train import batches, flops, trainer

PATTERNS = {"config": None, "mla": ("mla",), "kda": ("kda",)}


def variant(config, *, pattern: str, seq_len: int, tokens_per_step: int):
  """A copy of `config` with one stage of `seq_len` × `tokens_per_step / seq_len` rows, every layer of the type
  `pattern` names ("config": the config's own pattern)."""
  if pattern not in PATTERNS:
    raise ValueError(f"pattern must be one of {sorted(PATTERNS)}, got {pattern!r}")
  if tokens_per_step % seq_len:
    raise ValueError(f"tokens_per_step={tokens_per_step} is not a multiple of seq_len={seq_len}")
  c = copy.deepcopy(config)
  c.unlock()
  c.stages, c.seq_len, c.batch_size = (), seq_len, tokens_per_step // seq_len
  if PATTERNS[pattern] is not None:
    c.model.layer_pattern = PATTERNS[pattern]
    c.model.last_layer = PATTERNS[pattern][0]
  return c


def time_train_step(config, *, steps: int, warmup: int) -> dict:
  """Compiles and warms up the train step of `config`'s first stage, then times `steps` steps."""
  run = trainer.Run(config)
  stage = run.stages[0]
  data = pipeline.Mixture(config.data, stage.seq_len, 0, vocab_size=config.model.vocab_size)
  host = [batches.train_batch(data, i, stage.batch_size, config.micro_batches, run.mesh) for i in range(2)]
  state = run.init()
  t0 = time.perf_counter()
  for i in range(warmup):
    state, m = run.train_step(state, host[i % 2])
  jax.block_until_ready(m)
  warm_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for i in range(steps):
    state, m = run.train_step(state, host[i % 2])
  loss = float(m["loss"])
  elapsed = time.perf_counter() - t0
  tokens_per_s = steps * stage.batch_size * stage.seq_len / elapsed
  flops_token = flops.flops_per_token(config.model, stage.seq_len)
  devices = list(run.mesh.devices.flat)
  peak = [d.memory_stats().get("peak_bytes_in_use") for d in devices] if devices[0].memory_stats() else None
  return {"seq_len": stage.seq_len, "batch_size": stage.batch_size, "step_ms": 1e3 * elapsed / steps,
          "tokens_per_s": tokens_per_s, "flops_per_token": flops_token,
          "model_tflops_per_s": tokens_per_s * flops_token / 1e12,
          "mfu": flops.mfu(tokens_per_s, flops_token, devices), "warmup_s": warm_s, "loss": loss,
          "finite": bool(np.isfinite(loss)), "peak_gib": peak and max(peak) / 2 ** 30}


def loss_curve(config, *, mesh: str, steps: int, warmup: int = 5) -> dict:
  """The first `steps` losses of `config`'s first stage on the mesh `mesh` (same seed, data and global batch
  whatever the mesh), and tokens/s over the steps after `warmup` (the first compiles)."""
  if not 0 < warmup < steps:
    raise ValueError(f"need 0 < warmup < steps, got warmup={warmup}, steps={steps}")
  c = copy.deepcopy(config)
  c.unlock()
  c.mesh = mesh
  run = trainer.Run(c)
  stage = run.stages[0]
  if steps > stage.steps:
    raise ValueError(f"steps={steps} exceeds the first stage's {stage.steps} steps")
  data = run.data[0]
  state = run.init()
  metrics, start = [], None
  for i in range(steps):
    if i == warmup:
      jax.block_until_ready(metrics[-1])
      start = time.perf_counter()
    state, m = run.train_step(state, batches.train_batch(data, i, stage.batch_size, c.micro_batches, run.mesh))
    metrics.append({"loss": m["loss"], "grad_norm": m["grad_norm"]})
  jax.block_until_ready(metrics[-1])
  elapsed = time.perf_counter() - start
  metrics = jax.device_get(metrics)
  del state
  return {"mesh": mesh, "devices": run.mesh.size, "seq_len": stage.seq_len, "batch_size": stage.batch_size,
          "losses": [float(m["loss"]) for m in metrics], "grad_norms": [float(m["grad_norm"]) for m in metrics],
          "tokens_per_s": (steps - warmup) * stage.batch_size * stage.seq_len / elapsed,
          "step_ms": 1e3 * elapsed / (steps - warmup)}


def compare_curves(reference: dict, other: dict, *, tail: int = 50) -> dict:
  """How far `other`'s losses are from `reference`'s (same steps): max relative gap over all steps, mean relative
  gap and mean signed gap over the last `tail` steps, and the throughput scaling (1.0 = linear)."""
  a, b = np.asarray(reference["losses"]), np.asarray(other["losses"])
  rel = np.abs(b - a) / np.abs(a)
  return {"mesh": other["mesh"], "devices": other["devices"], "max_rel_gap": float(rel.max()),
          "tail_mean_rel_gap": float(rel[-tail:].mean()),
          "tail_mean_gap": float((b - a)[-tail:].mean()),
          "scaling": other["tokens_per_s"] / (reference["tokens_per_s"] * other["devices"] / reference["devices"])}


def format_table(rows: list[dict]) -> str:
  head = f"{'variant':<10} {'T':>6} {'B':>4} {'step ms':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}"
  lines = [head]
  for r in rows:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
    lines.append(f"{r['variant']:<10} {r['seq_len']:>6} {r['batch_size']:>4} {r['step_ms']:>9.1f} "
                 f"{r['tokens_per_s']:>11,.0f} {r['model_tflops_per_s']:>8.2f} {mfu:>6} {peak:>9}")
  return "\n".join(lines)
