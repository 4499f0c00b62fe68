"""Calculator problems: a short word problem of one to `max_steps` operations on a count, and a calculator tool.

    Ann has 12 pens. Ann gets 7 more. Ann buys 3 packs of 4. How many pens does Ann have?
    <calc>12+7</calc><result>19</result><calc>19+3*4</calc><result>31</result><answer>31</answer>

The solver writes one calculation per sentence on the previous result and answers the last one. Every count
stays a whole number below 1000. The context length only bounds the episode (the problem does not grow with it).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.envs import calculator, protocol
from k3jax.envs.episode import Problem

NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal")
ITEMS = ("apples", "pens", "cards", "coins", "shells", "stamps")
FRACTIONS = {2: "half", 3: "third", 4: "quarter"}
LIMIT = 1000


def _operations(rng: np.random.Generator, x: int, name: str) -> list[tuple[str, str, int]]:
  """(sentence, the operation as written after the count, the new count) for each operation applicable to x."""
  n = int(rng.integers(2, 21))
  k, m = int(rng.integers(2, 6)), int(rng.integers(2, 10))
  ops = [(f"{name} gets {n} more.", f"+{n}", x + n), (f"{name} buys {k} packs of {m}.", f"+{k}*{m}", x + k * m)]
  if x > 1:
    lose = int(rng.integers(1, x))
    ops.append((f"{name} gives away {lose}.", f"-{lose}", x - lose))
  for factor, word in ((2, "doubles"), (3, "triples")):
    ops.append((f"{name} {word} them.", f"*{factor}", x * factor))
  for d, word in FRACTIONS.items():
    if x % d == 0:
      ops.append((f"{name} keeps a {word} of them.", f"/{d}", x // d))
  return [op for op in ops if op[2] < LIMIT]


@dataclasses.dataclass(frozen=True)
class Plan:
  start: int
  operations: tuple[str, ...]  # what each sentence does to the count, as written after it: "+7", "+3*4", "/2"


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  max_steps: int = 2
  response_tokens: int = 192   # the solver needs at most 40 per step and 20 to answer

  @property
  def max_solver_turns(self) -> int:
    return self.max_steps + 1

  @property
  def min_length(self) -> int:
    longest = len(f"{NAMES[0]} has 99 {ITEMS[0]}. ") + self.max_steps * len(f"{NAMES[0]} keeps a quarter of them. ")
    longest += len(f"How many {max(ITEMS, key=len)} does {max(NAMES, key=len)} have?\n")
    return 1 + longest + 8 + self.response_tokens

  def problem(self, rng: np.random.Generator, length: int) -> Problem:
    if length < self.min_length:
      raise ValueError(f"calc needs length >= {self.min_length}, got {length}")
    name, item = str(rng.choice(NAMES)), str(rng.choice(ITEMS))
    x = start = int(rng.integers(2, 31))
    sentences, operations = [f"{name} has {x} {item}."], []
    for _ in range(int(rng.integers(1, self.max_steps + 1))):
      ops = _operations(rng, x, name)
      sentence, operation, x = ops[int(rng.integers(len(ops)))]
      sentences.append(sentence)
      operations.append(operation)
    prompt = " ".join(sentences) + f" How many {item} does {name} have?\n"
    return Problem(prompt, str(x), Plan(start, tuple(operations)))

  def links(self, problem: Problem) -> int:
    """The tool calls the solver makes on `problem`: one per operation."""
    return len(problem.data.operations)

  def tools(self, problem: Problem) -> dict:
    return {"calc": calculator.evaluate}

  def solver_turn(self, problem: Problem, outputs: list[str]) -> str:
    """The next sentence's operation on the last result (the first on the starting count), or the answer."""
    plan = problem.data
    if len(outputs) == len(plan.operations):
      return protocol.call(protocol.ANSWER, outputs[-1])
    previous = outputs[-1] if outputs else str(plan.start)
    return protocol.call("calc", previous + plan.operations[len(outputs)])
