"""Throughput and scaling benchmarks of the train step: an expert-parallel mesh reproduces the one-device loss
curve (fp32); variants measured in turn from their own processes; curve comparison and variant errors; the config's
stage lengths; the device-time profile by kind of kernel."""
import collections
import copy
import dataclasses
import functools
import gzip
import json
import math
import os
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import small, tiny
from k3jax import spec as spec_lib
from k3jax.train import benchmark, profile, trainer


def small_tiny():
  c = tiny.get_config()
  c.model.num_layers = 2  # layer 0: KDA + dense FFN, layer 1: MLA + LatentMoE
  c.model.dtype = "float32"
  c.seq_len, c.batch_size, c.steps = 32, 8, 10
  return c


def test_expert_parallel_mesh_reproduces_the_one_device_curve():
  configs = [benchmark.variant(small_tiny(), mesh=m) for m in ("data:1,expert:1", "data:2,expert:2")]
  runs = [benchmark.compile_run(c) for c in configs]
  curves = [benchmark.loss_curve(r, steps=6, warmup=2) for r in runs]
  chex.assert_trees_all_close(curves[0]["losses"], curves[1]["losses"], rtol=1e-5)
  assert curves[0]["losses"][-1] < curves[0]["losses"][0]  # the curve is a training curve, not a constant
  gap = benchmark.compare_curves(curves[0], curves[1], tail=3)
  assert gap["devices"] == 4 and gap["max_rel_gap"] < 1e-5
  assert gap["scaling"] > 0 and all(r.compile_s > 0 for r in runs)


def test_time_train_step_reports_finite_throughput_and_profiles_the_step_by_kind():
  run = benchmark.compile_run(benchmark.variant(small_tiny(), pattern="mla", seq_len=16, tokens_per_step=128))
  row = benchmark.time_train_step(run, steps=2, warmup=1, profile_steps=2)
  assert (row["seq_len"], row["batch_size"]) == (16, 8)
  assert row["finite"] and row["tokens_per_s"] > 0 and row["mfu"] is None  # no peak FLOP/s known for a CPU
  prof = row["profile"]
  assert set(prof["kinds"]) == set(profile.KINDS) and prof["total_ms"] > 0 and 0 < prof["glue_share"] < 1
  assert prof["kinds"]["gemm"]["ms"] > 0 and prof["kinds"]["dispatch"]["launches"] > 0
  assert {"moe", "mla", "ffn"} <= set(prof["glue_by_scope"])  # the layers' named scopes reach the profile
  header, line = benchmark.format_table([{**row, "variant": "mla", "compile_s": run.compile_s}]).splitlines()
  assert header.split()[-3:] == ["glue", "GB", "loss"]    # the glue's GB a step, just before the loss
  assert prof["glue_gb"] > 0 and float(line.split()[-2]) == round(prof["glue_gb"], 1)


class _RecordingStep:
  """A compiled step that keeps the segment ids of each batch it is given."""

  def __init__(self, step):
    self.step, self.segment_ids, self.placed = step, [], []

  def __call__(self, state, batch):
    self.segment_ids.append(np.asarray(batch["segment_ids"]))
    ids, tokens = batch["segment_ids"], batch["tokens"]
    self.placed.append(isinstance(ids, jax.Array) and ids.sharding == tokens.sharding)
    return self.step(state, batch)

  def __getattr__(self, name):
    return getattr(self.step, name)


def test_time_train_step_gives_one_document_rows_when_asked_placed_as_the_batch():
  config = small_tiny()
  config.data.mix = {"stack": 1.0}
  config.data.task_length = 8                                  # two documents a row of 16
  run = benchmark.compile_run(benchmark.variant(config, pattern="mla", seq_len=16, tokens_per_step=128))
  for documents, one in (("data", False), ("one", True)):
    recording = _RecordingStep(run.step)
    row = benchmark.time_train_step(dataclasses.replace(run, step=recording), steps=1, warmup=1, documents=documents)
    assert row["documents"] == documents and row["finite"]
    assert all((s == 1).all() == one for s in recording.segment_ids)
    assert all(recording.placed)   # on the device, not a host array copied in every step
  with pytest.raises(ValueError, match="documents must be one of"):
    benchmark.time_train_step(run, steps=1, warmup=0, documents="packed")
  with pytest.raises(ValueError, match="documents must be some of"):
    benchmark.time_variants(config, patterns=["mla"], steps=1, warmup=0, documents=("data", "packed"))


@pytest.mark.parametrize("name, target, op_name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", "", "", "gemm"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "__cublas$lt$matmul", "", "gemm"),
    ("gemm_fusion_dot_12", "fusion", "jit(step)/dot_general", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "__cudnn$fmhaSoftmax", "", "attention"),
    ("mla_decode_split", "__gpu$xla.gpu.triton", "", "attention"),   # pallas_kernels/mla_decode
    ("kda_intra_fwd_key_tiles", "__gpu$xla.gpu.triton", "", "kda"),
    ("kda_state_fwd_mosaic_gpu_kernel", "mosaic_gpu_v2", "", "kda"),
    ("grouped_ragged_dot_mosaic_gpu_kernel", "mosaic_gpu_v2", "", "grouped_gemm"),
    ("body_mosaic_gpu_kernel", "mosaic_gpu_v2", "jit(step)/transpose(jvp(moe))/grouped_gemm/pallas_call",
     "grouped_gemm"),
    ("body_mosaic_gpu_kernel", "", "", "grouped_gemm"),  # a trace without HLO op names
    ("body_mosaic_gpu_kernel", "mosaic_gpu_v2", "jit(step)/jvp(kda)/pallas_call", "other"),
    ("loop_pad_fusion_3", "fusion", "jit(step)/jvp(moe)/grouped_gemm/pad", "other"),  # glue beside the kernels
    ("DeviceRadixSortOnesweepKernel", "", "", "dispatch"),
    ("input_scatter_fusion_2", "fusion", "", "dispatch"),
    ("loop_add_fusion_7", "fusion", "jit(step)/transpose(jvp(moe))/moe_dispatch/add", "dispatch"),
    ("ncclDevKernel_AllGather_RING_LL", "", "", "collective"),
    ("all-reduce.3", "all-reduce", "", "collective"),
    ("input_reduce_fusion_4", "fusion", "jit(step)/jvp(kda)/reduce_sum", "other"),
    ("dot.3", "dot", "", "gemm"), ("sort.0", "sort", "", "dispatch"), ("wrapped_add", "add", "", "other"),
])
def test_kernel_kind_classifies_gpu_and_cpu_kernels(name, target, op_name, kind):
  assert profile.kernel_kind(name, target, op_name) == kind


@pytest.mark.parametrize("op_name, scope", [
    ("jit(step)/while/body/groups/position_0/jit(_layer_forward)/kda/kda/exp", "kda"),
    ("jit(step)/transpose(jvp(moe))/moe_dispatch/add", "moe"),                  # the outermost layer scope
    ("jit(train_step)/while/body/transpose(jvp(groups))/while/body/dynamic_update_slice", "layer_scan"),
    ("jit(train_step)/while/body/transpose(jvp(layer_2))/jit(_layer_forward)", "layer_call"),
    ("jit(train_step)/optimizer/mul", "optimizer"), ("jit(train_step)/while/body/jvp(head)/dot_general", "head"),
    ("jit(train_step)/while/body/transpose(jvp(embed))/dot_general", "embed"),
    ("jit(train_step)/add", "unscoped"), ("", "unscoped"),
])
def test_kernel_scope_is_the_layer_part_else_the_step_part(op_name, scope):
  assert profile.Kernel("fusion_1", "other", 1.0, 1.0, op_name).scope == scope


def test_our_glue_kernels_without_an_op_name_count_in_their_layer_s_scope():
  assert profile.Kernel("short_conv_backward", "other", 9.0, 12.7).scope == "kda"
  assert profile.Kernel("some_kernel", "other", 1.0, 1.0).scope == "unscoped"


def _scanned_step_config(readout):
  changes = {"model.num_layers": 6, "model.layer_pattern": ("kda", "mla"), "model.residual.readout": readout}
  config = benchmark.variant(small_tiny(), seq_len=32, tokens_per_step=256, changes=changes)
  assert spec_lib.model_spec(config.model).plan.num_groups == 2
  return config


def test_every_kernel_of_the_train_step_is_under_a_named_scope():
  """Every instruction of the compiled step (KDA and MLA layers, dense FFN and MoE; CPU) that carries an op_name
  falls under a layer's or the step's named scope, so a profile's glue reads as the model's parts; the step's own
  parts each appear; the layers scanned in groups of (KDA, MLA) after two unrolled ones."""
  step = benchmark.lower_step(trainer.Run(_scanned_step_config("layer"))).compile()   # the step alone, no init
  skip = ("parameter", "bitcast", "get-tuple-element", "tuple", "constant")
  scopes = collections.Counter(
      profile.Kernel(name, "other", 1.0, 1.0, i.op_name).scope
      for name, i in profile.hlo_instructions(step.as_text()).items()
      if i.op_name.startswith("jit(train_step)") and i.target not in skip)
  assert "unscoped" not in scopes, scopes
  assert {"embed", "head", "loss", "optimizer", "metrics", "kda", "mla", "moe", "ffn", "attnres"} <= set(scopes)


@pytest.mark.parametrize("readout", ["layer", "group"])
def test_the_group_read_out_s_summaries_are_attnres_s_not_the_layer_scan_s(readout):
  """The summaries are named where they are traced, so the step as lowered (before XLA, which keeps each
  instruction's op_name into the compiled step checked above) shows them: under AttnRes, and only with the group
  read-out."""
  hlo = benchmark.lower_step(trainer.Run(_scanned_step_config(readout))).as_text(dialect="hlo", debug_info=True)
  summary = [i.op_name for i in profile.hlo_instructions(hlo).values() if "attnres/summary" in i.op_name]
  assert bool(summary) == (readout == "group")
  assert all(profile.Kernel("k", "other", 1.0, 1.0, op_name).scope == "attnres" for op_name in summary)


def test_hlo_instructions_are_found_by_their_gpu_kernels_names_too():
  instructions = profile.hlo_instructions(
      '  %loop_reduce_fusion.10 = f32[8]{0} fusion(f32[8,4]{1,0} %p), kind=kLoop, calls=%fused, '
      'metadata={op_name="jit(f)/while/body/layer_3/attnres/reduce_sum"}\n'
      '  %all-reduce.3 = f32[8]{0} all-reduce(f32[8]{0} %x), to_apply=%add\n')
  reduce = ("fusion", "jit(f)/while/body/layer_3/attnres/reduce_sum", 8 * 4 + 8 * 4 * 4, "")   # operands typed
  assert instructions["loop_reduce_fusion.10"] == instructions["loop_reduce_fusion_10"] == reduce
  assert instructions["all-reduce.3"] == instructions["all_reduce_3"] == ("all-reduce", "", 2 * 8 * 4, "")
  assert "memcpy32_post" not in instructions


_UNNAMED_HLO = """HloModule m

%fused_reduce (p0: f32[8,4]) -> (f32[8], f32[8]) {
  %p0 = f32[8,4]{1,0} parameter(0)
  %c = f32[] constant(0)
  %r1 = f32[8]{0} reduce(%p0, %c), dimensions={1}, to_apply=%add, metadata={op_name="jit(f)/layer_1/attnres/reduce_sum"}
  %r2 = f32[8]{0} reduce(%p0, %c), dimensions={1}, to_apply=%add, metadata={op_name="jit(f)/layer_1/mla/reduce_sum"}
  ROOT %t = (f32[8]{0}, /*index=1*/f32[8]{0}) tuple(%r1, %r2)
}

%fused_zeros () -> f32[2,8] {
  %z = f32[] constant(0)
  ROOT %b = f32[2,8]{1,0} broadcast(%z), dimensions={}
}

ENTRY %main (x: f32[8,4], y: f32[3]) -> (f32[8], f32[2,8], f32[3]) {
  %x = f32[8,4]{1,0} parameter(0)
  %y = f32[3]{0} parameter(1)
  %input_reduce_fusion.3 = (f32[8]{0}, /*index=1*/f32[8]{0}) fusion(%x), kind=kInput, calls=%fused_reduce
  %gte = f32[8]{0} get-tuple-element(%input_reduce_fusion.3), index=0
  %copy.7 = f32[8]{0} copy(%gte)
  %loop_broadcast_fusion.2 = f32[2,8]{1,0} fusion(), kind=kLoop, calls=%fused_zeros
  %init = (f32[2,8]{1,0}) tuple(%loop_broadcast_fusion.2)
  %while.5 = (f32[2,8]{1,0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/while/body/groups/while"}
  %ys = f32[2,8]{1,0} get-tuple-element(%while.5), index=0
  %copy.9 = f32[3]{0} copy(%y)
  ROOT %out = (f32[8]{0}, f32[2,8]{1,0}, f32[3]{0}) tuple(%copy.7, %ys, %copy.9)
}
"""


def test_instructions_without_an_op_name_take_what_they_run_move_or_feed():
  """XLA's own instructions: a fusion takes its fused root's op_name (a multi-output root's first operand's, past
  XLA's /*index=N*/ comments), a copy its operand's, zeros written for a loop (through the tuple of its initial
  state) the loop's; a copy of a parameter, which nothing names, stays unscoped."""
  instructions = profile.hlo_instructions(_UNNAMED_HLO)
  scope = lambda name: profile.Kernel(name, "other", 1.0, 1.0, instructions[name][1]).scope
  assert instructions["input_reduce_fusion_3"][:2] == ("fusion", "jit(f)/layer_1/attnres/reduce_sum")
  assert scope("input_reduce_fusion.3") == scope("copy.7") == "attnres"
  assert scope("loop_broadcast_fusion_2") == "layer_scan"
  assert instructions["copy.9"][:2] == ("copy", "") and scope("copy.9") == "unscoped"


_SHARED_HLO = """ENTRY %main (a: f32[64], b: f32[64]) -> (f32[], f32[], f32[]) {
  %a = f32[64]{0} parameter(0)
  %b = f32[64]{0} parameter(1)
  %input_reduce_fusion.9 = f32[] fusion(%a), kind=kInput, calls=%sum, metadata={op_name="jit(f)/head/reduce_sum" deduplicated_name="input_reduce_fusion.2"}
  %input_reduce_fusion.2 = f32[] fusion(%b), kind=kInput, calls=%sum, metadata={op_name="jit(f)/layer_1/attnres/reduce_sum" deduplicated_name="input_reduce_fusion.2"}
  %input_reduce_fusion.5 = f32[] fusion(%a), kind=kInput, calls=%sum, metadata={op_name="jit(f)/layer_2/attnres/reduce_sum" deduplicated_name="input_reduce_fusion.2"}
  ROOT %out = (f32[], f32[], f32[]) tuple(%input_reduce_fusion.9, %input_reduce_fusion.2, %input_reduce_fusion.5)
}
"""


@pytest.mark.parametrize("names_its_instruction", [True, False])
def test_a_kernel_compiled_once_for_alike_fusions_is_shared_among_their_scopes(names_its_instruction):
  """XLA names a kernel it compiled for three alike fusions after one of them; a trace whose every launch names that
  one (or none) shares the kernel's launches, time and bytes evenly among the three's scopes."""
  instructions = profile.hlo_instructions(_SHARED_HLO)
  assert {instructions[n].kernel for n in ("input_reduce_fusion.9", "input_reduce_fusion.2")} == {
      "input_reduce_fusion.2"}
  hlo_op = "input_reduce_fusion.9" if names_its_instruction else ""
  events = [("input_reduce_fusion_9", hlo_op, 3_000_000)] * 3
  kernels = profile.kernels_of(events, instructions, calls=1)
  assert sorted((k.scope, k.launches, k.ms) for k in kernels) == [("attnres", 1.0, 3.0)] * 2 + [("head", 1.0, 3.0)]
  assert sum(k.gb for k in kernels) == pytest.approx(3 * (64 * 4 + 4) / 1e9)
  assert profile.breakdown(kernels)["glue_by_scope"] == {"attnres": 6.0, "head": 3.0}


def test_launches_that_name_their_own_instructions_are_not_shared():
  instructions = profile.hlo_instructions(_SHARED_HLO)
  events = [("input_reduce_fusion_9", "input_reduce_fusion.9", 1_000_000),
            ("input_reduce_fusion_9", "input_reduce_fusion.2", 1_000_000)]
  kernels = profile.kernels_of(events, instructions, calls=1)
  assert {(k.scope, k.launches) for k in kernels} == {("attnres", 1.0), ("head", 1.0)}


def test_a_kernel_s_bytes_are_its_instructions_operands_and_results_and_glue_s_rate_their_sum_over_its_time():
  instructions = profile.hlo_instructions(_UNNAMED_HLO)
  assert instructions["input_reduce_fusion.3"].bytes == 2 * 8 * 4 + 8 * 4 * 4   # two f32[8] results, f32[8,4] read
  assert instructions["copy.9"].bytes == 2 * 3 * 4
  assert instructions["loop_broadcast_fusion.2"].bytes == 2 * 8 * 4
  events = [("input_reduce_fusion_3", "input_reduce_fusion.3", 2_000), ("input_reduce_fusion_3", "input_reduce_fusion.3",
            6_000), ("MemcpyD2D", "copy.9", 1_000), ("mystery", "", 1_000)]
  kernels = {k.name: k for k in profile.kernels_of(events, instructions, calls=2)}
  fusion = kernels["input_reduce_fusion_3"]
  assert fusion.gb == pytest.approx(192e-9) and fusion.tb_per_s == pytest.approx(192e-9 / 0.004)
  assert kernels["MemcpyD2D"].gb == pytest.approx(12e-9) and kernels["mystery"].tb_per_s is None
  summary = profile.breakdown(list(kernels.values()))
  assert summary["glue_gb"] == pytest.approx(204e-9) and summary["kinds"]["other"]["gb"] == pytest.approx(204e-9)
  assert summary["glue_tb_per_s"] == pytest.approx(204e-9 / (0.004 + 0.0005 + 0.0005))
  assert summary["glue_gb_by_scope"] == pytest.approx({"attnres": 192e-9, "unscoped": 12e-9})
  assert "GB at" in profile.format_breakdown(summary, list(kernels.values()))


def test_a_kernel_launched_by_several_ops_counts_in_each_op_s_scope():
  instructions = profile.hlo_instructions(_UNNAMED_HLO)
  events = [("MemcpyD2D", "copy.7", 3_000_000), ("MemcpyD2D", "loop_broadcast_fusion.2", 1_000_000),
            ("MemcpyD2D", "copy.7", 1_000_000), ("MemcpyD2D", "copy.9", 2_000_000), ("mystery", "", 500_000)]
  kernels = profile.kernels_of(events, instructions, calls=2)
  assert [(k.name, k.scope, k.launches, k.ms) for k in kernels] == [
      ("MemcpyD2D", "attnres", 1.0, 2.0), ("MemcpyD2D", "unscoped", 0.5, 1.0),
      ("MemcpyD2D", "layer_scan", 0.5, 0.5), ("mystery", "unscoped", 0.5, 0.25)]
  assert profile.breakdown(kernels)["glue_by_scope"] == {"attnres": 2.0, "unscoped": 1.25, "layer_scan": 0.5}


def test_trace_kernels_times_a_cpu_program_by_kind_with_its_op_names():
  @jax.jit
  def f(x, i):
    with jax.named_scope("moe"):
      return jnp.sum(jnp.tanh(jnp.sort(x, axis=0) @ x.T)) + jnp.sum(x[i] * 2)
  args = jnp.ones((128, 128)), jnp.arange(128)[::-1]
  compiled = f.lower(*args).compile()
  compiled(*args)
  kernels = profile.trace_kernels(lambda: [compiled(*args) for _ in range(2)], calls=2,
                                  hlo_text=compiled.as_text())
  summary = profile.breakdown(kernels)
  assert summary["kinds"]["dispatch"]["launches"] > 0 and summary["kinds"]["gemm"]["ms"] > 0
  assert summary["total_ms"] == pytest.approx(sum(k.ms for k in kernels)) and summary["glue_by_scope"]["moe"] > 0
  assert all(k.op_name.startswith("jit(f)") for k in kernels)
  assert summary["glue_gb"] > 0 and all(k.gb > 0 for k in kernels if k.kind == "gemm")
  text = profile.format_breakdown(summary, kernels)
  assert "dispatch" in text and "glue" in text and kernels[0].name in text


def test_stage_lengths_follow_the_config_unless_told():
  c = small.get_config()
  assert benchmark.stage_lengths(c) == [(1024, 65536), (4096, 65536), (16384, 65536), (65536, 65536)]
  assert benchmark.stage_lengths(c, [4096, 16384]) == [(4096, 65536), (16384, 65536)]
  assert benchmark.stage_lengths(c, [64], 1024) == [(64, 1024)]
  assert benchmark.stage_lengths(tiny.get_config()) == [(64, 1024)]


def test_measure_in_turn_returns_rows_in_config_order_and_reports_a_failing_config():
  good = benchmark.variant(small_tiny(), pattern="mla", seq_len=16, tokens_per_step=128)
  bad = copy.deepcopy(good)
  bad.log_every = 0  # rejected when its Run is built, inside its process
  measure = functools.partial(benchmark.time_train_step, steps=1, warmup=1)
  rows = list(benchmark.measure_in_turn([bad, good], measure, timeout_s=600))
  assert "log_every" in rows[0]["error"]
  assert rows[1]["finite"] and (rows[1]["seq_len"], rows[1]["batch_size"]) == (16, 8), rows[1]


def test_side_by_side_without_turns_keeps_the_order_the_worker_limit_and_reports_a_failure():
  """Tasks with no `then` return what `prepare` returns, in the tasks' order, however many run at once; a task
  whose process fails yields a ProcessFailed with its error; `workers` with `then` is refused."""
  out = list(benchmark.side_by_side([3, -1, 5, 7], functools.partial(math.sqrt), workers=2, timeout_s=300))
  assert out[0] == math.sqrt(3) and out[2:] == [math.sqrt(5), math.sqrt(7)]
  assert isinstance(out[1], benchmark.ProcessFailed) and "math domain error" in str(out[1])
  with pytest.raises(ValueError, match="workers"):
    next(benchmark.side_by_side([1], abs, abs, workers=1))


def test_compare_curves_measures_gaps_and_scaling():
  ref = {"mesh": "a", "devices": 1, "losses": [2.0, 1.0, 1.0], "tokens_per_s": 100.0}
  other = {"mesh": "b", "devices": 2, "losses": [2.0, 1.1, 0.95], "tokens_per_s": 160.0}
  gap = benchmark.compare_curves(ref, other, tail=2)
  np.testing.assert_allclose([gap["max_rel_gap"], gap["tail_mean_rel_gap"], gap["tail_mean_gap"], gap["scaling"]],
                             [0.1, 0.075, 0.025, 0.8])
  with pytest.raises(ValueError, match="steps"):
    benchmark.compare_curves(ref, {**other, "losses": [1.0]})


def test_variant_rejects_unknown_patterns_uneven_batches_fields_and_values():
  with pytest.raises(ValueError, match="pattern"):
    benchmark.variant(small_tiny(), pattern="rnn")
  with pytest.raises(ValueError, match="multiple"):
    benchmark.variant(small_tiny(), seq_len=48, tokens_per_step=100)
  with pytest.raises(ValueError, match="remat"):
    benchmark.variant(small_tiny(), changes={"model.remat": "everything"})
  with pytest.raises(ValueError, match="no field 'model.residual.readouts'"):
    benchmark.variant(small_tiny(), changes={"model.residual.readouts": "group"})
  with pytest.raises(ValueError, match="no field 'modle.remat'"):
    benchmark.variant(small_tiny(), changes={"modle.remat": "none"})
  with pytest.raises(ValueError, match="model.d_model"):
    benchmark.variant(small_tiny(), changes={"model.d_model": "wide"})
  changed = benchmark.variant(small_tiny(), changes={"model.remat": "none", "model.residual.readout": "group"})
  assert (changed.model.remat, changed.model.residual.readout) == ("none", "group")
  assert small_tiny().model.residual.readout == "layer"   # the config given is left as it was


def test_parse_changes_reads_literals_and_keeps_words_as_strings():
  assert benchmark.parse_changes("g:model.residual.readout=group,model.moe.top_k=2,model.scan_layers=False") == (
      "g", {"model.residual.readout": "group", "model.moe.top_k": 2, "model.scan_layers": False})
  for bad in ("g", "g:", ":model.remat=none", "g:model.remat", "g:=none", "a/b:model.remat=none"):
    with pytest.raises(ValueError):
      benchmark.parse_changes(bad)


def test_bench_train_takes_config_names_and_says_which_exist(tmp_path):
  repo = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # one device; the fast compile conftest.py sets
  run = lambda *flags: subprocess.run([sys.executable, "-m", "experiments.bench_train", *flags], cwd=repo, env=env,
                                      capture_output=True, text=True, timeout=900)
  bad = run("--config=huge")
  assert bad.returncode != 0 and "no config of that name" in bad.stderr and "'tiny'" in bad.stderr, bad.stderr[-2000:]
  bad = run("--config=tiny", "--variant=g:model.residual.readouts=group")
  assert bad.returncode != 0 and "no field 'model.residual.readouts'" in bad.stderr, bad.stderr[-2000:]
  done = run("--config=tiny", "--config.model.num_layers=2", "--config.seq_len=16", "--config.batch_size=4",
             "--patterns=config", "--steps=1", "--warmup=1", "--profile", "--profile_steps=1",
             "--documents=data", "--documents=one", "--variant=group:model.residual.readout=group",
             f"--out={tmp_path / 'rows.json'}", f"--hlo_dir={tmp_path / 'hlo'}")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "config T=16 B=4, config/group T=16 B=4" in done.stdout and "glue by scope" in done.stdout
  rows = json.loads((tmp_path / "rows.json").read_text())   # each compiled step, timed on both kinds of rows
  assert [(r["variant"], r["documents"]) for r in rows] == [
      ("config/data", "data"), ("config/one", "one"), ("config/group/data", "data"), ("config/group/one", "one")]
  assert all("profile" in r for r in rows)
  hlo = {p.name: gzip.open(p, "rt").read() for p in (tmp_path / "hlo").iterdir()}   # each compiled step's program
  assert set(hlo) == {"config.T16.hlo.txt.gz", "config.group.T16.hlo.txt.gz"}
  assert all(text.startswith("HloModule jit_train_step") for text in hlo.values())


def test_compile_lowered_gives_each_lowered_program_compiled_under_its_key():
  double, square = jax.jit(lambda x: 2 * x), jax.jit(lambda x: x * x)
  x = jnp.arange(3.0)
  got = benchmark.compile_lowered({"double": double.lower(x), ("square", 1): square.lower(x), "none": None})
  assert set(got) == {"double", ("square", 1), "none"} and got["none"] == (None, got["none"][1])
  assert list(got["double"][0](x)) == [0.0, 2.0, 4.0] and list(got[("square", 1)][0](x)) == [0.0, 1.0, 4.0]
  assert all(seconds >= 0 for _, seconds in got.values())
