"""Token shards on disk (`.npy` 1-D integer arrays, or `.bin` raw uint16) read as memory maps, and the random
windows a training row takes from them."""
from __future__ import annotations

import glob
import os

import numpy as np

from k3jax.data import tokenizer as tok


def load_shard(path: str | os.PathLike) -> np.ndarray:
  """A 1-D integer token array, memory-mapped."""
  path = str(path)
  if path.endswith(".npy"):
    tokens = np.load(path, mmap_mode="r")
  elif path.endswith(".bin"):
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
  else:
    raise ValueError(f"token shard {path!r}: expected a .npy or .bin file")
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0:
    raise ValueError(f"token shard {path!r}: expected a non-empty 1-D integer array, got {tokens.dtype}{tokens.shape}")
  return tokens


def expand(pattern: str) -> list[str]:
  """Shard paths named by a comma-separated list of paths or globs, sorted; an error if any names nothing."""
  paths = []
  for part in filter(None, (p.strip() for p in pattern.split(","))):
    found = sorted(glob.glob(part))
    if not found:
      raise ValueError(f"token shards: {part!r} matches no file")
    paths += found
  if not paths:
    raise ValueError("token shards: empty pattern")
  return paths


def segments_of(tokens_T: np.ndarray) -> np.ndarray:
  """Segment ids of a window of a stream: 1 for the first document, +1 after every `<eos>`."""
  after_eos = np.concatenate([[0], (tokens_T[:-1] == tok.EOS).astype(np.int32)])
  return 1 + np.cumsum(after_eos, dtype=np.int32)


class TokenStream:
  """Shards read as one stream of documents separated by `<eos>`; a row is a window at a random place."""

  def __init__(self, paths: list[str], vocab_size: int):
    self.paths, self.vocab_size = list(paths), vocab_size
    self.shards = [load_shard(p) for p in self.paths]
    sizes = np.array([len(s) for s in self.shards], np.float64)
    self.probs = sizes / sizes.sum()

  def window(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
    """`length` consecutive tokens from a shard picked in proportion to its size, and their segment ids."""
    i = int(rng.choice(len(self.shards), p=self.probs))
    shard = self.shards[i]
    if len(shard) < length:
      raise ValueError(f"token shard {self.paths[i]!r} has {len(shard)} tokens, fewer than the row length {length}")
    start = int(rng.integers(0, len(shard) - length + 1))
    tokens = np.asarray(shard[start:start + length]).astype(np.int32)
    if tokens.min() < 0 or tokens.max() >= self.vocab_size:
      raise ValueError(f"token shard {self.paths[i]!r} holds ids outside [0, {self.vocab_size}) "
                       f"near offset {start}: [{tokens.min()}, {tokens.max()}]")
    return tokens, segments_of(tokens)
