"""k3jax/train/lowering.py: the train step lowers from abstract inputs, and with scanned layer groups its
program does not grow with the number of groups; the GPU kernels of a lowered program are counted."""
import jax
import jax.numpy as jnp
import pytest

from experiments import configs
from k3jax.ops import kda
from k3jax.train.lowering import kernel_calls, lower_train_step
from pallas_testing import cuda_module_text


def _lowered(num_layers: int) -> dict:
  c = configs.load("tiny")
  c.model.num_layers = num_layers   # layer 0 dense, then groups of (KDA, KDA, KDA, MLA) from layer 4
  return lower_train_step(c, seq_len=32, batch=2, micro_batches=1, mesh_spec="data:1,expert:1")


def test_the_scanned_train_step_does_not_grow_with_depth():
  two, four = _lowered(12), _lowered(20)          # 2 and 4 groups; unrolled, 8 more layers of program
  assert {"trace_s", "lower_s", "trace_lower_cpu_s", "jaxpr_eqns"} <= set(two)
  # What grows is per MoE layer and small: its load metrics and the balancer's stats (unrolled: by two thirds).
  assert four["jaxpr_eqns"] < 1.05 * two["jaxpr_eqns"], (two, four)
  assert four["stablehlo_mb"] < 1.05 * two["stablehlo_mb"], (two, four)


def test_kernel_calls_counts_a_lowered_programs_gpu_kernels_and_their_distinct_copies(monkeypatch):
  """Two KDA layers' forward and backward as lowered for the GPU (from this CPU): Triton calls and Mosaic GPU calls
  are counted, each Mosaic GPU kernel once among the distinct ones (`traced_once`); interpret mode has none."""
  B, T, H, D = 1, 128, 2, 64
  args = ([jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)] * 4 + [jax.ShapeDtypeStruct((B, T, H), jnp.bfloat16)]
          + [jax.ShapeDtypeStruct((H,), jnp.float32), jax.ShapeDtypeStruct((H, D), jnp.float32)])

  def loss(q, k, v, g, beta, A_log, dt_bias):
    for _ in range(2):
      v = v + kda.fused_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound=-5.0, backend="pallas")[0]
    return v.astype(jnp.float32).sum()
  calls = kernel_calls(cuda_module_text(monkeypatch, jax.grad(loss, argnums=tuple(range(7))), *args))
  assert calls["triton_calls"] > 0 and calls["mosaic_gpu_calls"] > 0, calls
  assert calls["mosaic_gpu_kernels"] == calls["mosaic_gpu_calls"], calls
  assert kernel_calls("module {}") == {"triton_calls": 0, "mosaic_gpu_calls": 0, "mosaic_gpu_kernels": 0}


def test_compile_phases_name_xlas_passes_and_need_a_compile():
  c = configs.load("tiny")
  r = lower_train_step(c, seq_len=32, batch=2, micro_batches=1, mesh_spec="data:1,expert:1", compile_too=True,
                       compile_phases=True)
  names = {p["name"] for p in r["compile_phases"]}
  assert all(p["s"] >= 0 and p["count"] >= 1 for p in r["compile_phases"]), r["compile_phases"]
  assert any("HloPass" in n or "jit_train_step" in n for n in names), names   # XLA's own events, not ours
  assert r["compile_s"] > 0 and r["init_compile_s"] > 0
  init_names = {p["name"] for p in r["init_compile_phases"]}
  assert any("jit_init" in n for n in init_names) and not any("jit_train_step" in n for n in init_names), init_names
  with pytest.raises(ValueError, match="compile_too"):
    lower_train_step(c, seq_len=32, batch=2, micro_batches=1, mesh_spec="data:1,expert:1", compile_phases=True)
