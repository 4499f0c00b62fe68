"""The tool protocol: plain text the byte tokenizer can learn, and its one parser.

A model turn ends with one call, `<search>key</search>`, `<calc>expr</calc>` or `<answer>text</answer>`; free
text before it is allowed and ignored. The environment replies to a tool call with `<result>...</result>`; an
answer ends the episode. Generation stops at the end of a call (`STOP_STRINGS`), so a turn holds at most one
closing tag, but `parse_turn` accepts any text: it takes the first complete call, a tag pair of one name around
an argument without `<` or `>`. Anything else is a `Malformed` turn, answered with an error result; the episode
goes on.
"""
from __future__ import annotations

import dataclasses
import re

TOOLS = ("search", "calc")
ANSWER = "answer"
NAMES = TOOLS + (ANSWER,)
STOP_STRINGS = tuple(f"</{n}>" for n in NAMES)
MAX_ARG_CHARS = 256

_CALL = re.compile(r"<([a-z]+)>([^<>]*)</\1>")
_OPEN = re.compile(r"<(" + "|".join(NAMES) + r")>")


class ToolError(Exception):
  """A tool call that cannot be answered; its message goes back as the tool's result."""


@dataclasses.dataclass(frozen=True)
class Call:
  name: str  # one of NAMES
  arg: str   # stripped of surrounding whitespace


@dataclasses.dataclass(frozen=True)
class Malformed:
  message: str  # the error the environment sends back


def call(name: str, arg: str) -> str:
  """The text of a call: `<name>arg</name>`."""
  return f"<{name}>{arg}</{name}>"


def result(content: str) -> str:
  """A tool result as the environment writes it; `<` and `>` in `content` become `(` and `)`, so a result can
  never read as a call."""
  return "<result>" + content.replace("<", "(").replace(">", ")") + "</result>"


def error(message: str) -> str:
  return result("error: " + message)


def _short(s: str, n: int = 16) -> str:
  return s if len(s) <= n else s[:n] + "..."


def parse_turn(text: str) -> Call | Malformed:
  """The first complete call of a model turn, or why there is none."""
  m = _CALL.search(text)
  if m is not None:
    name, arg = m.groups()
    if name not in NAMES:
      return Malformed(f"unknown tool {_short(name)!r}")
    if len(arg) > MAX_ARG_CHARS:
      return Malformed(f"<{name}> argument longer than {MAX_ARG_CHARS} characters")
    return Call(name, arg.strip())
  m = _OPEN.search(text)
  if m is None:
    return Malformed("no call; end a turn with <search>, <calc> or <answer>")
  name = m.group(1)
  if f"</{name}>" in text[m.end():]:
    return Malformed(f"tags inside <{name}>")
  return Malformed(f"unterminated <{name}>")
