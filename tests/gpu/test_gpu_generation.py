"""Generation on the GPU's lowerings (the KDA Pallas kernels, cuDNN attention, the MLA decode kernel, the Mosaic
grouped GEMM): each token mixer's chunked prefill and the model's (several chunk sizes, per-row lengths) and its
teacher-forced decode equal the full forward, both layer patterns, B = 1 and B = 8; and a B = 32 cache is updated
in place (the compiled prefill step and decode loop hold no second copy of it).

Numerics: in fp32 (products at "highest") the paths agree to roundoff. In bf16 a random-init MoE model is chaotic (a
rounding difference flips an expert choice and moves that token by O(1): its bf16 full forward differs from its fp32
forward as much as the chunked prefill does), so bf16 is held to the anchor's error, the full forward's own error
against fp32 on the same weights, on the token mixers and on a dense model.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks.generate import fp32_twin
from k3jax import generate_lib
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.model import K3Model
from k3jax.numerics import rel_err
from k3jax.ops import mla as mla_ops
from model_testing import random_module, small_config

pytestmark = pytest.mark.gpu

ON_GPU = jax.default_backend() == "gpu"
T = 1000 if ON_GPU else 80            # not a multiple of the kernels' 64-token chunk
B = 8
CHUNKS = (T, 256, 100) if ON_GPU else (T, 32, 20)
# Head dims of 128 (the kernels' and K3's); two scanned groups of (KDA, MLA) after an unrolled KDA + MLA (as
# tests/model_testing.py's SCANNED), LatentMoE from layer 1 on, AttnRes blocks of 3 layers straddling the groups.
WIDTH = {"d_model": 256, "kda.num_heads": 2, "mla.num_heads": 2, "mla.kv_lora_rank": 64, "ffn_hidden": 256,
         "vocab_size": 256, "num_layers": 6, "layer_pattern": ("kda", "mla"), "residual.block_size": 3}
# Every expert chosen (top 4 of 4): the MoE's dispatch and grouped GEMMs run, but no expert choice can flip on a
# roundoff difference (top-2 of 8 flips one in about 24 rows in fp32, moving that row by ~6e-3).
MOE = {"moe.enabled": True, "moe.num_experts": 4, "moe.top_k": 4, "moe.latent_dim": 128, "moe.expert_hidden": 128,
       "moe.shared_hidden": 256}
PATTERNS = {"mix": {}, "mla": {"layer_pattern": ("mla",)}}
FP32_TOL = 1e-4        # fp32 roundoff over six layers
BF16_FLOOR = 2e-3      # bf16's rounding of a result at unit scale

full_logits = nnx.jit(lambda m, tokens: m(tokens)[0])


def _config(dtype, pattern="mix", moe=True):
  return small_config(**{**WIDTH, **(MOE if moe else {}), **PATTERNS[pattern], "dtype": dtype})


def _model(dtype, pattern="mix", moe=True, seed=0):
  """The test model as the model initialises it (zero AttnRes queries, the gate's ranges). Not `random_module`:
  its random depth-softmax queries make the AttnRes read-outs nearly one-hot, so some positions do not see a change
  earlier in the context (a cache error), and its bf16 forward is chaotic."""
  return nnx.jit(lambda: K3Model(_config(dtype, pattern, moe), rngs=nnx.Rngs(seed)))()


def _rows(seed, batch):
  """Tokens `[batch, T]` and each row's length (1..T, the first row all T)."""
  rng = np.random.default_rng(seed)
  lengths = np.concatenate([[T], rng.integers(1, T, batch - 1)])[:batch]
  return jnp.asarray(rng.integers(0, 256, (batch, T)), jnp.int32), lengths


def _at_lengths(logits_BTV, lengths):
  return jnp.stack([logits_BTV[b, n - 1] for b, n in enumerate(lengths)])


@pytest.fixture(scope="module")
def fp32_models():
  return {p: _model("float32", p) for p in PATTERNS}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("batch,chunk", [(1, CHUNKS[0]), (B, CHUNKS[1]), (B, CHUNKS[2])])
def test_chunked_prefill_equals_the_full_forward_fp32(fp32_models, pattern, batch, chunk):
  model = fp32_models[pattern]
  tokens, lengths = _rows(batch, batch)
  with jax.default_matmul_precision("highest"):
    full = _at_lengths(full_logits(model, tokens), lengths)
    logits, cache = generate_lib.prefill_chunked(model, tokens, lengths, chunk=chunk, max_len=T + 8)
  np.testing.assert_array_equal(cache.lengths_B, lengths)
  assert rel_err(logits, full) < FP32_TOL


@pytest.mark.parametrize("pattern", PATTERNS)
def test_teacher_forced_decode_equals_the_full_forward_fp32(fp32_models, pattern):
  """A prompt of each row's length prefilled, then the row's next tokens fed one by one: each step's logits are the
  full forward's at that position."""
  model = fp32_models[pattern]
  tokens, lengths = _rows(7, B)
  prompt = np.minimum(lengths, T - 4)
  steps = 4
  with jax.default_matmul_precision("highest"):
    full = full_logits(model, tokens)
    _, cache = generate_lib.prefill_chunked(model, tokens, prompt, chunk=CHUNKS[1], max_len=T + 8)
    step = jax.jit(lambda state, cache, token: generate_lib.decode_step(
        nnx.merge(graphdef, state), cache, token, jnp.ones((B,), bool)))
    graphdef, state = nnx.split(model)
    for s in range(steps):
      token = jnp.asarray([tokens[b, prompt[b] + s] for b in range(B)])
      logits, cache = step(state, cache, token)
      expected = jnp.stack([full[b, prompt[b] + s] for b in range(B)])
      assert rel_err(logits, expected) < FP32_TOL, s
  np.testing.assert_array_equal(cache.lengths_B, prompt + steps)


def _bf16_errors(model_bf16, reference, tokens, lengths, chunk):
  """(the bf16 full forward's error against the fp32 `reference`, the bf16 chunked prefill's)."""
  with jax.default_matmul_precision("highest"):
    ref = _at_lengths(full_logits(reference, tokens), lengths)
  full = _at_lengths(full_logits(model_bf16, tokens), lengths)
  logits, _ = generate_lib.prefill_chunked(model_bf16, tokens, lengths, chunk=chunk, max_len=T + 8)
  return rel_err(full, ref), rel_err(logits, ref)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_bf16_chunked_prefill_is_as_close_to_fp32_as_the_full_forward(pattern):
  """A dense bf16 model (no expert choice to flip) as initialised: the chunked prefill's error against the fp32
  forward of the same weights is within twice the bf16 full forward's own."""
  model = _model("bfloat16", pattern, moe=False)
  reference = fp32_twin(model, _config("bfloat16", pattern, moe=False))
  anchor, ours = _bf16_errors(model, reference, *_rows(3, B), chunk=CHUNKS[2])
  assert ours <= 2 * anchor + BF16_FLOOR, (ours, anchor)


def _mixer_case(kind, dtype, seed=0):
  cfg = small_config(**WIDTH, dtype=dtype)
  factory = (lambda rngs: KDALayer(cfg, rngs=rngs)) if kind == "kda" else (lambda rngs: GatedMLA(cfg, rngs=rngs))
  return random_module(factory, seed)


call = nnx.jit(lambda m, x: m(x))
chunk_call = nnx.jit(lambda m, x, cache, start, n: m.prefill_chunk(x, cache, start, n))


def _chunked(mixer, x_BTD, lengths, chunk):
  """The mixer's outputs `[B, T, d]` from prefill_chunk over chunks of `chunk` tokens (row b: its first lengths[b])."""
  cache = mixer.init_cache(x_BTD.shape[0], T + 8)
  done, ys = np.zeros_like(lengths), []
  for c in range(0, T, chunk):
    n = np.clip(lengths - c, 0, chunk)
    y, cache = chunk_call(mixer, jnp.pad(x_BTD[:, c:c + chunk], ((0, 0), (0, chunk - x_BTD[:, c:c + chunk].shape[1]),
                                                              (0, 0))), cache, jnp.asarray(done), jnp.asarray(n))
    ys.append(y[:, :min(chunk, T - c)])
    done = done + n
  return jnp.concatenate(ys, axis=1)


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_each_mixers_bf16_chunked_prefill_is_held_to_its_full_forwards_error(kind):
  """Every valid position of every row, chunks not dividing T, per-row lengths; against the fp32 layer (XLA paths,
  "highest") on the same weights, the chunked bf16 outputs are within twice the bf16 full forward's error."""
  mixer = _mixer_case(kind, "bfloat16")
  ref_mixer = _mixer_case(kind, "float32")
  nnx.update(ref_mixer, nnx.state(mixer, nnx.Param))
  if kind == "kda":
    ref_mixer.backend = "xla"
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, WIDTH["d_model"]), jnp.float32)
  _, lengths = _rows(5, B)
  valid = np.arange(T)[None] < lengths[:, None]
  with jax.default_matmul_precision("highest"):
    ref = np.asarray(call(ref_mixer, x))[valid]
  full = np.asarray(call(mixer, x.astype(jnp.bfloat16)).astype(jnp.float32))[valid]
  anchor = rel_err(full, ref)
  for chunk in CHUNKS[1:]:
    ours = rel_err(np.asarray(_chunked(mixer, x.astype(jnp.bfloat16), lengths, chunk).astype(jnp.float32))[valid], ref)
    assert ours <= 2 * anchor + BF16_FLOOR, (chunk, ours, anchor)


def test_cudnn_chunk_attention_is_held_to_the_xla_paths_bf16_error():
  """The MLA chunk attention on cuDNN (the split: own chunk causal, then prefix blocks of 512 cut at each row's
  start) against the fp32 blocked XLA path ("highest"), within twice the bf16 blocked XLA path's own error; rows at
  start 0, mid-block, on a block boundary and near the cache's end, a chunk no block divides. (cuDNN only: not in
  CPU mode, where tests/ops/test_ops_mla.py checks the split's merging with einsum attentions.)"""
  if not ON_GPU:
    pytest.skip("cuDNN attention needs a GPU")
  Bq, Tq, L, H, D, R = 4, T, 4 * T + 96, 2, 128, 64
  ks = jax.random.split(jax.random.PRNGKey(7), 4)
  q = jax.random.normal(ks[0], (Bq, Tq, H, D), jnp.float32)
  ckv = jax.random.normal(ks[1], (Bq, L, R), jnp.float32)
  w_uk, w_uv = (jax.random.normal(k, (R, H, D), jnp.float32) * R ** -0.5 for k in ks[2:])
  start = jnp.asarray([0, 700, 1024, L - Tq], jnp.int32)
  bf16 = lambda *a: tuple(x.astype(jnp.bfloat16) for x in a)
  blocked = jax.jit(lambda *a: mla_ops.chunk_attention_blocked(*a, scale=D ** -0.5))
  split = jax.jit(lambda *a: mla_ops.chunk_attention_split(*a, scale=D ** -0.5, attend=mla_ops.cudnn_attend,
                                                            key_block=512))
  with jax.default_matmul_precision("highest"):
    ref = blocked(q, ckv, start, w_uk, w_uv)
  q16, c16, uk16, uv16 = bf16(q, ckv, w_uk, w_uv)
  anchor = rel_err(blocked(q16, c16, start, uk16, uv16), ref)
  ours = rel_err(split(q16, c16, start, uk16, uv16), ref)
  assert ours <= 2 * anchor + BF16_FLOOR, (ours, anchor)


def test_a_batch_32_cache_is_updated_in_place():
  """The compiled chunk step's and decode loop's scratch memory at B = 32 does not grow with the cache: from a
  cache of L to one of 4L positions it grows by under a tenth of the cache's growth (a scan over stacked caches
  held a second copy of them), and the donated cache is the output's buffer. (In CPU mode the decode loop is not
  held to it: the XLA decode attention there upcasts the bf16 cache for its products, the CPU having no bf16
  dots; the GPU runs the Pallas decode kernel on the cache as it is.)"""
  model = nnx.eval_shape(lambda: K3Model(_config("bfloat16"), rngs=nnx.Rngs(0)))
  temps, caches = {}, {}
  for max_len in (16384, 65536):
    caches[max_len] = generate_lib.cache_bytes(jax.eval_shape(lambda: generate_lib.init_cache(model, 32, max_len)))
    step, loop = generate_lib.lower(model, 32, max_len, chunk=256, max_new=8)
    for name, lowered in (("prefill step", step), ("decode loop", loop)):
      memory = lowered.compile().memory_analysis()
      temps[name, max_len] = memory.temp_size_in_bytes
      assert memory.alias_size_in_bytes >= caches[max_len], name
  for name in ("prefill step", "decode loop") if ON_GPU else ("prefill step",):
    growth = temps[name, 65536] - temps[name, 16384]
    assert growth < 0.1 * (caches[65536] - caches[16384]), (name, temps, caches)
