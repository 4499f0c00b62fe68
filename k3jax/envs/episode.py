"""The episode API a batched rollout drives: a problem's prompt, then `step(model turn) -> Step` until done.

An episode ends when the model answers, when it has used its turns, or when the rollout ends it (its token budget,
`end`). Reward comes only at the end, from `outcome()` (`k3jax.rl.rewards`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from k3jax.data import tokenizer as tok
from k3jax.envs import protocol

END_REASONS = ("answer", "turns", "tokens")


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str   # the context before the first model turn (after <bos>)
  answer: str   # the exact text of a correct answer
  data: Any     # what the environment's tools and solver need


@dataclasses.dataclass(frozen=True)
class Step:
  result: str | None  # text to append to the context (a tool result); None when the episode is over
  done: bool
  info: dict          # call (the parsed call's name or None), invalid (malformed or unknown call), tool_error


@dataclasses.dataclass(frozen=True)
class Outcome:
  correct: bool       # answered with exactly the expected text
  answered: bool
  ended_by: str       # one of END_REASONS
  turns: int
  tool_calls: int     # well-formed calls of an available tool (tool errors included)
  invalid_calls: int  # malformed turns and calls of unknown or unavailable tools
  tool_errors: int    # well-formed calls the tool could not answer (no such key, division by zero, ...)

  @property
  def well_formed(self) -> bool:
    """Ended with an answer and made no invalid call (the optional format reward)."""
    return self.answered and self.invalid_calls == 0


class Episode:
  """One interaction with a problem; `tools` maps a tool name to `f(arg) -> result text` (may raise ToolError)."""

  def __init__(self, problem: Problem, tools: dict[str, Callable[[str], str]], *, max_turns: int):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.problem, self.tools, self.max_turns = problem, dict(tools), max_turns
    self.turns = self.tool_calls = self.invalid_calls = self.tool_errors = 0
    self.outputs: list[str] = []   # the tools' successful results, in order (what a solver reads)
    self.answer: str | None = None
    self.ended_by: str | None = None

  @property
  def prompt_tokens(self) -> np.ndarray:
    return np.concatenate([[tok.BOS], tok.encode(self.problem.prompt)]).astype(np.int32)

  @property
  def done(self) -> bool:
    return self.ended_by is not None

  def step(self, turn: str) -> Step:
    """Acts on one model turn: a tool call gets its result, an answer (or the last turn) ends the episode."""
    if self.done:
      raise RuntimeError(f"the episode is over (ended by {self.ended_by})")
    self.turns += 1
    parsed = protocol.parse_turn(turn)
    info = {"call": None, "invalid": False, "tool_error": False}
    if isinstance(parsed, protocol.Malformed):
      reply = self._invalid(info, parsed.message)
    elif parsed.name == protocol.ANSWER:
      info["call"] = parsed.name
      self.answer, self.ended_by = parsed.arg, "answer"
      return Step(None, True, info)
    elif parsed.name not in self.tools:
      reply = self._invalid(info, f"no tool {parsed.name!r} here; tools: {', '.join(sorted(self.tools))}")
    else:
      info["call"] = parsed.name
      self.tool_calls += 1
      try:
        output = self.tools[parsed.name](parsed.arg)
        self.outputs.append(output)
        reply = protocol.result(output)
      except protocol.ToolError as e:
        self.tool_errors += 1
        info["tool_error"] = True
        reply = protocol.error(str(e))
    if self.turns >= self.max_turns:
      self.ended_by = "turns"
      return Step(None, True, info)
    return Step(reply, False, info)

  def _invalid(self, info: dict, message: str) -> str:
    self.invalid_calls += 1
    info["invalid"] = True
    return protocol.error(message)

  def end(self, reason: str) -> None:
    """Ends the episode from outside (the rollout's token budget)."""
    if reason not in END_REASONS:
      raise ValueError(f"reason must be one of {END_REASONS}, got {reason!r}")
    if not self.done:
      self.ended_by = reason

  def outcome(self) -> Outcome:
    if not self.done:
      raise RuntimeError("the episode is not over")
    answered = self.ended_by == "answer"
    return Outcome(answered and self.answer == self.problem.answer, answered, self.ended_by, self.turns,
                   self.tool_calls, self.invalid_calls, self.tool_errors)
