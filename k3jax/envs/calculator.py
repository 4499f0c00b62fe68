"""The calculator tool: exact arithmetic on integers with + - * / and parentheses, by a small recursive-descent
parser (never `eval`).

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := ("+" | "-") factor | integer | "(" expr ")"

Values are exact fractions; a result prints as an integer or as `n/d` in lowest terms. Syntax errors, division
by zero, numbers beyond `MAX_ABS` (literals, intermediates, results) and expressions too long or too deeply nested
raise `ToolError`, which the environment sends back as the tool's result.
"""
from __future__ import annotations

import fractions
import operator

from k3jax.envs.protocol import ToolError

MAX_CHARS = 128
MAX_DEPTH = 32            # nested parentheses and unary signs
MAX_ABS = 10 ** 15        # bound on |numerator| and denominator of every value
DIGITS = "0123456789"     # ASCII only: str.isdigit() also accepts other scripts' digits and superscripts
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def evaluate(expr: str) -> str:
  """The value of `expr` as text (`"42"`, `"-7/2"`)."""
  if len(expr) > MAX_CHARS:
    raise ToolError(f"expression longer than {MAX_CHARS} characters")
  value = _Parser(expr).parse()
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _checked(x: fractions.Fraction) -> fractions.Fraction:
  if abs(x.numerator) > MAX_ABS or x.denominator > MAX_ABS:
    raise ToolError("overflow")
  return x


class _Parser:
  def __init__(self, text: str):
    self.text, self.pos, self.depth = text, 0, 0

  def parse(self) -> fractions.Fraction:
    self._skip()
    if self.pos == len(self.text):
      raise ToolError("empty expression")
    value = self._expr()
    if self.pos != len(self.text):
      raise ToolError(f"unexpected {self.text[self.pos]!r} at position {self.pos}")
    return value

  def _skip(self):
    while self.pos < len(self.text) and self.text[self.pos] in " \t":
      self.pos += 1

  def _peek(self) -> str:
    return self.text[self.pos] if self.pos < len(self.text) else ""

  def _take(self) -> str:
    c = self.text[self.pos]
    self.pos += 1
    self._skip()
    return c

  def _expr(self):
    return self._chain(self._term, "+-")

  def _term(self):
    return self._chain(self._factor, "*/")

  def _chain(self, operand, ops: str):
    """operand (op operand)*, left to right, for the operators of one precedence level."""
    value = operand()
    while self._peek() and self._peek() in ops:
      op = self._take()
      rhs = operand()
      if op == "/" and rhs == 0:
        raise ToolError("division by zero")
      value = _checked(_APPLY[op](value, rhs))
    return value

  def _factor(self):
    c = self._peek()
    if c in ("+", "-", "("):
      self.depth += 1
      if self.depth > MAX_DEPTH:
        raise ToolError(f"nested more than {MAX_DEPTH} deep")
      self._take()
      if c == "(":
        value = self._expr()
        if self._peek() != ")":
          raise ToolError("missing ')'")
        self._take()
      else:
        value = self._factor()
        value = -value if c == "-" else value
      self.depth -= 1
      return value
    start = self.pos
    while self.pos < len(self.text) and self.text[self.pos] in DIGITS:
      self.pos += 1
    if self.pos == start:
      raise ToolError(f"unexpected {c!r} at position {start}" if c else "unexpected end of expression")
    if self.pos - start > len(str(MAX_ABS)):
      raise ToolError("overflow")
    value = fractions.Fraction(int(self.text[start:self.pos]))
    self._skip()
    return _checked(value)
