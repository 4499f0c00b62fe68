"""The generation benchmark's library (experiments/benchmarks/generate.py): the cache's bytes per row against a hand
count, the bf16 inference model, the settings it refuses, and the table and bars it prints. The whole benchmark runs
end to end in tests/test_benchmarks.py."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks import generate as generate_benchmark
from experiments.configs import tiny
from k3jax.layers.kda import KDALayer
from k3jax.model import K3Model

SETTINGS = generate_benchmark.Settings(patterns=("config", "mla"), **generate_benchmark.SMALL, prefill_budget_s=1.0,
                                       memory_fraction=0.8, check=True)


def test_cache_line_counts_the_kda_states_and_the_mla_latents_by_hand():
  """tiny: KDA, KDA, KDA, MLA in fp32, H = 2 heads of K = V = 32, conv 4, kv_lora_rank 32."""
  m = tiny.get_config().model
  model = nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0)))
  H, K, R, f32, int32 = 2, 32, 32, 4, 4
  kda_state = H * K * K * f32 + (4 - 1) * H * (2 * K + K) * f32   # the recurrent state and the conv's last 3 inputs
  assert generate_benchmark.cache_line(model) == (3 * kda_state + int32, 1 * R * f32)   # + the row's length


def test_bf16_matrices_keep_vectors_and_the_kda_gate_in_fp32():
  layer = generate_benchmark.with_bf16_matrices(KDALayer(tiny.get_config().model, rngs=nnx.Rngs(0)))
  params = {"/".join(map(str, path)): p.get_value() for path, p in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
  kept = {name for name, x in params.items() if name in generate_benchmark.KEEP_FP32 or x.ndim < 2}
  assert kept == {"A_log", "dt_bias", "o_norm/weight"} and params["dt_bias"].ndim == 2   # [H, K]: kept, the gate's
  assert {params[name].dtype for name in kept} == {jnp.dtype(jnp.float32)}
  assert {params[name].dtype for name in set(params) - kept} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("change, says", [(dict(decode_steps=1), "decode_steps must be >= 2"),
                                          (dict(patterns=("config", "gdn")), "patterns ['gdn']"),
                                          (dict(prefill=False), "needs prefill on")])
def test_settings_refuse_what_the_run_cannot_measure(change, says):
  with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
    dataclasses.replace(SETTINGS, **change)


def test_decode_alone_times_the_decode_loop_of_rows_that_differ():
  """Without the prefill only the decode loops are compiled and timed; the rows start from logits of their own, so
  they feed different tokens (a batch of identical rows would route every row to the same experts)."""
  settings = dataclasses.replace(SETTINGS, patterns=("config",), contexts=(64,), batches=(4,), check=False,
                                 prefill=False)
  rows = generate_benchmark.run(tiny.get_config(), settings)
  assert len(rows) == 1 and rows[0]["decode_ms_per_step"] > 0
  assert not any(k.startswith("prefill") or k.startswith("chunk_") for k in rows[0])
  p = generate_benchmark.Programs("config", None, 4, 1, 64, [64], generate_benchmark.inference_model(
      tiny.get_config().model))
  assert len({int(t) for t in generate_benchmark.first_logits(p).argmax(-1)}) == 4


def row(pattern, L, B, **extra):
  return dict(pattern=pattern, L=L, B=B, prefill_est_tok_s=1000.0, decode_ms_per_step=2.0,
              decode_tok_s_per_seq=500.0, cache_gib=0.5, cache_bytes_per_token=100.0, est_peak_gib=3.0) | extra


def test_format_table_says_how_each_prefill_speed_was_had_and_which_rows_did_not_run():
  rows = [row("config", 64, 1, prefill_tok_s=2500.0), row("config", 64, 2),
          {"pattern": "mla", "B": 1, "L": 1048576, "skipped": "cache 99 GiB"},
          {"pattern": "mla", "B": 2, "L": 64, "error": "RuntimeError: out of memory"}]
  lines = generate_benchmark.format_table(rows).splitlines()
  assert lines[1].split() == ["config", "64", "1", "2,500", "run", "2.000", "500.0", "0.500", "100", "3.0"]
  assert lines[2].split()[3:5] == ["1,000", "est"]
  assert lines[3].endswith("skipped: cache 99 GiB") and lines[4].endswith("error: RuntimeError: out of memory")


def _logits(chunked_err, full_err):
  """(chunked, full, reference) logits [1, 4] whose errors against the reference are the given ones."""
  ref = np.asarray([[1.0, -1.0, 1.0, -1.0]])
  return ref * (1 + chunked_err), ref * (1 - full_err), ref


def test_the_check_holds_the_chunked_prefill_to_the_full_forwards_error():
  assert generate_benchmark.check(*_logits(0.5, 0.3))["check_ok"]          # within 2x the anchor's error
  fails = generate_benchmark.check(*_logits(0.5, 0.2))
  assert not fails["check_ok"] and fails["check_rel_err"] == pytest.approx(0.5)
  assert fails["check_anchor_err"] == pytest.approx(0.2)
  assert generate_benchmark.check(*_logits(5e-4, 0.0))["check_ok"]         # the floor, for an fp32 model
  assert not generate_benchmark.check(*_logits(2e-3, 0.0))["check_ok"]


def test_summary_gives_the_cache_ratio_the_decode_ratios_and_the_checks():
  rows = [row("config", 8192, 1, cache_bytes_per_token=30.0, decode_ms_per_step=1.0),
          row("mla", 8192, 1, cache_bytes_per_token=100.0, decode_ms_per_step=3.0),
          row("config", 262144, 1, cache_bytes_per_token=25.0, decode_ms_per_step=1.5, prefill_tok_s=1.0,
              prefill_s=12.0, **generate_benchmark.check(*_logits(0.6, 0.5))),
          row("mla", 262144, 1, cache_bytes_per_token=100.0, decode_ms_per_step=6.0,
              **generate_benchmark.check(*_logits(0.2, 0.05)))]
  assert generate_benchmark.summary(rows) == [
      "cache bytes/token at the longest context: mix 25, all-MLA 100: 25.0% (bar <= 30%)",
      "decode L=8192 B=1: mix 3.00x all-MLA's tokens/s",
      "decode L=262144 B=1: mix 4.00x all-MLA's tokens/s (bar >= 3x at 256K)",
      "mix decode B=1: 262144 is 1.50x slower per step than 8192 (bar <= 2x at 1M vs 8K)",
      "mix: longest real prefill 262144 tokens in 12.0 s, then decoded",
      "check config: vs the fp32 forward, chunked prefill rel err 6.0e-01, bf16 full forward 5.0e-01 (ok)",
      "check mla: vs the fp32 forward, chunked prefill rel err 2.0e-01, bf16 full forward 5.0e-02 (FAILED)"]
  assert [(r["pattern"], r["L"]) for r in generate_benchmark.failed_rows(rows)] == [("mla", 262144)]
