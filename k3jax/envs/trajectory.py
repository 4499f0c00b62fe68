"""An episode's tokens as they entered the context, with the model's own tokens marked.

The context grows by deltas (verl's multi-turn tokenisation): the prompt, then each model turn as the tokens the
model produced, then each tool result as the tokens of its text. With the byte tokenizer, tokenising the pieces
is tokenising the whole text, so the deltas are exactly the episode's tokens. Only the model's tokens carry loss.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Trajectory:
  chunks: list[tuple[np.ndarray, bool]] = dataclasses.field(default_factory=list)  # (int32 tokens, by the model)

  def add(self, tokens, *, model: bool) -> None:
    self.chunks.append((np.asarray(tokens, np.int32).reshape(-1), bool(model)))

  def __len__(self) -> int:
    return sum(len(t) for t, _ in self.chunks)

  @property
  def tokens(self) -> np.ndarray:
    return np.concatenate([t for t, _ in self.chunks] or [np.zeros(0, np.int32)])

  @property
  def loss_mask(self) -> np.ndarray:
    """bool per token: produced by the model."""
    return np.concatenate([np.full(len(t), m) for t, m in self.chunks] or [np.zeros(0, bool)])

  @property
  def response_tokens(self) -> int:
    return sum(len(t) for t, m in self.chunks if m)
