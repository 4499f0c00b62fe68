"""The tool protocol's parser on good, malformed and adversarial turns; the calculator against exact arithmetic
done independently (Python's Fraction over the same expression), and its refusals."""
import fractions
import re

import numpy as np
import pytest

from k3jax.data import tokenizer as tok
from k3jax.envs import calculator, protocol
from k3jax.envs.protocol import Call, Malformed


@pytest.mark.parametrize("text,want", [
    ("<search>abc</search>", Call("search", "abc")),
    ("let me look <search> abc </search>", Call("search", "abc")),
    ("<calc>12+3*4</calc>", Call("calc", "12+3*4")),
    ("<answer>mfe</answer>", Call("answer", "mfe")),
    ("<answer></answer>", Call("answer", "")),
    ("<search>ключ</search>", Call("search", "ключ")),
    ("\ufffd\ufffd<answer>é 1</answer>", Call("answer", "é 1")),
    # The first complete call wins: text and broken tags before it are ignored.
    ("<search>a<search>b</search>", Call("search", "b")),
    ("<search><calc>1+1</calc>", Call("calc", "1+1")),
    ("<calc>1</calc><answer>2</answer>", Call("calc", "1")),
])
def test_parse_turn_takes_the_first_complete_call(text, want):
  assert protocol.parse_turn(text) == want


@pytest.mark.parametrize("text,message", [
    ("<search>abc", "unterminated <search>"),
    ("<search>abc</calc>", "unterminated <search>"),
    ("<search>a<b</search>", "tags inside <search>"),
    ("<answer>x<answer>", "unterminated <answer>"),
    ("no call at all", "no call"),
    ("", "no call"),
    ("<SEARCH>abc</SEARCH>", "no call"),
    ("<eos><pad>", "no call"),
    ("<foo>x</foo>", "unknown tool 'foo'"),
    ("<" + "z" * 40 + ">x</" + "z" * 40 + ">", "unknown tool '" + "z" * 16 + "...'"),
    ("<foo>x</foo><search>abc</search>", "unknown tool 'foo'"),
    ("<search>" + "a" * (protocol.MAX_ARG_CHARS + 1) + "</search>", "longer than"),
])
def test_parse_turn_names_what_is_wrong_with_a_malformed_turn(text, message):
  got = protocol.parse_turn(text)
  assert isinstance(got, Malformed) and message in got.message, got


def test_parse_turn_survives_invalid_utf8_and_special_tokens():
  ids = np.concatenate([[0xFF, 0xC3, tok.EOS], tok.encode("<calc>2*3</calc>")])
  assert protocol.parse_turn(tok.decode(ids)) == Call("calc", "2*3")


def test_results_cannot_read_as_calls():
  text = protocol.result("<answer>x</answer>")
  assert text.startswith("<result>") and text.endswith("</result>")
  assert isinstance(protocol.parse_turn(text), Malformed)
  assert protocol.STOP_STRINGS == ("</search>", "</calc>", "</answer>")
  for stop in protocol.STOP_STRINGS:
    assert stop not in text


def _random_expression(rng, depth=0):
  if depth > 3 or rng.random() < 0.3:
    n = str(int(rng.integers(0, 1000)))
    return ("-" + n) if rng.random() < 0.1 else n
  if rng.random() < 0.2:
    return "(" + _random_expression(rng, depth + 1) + ")"
  op = str(rng.choice(["+", "-", "*", "/"]))
  return _random_expression(rng, depth + 1) + (" " if rng.random() < 0.3 else "") + op + _random_expression(
      rng, depth + 1)


def _exact(expr):
  """The value by Python's own parser on Fractions (test-only: the tool must not use eval)."""
  return eval(re.sub(r"\d+", lambda m: f"F({m.group()})", expr), {"F": fractions.Fraction})  # noqa: S307


def test_calculator_matches_exact_arithmetic_on_random_expressions():
  rng = np.random.default_rng(0)
  checked = 0
  for _ in range(300):
    expr = _random_expression(rng)
    try:
      want = _exact(expr)
    except ZeroDivisionError:
      with pytest.raises(protocol.ToolError, match="division by zero"):
        calculator.evaluate(expr)
      continue
    if abs(want.numerator) > calculator.MAX_ABS or want.denominator > calculator.MAX_ABS:
      continue
    got = calculator.evaluate(expr)
    assert fractions.Fraction(got) == want, expr
    assert got == (str(want.numerator) if want.denominator == 1 else f"{want.numerator}/{want.denominator}")
    checked += 1
  assert checked > 200


@pytest.mark.parametrize("expr,want", [("1+2*3", "7"), ("(1+2)*3", "9"), ("-3--2", "-1"), ("7/2", "7/2"),
                                       ("6/3", "2"), (" 2 * ( 3 + 4 ) ", "14"), ("-(4)/-(8)", "1/2"),
                                       ("0012", "12"), ("+5", "5")])
def test_calculator_examples(expr, want):
  assert calculator.evaluate(expr) == want


@pytest.mark.parametrize("expr,message", [
    ("1/0", "division by zero"), ("5/(2-2)", "division by zero"),
    ("9" * 17, "overflow"), ("99999999*99999999*99999999", "overflow"), ("1/" + "3" * 16, "overflow"),
    ("10**3", "unexpected '\\*'"), ("1e5", "unexpected 'e'"), ("", "empty"), ("  ", "empty"),
    ("(((1", "missing '\\)'"), ("(" * 40 + "1" + ")" * 40, "nested more than"), ("-" * 40 + "1", "nested more than"),
    ("\u0663+1", "unexpected"), ("2\u00b2", "unexpected"), ("1+", "unexpected end"), ("1 2", "unexpected '2'"),
    ("__import__('os')", "unexpected '_'"), ("1" + "+1" * 100, "longer than"), ("1.5", "unexpected '.'"),
])
def test_calculator_refuses_bad_expressions_with_a_tool_error(expr, message):
  with pytest.raises(protocol.ToolError, match=message):
    calculator.evaluate(expr)
