"""Synthetic tasks for training and long-context evaluation, each example a pure function of (seed, index, length).

An example is a document `<bos> ... <eos>` of at most `length` tokens and a mask of its answer tokens: the tokens a
model can only predict by using the context (the values in recall, the reversed string, a scripted solver's turns in
an RL environment, ...). Accuracy is measured on them, and training on a task puts its loss on them alone. `chance`
is the accuracy of guessing uniformly among the possible answer tokens.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from k3jax import envs
from k3jax.data import tokenizer as tok

LOWER = np.arange(ord("a"), ord("z") + 1)
UPPER = np.arange(ord("A"), ord("Z") + 1)
DIGITS = np.arange(ord("0"), ord("9") + 1)


@dataclasses.dataclass(frozen=True)
class Example:
  tokens: np.ndarray       # int32 [L], L <= the requested length
  answer_mask: np.ndarray  # bool [L]


def _doc(parts, answers) -> Example:
  """Concatenates token chunks into `<bos> parts <eos>`; `answers[i]` marks chunk i as answer tokens."""
  chunks = [np.array([tok.BOS])] + [np.asarray(p, np.int32).reshape(-1) for p in parts] + [np.array([tok.EOS])]
  flags = [False] + list(answers) + [False]
  tokens = np.concatenate(chunks).astype(np.int32)
  mask = np.concatenate([np.full(len(c), f) for c, f in zip(chunks, flags)])
  return Example(tokens, mask)


@dataclasses.dataclass(frozen=True)
class MQAR:
  """Multi-query associative recall: key-value pairs, filler, then every key again; answer its value."""
  num_pairs: int = 8
  chance: float = 1 / len(DIGITS)

  @property
  def min_length(self) -> int:
    return 4 * self.num_pairs + 3

  def __call__(self, rng: np.random.Generator, length: int) -> Example:
    keys = rng.choice(LOWER, self.num_pairs, replace=False)
    values = rng.choice(DIGITS, self.num_pairs)
    filler = rng.choice(UPPER, length - self.min_length)
    order = rng.permutation(self.num_pairs)
    pairs = np.stack([keys, values], 1).reshape(-1)
    queries = [[k] for k in keys[order]]
    answers = [[v] for v in values[order]]
    parts = [pairs, filler, [tok.SEP]] + [x for qa in zip(queries, answers) for x in qa]
    return _doc(parts, [False, False, False] + [False, True] * self.num_pairs)


PASSKEY_FILLER = tok.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                            "There and back again. ")
PASSKEY_PREFIX = tok.encode("The pass key is ")


@dataclasses.dataclass(frozen=True)
class Passkey:
  """Needle retrieval: "The pass key is 12345. " at a random depth of repeated filler text, asked for at the end."""
  num_digits: int = 5
  chance: float = 1 / len(DIGITS)

  @property
  def min_length(self) -> int:
    return 2 + 2 * (len(PASSKEY_PREFIX) + self.num_digits) + 2

  def __call__(self, rng: np.random.Generator, length: int) -> Example:
    digits = rng.choice(DIGITS, self.num_digits)
    n_filler = length - self.min_length
    filler = np.tile(PASSKEY_FILLER, n_filler // len(PASSKEY_FILLER) + 1)[:n_filler]
    depth = int(rng.integers(0, n_filler + 1))
    needle = [PASSKEY_PREFIX, digits, tok.encode(". ")]
    parts = [filler[:depth], *needle, filler[depth:], PASSKEY_PREFIX, digits]
    return _doc(parts, [False] * 5 + [False, True])


@dataclasses.dataclass(frozen=True)
class Palindrome:
  """A random lower-case string, `<sep>`, then the string reversed (the answer)."""
  chance: float = 1 / len(LOWER)
  min_length: int = 5

  def __call__(self, rng: np.random.Generator, length: int) -> Example:
    x = rng.choice(LOWER, (length - 3) // 2)
    return _doc([x, [tok.SEP], x[::-1]], [False, False, True])


@dataclasses.dataclass(frozen=True)
class Stack:
  """Push (`+c`) and pop (`-`) operations; after each `-` comes the popped letter (the answer)."""
  chance: float = 1 / len(LOWER)
  min_length: int = 6

  def __call__(self, rng: np.random.Generator, length: int) -> Example:
    parts, answers, stack = [], [], []
    budget = length - 2
    while budget >= 2 and (budget >= 4 or stack):
      if stack and (rng.random() < 0.5 or budget < 4):
        parts += [[ord("-")], [stack.pop()]]
        answers += [False, True]
      else:
        stack.append(int(rng.choice(LOWER)))
        parts.append([ord("+"), stack[-1]])
        answers.append(False)
      budget -= 2
    return _doc(parts, answers)


@dataclasses.dataclass(frozen=True)
class Demonstration:
  """A scripted solver's episode in RL environment `env` (`k3jax.envs`), then `<eos>`: the prompt and the tool
  results are context, the solver's own turns are the answer tokens (the tokens a policy writes)."""
  env: str
  chance: float = 1 / 256

  @property
  def min_length(self) -> int:
    return envs.get(self.env).min_length + 1

  def __call__(self, rng: np.random.Generator, length: int) -> Example:
    traj = envs.demonstration(self.env, rng, length - 1)
    return Example(np.append(traj.tokens, tok.EOS).astype(np.int32), np.append(traj.loss_mask, False))


TASKS = {"mqar": MQAR(), "passkey": Passkey(), "palindrome": Palindrome(), "stack": Stack(),
         **{name: Demonstration(name) for name in envs.ENVS}}


def task_rng(name: str, seed: int, index: int) -> np.random.Generator:
  """The generator behind example `index` of task `name` under `seed` (independent for every triple)."""
  if seed < 0 or index < 0:
    raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
  return np.random.default_rng([seed, zlib.crc32(name.encode()), index])


def make_example(name: str, seed: int, index: int, length: int) -> Example:
  """Example `index` of task `name`: a document of at most `length` tokens, the same for the same arguments."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
  task = TASKS[name]
  if length < task.min_length:
    raise ValueError(f"task {name!r} needs length >= {task.min_length}, got {length}")
  ex = task(task_rng(name, seed, index), length)
  assert len(ex.tokens) <= length and ex.answer_mask.any()
  return ex
