"""One train step of a small model on the GPU's kernels (KDA ×3 + MLA, LatentMoE, bf16, its layers scanned in two
groups): finite, and its loss, gradient norm and every parameter's gradient those of the same step on the XLA paths
(`model.kda.backend = "xla"`, the MoE's grouped GEMM on `jax.lax.ragged_dot`), held to the XLA bf16 step's own error
against an fp32 XLA step, with the AttnRes read-out per layer and per group (`model.residual.readout`), with the
sources stored in bf16 (`model.residual.source_dtype`; the references store them in fp32) and rematerialised
keeping the attention's or both mixers' residuals (`model.remat`; the references keep everything); and the
program compared holds the Pallas kernels (the KDA kernels, the Mosaic GPU grouped GEMM; with the per-layer read-out
also the short convs' backward kernel), so the XLA path is not compared with itself.

The step is `k3jax.train.step.make_train_step`, built as tests/train/test_train_step.py builds it, its
optimizer wrapped to keep the step's gradient in its state: the step returns none. On the GPU: d_model 256 (KDA's
K = V = 128), T = 512, B = 2, 9 layers (layer 0 dense and unrolled, layers 1-8 two scanned groups of KDA, KDA,
MLA, KDA), 4 experts of latent width 128 (shapes the Mosaic GPU grouped GEMM takes). With
K3JAX_GPU_TESTS=cpu the KDA kernels run in interpret mode on a smaller model, the grouped GEMM on XLA (its Mosaic
kernels run only on a Hopper GPU), to check the test itself.

What this can see: a model-level error of about twice the bf16 step's own (2-12% per gradient here: bf16 through
four layers and their norms), e.g. a kernel that ignores the documents, drops a gradient or is wired to the wrong
input; the kernels' precision is tests/gpu/test_gpu_kda.py's to hold.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.configs import common
from k3jax import config as config_lib, parallel
from k3jax.model import K3Model
from k3jax.numerics import rel_err
from k3jax.train import optimizer, stages as stages_lib, state as state_lib, step as step_lib
from pallas_kernels.grouped_gemm import GroupedGemmOptions
from pallas_testing import pallas_kernels_in, primitive_calls

pytestmark = pytest.mark.gpu

ON_GPU = jax.default_backend() == "gpu"
D_MODEL, T, B = (256, 512, 2) if ON_GPU else (128, 128, 2)
MESH = "data:1,expert:1"
# Every token to every expert: with top-2 of 4, bf16's rounding flips the routing of a few tokens per layer, each
# flip moving its token's expert gradients wholesale, and the XLA bf16 step's gradients were 10-28% off the fp32
# step's (the kernels' alike): too coarse to hold anything to. With all four the MoE is smooth (the grouped GEMM
# still runs, on four groups of B·T rows) and the XLA step's errors were 2-12% per gradient, the kernels' step's
# 0.7-1.4x them (interpret mode).
TOP_K = 4
# Errors against the fp32 step: the kernels' step's within 2x the XLA bf16 step's plus FLOOR (about one bf16 rounding;
# it covers gradients the fp32 step has exactly, such as the zeros of the AttnRes key norms at initialisation).
FLOOR = 2e-3
# A gradient of fewer elements estimates its own bf16 error too loosely to be held to it (A_log, one per head: over
# 2 elements, two equally good steps' errors differ 2x one time in five; stacked over two groups, 4 elements whose
# errors were 0.04-0.19 for the XLA step and 0.12-0.23 for the kernels', run to run on the CPU); it is held to the
# largest anchor of such gradients and the median anchor over all, so a wrong one (an error near 1) is still seen,
# a 2x loss of precision not.
FEW = 64
# The loss and the gradient norm are sums over everything: their bf16 errors partly cancel, so the XLA step's can be
# far below the kernels' by chance (the loss's: 6e-5 against the kernels' 3e-4; the norm's 1.2e-3 and 7e-4); held to
# 2x it plus this fraction of the value.
SCALAR_FLOOR = 2e-3
# The kernels the KDA layers launch at this size (B·H = 4: the Triton state passes, the Mosaic GPU solve), and on
# the GPU the grouped GEMM's: ours for the forward and dX (the routed SiTU-GLU in the epilogues of the gate/up
# product and of the down product's dX, `moe.glu_epilogue`), JAX's `transposed_ragged_dot` (its kernel is "body")
# for dW.
KDA_KERNELS = {"kda_prepare", "kda_intra_fwd_key_tiles", "kda_intra_fwd_solve_mosaic", "kda_state_fwd",
               "kda_state_bwd", "kda_state_grads", "kda_intra_bwd_rows", "kda_intra_bwd_cols",
               "kda_intra_bwd_dg"}
GEMM_KERNELS = {"grouped_ragged_dot", "grouped_ragged_dot_glu", "grouped_ragged_dot_glu_grad", "body"}
# The "pallas" run's short convs run their backward passes as kernels too.
GLUE_KERNELS = {"pallas": {"short_conv_backward"}, "pallas_group": set(), "pallas_bf16_sources": set(),
                "pallas_save_attention": set(), "pallas_save_mixers": set()}
# The primitive of cuDNN's fused attention forward, as its custom VJP binds it.
CUDNN_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


def _model_config(dtype: str, kda_backend: str, readout: str = "layer", conv_backward: str = "fused",
                  source_dtype: str = "float32", remat: str = "none"):
  """The pattern KDA, KDA, KDA, MLA over 9 layers (layer 0 dense, 1-8 LatentMoE of 4 experts, scanned as two groups,
  so that a group read-out has a group to read), two heads per mixer; `conv_backward` the short convs' backward
  passes ("kernel": their Pallas kernel, which takes these shapes); `source_dtype` the AttnRes sources' storage."""
  m = config_lib.model_config()
  m.num_layers, m.last_layer, m.residual.readout, m.remat = 9, None, readout, remat
  m.residual.source_dtype = source_dtype
  m.kda.conv_backward = conv_backward
  m.d_model, m.dtype, m.ffn_hidden = D_MODEL, dtype, 2 * D_MODEL
  m.kda.num_heads, m.kda.backend = 2, kda_backend
  m.mla.num_heads, m.mla.kv_lora_rank = 2, 64
  m.moe.enabled, m.moe.num_experts, m.moe.top_k = True, 4, TOP_K
  m.moe.latent_dim, m.moe.expert_hidden, m.moe.shared_hidden = D_MODEL // 2, D_MODEL // 2, D_MODEL
  return m


def _keeping_gradients(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx`, its state also holding the last gradient it was given (before clipping), for the test to read."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params), tx.init(params)

  def update(grads, state, params=None):
    updates, inner = tx.update(grads, state[1], params)
    return updates, (grads, inner)
  return optax.GradientTransformation(init, update)


def _graphdef(model_cfg, moe_backend: str, mesh):
  """The model's graphdef with every LatentMoE's grouped GEMM on `moe_backend`: no config field chooses it (the
  layer's `grouped_gemm` options, which K3Model leaves at their defaults)."""
  model = nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(0), mesh=mesh))
  for moe in model.moe_layers():
    moe.grouped_gemm = GroupedGemmOptions(backend=moe_backend)
  return state_lib.split(model)[0]


def _batch(vocab_size):
  """One micro-batch of B rows: random tokens, two documents per row (starting mid-tile, at other positions)."""
  tokens = jax.random.randint(jax.random.PRNGKey(5), (1, B, T + 1), 0, vocab_size)
  starts = jnp.array([[T // 5 + 3], [T // 2 + 7]])
  segment_ids = (jnp.arange(T)[None] >= starts).astype(jnp.int32)[None]
  return {"tokens": tokens[..., :-1], "targets": tokens[..., 1:], "segment_ids": segment_ids,
          "weights": jnp.ones((1, B, T), jnp.float32)}


@pytest.fixture(scope="module")
def steps():
  """{*KERNEL_RUNS, "xla", "fp32"}: (metrics, gradients, the state after the step, its traced program, its lowered
  program's text) of one step from the same state on the same batch."""
  c = common.base_config()
  c.model, c.mesh, c.seq_len, c.batch_size, c.steps = _model_config("bfloat16", "pallas"), MESH, T, B, 10
  lr = stages_lib.training_plan(c).learning_rate
  tx = _keeping_gradients(optimizer.make_optimizer(c.optimizer, lr))
  mesh = parallel.mesh_from_string(MESH)
  _, _, init = state_lib.abstract_state(c, tx, mesh)
  state = jax.jit(init)(c.seed)
  batch = _batch(c.model.vocab_size)
  runs = {"pallas": (_model_config("bfloat16", "pallas", conv_backward="kernel"), "auto"),
          "pallas_group": (_model_config("bfloat16", "pallas", readout="group"), "auto"),
          "pallas_bf16_sources": (_model_config("bfloat16", "pallas", source_dtype="bfloat16"), "auto"),
          "xla": (_model_config("bfloat16", "xla"), "xla"), "fp32": (_model_config("float32", "xla"), "xla")}
  for policy in REMAT_RUNS:
    runs[f"pallas_{policy}"] = (_model_config("bfloat16", "pallas", remat=policy), "auto")
  out = {}
  for name, (model_cfg, moe_backend) in runs.items():
    step = jax.jit(step_lib.make_train_step(_graphdef(model_cfg, moe_backend, mesh), tx, lr, model_cfg))
    precision = jax.default_matmul_precision("highest") if name == "fp32" else contextlib.nullcontext()
    with precision:   # the reference's fp32 products in full fp32 (no TF32)
      traced = step.trace(state, batch)
      lowered = traced.lower()
    new_state, metrics = lowered.compile()(state, batch)
    out[name] = (jax.device_get(metrics), new_state.opt_state[0], new_state, traced.jaxpr, lowered.as_text())
  return out


def _leaves(tree):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# The kernels' steps held to the XLA bf16 step: the AttnRes read-out per layer and per scanned group.
# Rematerialised on the GPU only: interpret mode runs the kernels through ordered callbacks, which jax.checkpoint
# cannot differentiate. "save_attention": the scanned KDA layers keep only their inputs, the MLA layer its VJP's
# residuals; "save_mixers": every layer its VJP's residuals.
REMAT_RUNS = ("save_attention", "save_mixers") if ON_GPU else ()
KERNEL_RUNS = ("pallas", "pallas_group", "pallas_bf16_sources") + tuple(f"pallas_{p}" for p in REMAT_RUNS)


def test_the_model_scans_two_groups_for_the_group_read_out_to_read():
  plan = config_lib.layer_plan(_model_config("bfloat16", "pallas", readout="group"))
  assert (plan.unrolled, plan.num_groups) == ((0,), 2), plan


@pytest.mark.parametrize("run", KERNEL_RUNS)
def test_the_step_on_the_kernels_is_finite(steps, run):
  metrics, grads, new_state, _, _ = steps[run]
  bad = [k for k, v in metrics.items() if not np.all(np.isfinite(v))]
  bad += [p for p, x in {**_leaves(grads), **_leaves(new_state.params)}.items() if not np.all(np.isfinite(x))]
  assert not bad, bad
  assert metrics["loss"] > 0 and metrics["grad_norm"] > 0


@pytest.mark.parametrize("run", KERNEL_RUNS)
def test_loss_gradient_norm_and_gradients_are_the_xla_steps(steps, run):
  """Each error of the kernels' bf16 step against the fp32 XLA step within 2x the XLA bf16 step's plus a floor:
  the loss, the gradient norm and every parameter's gradient (those of fewer than FEW elements: see FEW). Both
  references read out per layer: the group read-out is the same sums in another order."""
  (m_p, g_p, *_), (m_x, g_x, *_), (m_f, g_f, *_) = steps[run], steps["xla"], steps["fp32"]
  bad = {}
  for key in ("loss", "grad_norm"):
    err, anchor = (abs(float(m[key]) - float(m_f[key])) / abs(float(m_f[key])) for m in (m_p, m_x))
    if not err <= 2 * anchor + SCALAR_FLOOR:
      bad[key] = (err, anchor)
  ref, xla = _leaves(g_f), _leaves(g_x)
  anchors = {path: rel_err(g, ref[path]) for path, g in xla.items()}
  typical = float(np.median([a for path, a in anchors.items() if np.any(ref[path])]))
  few = max([typical] + [a for path, a in anchors.items() if xla[path].size < FEW])
  for path, g in _leaves(g_p).items():
    err, anchor = rel_err(g, ref[path]), anchors[path]
    if not err <= 2 * (anchor if g.size >= FEW else few) + FLOOR:
      bad[path] = (err, anchor, rel_err(g, xla[path]))
  assert not bad, f"(error, the XLA bf16 step's[, kernels against XLA bf16]) above the bound: {bad}"


@pytest.mark.parametrize("run", KERNEL_RUNS)
def test_the_step_compared_runs_the_kernels(steps, run):
  """The kernels' step launches every KDA kernel (the "pallas" run also the short conv's backward kernel) and on the
  GPU the Mosaic GPU grouped GEMM's (lowered, its program holds the Triton and Mosaic GPU calls); the XLA steps
  launch none."""
  _, _, _, jaxpr, text = steps[run]
  kernels = pallas_kernels_in(jaxpr)
  want = KDA_KERNELS | GLUE_KERNELS[run] | (GEMM_KERNELS if ON_GPU else set())
  assert kernels == want, f"missing {sorted(want - kernels)}, not expected {sorted(kernels - want)}"
  for name in ("xla", "fp32"):
    assert not pallas_kernels_in(steps[name][3]), name
  if ON_GPU:
    assert all(f'name = "{n}"' in text for n in KDA_KERNELS if not n.endswith("_mosaic"))
    assert "kda_intra_fwd_solve_mosaic" in text and "grouped_ragged_dot" in text
    for name in ("xla", "fp32"):
      xla_text = steps[name][4]
      assert "__gpu$xla.gpu.triton" not in xla_text and "mosaic_gpu_v2" not in xla_text, name


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's fused attention runs on the GPU only (the CPU check runs XLA's)")
@pytest.mark.parametrize("policy", ("save_attention", "save_mixers"))
def test_remat_keeping_the_attention_s_residuals_runs_its_forward_once_per_layer(steps, policy):
  """Rematerialised under either policy, the step launches cuDNN's attention forward as often as the step that keeps
  everything (once per MLA layer), not once more for the recomputation (the KDA kernels under "save_mixers": the CPU
  test tests/test_model.py counts them)."""
  count = lambda run: primitive_calls(steps[run][3], CUDNN_ATTENTION_FORWARD)
  assert count(f"pallas_{policy}") == count("pallas") > 0
