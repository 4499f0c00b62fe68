"""Long-context lookup: a document of key=value records filling the context, and a multi-hop question.

Keys are distinct strings of lower-case letters and every value is itself a key, so a question can chain: start
at a key, follow `hops` links (the value of one record names the next), answer the key reached. The search tool
takes a key and returns its record. The document grows with the context length, the interaction does not: the
episode's last `response_tokens` tokens are room for the model's turns and the tool results.

    records:
    qzk=abc
    ...
    question: which key is 2 links from qzk?
    <search>qzk</search><result>qzk=abc</result><search>abc</search><result>abc=mfe</result><answer>mfe</answer>
"""
from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.envs import protocol
from k3jax.envs.episode import Problem

HEADER = "records:\n"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclasses.dataclass(frozen=True)
class Records:
  values: dict[str, str]  # key -> value
  start: str
  hops: int


@dataclasses.dataclass(frozen=True)
class Lookup:
  key_len: int = 3
  max_hops: int = 2
  response_tokens: int = 160  # the solver needs 45 per hop and 20 to answer; the rest is the model's slack

  @property
  def max_solver_turns(self) -> int:
    return self.max_hops + 1

  @property
  def record_len(self) -> int:
    return 2 * self.key_len + 2  # "abc=xyz\n"

  def question(self, start: str, hops: int) -> str:
    return f"question: which key is {hops} link{'s' if hops > 1 else ''} from {start}?\n"

  @property
  def min_length(self) -> int:
    """The shortest context with room for a chain of `max_hops` links."""
    question = len(self.question("x" * self.key_len, self.max_hops))
    return 1 + len(HEADER) + (self.max_hops + 1) * self.record_len + question + self.response_tokens

  def max_records(self) -> int:
    return len(LETTERS) ** self.key_len // 2

  def problem(self, rng: np.random.Generator, length: int) -> Problem:
    if length < self.min_length:
      raise ValueError(f"lookup needs length >= {self.min_length}, got {length}")
    hops = int(rng.integers(1, self.max_hops + 1))
    room = length - self.response_tokens - 1 - len(HEADER) - len(self.question("x" * self.key_len, hops))
    n = room // self.record_len
    if n > self.max_records():
      raise ValueError(f"length {length} needs {n} records, more than {self.max_records()} keys of "
                       f"{self.key_len} letters allow: raise key_len")
    codes = rng.choice(len(LETTERS) ** self.key_len, n, replace=False)
    keys = ["".join(LETTERS[c // len(LETTERS) ** i % len(LETTERS)] for i in range(self.key_len)) for c in codes]
    targets = rng.integers(0, n, n)
    targets[:hops] = np.arange(1, hops + 1)   # the chain keys[0] -> keys[1] -> ... -> keys[hops]
    values = {k: keys[t] for k, t in zip(keys, targets)}
    lines = "".join(f"{keys[i]}={values[keys[i]]}\n" for i in rng.permutation(n))
    prompt = HEADER + lines + self.question(keys[0], hops)
    return Problem(prompt, keys[hops], Records(values, keys[0], hops))

  def links(self, problem: Problem) -> int:
    """The tool calls the solver makes on `problem`: its chain's length."""
    return problem.data.hops

  def tools(self, problem: Problem) -> dict:
    values = problem.data.values

    def search(key: str) -> str:
      if key not in values:
        raise protocol.ToolError(f"no record {key[:16]!r}")
      return f"{key}={values[key]}"
    return {"search": search}

  def solver_turn(self, problem: Problem, outputs: list[str]) -> str:
    """Searches the start, then each record's value, and answers the last value."""
    key = outputs[-1].split("=")[1] if outputs else problem.data.start
    return protocol.call("search" if len(outputs) < problem.data.hops else protocol.ANSWER, key)
