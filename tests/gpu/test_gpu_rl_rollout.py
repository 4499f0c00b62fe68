"""One RL rollout turn on the GPU's lowerings, through the sampler's `Session` (`k3jax.rl.sampler`): eight episode
rows of their own prompt lengths; the model's turn decoded greedily (one row sits it out); tool results of their own
lengths appended (one row that took the turn gets none) and prefilled into the live cache by
`generate_lib.prefill_chunked` from the cache with per-row lengths; the next turn decoded; a second result after it.
Against the same episodes run from scratch, one forward over each row's whole context (causal: its logits at a
position are those of one prefill up to there): the logits after each tool result (and after the next turn, for the
rows without a second result) are the reference's, and the next turn's greedy tokens are its argmax.

The rollout's model forces the Pallas paths, on head dims they take: KDA's chunked kernels in every prefill
(K = V = 64, the bounded gate), the MLA decode kernel in every decode step (R = 64), with a LatentMoE and two
scanned groups; the reference runs the same weights on the XLA paths. On the CPU (K3JAX_GPU_TESTS=cpu) the kernels
run in interpret mode, on tiny lengths.

Numerics, fp32 with products at "highest" (measured on the CPU, at the GPU's shapes):
- the model is the real initialisation (`K3Model`'s), not `model_testing.random_module`'s redrawn weights, whose
  AttnRes pseudo-queries of ~1 make block softmaxes nearly one-hot: that model is chaotic (1e-5 noise on its weights
  moves 3% of positions' logits by more than 1e-2) and blind in places (a 10-token change leaves 6% of the later
  logits as they were). This one moves smoothly (< 4e-4 under that noise) and that change moves every later logit
  by > 1e-2.
- the MoE routes every token to all its experts (top_k = num_experts): with top-2 of 8, the cached and the
  from-scratch paths' roundoff alone flipped an expert choice in one row of 24 (logits off by 6e-3).
- the KDA kernels and the MLA decode kernel run fp32 products at Precision.HIGHEST (IEEE in Triton; Triton's own
  default would be TF32). The exact paths agree to 5e-6; with the decode attention's operands truncated to TF32
  the logits moved by up to 7e-4 over five seeds, so TOL also fails a kernel that fell back to TF32. The greedy
  tokens are compared where the reference's top-2 margin is clear.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import sampling
from k3jax.data import tokenizer as tok
from k3jax.envs import protocol
from k3jax.model import K3Model
from k3jax.numerics import rel_err
from k3jax.rl import sampler as sampler_lib
from model_testing import small_config

pytestmark = [pytest.mark.gpu,
              # fp32 experts: the Mosaic grouped GEMM takes bf16 / fp16 only, so the MoE runs XLA's ragged dots
              pytest.mark.filterwarnings("ignore:grouped_matmul falls back")]

ON_GPU = jax.default_backend() == "gpu"
# Layer 0 KDA (dense) and 1 MLA unrolled, then two scanned groups of (KDA, MLA); LatentMoE from layer 1 on.
CHANGES = {"vocab_size": tok.VOCAB_SIZE, "d_model": 256, "ffn_hidden": 256, "num_layers": 6,
           "layer_pattern": ("kda", "mla"), "residual.block_size": 3, "kda.num_heads": 4, "kda.backend": "pallas",
           "mla.num_heads": 2, "mla.kv_lora_rank": 64, "mla.decode_impl": "pallas", "moe.enabled": True,
           "moe.num_experts": 4, "moe.top_k": 4, "moe.latent_dim": 64, "moe.expert_hidden": 64,
           "moe.shared_hidden": 128}
B = 8
# Rows 0-6 take the first turn (budgets FIRST), row 7 sits it out; rows 0-5 then get a result of RESULTS characters
# (row 6 none); every row takes the second turn (SECOND), then rows LATER get another result. One chunk size for the
# prompts and the continuations: one compiled chunk step.
if ON_GPU:
  PROMPTS = (37, 300, 85, 160, 9, 230, 64, 121)
  FIRST, RESULTS, SECOND = (24, 7, 18, 24, 12, 3, 20), (1, 90, 20, 45, 130, 7), (24, 24, 10, 24, 17, 24, 24, 5)
  TURN, CHUNK, MAX_LEN = 24, 64, 512
else:
  PROMPTS = (6, 29, 13, 20, 3, 24, 9, 16)
  FIRST, RESULTS, SECOND = (6, 2, 5, 6, 4, 1, 3), (1, 12, 4, 30, 7, 2), (6, 6, 3, 6, 5, 6, 6, 2)
  TURN, CHUNK, MAX_LEN = 6, 16, 128
LATER = {1: 3, 4: 20, 7: 0}   # row: characters of its second result; the other rows feed only their last token
TOL = 1e-4      # fp32 roundoff (module docstring: 5e-6); TF32 in a kernel moves the logits by up to 7e-4, and at
                # the CPU's shapes one row's KDA state in one layer scaled by 0.9 after the first turn by 5.5e-3
MARGIN = 1e-2   # a clear top-2 margin, in units of the reference's logits RMS at that position

full_logits = nnx.jit(lambda m, tokens: m(tokens)[0])


def _models(seed=0):
  """(the rollout's model, really initialised; the reference: its weights in the same layout on the XLA paths)."""
  model = nnx.jit(lambda: K3Model(small_config(**CHANGES), rngs=nnx.Rngs(seed)))()
  assert model.plan.unrolled == (0, 1) and model.plan.num_groups == 2
  xla = small_config(**{**CHANGES, "kda.backend": "xla", "mla.decode_impl": "xla"})
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(xla, rngs=nnx.Rngs(seed))))
  return model, nnx.merge(graphdef, nnx.state(model))


def _result(rng, chars):
  """A tool result as an environment writes it, `chars` characters of content."""
  return tok.encode(protocol.result("".join(rng.choice(list("abcdefghij=+-0123456789 "), chars))))


def _fed_logits(session):
  """Every row's queued tokens prefilled from its cache (what `generate` does before it decodes; the `Session`
  interface exposes no logits), and the session's logits after them `[B, V]`."""
  session._feed_queued()
  return np.asarray(session.logits)


def test_a_turn_after_tool_results_continues_the_live_cache_as_a_run_from_scratch():
  model, reference = _models()
  rng = np.random.default_rng(0)
  prompts = [np.concatenate([[tok.BOS], rng.integers(0, 256, n - 1)]).astype(np.int32) for n in PROMPTS]
  sampler = sampler_lib.Sampler(model, sampling.SamplingOptions(pad_id=tok.PAD), turn_tokens=TURN,
                                prefill_chunk=CHUNK, append_chunk=CHUNK)
  with jax.default_matmul_precision("highest"):
    session = sampler.open(prompts, MAX_LEN)
    first = session.generate(range(7), FIRST, jax.random.PRNGKey(0))
    for row, chars in enumerate(RESULTS):
      session.append(row, _result(rng, chars))
    turn_at = [len(session.context(b)) for b in range(B)]   # where the second turn starts
    logits = _fed_logits(session)
    second = session.generate(range(B), SECOND, jax.random.PRNGKey(1))
    for row, chars in LATER.items():
      session.append(row, _result(rng, chars))
    ends = [len(session.context(b)) for b in range(B)]
    later = _fed_logits(session)
    contexts = np.full((B, MAX_LEN), tok.PAD, np.int32)
    for b in range(B):
      contexts[b, :ends[b]] = session.context(b)
    ref = np.asarray(full_logits(reference, jnp.asarray(contexts)))
  assert [len(t) for t in first] == list(FIRST) and [len(t) for t in second] == list(SECOND)
  clear = []
  for b in range(B):
    n, context = turn_at[b], session.context(b)
    np.testing.assert_array_equal(context[:PROMPTS[b]], prompts[b])
    if b < 7:
      np.testing.assert_array_equal(context[PROMPTS[b]:PROMPTS[b] + FIRST[b]], first[b])
    np.testing.assert_array_equal(context[n:n + SECOND[b]], second[b])
    errs = rel_err(logits[b], ref[b, n - 1]), rel_err(later[b], ref[b, ends[b] - 1])
    assert max(errs) < TOL, (b, errs)
    turn_ref = ref[b, n - 1:n - 1 + SECOND[b]]   # the reference's logits before each token of the second turn
    top2 = np.sort(turn_ref, -1)[:, -2:]
    clear.append(top2[:, 1] - top2[:, 0] > MARGIN * np.sqrt(np.mean(turn_ref ** 2, -1)))
    np.testing.assert_array_equal(second[b][clear[-1]], np.argmax(turn_ref, -1)[clear[-1]], err_msg=f"row {b}")
  assert np.concatenate(clear).mean() >= 0.75, [c.mean() for c in clear]   # most tokens were compared
