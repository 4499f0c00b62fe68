"""Rows and batches: a weighted mixture of sources packed into fixed-length rows with segment ids, and
next-token targets that never cross a document boundary. Row `i` is a pure function of (seed, i), so the data
position of a run is its step and a resumed run sees exactly the rows the uninterrupted one would have seen."""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from k3jax.data import corpus, shards, tasks
from k3jax.data import tokenizer as tok

TEXT_SOURCES = ("stdlib", "shards")


@dataclasses.dataclass(frozen=True)
class Row:
  tokens: np.ndarray       # int32 [T]
  segment_ids: np.ndarray  # int32 [T]: documents 1, 2, ...; 0 is padding
  target_mask: np.ndarray  # bool [T]: the token is a training target (when its predecessor is in its document)


PURPOSES = ("train", "heldout", "tasks")


def derive_seed(seed: int, stage: int, purpose: str) -> int:
  """The 32-bit data seed of a run seed, a stage and a purpose (training rows, held-out rows, task evaluation)."""
  if purpose not in PURPOSES:
    raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
  return int(np.random.SeedSequence([int(seed), int(stage), PURPOSES.index(purpose)]).generate_state(1)[0])


def pack(examples: list[tasks.Example], seq_len: int) -> Row:
  """Examples one after another as documents 1, 2, ...; the rest of the row is padding (segment 0)."""
  total = sum(len(e.tokens) for e in examples)
  if total > seq_len:
    raise ValueError(f"examples hold {total} tokens, more than the row length {seq_len}")
  row = Row(np.full(seq_len, tok.PAD, np.int32), np.zeros(seq_len, np.int32), np.zeros(seq_len, bool))
  at = 0
  for seg, e in enumerate(examples, start=1):
    n = len(e.tokens)
    row.tokens[at:at + n], row.segment_ids[at:at + n], row.target_mask[at:at + n] = e.tokens, seg, e.answer_mask
    at += n
  return row


def next_token_targets(tokens_NT, segment_ids_NT, target_mask_NT):
  """(targets, weights), both `[N,T]`: position t predicts token t+1, weighted 1 when both lie in the same
  (non-padding) document and token t+1 is a target; the last position has no target."""
  targets = np.concatenate([tokens_NT[:, 1:], np.full_like(tokens_NT[:, :1], tok.PAD)], axis=1)
  same_doc = (segment_ids_NT[:, 1:] == segment_ids_NT[:, :-1]) & (segment_ids_NT[:, 1:] != 0)
  weights = np.concatenate([same_doc & target_mask_NT[:, 1:], np.zeros_like(same_doc[:, :1])], axis=1)
  return targets.astype(np.int32), weights.astype(np.float32)


def stack_rows(rows: list[Row]) -> dict[str, np.ndarray]:
  """Rows as `[N,T]` arrays: tokens, segment_ids, and their next-token targets and weights."""
  tokens = np.stack([r.tokens for r in rows])
  segment_ids = np.stack([r.segment_ids for r in rows])
  targets, weights = next_token_targets(tokens, segment_ids, np.stack([r.target_mask for r in rows]))
  return {"tokens": tokens, "segment_ids": segment_ids, "targets": targets, "weights": weights}


def parse_mix(mix) -> list[tuple[str, float]]:
  """`{source: weight}` as sorted (name, probability) pairs; sources are `stdlib`, `shards` and the task names."""
  known = set(TEXT_SOURCES) | set(tasks.TASKS)
  items = sorted((str(k), float(v)) for k, v in dict(mix).items())
  for name, w in items:
    if name not in known:
      raise ValueError(f"config.data.mix: unknown source {name!r}; expected some of {sorted(known)}")
    if not w >= 0:
      raise ValueError(f"config.data.mix[{name!r}] must be >= 0, got {w}")
  total = sum(w for _, w in items)
  if total <= 0:
    raise ValueError(f"config.data.mix needs a positive total weight, got {dict(mix)}")
  return [(n, w / total) for n, w in items if w > 0]


class Mixture:
  """Rows of length `seq_len` from the sources of `data_cfg.mix`, drawn per row in proportion to their weights.

  Text sources give a window of their token stream (split `train` or `heldout`); a task gives
  `seq_len // task_length` examples of at most `task_length` tokens each, packed.
  """

  def __init__(self, data_cfg, seq_len: int, seed: int, *, vocab_size: int, split: str = "train"):
    if split not in corpus.SPLITS:
      raise ValueError(f"split must be one of {corpus.SPLITS}, got {split!r}")
    if vocab_size < tok.VOCAB_SIZE:
      raise ValueError(f"config.model.vocab_size must be >= {tok.VOCAB_SIZE} (the byte tokenizer), got {vocab_size}")
    self.seq_len, self.seed = seq_len, seed
    self.mix = parse_mix(data_cfg.mix)
    self.probs = np.array([w for _, w in self.mix])
    self.task_length = data_cfg.task_length or seq_len
    if not 0 < self.task_length <= seq_len:
      raise ValueError(f"config.data.task_length must lie in (0, seq_len={seq_len}], got {data_cfg.task_length}")
    self.streams = {}
    for name, _ in self.mix:
      if name == "stdlib":
        self.streams[name] = shards.TokenStream([corpus.stdlib_shards(data_cfg.cache_dir or None)[split]], vocab_size)
      elif name == "shards":
        pattern = data_cfg.shards if split == "train" else data_cfg.heldout_shards
        if not pattern:
          field = "shards" if split == "train" else "heldout_shards"
          raise ValueError(f"config.data.mix uses 'shards': set config.data.{field}")
        self.streams[name] = shards.TokenStream(shards.expand(pattern), vocab_size)
      elif tasks.TASKS[name].min_length > self.task_length:
        raise ValueError(f"task {name!r} needs task_length >= {tasks.TASKS[name].min_length}, got {self.task_length}")

  def _rng(self, what: str, index: int) -> np.random.Generator:
    return np.random.default_rng([self.seed, zlib.crc32(what.encode()), index])

  def row(self, index: int) -> Row:
    name = self.mix[int(self._rng("mixture", index).choice(len(self.mix), p=self.probs))][0]
    if name in self.streams:
      tokens, segment_ids = self.streams[name].window(self._rng(name, index), self.seq_len)
      return Row(tokens, segment_ids, np.ones(self.seq_len, bool))
    per_row = self.seq_len // self.task_length
    return pack([tasks.make_example(name, self.seed, index * per_row + j, self.task_length) for j in range(per_row)],
                self.seq_len)

  def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows `start..stop-1` as `[N,T]` arrays: tokens, segment_ids, targets, weights."""
    return stack_rows([self.row(i) for i in range(start, stop)])
