"""Data: tokenizer, synthetic tasks (determinism, answers implied by the context), stdlib shards, token shards,
packing and next-token targets, the row mixture."""
import ml_collections
import numpy as np
import pytest

from k3jax.data import corpus, pipeline, shards, tasks
from k3jax.data import tokenizer as tok


def data_config(**mix):
  return ml_collections.ConfigDict({"mix": mix, "task_length": 0, "shards": "", "heldout_shards": "",
                                    "cache_dir": ""})


def test_tokenizer_roundtrips_text_and_names_specials():
  text = "def f(x):\n  return 'é' + x\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256
  assert tok.decode(ids) == text
  assert tok.decode([tok.BOS, *tok.encode("ab"), tok.SEP, tok.EOS, tok.PAD]) == "<bos>ab<sep><eos><pad>"
  with pytest.raises(ValueError, match="ids must lie"):
    tok.decode([tok.VOCAB_SIZE])


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_task_examples_are_a_function_of_seed_index_and_length(name):
  length = max(96, tasks.TASKS[name].min_length)
  a = tasks.make_example(name, 3, 17, length)
  b = tasks.make_example(name, 3, 17, length)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.answer_mask, b.answer_mask)
  others = [tasks.make_example(name, s, i, length).tokens for s, i in ((3, 18), (4, 17))]
  assert all(not np.array_equal(a.tokens, o) for o in others)
  assert len(a.tokens) <= length and a.tokens[0] == tok.BOS and a.tokens[-1] == tok.EOS
  assert a.answer_mask.any() and not a.answer_mask[0]


def _answers(ex):
  return ex.tokens[ex.answer_mask]


def test_mqar_answers_are_the_values_paired_with_the_queried_keys():
  ex = tasks.make_example("mqar", 0, 5, 120)
  t = ex.tokens
  n = tasks.TASKS["mqar"].num_pairs
  pairs = dict(zip(t[1:1 + 2 * n:2], t[2:2 + 2 * n:2]))
  sep = int(np.where(t == tok.SEP)[0][0])
  queries, answers = t[sep + 1:-1:2], t[sep + 2:-1:2]
  assert len(pairs) == n and sorted(queries) == sorted(pairs)
  np.testing.assert_array_equal(answers, [pairs[q] for q in queries])
  np.testing.assert_array_equal(_answers(ex), answers)
  assert len(t) == 120  # filler pads it to the requested length


def test_passkey_answer_repeats_the_needle():
  ex = tasks.make_example("passkey", 1, 2, 300)
  text = tok.decode(ex.tokens)
  key = tok.decode(_answers(ex))
  assert len(key) == 5 and key.isdigit()
  assert text.count(f"The pass key is {key}") == 2 and text.endswith(f"The pass key is {key}<eos>")


def test_palindrome_answer_is_the_reversed_string():
  ex = tasks.make_example("palindrome", 0, 9, 41)
  sep = int(np.where(ex.tokens == tok.SEP)[0][0])
  np.testing.assert_array_equal(_answers(ex), ex.tokens[1:sep][::-1])


def test_stack_answers_are_the_popped_letters():
  ex = tasks.make_example("stack", 2, 4, 200)
  stack, popped, t = [], [], list(ex.tokens[1:-1])
  while t:
    op = t.pop(0)
    if op == ord("+"):
      stack.append(t.pop(0))
    else:
      assert op == ord("-")
      popped.append(t.pop(0))
      assert popped[-1] == stack.pop()
  np.testing.assert_array_equal(_answers(ex), popped)


def test_task_rejects_unknown_name_and_short_length():
  with pytest.raises(ValueError, match="unknown task"):
    tasks.make_example("sorting", 0, 0, 64)
  with pytest.raises(ValueError, match="needs length"):
    tasks.make_example("mqar", 0, 0, tasks.TASKS["mqar"].min_length - 1)


def test_pack_gives_each_document_its_segment_and_pads_the_rest():
  exs = [tasks.make_example("palindrome", 0, i, 11) for i in range(3)]
  row = pipeline.pack(exs, 40)
  n = sum(len(e.tokens) for e in exs)
  expected = np.concatenate([np.full(len(e.tokens), i + 1) for i, e in enumerate(exs)] + [np.zeros(40 - n)])
  np.testing.assert_array_equal(row.segment_ids, expected)
  assert (row.tokens[n:] == tok.PAD).all() and not row.target_mask[n:].any()
  with pytest.raises(ValueError, match="more than the row length"):
    pipeline.pack(exs, n - 1)


def test_next_token_targets_never_cross_a_document_boundary():
  rng = np.random.default_rng(0)
  seg = np.sort(rng.integers(0, 4, (3, 50)), axis=1)
  tokens = rng.integers(0, 256, (3, 50)).astype(np.int32)
  mask = rng.random((3, 50)) < 0.7
  targets, weights = pipeline.next_token_targets(tokens, seg, mask)
  np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
  expected = (seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0) & mask[:, 1:]
  np.testing.assert_array_equal(weights[:, :-1], expected)
  assert (weights[:, -1] == 0).all()


def test_stdlib_shards_hold_every_file_once_split_by_path(tmp_path):
  paths = corpus.stdlib_shards(tmp_path)
  files = corpus.stdlib_files()
  heldout = [f for f in files if corpus.split_of(f) == "heldout"]
  assert 0 < len(heldout) < len(files) // 10
  for split, n_docs in (("train", len(files) - len(heldout)), ("heldout", len(heldout))):
    data = shards.load_shard(paths[split])
    assert (data == tok.BOS).sum() == n_docs == (data == tok.EOS).sum()
  assert corpus.stdlib_shards(tmp_path) == paths  # cached: the second call finds the shards


def test_token_stream_reads_npy_and_bin_shards_and_segments_after_eos(tmp_path):
  rng = np.random.default_rng(1)
  doc = lambda n: list(rng.integers(0, 256, n)) + [tok.EOS]
  a = np.array(doc(30) + doc(45), np.int32)
  b = np.array(doc(80), np.uint16)
  np.save(tmp_path / "a.npy", a)
  b.tofile(tmp_path / "b.bin")
  stream = shards.TokenStream(shards.expand(f"{tmp_path}/*.npy,{tmp_path}/b.bin"), tok.VOCAB_SIZE)
  windows = lambda x: [x[j:j + 40] for j in range(len(x) - 39)]
  for i in range(20):
    tokens, seg = stream.window(np.random.default_rng(i), 40)
    assert any(np.array_equal(tokens, w) for w in windows(a) + windows(b))
    np.testing.assert_array_equal(seg, 1 + np.concatenate([[0], np.cumsum(tokens[:-1] == tok.EOS)]))


def test_token_shards_reject_bad_files(tmp_path):
  np.save(tmp_path / "two_d.npy", np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match="1-D integer"):
    shards.load_shard(tmp_path / "two_d.npy")
  with pytest.raises(ValueError, match="matches no file"):
    shards.expand(f"{tmp_path}/missing*.bin")
  np.save(tmp_path / "big.npy", np.full(100, 999, np.int32))
  with pytest.raises(ValueError, match="outside"):
    shards.TokenStream([str(tmp_path / "big.npy")], tok.VOCAB_SIZE).window(np.random.default_rng(0), 10)


def test_mixture_rows_are_a_pure_function_of_seed_and_index(tmp_path):
  cfg = data_config(stdlib=0.5, mqar=0.3, passkey=0.2)
  cfg.cache_dir, cfg.task_length = str(tmp_path), 64
  mix = pipeline.Mixture(cfg, 128, 7, vocab_size=tok.VOCAB_SIZE)
  whole = mix.rows(0, 12)
  part = pipeline.Mixture(cfg, 128, 7, vocab_size=tok.VOCAB_SIZE).rows(5, 12)
  for k in whole:
    np.testing.assert_array_equal(whole[k][5:], part[k])
  other = pipeline.Mixture(cfg, 128, 8, vocab_size=tok.VOCAB_SIZE).rows(0, 12)
  assert not np.array_equal(whole["tokens"], other["tokens"])
  assert whole["tokens"].shape == (12, 128) and whole["weights"].dtype == np.float32


def test_mixture_draws_sources_in_proportion_to_their_weights(tmp_path):
  cfg = data_config(stdlib=0.25, palindrome=0.75)
  cfg.cache_dir = str(tmp_path)
  mix = pipeline.Mixture(cfg, 64, 0, vocab_size=tok.VOCAB_SIZE)
  rows = [mix.row(i) for i in range(400)]
  synthetic = np.mean([(r.tokens == tok.SEP).any() for r in rows])  # the stdlib holds no <sep>
  assert abs(synthetic - 0.75) < 0.07


def test_mixture_rejects_bad_configs(tmp_path):
  with pytest.raises(ValueError, match="unknown source"):
    pipeline.parse_mix({"wikipedia": 1.0})
  with pytest.raises(ValueError, match="positive total"):
    pipeline.parse_mix({"stdlib": 0.0})
  with pytest.raises(ValueError, match="set config.data.shards"):
    pipeline.Mixture(data_config(shards=1.0), 64, 0, vocab_size=tok.VOCAB_SIZE)
  with pytest.raises(ValueError, match="vocab_size"):
    pipeline.Mixture(data_config(mqar=1.0), 64, 0, vocab_size=200)
  cfg = data_config(mqar=1.0)
  cfg.task_length = 16
  with pytest.raises(ValueError, match="needs task_length"):
    pipeline.Mixture(cfg, 64, 0, vocab_size=tok.VOCAB_SIZE)


def test_derived_seeds_differ_by_stage_and_purpose():
  seeds = {pipeline.derive_seed(0, stage, p) for stage in range(3) for p in pipeline.PURPOSES}
  assert len(seeds) == 9 and all(0 <= s < 2 ** 32 for s in seeds)
  assert pipeline.derive_seed(5, 1, "train") == pipeline.derive_seed(5, 1, "train")
