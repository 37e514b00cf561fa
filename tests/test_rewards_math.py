"""Tests for ``mimo_jax.rewards.math``: answer extraction, number normalisation, matching, reward components."""

from __future__ import annotations

import json
import os
import threading
import time
from fractions import Fraction

import pytest

from mimo_jax.rewards import math as rm
from mimo_jax.rewards.math import (
  answers_match,
  extract_answer,
  extract_answer_with_source,
  math_reward,
  normalize_number,
  sympy_available,
)

_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mimo_jax", "data", "gsm8k")

needs_sympy = pytest.mark.skipif(not sympy_available(), reason="sympy is optional and not installed")


def _rows(name: str) -> list[dict]:
  with open(os.path.join(_DATA_DIR, name), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


# ---- the shipped GSM8K samples ------------------------------------------------------------


@pytest.mark.parametrize(("name", "count"), [("train_sample.jsonl", 200), ("test_sample.jsonl", 100)])
def test_gold_answers_of_every_shipped_row(name: str, count: int) -> None:
  rows = _rows(name)
  assert len(rows) == count
  for row in rows:
    solution = row["answer"]
    found = extract_answer_with_source(solution)
    assert found is not None, solution
    answer, source = found
    assert source == "hash"
    # Independent reading of the gold: the text after the last "####", commas dropped.
    expected = Fraction(solution.rsplit("####", 1)[1].strip().replace(",", ""))
    assert normalize_number(answer) == expected, answer
    assert answers_match(answer, str(expected))
    # The gold solution is itself a correct, well-formatted completion.
    assert math_reward(solution, answer) == {"correct": 1.0, "format": 1.0}


# ---- extraction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("text", "expected", "source"),
  [
    ("Some steps.\n#### 1,234", "1,234", "hash"),
    ("#### 12\nwait, no\n#### 13", "13", "hash"),
    ("#### 5\n####   \n", "5", "hash"),
    ("so $x = \\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}", "boxed"),
    ("\\boxed{1} then \\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", "boxed"),
    ("\\boxed{\\text{\\{nested\\}}}", "\\text{\\{nested\\}}", "boxed"),
    ("\\boxed{7} and later \\boxed{8", "7", "boxed"),  # an unclosed (truncated) box is ignored
    ("The answer is 42.", "42", "phrase"),
    ("the final answer is: 3.50. I think.", "3.50", "phrase"),
    ("Answer: $5", "$5", "phrase"),
    ("Final Answer: -7 apples", "-7 apples", "phrase"),
    ("Answer: 1\nAnswer: 2", "2", "phrase"),
    ("**Final Answer**: 72", "72", "phrase"),  # Markdown bold closed before the colon
    # A phrase inside the phrase: the inner one's answer.
    ("Final Answer: The final answer is $18$. I hope it is correct.", "$18$", "phrase"),
    ("The final answer is: the answer is 18", "18", "phrase"),
    # Explicit markers beat prose, wherever the prose is.
    ("#### 9\nThe answer is 10.", "9", "hash"),
    ("The answer is \\boxed{11}.", "11", "boxed"),
    ("#### 12 or 13", "12 or 13", "hash"),
    # Of the two markers, the later one: a Markdown heading above a boxed answer is not the answer.
    ("#### Final Answer\nThe total is $\\boxed{7}$.", "7", "boxed"),
    ("\\boxed{7}\nNo, wait.\n#### 8", "8", "hash"),
  ],
)
def test_extract_answer(text: str, expected: str, source: str) -> None:
  assert extract_answer(text) == expected
  assert extract_answer_with_source(text) == (expected, source)


def test_hostile_lengths_are_read_in_one_pass_and_refused_cleanly() -> None:
  """A policy's degenerate output: thousands of unclosed boxes (their braces matched in one pass, not
  one scan per box) and a number past the 4300 digits Python converts (not a number: no error)."""
  text = "\\boxed{" * 3000 + "} \\boxed{1} \\boxed{\\frac{1}{2}} } \\boxed{"
  assert extract_answer_with_source(text) == ("\\frac{1}{2}", "boxed")
  assert normalize_number("1" * 5000) is None and normalize_number("0." + "1" * 5000) is None
  assert math_reward("#### " + "1" * 5000, "72") == {"correct": 0.0, "format": 0.0}  # no number, no format
  assert math_reward("The answer is " + "9" * 4301, "72") == {"correct": 0.0, "format": 0.0}


@pytest.mark.parametrize(
  "text", ["", "I have 3 apples and 4 pears.", "To answer this, add 2 and 2.", "\\boxed{}", "####"]
)
def test_no_answer_is_none(text: str) -> None:
  assert extract_answer(text) is None
  assert extract_answer_with_source(text) is None


def test_last_number_fallback_is_opt_in() -> None:
  text = "First 3 apples, then 1,250 more, so -2.5 or 3/4"
  assert extract_answer(text) is None
  assert extract_answer(text, fallback_last_number=True) == "3/4"
  assert extract_answer_with_source("I got 1,250.", fallback_last_number=True) == ("1,250", "last_number")
  assert extract_answer("no digits here", fallback_last_number=True) is None
  # A marker still wins over the fallback.
  assert extract_answer("#### 5 and 6 and 7", fallback_last_number=True) == "5 and 6 and 7"


# ---- normalisation ------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("text", "value"),
  [
    ("42", 42),
    ("-5", -5),
    ("+5", 5),
    ("\u22123", -3),  # Unicode minus sign
    ("1,234", 1234),
    ("1,234,567.5", Fraction(2469135, 2)),
    ("$18.00", 18),
    ("-$5", -5),
    ("$-5", -5),
    ("\\$1{,}234", 1234),
    ("12€", 12),
    ("£3.50", Fraction(7, 2)),
    ("3.50", Fraction(7, 2)),
    (".5", Fraction(1, 2)),
    ("5.", 5),
    ("42.", 42),
    ("50%", 50),
    ("50\\%", 50),
    ("7 apples", 7),
    ("12 dollars.", 12),
    ("3 hours", 3),
    ("60 km/h", 60),
    ("25 m^2", 25),
    ("5 cm²", 5),
    ("90^\\circ", 90),
    ("5\\,\\text{cm}", 5),
    ("\\text{5 apples}", 5),
    ("3/4", Fraction(3, 4)),
    ("-3/4", Fraction(-3, 4)),
    ("7/2 cups", Fraction(7, 2)),
    ("2 1/2", Fraction(5, 2)),
    ("2\\frac{1}{2}", Fraction(5, 2)),
    ("\\frac{1}{2}", Fraction(1, 2)),
    ("\\dfrac{3}{4}", Fraction(3, 4)),
    ("\\tfrac{3}{4}", Fraction(3, 4)),
    ("\\frac12", Fraction(1, 2)),
    ("\\frac{-3}{4}", Fraction(-3, 4)),
    ("-\\frac{-3}{4}", Fraction(3, 4)),
    ("\\frac{1.5}{3}", Fraction(1, 2)),
    ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
    ("$\\frac{3}{4}$", Fraction(3, 4)),
    ("\\(12\\)", 12),
    ("**42**", 42),
    ("x = 5", 5),
  ],
)
def test_normalize_number(text: str, value: Fraction | int) -> None:
  result = normalize_number(text)
  assert isinstance(result, Fraction)
  assert result == value


@pytest.mark.parametrize(
  "text",
  [
    "",
    "five",
    "12 or 13",
    "3 to 4 hours",
    "5 apples and 6 pears",
    "1, 2, 3",
    "1,2345",
    "1,23",
    "1/0",
    "\\frac{1}{0}",
    "1e5",
    "2 + 3",
    "5!",
    "(5)",
    "42, which is even",
    # A power after no unit is an operation, not a unit's square.
    "5^2",
    "10^{3}",
    "5²",
  ],
)
def test_normalize_number_refuses(text: str) -> None:
  assert normalize_number(text) is None


# ---- matching -----------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("pred", "gold"),
  [
    ("1,234", "1234"),
    ("$18.00", "18"),
    ("\\frac{3}{4}", "0.75"),
    ("\\boxed{\\frac{3}{4}}", "3/4"),
    ("0.5", "1/2"),
    ("\\frac{1}{2}", "0.5"),
    ("-5", "-5"),
    ("-5.0", "-5"),
    ("50%", "50"),
    ("7 apples", "7"),
    ("3.5", "7/2"),
    ("2 1/2", "2.5"),
    ("007", "7"),
    # Non-numeric answers: text equality up to case, whitespace and wrappers.
    ("\\text{Yes}", "yes"),
    ("  North  West ", "northwest"),
  ],
)
def test_answers_match(pred: str, gold: str) -> None:
  assert answers_match(pred, gold)
  assert answers_match(gold, pred)


@pytest.mark.parametrize(
  ("pred", "gold"),
  [
    ("12", "13"),
    ("1/3", "0.33"),  # exact: a rounded decimal is not the fraction
    ("0.333333", "\\frac{1}{3}"),
    ("50%", "0.5"),  # percentages keep the value as written
    ("12 or 13", "12"),  # a hedged answer matches neither number
    ("12 or 13", "13"),
    ("-5", "5"),
    ("", "5"),
    ("yes", "no"),
    ("1 2", "12"),  # whitespace between digits separates two numbers
    ("7 2", "72"),
    ("2 9", "18"),  # ... and is no product (implicit multiplication in the symbolic check)
    ("3 (6)", "18"),
    ("12 18", "216"),
    ("18 thousand", "18"),  # a word that scales the number is no unit
    ("2 dozen", "2"),
    ("5 squared", "5"),
    ("3 million dollars", "3"),
    ("5 degrees below zero", "5"),
  ],
)
def test_answers_do_not_match(pred: str, gold: str) -> None:
  assert not answers_match(pred, gold)


def test_none_never_matches() -> None:
  assert not answers_match(None, "5")
  assert not answers_match(extract_answer("no answer here"), "5")


def test_hedged_hash_answer_does_not_match() -> None:
  # Rule: the whole "####" line is the answer; it must read as one number, so hedging fails.
  pred = extract_answer("#### 12 or 13")
  assert pred == "12 or 13"
  assert normalize_number(pred) is None
  assert not answers_match(pred, "12")
  assert not answers_match(pred, "13")


def test_numeric_matching_does_not_need_sympy(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(rm, "_import_sympy", lambda: None)
  rm._symbolic_match_cached.cache_clear()
  assert not sympy_available()
  assert answers_match("\\dfrac{3}{4}", "0.75")
  assert answers_match("$1{,}234.00", "1234")
  assert answers_match("\\text{Yes}", "yes")
  assert not answers_match("1/3", "0.33")
  # Without sympy, non-numeric expressions simply do not match.
  assert not answers_match("2\\sqrt{2}", "\\sqrt{8}")


@needs_sympy
@pytest.mark.parametrize(
  ("pred", "gold"),
  [
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("2 \\cdot 3", "6"),
    ("x^2 - 1", "(x-1)(x+1)"),
    ("0.5x", "\\frac{x}{2}"),
    ("\\sqrt[3]{8}", "2"),
  ],
)
def test_symbolic_match(pred: str, gold: str) -> None:
  rm._symbolic_match_cached.cache_clear()
  # A generous limit: this checks what matches, not how fast (the first sympy call on a busy 2-core
  # machine has taken over the 1 s default).
  assert answers_match(pred, gold, timeout_s=60.0)
  # timeout_s <= 0 turns the symbolic check off.
  assert not answers_match(pred, gold, timeout_s=0)


@needs_sympy
@pytest.mark.parametrize(
  ("pred", "gold"),
  [
    ("\\sqrt{2}", "1.414"),
    ("\\pi", "3.14"),
    ("x + 1", "x"),
    # Outside the restricted language handed to sympy's eval-based parser.
    ("__import__('os').getcwd()", "1"),
    ("12 or 13", "12"),
    ("12 if 1 else 13", "12"),
    ("5!", "120"),
  ],
)
def test_symbolic_mismatch(pred: str, gold: str) -> None:
  assert not answers_match(pred, gold)


@needs_sympy
@pytest.mark.parametrize("pred", ["9^9^9^9", "9^{9^{9}}", "10^{999}", "((2^{9})^{9})^{9}"])
def test_power_towers_are_refused_without_computing(pred: str) -> None:
  # A big-integer power holds the GIL, so a time limit could not stop it: these must be
  # rejected before sympy sees them, hence quickly.
  # Computing any of them would hold the GIL for far longer than the ceiling below (and than the
  # 600 s limit, which a thread cannot enforce on a GIL-holding power).
  start = time.monotonic()
  assert not answers_match(pred, "1", timeout_s=600.0)
  assert time.monotonic() - start < 60.0


@pytest.fixture
def stand_in_sympy(monkeypatch: pytest.MonkeyPatch):
  """Stand-ins for sympy (so the time-limit paths are tested with or without it) and an event that
  releases comparisons left waiting: set at the end, so no thread outlives the test."""
  release = threading.Event()
  monkeypatch.setattr(rm, "_import_sympy", lambda: object())
  rm._symbolic_match_cached.cache_clear()
  yield release
  release.set()
  rm._symbolic_match_cached.cache_clear()


def test_symbolic_timeout_returns_false(monkeypatch: pytest.MonkeyPatch, stand_in_sympy) -> None:
  def slow_equal(sympy: object, a: str, b: str) -> bool:
    del sympy, a, b
    stand_in_sympy.wait(600.0)
    return True

  monkeypatch.setattr(rm, "_sympy_equal", slow_equal)
  start = time.monotonic()
  assert not answers_match("2x", "x + x", timeout_s=0.2)
  assert time.monotonic() - start < 300.0  # far short of the 600 s comparison: the limit held
  # A comparison that finishes within the limit is believed.
  monkeypatch.setattr(rm, "_sympy_equal", lambda sympy, a, b: True)
  assert answers_match("3x", "x + 2x", timeout_s=1.0)


def test_timed_out_symbolic_checks_hold_their_slots_until_they_end(
  monkeypatch: pytest.MonkeyPatch, stand_in_sympy
) -> None:
  """A timed-out check cannot be killed, so it keeps its slot: once every slot is held, a new check
  runs nothing and counts as no match, uncached, and runs again once a slot is free; at most
  ``_SYMPY_SLOTS`` threads ever compute, however many pathological answers come."""
  running = []

  def equal(sympy: object, a: str, b: str) -> bool:
    del sympy
    running.append((a, b))
    if "y" in a:  # the pathological answers
      stand_in_sympy.wait(600.0)
    return True

  monkeypatch.setattr(rm, "_sympy_equal", equal)
  for k in range(2 * rm._SYMPY_SLOTS):
    assert not answers_match(f"{k + 2}y", "y", timeout_s=0.05)
  assert len(running) == rm._SYMPY_SLOTS  # the later ones never started a thread
  assert not answers_match("3x", "x + 2x", timeout_s=0.05)  # no slot: not checked
  assert len(running) == rm._SYMPY_SLOTS
  stand_in_sympy.set()
  deadline = time.monotonic() + 60.0
  while rm._SYMPY_SLOT._value < rm._SYMPY_SLOTS and time.monotonic() < deadline:
    time.sleep(0.01)
  assert answers_match("3x", "x + 2x", timeout_s=60.0)  # checked now: the refusal was not cached


# ---- reward components --------------------------------------------------------------------


@pytest.mark.parametrize(
  ("completion", "gold", "correct", "formatted"),
  [
    ("48/2 = 24, 48 + 24 = 72\n#### 72", "72", 1.0, 1.0),
    ("So the total is \\boxed{72}.", "72", 1.0, 1.0),
    ("The answer is 72.", "72", 1.0, 0.0),  # right, but not in the requested form
    ("#### 71", "72", 0.0, 1.0),  # well formed, wrong
    ("I think it is 72", "72", 0.0, 0.0),  # no committed answer: no last-number fallback
    ("#### $1,234.00", "1234", 1.0, 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0, 1.0),
    ("#### 12 or 13", "12", 0.0, 0.0),  # the marker on a hedge, or on no number, is no format
    ("#### banana", "12", 0.0, 0.0),
    ("#### x + 2x", "12", 0.0, 1.0),  # an expression reads as one
    ("", "5", 0.0, 0.0),
    ("\\boxed{5^2}", "5", 0.0, 1.0),  # 25, not 5 with a unit's square
  ],
)
def test_math_reward(completion: str, gold: str, correct: float, formatted: float) -> None:
  assert math_reward(completion, gold) == {"correct": correct, "format": formatted}
