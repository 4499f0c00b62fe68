"""Byte-level tokenizer: ids 0-255 are the bytes of UTF-8 text, then four special tokens."""
from __future__ import annotations

import numpy as np

PAD, BOS, EOS, SEP = 256, 257, 258, 259
VOCAB_SIZE = 260
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", SEP: "<sep>"}


def encode(text: str | bytes) -> np.ndarray:
  """int32 ids of the UTF-8 bytes of `text` (no specials added)."""
  data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(ids) -> str:
  """Text of `ids`; specials are written as `<pad>`, `<bos>`, `<eos>`, `<sep>`, invalid UTF-8 as U+FFFD."""
  ids = np.asarray(ids).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
    raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got range [{ids.min()}, {ids.max()}]")
  out, run = [], bytearray()
  for i in ids.tolist():
    if i < 256:
      run.append(i)
      continue
    out.append(run.decode("utf-8", errors="replace"))
    out.append(SPECIAL_NAMES[i])
    run = bytearray()
  out.append(run.decode("utf-8", errors="replace"))
  return "".join(out)
