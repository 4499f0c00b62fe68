"""MLA attention: causal attention within documents and its packed-run layout (cuDNN's; the cuDNN path itself is
tested in tests/gpu/test_gpu_mla.py); over a latent cache, the blocked and the split chunk attention and the absorbed
decode against dense float64 formulas, with per-row starts and lengths, blocks that do not divide the cache, and the
cache writes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals   # jax prints them publicly (print_saved_residuals), not returns

from k3jax.numerics import rel_err
from k3jax.ops import mla
from model_testing import causal_attention_reference, random_segments

B, H, D, DV, R = 3, 2, 8, 6, 12


def _dense_chunk_reference(q, ckv, start, w_uk, w_uv, scale):
  """Query t of row b (position start_b + t) attends to positions 0..start_b + t: float64 NumPy."""
  q, ckv, w_uk, w_uv = (np.asarray(a, np.float64) for a in (q, ckv, w_uk, w_uv))
  k, v = np.einsum("blr,rhd->blhd", ckv, w_uk), np.einsum("blr,rhv->blhv", ckv, w_uv)
  s = np.einsum("bthd,blhd->bhtl", q, k) * scale
  T, L = q.shape[1], ckv.shape[1]
  qpos = np.asarray(start)[:, None] + np.arange(T)[None]
  allowed = np.arange(L)[None, None] <= qpos[:, :, None]                                 # [B,T,L]
  s = np.where(allowed[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhtl,blhv->bthv", p, v)


def _draw(seed, T, L):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[1], (B, L, R)),
          jax.random.normal(ks[2], (R, H, D)) * R ** -0.5, jax.random.normal(ks[3], (R, H, DV)) * R ** -0.5)


@pytest.mark.parametrize("query_block,key_block", [(3, 5), (4, 7), (64, 64)])
def test_chunk_attention_matches_dense_formula_with_per_row_starts(query_block, key_block):
  """L = 23 positions: key blocks of 5 and 7 leave a last block shifted back over the previous one; query tiles of
  3 and 4 do not divide T = 10; 64 is one block of each."""
  T, L = 10, 23
  q, ckv, w_uk, w_uv = _draw(0, T, L)
  start = jnp.asarray([0, 7, 13], jnp.int32)
  got = jax.jit(lambda *a: mla.chunk_attention_blocked(*a, scale=0.3, query_block=query_block,
                                                      key_block=key_block))(
      q, ckv, start, w_uk, w_uv)
  assert got.shape == (B, T, H, DV)
  assert rel_err(got, _dense_chunk_reference(q, ckv, start, w_uk, w_uv, 0.3)) < 1e-5


def _einsum_attend(q, k, v, *, scale, kv_lengths_B):
  """`chunk_attention_split`'s `attend` as fp32 einsums (what `cudnn_attend` computes on the GPU)."""
  T, S = q.shape[1], k.shape[1]
  s = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * scale
  if kv_lengths_B is None:
    allowed = jnp.tril(jnp.ones((T, S), bool))[None, None]
  else:
    allowed = (jnp.arange(S)[None] < kv_lengths_B[:, None])[:, None, None]
  s = jnp.where(allowed, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  return jnp.einsum("bhts,bshv->bthv", jnp.exp(s - lse[..., None]), v, precision="highest"), lse


@pytest.mark.parametrize("key_block", [4, 7, 64])
def test_split_chunk_attention_merges_its_parts_as_the_dense_formula(key_block):
  """Rows at start 0 (no prefix), inside the cache, and at its end with padding past it (row 2: 7 real tokens of
  10, positions 16..22 of L = 23); prefix blocks of 4 and 7 cut inside a row's prefix and reach past L, 64 is one
  block; Dqk != Dv. Only the real tokens' outputs are compared."""
  T, L = 10, 23
  q, ckv, w_uk, w_uv = _draw(5, T, L)
  start, lengths = jnp.asarray([0, 7, 16], jnp.int32), [10, 10, 7]
  got = jax.jit(lambda *a: mla.chunk_attention_split(*a, scale=0.3, attend=_einsum_attend, key_block=key_block))(
      q, ckv, start, w_uk, w_uv)
  want = _dense_chunk_reference(q, ckv, start, w_uk, w_uv, 0.3)
  assert got.shape == (B, T, H, DV)
  for b, n in enumerate(lengths):
    assert rel_err(got[b, :n], want[b, :n]) < 1e-5, b


def test_chunk_attention_refuses_an_unknown_impl():
  q, ckv, w_uk, w_uv = _draw(0, 4, 8)
  with pytest.raises(ValueError, match="impl must be one of"):
    mla.chunk_attention(q, ckv, jnp.zeros((B,), jnp.int32), w_uk, w_uv, scale=1.0, impl="flash")


def test_write_latents_writes_each_rows_valid_tokens_at_its_start_and_nothing_else():
  ckv = jax.random.normal(jax.random.PRNGKey(1), (B, 9, R))
  c = jax.random.normal(jax.random.PRNGKey(2), (B, 4, R))
  start, lengths = jnp.asarray([0, 3, 7]), jnp.asarray([4, 2, 2])
  out = np.asarray(mla.write_latents(ckv, c, start, lengths))
  want = np.array(ckv)
  for b in range(B):
    want[b, int(start[b]):int(start[b] + lengths[b])] = np.asarray(c)[b, :int(lengths[b])]
  np.testing.assert_array_equal(out, want)


def test_decode_attention_xla_matches_dense_formula_with_per_row_lengths():
  L = 17
  q = jax.random.normal(jax.random.PRNGKey(3), (B, H, R))
  ckv = jax.random.normal(jax.random.PRNGKey(4), (B, L, R))
  lengths = jnp.asarray([1, 9, L], jnp.int32)
  got = mla.decode_attention(q, ckv, lengths, scale=0.25, impl="xla")
  q64, c64 = np.asarray(q, np.float64), np.asarray(ckv, np.float64)
  s = np.einsum("bhr,blr->bhl", q64, c64) * 0.25
  s = np.where(np.arange(L)[None, None] < np.asarray(lengths)[:, None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  assert rel_err(got, np.einsum("bhl,blr->bhr", p / p.sum(-1, keepdims=True), c64)) < 1e-5


def test_decode_impl_choice_and_refusals():
  assert mla.pick_decode_impl("xla", 256, 4096) == "xla"
  assert mla.pick_decode_impl("auto", 256, 4096) == ("pallas" if jax.default_backend() == "gpu" else "xla")
  assert mla.pick_decode_impl("auto", 96, 4096) == "xla"
  with pytest.raises(ValueError, match="power of two >= 16"):
    mla.pick_decode_impl("pallas", 24, 4096)
  with pytest.raises(ValueError, match="cache of >= 16"):
    mla.pick_decode_impl("pallas", 32, 8)
  with pytest.raises(ValueError, match="impl must be one of"):
    mla.decode_attention(jnp.zeros((1, 1, 16)), jnp.zeros((1, 4, 16)), jnp.ones((1,), jnp.int32), scale=1.0,
                         impl="cuda")


@pytest.mark.parametrize("docs,pad,max_runs", [(1, 0, 1), (4, 0, 4), (5, 7, 8), (9, 3, 4)])
def test_document_runs_place_every_position_in_its_document(docs, pad, max_runs):
  """The packed layout read back position by position gives each position's run: the same positions as the segment
  ids' equality, slots past a row's runs at −1, and the count of runs, also when it exceeds the slots (then only
  the first max_runs are laid out)."""
  seg = random_segments(docs * 10 + pad, 3, 37, docs, pad)
  offsets, lengths, runs = (np.asarray(a) for a in mla.document_runs(jnp.asarray(seg), max_runs))
  n = docs + (pad > 0)
  assert offsets.shape == (3, max_runs + 1) and lengths.shape == (3, max_runs)
  np.testing.assert_array_equal(runs, n)
  kept = min(n, max_runs)
  assert (offsets[:, kept:] == -1).all() and (lengths[:, kept:] == -1).all()
  for b in range(3):
    run_of = np.full(37, -1)
    for r in range(kept):
      assert lengths[b, r] > 0
      run_of[offsets[b, r]:offsets[b, r] + lengths[b, r]] = r
    covered = run_of >= 0
    if n <= max_runs:
      assert covered.all()
    same_run = (run_of[:, None] == run_of[None]) & covered[:, None] & covered[None]
    same_doc = (seg[b][:, None] == seg[b][None]) & covered[:, None] & covered[None]
    np.testing.assert_array_equal(same_run, same_doc)


def _causal_reference(q, k, v, seg, scale):
  """float64 NumPy: query t attends to keys s ≤ t with the same segment id."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  T = q.shape[1]
  allowed = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((T, T), bool))[None]
  s = np.where(allowed[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhts,bshv->bthv", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("with_segments", [False, True])
def test_causal_attention_is_the_formula_within_documents(with_segments):
  """The XLA path with Dv ≠ Dqk (the zero-padding to one head dim is undone) and an odd length."""
  T = 29
  ks = jax.random.split(jax.random.PRNGKey(3), 3)
  q, k = (jax.random.normal(kk, (B, T, H, D)) for kk in ks[:2])
  v = jax.random.normal(ks[2], (B, T, H, DV))
  seg = random_segments(5, B, T, 3, 4) if with_segments else np.ones((B, T), np.int32)
  with jax.default_matmul_precision("highest"):
    o = mla.causal_attention(q, k, v, jnp.asarray(seg) if with_segments else None, scale=D ** -0.5, impl="xla")
  assert o.shape == (B, T, H, DV)
  assert rel_err(o, _causal_reference(q, k, v, seg, D ** -0.5)) < 1e-5


def test_blocked_attention_saves_its_inputs_output_and_log_sum_exps_in_their_own_layout():
  """What the backward keeps: q, k, v as given, the output in their dtype, the log-sum-exps and the segment ids;
  none of the fp32 `[B, H, T, D]` working copies. Under the cuDNN path's `lax.cond` the branches' residuals share
  slots by shape and dtype, so these fill cuDNN's own (its q, k, v and output) instead of being written as zeros
  when cuDNN runs."""
  T = 40
  q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in jax.random.split(jax.random.PRNGKey(1), 3))
  seg = jnp.asarray(random_segments(7, B, T, 3, 2))
  saved = saved_residuals(lambda q, k, v: mla.blocked_attention(q, k, v, seg, scale=0.1, block=16), q, k, v)
  big = [(aval.dtype, aval.shape) for aval, _ in saved if aval.size >= B * T * H * D]
  assert big == [(jnp.dtype(jnp.bfloat16), (B, T, H, D))] * 4   # q, k, v and the output
  assert sum(aval.size for aval, _ in saved) < 4 * B * T * H * D + 2 * B * H * 48


def test_causal_attention_rejects_an_unknown_impl():
  x = jnp.ones((1, 4, 1, 2))
  with pytest.raises(ValueError, match="impl must be one of"):
    mla.causal_attention(x, x, x, scale=1.0, impl="flash")


@pytest.mark.parametrize("T,block", [(29, 8), (32, 16), (5, 16)])
def test_blocked_attention_and_its_gradients_are_the_formula(T, block):
  """The fallback of the cuDNN path: blocks of queries and keys with an online softmax and a recomputing backward,
  against autodiff of the float64 formula; documents of random lengths and a padding tail, T that no block divides,
  one block holding all of T, Dv ≠ Dqk."""
  ks = jax.random.split(jax.random.PRNGKey(T), 4)
  q, k = (jax.random.normal(kk, (B, T, H, D)) for kk in ks[:2])
  v = jax.random.normal(ks[2], (B, T, H, DV))
  do = jax.random.normal(ks[3], (B, T, H, DV))
  seg = random_segments(T + block, B, T, min(3, T), 2 if T > 4 else 0)
  blocked = lambda q, k, v: mla.blocked_attention(q, k, v, jnp.asarray(seg), scale=D ** -0.5, block=block)
  o, pullback = jax.vjp(blocked, q, k, v)
  assert rel_err(o, _causal_reference(q, k, v, seg, D ** -0.5)) < 1e-5

  _, reference_pullback = jax.vjp(lambda q, k, v: causal_attention_reference(q, k, v, seg, D ** -0.5), q, k, v)
  want = reference_pullback(do)
  for name, got, w in zip(("dq", "dk", "dv"), pullback(do), want):
    assert rel_err(got, w) < 1e-5, name
