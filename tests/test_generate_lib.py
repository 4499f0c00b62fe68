"""Long-context generation: a chunked prefill with per-row lengths equals each row's full forward, decoding after
it is the argmax of full forwards, stop tokens / stop sequences / budgets / a full cache end rows, a turn after a
tool result appended to some rows continues their caches as a full forward over the whole context, sampling is
reproducible; the first and the greedy decode also on a model with scanned layer groups (run
unrolled, every layer with a cache of its own)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import generate_lib, parallel, sampling
from k3jax.numerics import rel_err
from model_testing import MODEL, SCANNED, T, compiled_programs, shared_model

TOL = 1e-4   # fp32 roundoff over the layers (as tests/test_model.py)
LENGTHS, MAX_LEN, NEW = [7, 3, 10], T + 4, 6   # shared by the tests: each function compiles once per shape
full_forward = nnx.jit(lambda m, tokens: m(tokens)[0])
# The generation tests' models: three unrolled layers, and six of which four run as two scanned groups.
MODELS = {"unrolled": tuple(MODEL.items()), "scanned": tuple(SCANNED.items())}


def _prompts(seed):
  """Three rows of T tokens: random tokens after each row's length too (garbage the prefill must ignore)."""
  return jax.random.randint(jax.random.PRNGKey(seed), (len(LENGTHS), T), 0, 64)


def _reference_logits(model, rows):
  """Full-forward logits `[B, MAX_LEN, V]` of each row (a list of token arrays, padded at the end: causal)."""
  return full_forward(model, jnp.stack([jnp.pad(r, (0, MAX_LEN - r.shape[0])) for r in rows]))


def _prefill(model, tokens, lengths=LENGTHS, chunk=5):
  return generate_lib.prefill_chunked(model, tokens, jnp.asarray(lengths), chunk=chunk, max_len=MAX_LEN)


@pytest.mark.parametrize("layers", MODELS)
@pytest.mark.parametrize("chunk", [5, T])
def test_chunked_prefill_gives_each_rows_full_forward_logits(chunk, layers):
  model = shared_model(MODELS[layers])
  tokens = _prompts(0)
  logits, cache = _prefill(model, tokens, chunk=chunk)
  np.testing.assert_array_equal(cache.lengths_B, LENGTHS)
  if layers == "scanned":  # a cache per decoder layer, the scanned ones too (none stacked over the 2 groups)
    assert model.plan.num_groups == 2 and len(cache.layers) == 6
    assert [type(c).__name__ for c in cache.layers] == ["KDACache", "MLACache"] * 3
    assert cache.layers[5].ckv_BLR.shape == (len(LENGTHS), MAX_LEN, 16)
  full = _reference_logits(model, list(tokens))
  for b, n in enumerate(LENGTHS):
    assert rel_err(logits[b], full[b, n - 1]) < TOL, b


def test_chunk_sizes_give_the_same_cache():
  model = shared_model()
  tokens = _prompts(1)
  caches = [_prefill(model, tokens, chunk=c)[1] for c in (5, T)]
  for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(caches[1])):
    assert rel_err(a, b) < TOL


def test_continuing_a_cache_equals_one_prefill():
  """Rows continued by a second prefill_chunked call (different lengths each time) equal one prefill of the whole."""
  model = shared_model()
  tokens = _prompts(2)
  first, second = [2, 1, 5], [3, 2, T - 5]
  _, cache = _prefill(model, tokens, first)
  rest = jnp.stack([jnp.roll(tokens[b], -n) for b, n in enumerate(first)])
  logits, cache = generate_lib.prefill_chunked(model, rest, jnp.asarray(second), chunk=5, cache=cache)
  full = _reference_logits(model, list(tokens))
  for b, (n, m) in enumerate(zip(first, second)):
    assert rel_err(logits[b], full[b, n + m - 1]) < TOL, b


@pytest.mark.parametrize("layers", MODELS)
def test_greedy_decode_after_a_chunked_prefill_is_the_argmax_of_full_forwards(layers):
  model = shared_model(MODELS[layers])
  tokens = _prompts(3)
  logits, cache = _prefill(model, tokens)
  new, got, cache = generate_lib.decode_loop(model, logits, cache, jax.random.PRNGKey(0), max_new=NEW)
  np.testing.assert_array_equal(got, [NEW] * 3)
  np.testing.assert_array_equal(cache.lengths_B, np.asarray(LENGTHS) + NEW - 1)   # the last token is not fed
  full = _reference_logits(model, [jnp.concatenate([tokens[b, :n], new[b]]) for b, n in enumerate(LENGTHS)])
  for b, n in enumerate(LENGTHS):
    np.testing.assert_array_equal(new[b], jnp.argmax(full[b, n - 1:n + NEW - 1], -1))


def test_stop_tokens_budgets_and_a_full_cache_end_rows():
  model = shared_model()
  tokens = _prompts(4)
  key = jax.random.PRNGKey(0)
  free, _, _ = generate_lib.decode_loop(model, *_prefill(model, tokens), key, max_new=NEW)
  stop = int(free[0, 2])               # row 0's third greedy token
  options = sampling.SamplingOptions(stop_tokens=(stop,), pad_id=63)
  new, got, _ = generate_lib.decode_loop(model, *_prefill(model, tokens), key, max_new=NEW,
                                         max_new_B=jnp.asarray([NEW, 2, NEW]), options=options)
  for b in range(3):
    first_stop = next((i + 1 for i, t in enumerate(np.asarray(free[b])) if t == stop), NEW)
    n = min(first_stop, 2 if b == 1 else NEW)
    assert int(got[b]) == n, b
    np.testing.assert_array_equal(new[b, :n], free[b, :n])
    assert np.all(np.asarray(new[b, n:]) == 63), b
  # A row of T tokens fills its cache (T + 4 positions) after feeding 4: it gets 5 tokens, the others go on.
  lengths = LENGTHS[:2] + [T]
  new, got, cache = generate_lib.decode_loop(model, *_prefill(model, tokens, lengths), key, max_new=NEW)
  np.testing.assert_array_equal(got, [NEW, NEW, 5])
  np.testing.assert_array_equal(cache.lengths_B, [LENGTHS[0] + NEW - 1, LENGTHS[1] + NEW - 1, MAX_LEN])
  full = _reference_logits(model, [jnp.concatenate([tokens[2], new[2, :4]])])
  np.testing.assert_array_equal(new[2, :5], jnp.argmax(full[0, T - 1:T + 4], -1))


def _ends_at_stop(tokens, stops, limit):
  """How many of `tokens` a row keeps: up to the first end of one of `stops` within them, at most `limit`."""
  tokens = [int(t) for t in tokens]
  return next((i for i in range(1, limit + 1) if any(tuple(tokens[max(0, i - len(s)):i]) == s for s in stops)),
              limit)


def test_stop_sequences_end_rows_after_their_last_token_and_only_within_the_new_tokens():
  model = shared_model()
  tokens = _prompts(7)
  key = jax.random.PRNGKey(0)
  free, _, _ = generate_lib.decode_loop(model, *_prefill(model, tokens), key, max_new=NEW)
  free = np.asarray(free)
  # Row 0's 2nd-3rd greedy tokens; and row 1's last prompt token with its first new token, which must not stop it.
  stops = ((int(free[0, 1]), int(free[0, 2])), (int(tokens[1, LENGTHS[1] - 1]), int(free[1, 0])))
  options = sampling.SamplingOptions(stop_sequences=stops, pad_id=63)
  new, got, cache = generate_lib.decode_loop(model, *_prefill(model, tokens), key, max_new=NEW, options=options)
  for b in range(3):
    n = _ends_at_stop(free[b], stops, NEW)
    assert int(got[b]) == n, b
    np.testing.assert_array_equal(new[b, :n], free[b, :n])
    assert np.all(np.asarray(new[b, n:]) == 63), b
  assert int(got[0]) <= 3
  np.testing.assert_array_equal(cache.lengths_B, np.asarray(LENGTHS) + np.asarray(got) - 1)
  with pytest.raises(ValueError, match="stop_sequences must be"):
    sampling.SamplingOptions(stop_sequences=((1, 2), ()))


def test_a_turn_after_a_tool_result_continues_the_cache_as_a_full_forward():
  """Turn 1 on rows 0 and 2 (row 1 sits out: budget 0); a tool result appended to rows 0 and 2 with each row's last
  sampled token (row 1 takes nothing and keeps its logits); turn 2 on every row: the logits after the result and
  every greedy token equal the full forward over the whole context (fp32)."""
  model = shared_model()
  tokens = _prompts(8)
  logits, cache = _prefill(model, tokens)
  prompt_logits = np.asarray(logits)
  first, got, cache = generate_lib.decode_loop(model, logits, cache, jax.random.PRNGKey(0), max_new=NEW,
                                               max_new_B=jnp.asarray([2, 0, 2]))
  np.testing.assert_array_equal(got, [2, 0, 2])
  np.testing.assert_array_equal(cache.lengths_B, [LENGTHS[0] + 1, LENGTHS[1], LENGTHS[2] + 1])
  results = [[5], [], [11]]
  append = np.zeros((3, 2), np.int32)
  for b in (0, 2):
    append[b] = [int(first[b, 1]), *results[b]]
  logits, cache = generate_lib.prefill_chunked(model, jnp.asarray(append), jnp.asarray([2, 0, 2]), chunk=5,
                                               cache=cache, logits_BV=jnp.asarray(prompt_logits))
  contexts = [jnp.concatenate([tokens[b, :n], first[b, :int(got[b])], jnp.asarray(results[b], jnp.int32)])
              for b, n in enumerate(LENGTHS)]
  full = _reference_logits(model, contexts)
  for b, ctx in enumerate(contexts):
    assert rel_err(logits[b], full[b, ctx.shape[0] - 1]) < TOL, b
  np.testing.assert_array_equal(logits[1], prompt_logits[1])
  budgets = [NEW, NEW, 3]
  second, got, _ = generate_lib.decode_loop(model, logits, cache, jax.random.PRNGKey(1), max_new=NEW,
                                            max_new_B=jnp.asarray(budgets))
  np.testing.assert_array_equal(got, budgets)
  full = _reference_logits(model, [jnp.concatenate([c, second[b, :budgets[b]]]) for b, c in enumerate(contexts)])
  for b, ctx in enumerate(contexts):
    n = ctx.shape[0]
    np.testing.assert_array_equal(second[b, :budgets[b]], jnp.argmax(full[b, n - 1:n - 1 + budgets[b]], -1))


def test_rows_that_ended_early_keep_their_caches_for_a_later_turn():
  """After a decode with per-row budgets (rows stop at 2, 4 and 6 tokens), each row's last token fed by a second
  prefill gives the full forward's logits over its prompt and tokens: a stopped row's caches stayed as they were."""
  model = shared_model()
  tokens = _prompts(6)
  new, got, cache = generate_lib.decode_loop(model, *_prefill(model, tokens), jax.random.PRNGKey(0), max_new=NEW,
                                             max_new_B=jnp.asarray([2, 4, NEW]))
  np.testing.assert_array_equal(got, [2, 4, NEW])
  last = jnp.stack([new[b, int(got[b]) - 1] for b in range(3)])[:, None]
  logits, cache = generate_lib.prefill_chunked(model, last, chunk=5, cache=cache)
  rows = [jnp.concatenate([tokens[b, :n], new[b, :int(got[b])]]) for b, n in enumerate(LENGTHS)]
  full = _reference_logits(model, rows)
  for b, row in enumerate(rows):
    assert rel_err(logits[b], full[b, row.shape[0] - 1]) < TOL, b


def test_sampled_decoding_is_reproducible_and_depends_on_the_key():
  model = shared_model()
  tokens = _prompts(5)
  options = sampling.SamplingOptions(temperature=1.0, top_p=0.9)
  run = lambda seed: generate_lib.decode_loop(model, *_prefill(model, tokens), jax.random.PRNGKey(seed),
                                              max_new=NEW, options=options)[0]
  a, b, c = run(7), run(7), run(8)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_a_model_on_a_mesh_gets_each_program_once_for_a_new_cache_and_for_its_own():
  """On a mesh (as the trainer places a model), a prompt of three chunks, a decode and a second prefill on the
  decoded cache: the prefill step is compiled once (a new cache is placed as the programs return theirs), the
  decode loop once, and `lower`'s programs are those the calls use. Shapes of this test only (2 rows, 19
  positions), so no other test compiled them first."""
  graphdef, state = nnx.split(shared_model())
  mesh = parallel.mesh_from_string("data:1,expert:1", jax.devices()[:1])
  model = nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, P())))
  rows, max_len, chunk = 2, 19, 4
  with compiled_programs() as ahead:
    for program in generate_lib.lower(model, rows, max_len, chunk=chunk, max_new=3):
      program.compile()
  assert sorted(ahead) == ["_decode_loop", "_prefill_step"]
  tokens = _prompts(9)[:rows, :11]
  with compiled_programs() as calls:
    logits, cache = generate_lib.prefill_chunked(model, tokens, chunk=chunk, max_len=max_len)
    new, _, cache = generate_lib.decode_loop(model, logits, cache, jax.random.PRNGKey(0), max_new=3)
    generate_lib.prefill_chunked(model, new[:, -1:], chunk=chunk, cache=cache, logits_BV=logits)
  assert not {"_decode_loop", "_prefill_step"} & set(calls), calls


@pytest.mark.parametrize("devices,options", [(1, (("xla_gpu_enable_latency_hiding_scheduler", False),)), (2, ())])
def test_the_generation_programs_take_the_compiler_options_of_the_weights_mesh(devices, options):
  """As the trainer's programs (`parallel.compiler_options`): on one device no latency-hiding scheduler, on a mesh of
  several XLA's defaults; the prefill step and the decode loop both."""
  graphdef, state = nnx.split(shared_model())
  mesh = parallel.mesh_from_string(f"data:{devices},expert:1", jax.devices()[:devices])
  state = jax.device_put(state, NamedSharding(mesh, P()))
  _, _, spec, cache = generate_lib._abstract_inputs(nnx.merge(graphdef, state), 2, 19)
  prefill, decode = generate_lib._programs(state)
  V = shared_model().vocab_size
  traced = [prefill.trace(graphdef, state, cache, spec((2, 4), jnp.int32), spec((2,), jnp.int32),
                          spec((2, V), jnp.float32)),
            decode.trace(graphdef, state, cache, spec((2, V), jnp.float32), spec((2,), jnp.uint32),
                         spec((2,), jnp.int32), max_new=3, options=sampling.SamplingOptions())]
  assert [t._params["compiler_options_kvs"] for t in traced] == [options, options]


@pytest.mark.parametrize("kwargs,match", [
    (dict(lengths=[-1, 3, 3]), "lengths_B must be B=3 ints in \\[0, T=12\\]"),
    (dict(lengths=[3, 3, 13]), "lengths_B must be B=3 ints in \\[0, T=12\\]"),
    (dict(chunk=0), "chunk must be a positive int"),
    (dict(max_len=9), "the cache holds 9 positions; a row would reach 10"),
    (dict(max_len=None), "needs max_len"),
])
def test_prefill_rejects_bad_arguments(kwargs, match):
  args = dict(lengths=LENGTHS, chunk=4, max_len=MAX_LEN)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    generate_lib.prefill_chunked(shared_model(), _prompts(0), jnp.asarray(args["lengths"]), chunk=args["chunk"],
                                 max_len=args["max_len"])


def test_decode_loop_rejects_bad_budgets():
  model = shared_model()
  cache = generate_lib.init_cache(model, 3, MAX_LEN)
  logits = jnp.zeros((3, model.vocab_size))
  with pytest.raises(ValueError, match="max_new must be a positive int"):
    generate_lib.decode_loop(model, logits, cache, jax.random.PRNGKey(0), max_new=0)
  with pytest.raises(ValueError, match="max_new_B must be B=3 ints in \\[0, max_new=4\\]"):
    generate_lib.decode_loop(model, logits, cache, jax.random.PRNGKey(0), max_new=4,
                             max_new_B=jnp.asarray([1, 5, 1]))
  with pytest.raises(ValueError, match="logits_BV must be fp32"):
    generate_lib.prefill_chunked(model, _prompts(0), jnp.asarray(LENGTHS), chunk=4, cache=cache, logits_BV=logits[:2])
