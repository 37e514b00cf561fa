"""Rule-based verification of final answers to math problems (GSM8K-style word problems).

Three steps turn a free-form completion into a reward:

1. :func:`extract_answer` finds the final answer the completion commits to.  It looks,
   in this order of precedence, for the last GSM8K marker ``#### x``, the last
   ``\\boxed{x}`` and the last "the answer is x" / "Answer: x" phrase.  Explicit markers
   win over prose even when the prose comes later, so a model cannot hedge with a second
   answer in words.  There is no "last number in the text" fallback unless asked for:
   rewarding any trailing number would pay a model for answers it never committed to.
2. :func:`normalize_number` reads the extracted string as an exact
   :class:`fractions.Fraction`, forgiving presentation (``1,234``, ``$18.00``, ``50%``,
   ``7 apples``, ``\\frac{3}{4}``) but not ambiguity (``12 or 13``, ``1,2,3``).
3. :func:`answers_match` compares a prediction with the gold answer: exactly, as
   fractions, when both are numbers (``0.5 == 1/2`` but ``0.33 != 1/3``); otherwise by
   normalised text; otherwise, if ``sympy`` happens to be importable, symbolically under
   a time limit.  ``sympy`` is optional: numeric, fraction and LaTeX-fraction matching
   never need it.

:func:`math_reward` bundles these into reward components for an RL trainer.
"""

from __future__ import annotations

import fractions
import functools
import logging
import re
import threading
from types import ModuleType
from typing import Any, Literal

__all__ = [
  "AnswerSource",
  "answers_match",
  "extract_answer",
  "extract_answer_with_source",
  "math_reward",
  "normalize_number",
  "sympy_available",
]

# Where an extracted answer came from: "hash" is GSM8K's "#### x", "boxed" is "\boxed{x}",
# "phrase" is "the answer is x" / "Answer: x", "last_number" is the opt-in fallback.
AnswerSource = Literal["hash", "boxed", "phrase", "last_number"]

# Sources that count as answering in the requested format for the "format" reward component.
_FORMATTED_SOURCES = frozenset({"hash", "boxed"})

# ---- extraction ------------------------------------------------------------------------

# "####" up to the end of its line: GSM8K puts the final answer alone on the last line.
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "The (final) answer is: x" or "(Final) Answer: x".  A bare "answer" without "is" or ":"
# is ordinary prose ("to answer this we ...") and must not trigger.
# Markdown bold may close between "answer" and the colon ("**Final Answer**: 72").
_PHRASE_RE = re.compile(r"\b(?:final\s+)?answer\s*\**\s*(?:is\b\s*:?|:)[ \t]*([^\n]*)", re.IGNORECASE)
# A phrase answer ends at the end of its sentence; a decimal point is never followed by a space.
_SENTENCE_END_RE = re.compile(r"[.!?;](?=\s|$)")
# Numbers for the opt-in fallback: optional sign, digits with optional thousands commas,
# decimals and a simple fraction.
_LAST_NUMBER_RE = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\.\d+")


def _balanced_brace_content(text: str, start: int) -> str | None:
  """Returns the text from ``start`` up to the ``}`` that closes an already-open ``{``.

  Args:
    text: the whole text.
    start: index just after the opening brace.

  Returns:
    The content between the braces, or None if the brace is never closed (a truncated
    completion).
  """
  depth = 1
  for i in range(start, len(text)):
    c = text[i]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[start:i]
  return None


def _last_hash_answer(text: str) -> tuple[int, str] | None:
  """The last non-empty ``#### x`` and where it starts."""
  answers = [(m.start(), m.group(1).strip()) for m in _HASH_RE.finditer(text)]
  answers = [a for a in answers if a[1]]
  return answers[-1] if answers else None


def _closing_braces(text: str) -> dict[int, int]:
  """``{index of a "{": index of the "}" that closes it}`` for every closed brace, in one pass (a
  scan from each opening brace would take time quadratic in a text of many unclosed ones)."""
  closes, open_at = {}, []
  for i, c in enumerate(text):
    if c == "{":
      open_at.append(i)
    elif c == "}" and open_at:
      closes[open_at.pop()] = i
  return closes


def _last_boxed_answer(text: str) -> tuple[int, str] | None:
  """The last complete, non-empty ``\\boxed{x}`` and where it starts."""
  starts = list(_BOXED_RE.finditer(text))
  if not starts:
    return None
  closes = _closing_braces(text)
  for m in reversed(starts):
    end = closes.get(m.end() - 1)
    if end is not None and text[m.end() : end].strip():
      return m.start(), text[m.end() : end].strip()
  return None


def _last_phrase_answer(text: str) -> str | None:
  answers = []
  for m in _PHRASE_RE.finditer(text):
    candidate = m.group(1)
    # "Final Answer: The final answer is $18$." holds a phrase inside the phrase: the innermost one's.
    while (inner := _PHRASE_RE.search(candidate)) is not None:
      candidate = inner.group(1)
    end = _SENTENCE_END_RE.search(candidate)
    if end is not None:
      candidate = candidate[: end.start()]
    candidate = candidate.strip()
    if candidate:
      answers.append(candidate)
  return answers[-1] if answers else None


def extract_answer_with_source(text: str, *, fallback_last_number: bool = False) -> tuple[str, AnswerSource] | None:
  """Finds the final answer in ``text`` and says which form it was written in.

  Precedence: of the last non-empty ``#### x`` (rest of that line) and the last complete
  ``\\boxed{x}`` (braces balanced, nesting allowed; an unclosed one is ignored), the one written
  later; else the last "the answer is x" / "Answer: x" phrase (cut at the end of its sentence), else,
  only when ``fallback_last_number`` is set, the last number anywhere in the text.

  The answer is returned as written, only stripped of surrounding whitespace (and, for
  phrases, of the sentence's closing punctuation); interpreting it is the job of
  :func:`normalize_number` / :func:`answers_match`.

  Args:
    text: a model completion or a GSM8K gold solution.
    fallback_last_number: if no marker or phrase is found, use the last number in the text.

  Returns:
    ``(answer, source)`` or None when no answer is found.
  """
  # Of the two markers, the one written last: a Markdown "#### Final Answer" heading above a
  # "\\boxed{7}" is not the answer.
  hashed, boxed = _last_hash_answer(text), _last_boxed_answer(text)
  if hashed is not None and (boxed is None or hashed[0] > boxed[0]):
    return hashed[1], "hash"
  if boxed is not None:
    return boxed[1], "boxed"
  answer = _last_phrase_answer(text)
  if answer is not None:
    return answer, "phrase"
  if fallback_last_number:
    numbers = _LAST_NUMBER_RE.findall(text)
    if numbers:
      return numbers[-1], "last_number"
  return None


def extract_answer(text: str, fallback_last_number: bool = False) -> str | None:
  """Returns the final answer in ``text`` as written (e.g. ``"1,234"``, ``"$5"``, ``"\\frac{1}{2}"``).

  See :func:`extract_answer_with_source` for the precedence of the accepted forms.  A
  marker is taken as a whole: ``"#### 12 or 13"`` extracts ``"12 or 13"``, which
  :func:`normalize_number` then refuses, so a hedged answer never matches either number.

  Args:
    text: a model completion or a GSM8K gold solution.
    fallback_last_number: if no marker or phrase is found, use the last number in the text.

  Returns:
    The stripped answer string, or None if none is found.
  """
  found = extract_answer_with_source(text, fallback_last_number=fallback_last_number)
  return None if found is None else found[0]


# ---- normalisation ---------------------------------------------------------------------

# LaTeX text-like wrappers whose content is kept: "\text{ apples}" -> " apples".
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# LaTeX spacing commands, including "\ " (a backslash followed by a space).
_LATEX_SPACE_RE = re.compile(r"\\[,!;: ]|\\quad|\\qquad")
_CURRENCY_RE = re.compile(r"[$€£¥]")
# "x = 5" as a final answer means 5.
_VARIABLE_PREFIX_RE = re.compile(r"^[A-Za-z]\s*=\s*")

_INT = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
# Digits with optional well-formed thousands groups and an optional decimal part.  Ill-formed
# groups ("1,2345", "1,23") are not numbers: they could be lists or European decimals.
_DEC = rf"(?:{_INT}(?:\.\d*)?|\.\d+)"
_SIGN = r"(?P<sign>[-+])?\s*"
_LATEX_FRAC = (
  rf"\\frac\s*(?:\{{\s*(?P<fsn>[-+]?)\s*(?P<fn>{_DEC})\s*\}}\s*\{{\s*(?P<fsd>[-+]?)\s*(?P<fd>{_DEC})\s*\}}"
  r"|(?P<fn1>\d)\s*(?P<fd1>\d))"  # "\frac12"
)
_REST = r"(?P<rest>.*)"
# Tried in order; the first full match wins.  Mixed numbers come before plain numbers so
# that "2 1/2" is read as 5/2 rather than as 2 followed by junk.
_NUMBER_FORMS = (
  ("latex_mixed", re.compile(rf"{_SIGN}(?P<whole>{_INT})\s*{_LATEX_FRAC}{_REST}", re.DOTALL)),
  ("mixed", re.compile(rf"{_SIGN}(?P<whole>{_INT})\s+(?P<n>{_INT})\s*/\s*(?P<d>{_INT}){_REST}", re.DOTALL)),
  ("latex_frac", re.compile(rf"{_SIGN}{_LATEX_FRAC}{_REST}", re.DOTALL)),
  ("fraction", re.compile(rf"{_SIGN}(?P<n>{_DEC})\s*/\s*(?P<d>{_DEC}){_REST}", re.DOTALL)),
  ("decimal", re.compile(rf"{_SIGN}(?P<n>{_DEC}){_REST}", re.DOTALL)),
)
# Squares and cubes in units ("m^2", "cm²") are part of the unit, not a second number; a power
# after no letter ("5^2") is an operation, not a unit.
_UNIT_POWER_RE = re.compile(r"(?<=[^\W\d_])\s*(?:\^\s*\{?\s*[23]\s*\}?|[²³])")
_UNIT_PUNCTUATION = frozenset("°.'/-()")
# Words that turn "5 <words>" into something other than a quantity of 5 units.
_CONNECTIVES = frozenset(
  {"or", "and", "to", "plus", "minus", "times", "divided", "over", "between", "not", "below", "less", "more", "than"}
)
# Words that scale the number before them ("18 thousand" is not 18 of a unit called thousand).
_MULTIPLIERS = frozenset(
  {"hundred", "thousand", "million", "billion", "trillion", "dozen", "squared", "cubed", "half", "k", "bn"}
)


def _clean(s: str) -> str:
  """Strips presentation that never changes the value: LaTeX wrappers, spacing, currency, delimiters."""
  s = s.replace("\u2212", "-").strip()
  # Loop because wrappers nest ("\boxed{\text{5}}"); each pass peels one layer.
  for _ in range(8):
    before = s
    if s.startswith(("\\boxed", "\\fbox")):
      m = _BOXED_RE.match(s)
      if m is not None:
        content = _balanced_brace_content(s, m.end())
        if content is not None and not s[m.end() + len(content) + 1 :].strip():
          s = content.strip()
    s = _TEXT_WRAPPER_RE.sub(r"\1", s)
    s = s.strip().strip("*").strip()
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
      if s.startswith(left) and s.endswith(right):
        s = s[len(left) : -len(right)].strip()
    if s == before:
      break
  s = s.replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = s.replace("\\left", "").replace("\\right", "")
  s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "°", s)
  s = _LATEX_SPACE_RE.sub("", s)
  # "$" is either currency or a math delimiter; neither carries value.
  s = _CURRENCY_RE.sub("", s)
  return s.strip()


def _is_unit_suffix(rest: str) -> bool:
  """Whether ``rest`` (text after a number) is only a unit such as ``"apples"`` or ``"km/h"``."""
  rest = _UNIT_POWER_RE.sub("", rest).strip()
  if not rest:
    return True
  if not (rest[0].isalpha() or rest[0] == "°"):
    return False
  if any(not (c.isalpha() or c.isspace() or c in _UNIT_PUNCTUATION) for c in rest):
    return False
  words = {w.removesuffix("s") for w in re.findall(r"[^\W\d_]+", rest.casefold())}
  return not words & (_CONNECTIVES | _MULTIPLIERS)


def _to_fraction(s: str) -> fractions.Fraction:
  return fractions.Fraction(s.replace(",", ""))


def normalize_number(s: str) -> fractions.Fraction | None:
  """Reads an answer string as an exact number.

  Accepted: integers and decimals with optional sign and well-formed thousands commas
  (``"-1,234.50"``); simple fractions ``"3/4"``; mixed numbers ``"2 1/2"`` and
  ``"2\\frac{1}{2}"``; LaTeX ``\\frac``/``\\dfrac``/``\\tfrac`` (also ``\\frac12``);
  ``\\boxed{}``, ``\\text{}`` and ``$...$`` wrappers; currency symbols ``$ € £ ¥``
  (also ``\\$``); LaTeX spacing and ``{,}`` separators; a percent sign, kept as written
  (``"50%"`` is 50, not 1/2); a trailing unit made only of words (``"7 apples"``,
  ``"12 dollars"``, ``"3 km/h"``, ``"5 m^2"``); a trailing period; a leading ``"x ="``.

  Refused (None): anything with a second number or a connective after the first
  (``"12 or 13"``, ``"3 to 4 hours"``), ill-formed digit groups (``"1,2345"``), zero
  denominators, scientific notation, a bare power (``"5^2"``; a power is a unit's, ``"m^2"``), numbers
  longer than Python converts (4300 digits), and non-numeric text.

  Args:
    s: an answer string, typically from :func:`extract_answer`.

  Returns:
    The exact value, or None if ``s`` is not a single number.
  """
  s = _VARIABLE_PREFIX_RE.sub("", _clean(s))
  for form, pattern in _NUMBER_FORMS:
    m = pattern.fullmatch(s)
    if m is None:
      continue
    rest = m.group("rest").strip()
    if rest.startswith("%"):
      rest = rest[1:].strip()
    if rest.endswith("."):
      rest = rest[:-1]
    if not _is_unit_suffix(rest):
      # A later form can only match a shorter prefix, leaving even more text behind.
      return None
    try:
      if form in ("latex_mixed", "latex_frac"):
        if m.group("fn") is not None:
          value = _to_fraction(m.group("fn")) / _to_fraction(m.group("fd"))
          if (m.group("fsn") == "-") != (m.group("fsd") == "-"):
            value = -value
        else:
          value = fractions.Fraction(int(m.group("fn1")), int(m.group("fd1")))
        if form == "latex_mixed":
          value += _to_fraction(m.group("whole"))
      elif form == "mixed":
        value = _to_fraction(m.group("whole")) + fractions.Fraction(
          int(m.group("n").replace(",", "")), int(m.group("d").replace(",", ""))
        )
      elif form == "fraction":
        value = _to_fraction(m.group("n")) / _to_fraction(m.group("d"))
      else:
        value = _to_fraction(m.group("n"))
    except (ZeroDivisionError, ValueError):  # ValueError: past Python's limit on digits (4300)
      return None
    return -value if m.group("sign") == "-" else value
  return None


def _normalize_text(s: str) -> str:
  """Case-, whitespace- and wrapper-insensitive form of a non-numeric answer; whitespace between two
  digits is kept (as one space): ``"1 2"`` is two numbers, not ``"12"``."""
  s = _clean(s).rstrip(".")
  s = re.sub(r"(?<=\d)\s+(?=\d)", " ", s)
  return re.sub(r"(?<!\d)\s+|\s+(?!\d)", "", s).casefold()


# ---- symbolic equivalence (optional sympy) ---------------------------------------------

_MAX_SYMPY_CHARS = 200
_MAX_SYMPY_DIGITS = 30
# At most two powers, each with an exponent of at most two digits and never a tower: the
# largest reachable integer, ((10**30)**99)**99, has about 300k digits and is computed in
# milliseconds.  This bound matters more than the time limit: a single big-integer
# operation such as 9**9**9 holds the GIL, so no timeout (or signal) can interrupt it and
# it would stall the whole trainer.
_MAX_SYMPY_POWERS = 2
_SAFE_POWER_RE = re.compile(
  r"\*\*\s*(?:"
  r"\(\s*[-+]?\s*(?:\d{1,2}|[A-Za-z])\s*(?:/\s*\(?\s*\d{1,2}\s*\)?)?\s*\)"  # "**(2)", "**(1/(3))"
  r"|[-+]?\s*(?:\d{1,2}|[A-Za-z])(?![\d.])"  # "**2", "**n"
  r")(?!\s*\*\*)"  # no tower
)
_SYMPY_CHARS_RE = re.compile(r"[0-9A-Za-z+\-*/()\s]*")
_SYMPY_FUNCTIONS = frozenset({"sqrt", "pi"})


@functools.cache
def _import_sympy() -> ModuleType | None:
  # Imported lazily: sympy takes about a second to import and most answers never need it.
  try:
    import sympy
  except ImportError:
    return None
  return sympy


def sympy_available() -> bool:
  """Whether the optional symbolic check of :func:`answers_match` can run (sympy is importable)."""
  return _import_sympy() is not None


def _replace_command(s: str, command: str, nargs: int, template: str) -> str | None:
  """Rewrites ``\\command{a}{b}`` (braced arguments, nesting allowed) with ``template.format(a, b)``.

  Returns None on an argument that is not braced or never closed.
  """
  marker = "\\" + command
  for _ in range(64):
    i = s.find(marker)
    if i < 0:
      return s
    j = i + len(marker)
    args = []
    for _ in range(nargs):
      while j < len(s) and s[j].isspace():
        j += 1
      if j >= len(s) or s[j] != "{":
        return None
      content = _balanced_brace_content(s, j + 1)
      if content is None:
        return None
      args.append(content)
      j += len(content) + 2
    s = s[:i] + template.format(*args) + s[j:]
  return None


def _to_sympy_source(s: str) -> str | None:
  """Translates a (LaTeX) answer into a restricted Python expression, or None if it falls outside it.

  The restriction is what makes handing the text to sympy's parser (which uses ``eval``)
  acceptable for untrusted model output: only digits, ``+ - * / ( )``, single-letter
  variables, ``sqrt`` and ``pi`` survive, with bounded number sizes and exponents.
  """
  s = _clean(s).rstrip(".").strip()
  if not s or len(s) > _MAX_SYMPY_CHARS:
    return None
  # Numbers or brackets apart by whitespace ("2 9", "3 (6)") are two things, not a product that implicit
  # multiplication would make of them (18).
  if re.search(r"[\d)]\s+[\d.(]", s):
    return None
  s = _replace_command(s, "frac", 2, "(({0})/({1}))")
  if s is None:
    return None
  s = re.sub(r"\\sqrt\s*\[\s*(\d{1,2})\s*\]\s*\{", r"\\root{\1}{", s)
  s = _replace_command(s, "root", 2, "(({1})**(1/({0})))")
  if s is None:
    return None
  s = _replace_command(s, "sqrt", 1, "sqrt({0})")
  if s is None:
    return None
  s = re.sub(r"\\(?:cdot|times)", "*", s)
  s = s.replace("\\div", "/").replace("\\pi", " pi ").replace("^", "**").replace("{", "(").replace("}", ")")
  # Decimals become exact ratios, so "0.33" is never "close enough" to 1/3.
  s = re.sub(r"(?<![\d.])(\d+)\.(\d+)(?![\d.])", lambda m: f"({int(m[1] + m[2])}/{10 ** len(m[2])})", s)
  # Python rejects integer literals with leading zeros ("007").
  s = re.sub(r"(?<![\w.])0+(?=\d)", "", s)
  # An explicit product keeps Python's tokenizer from reading "1e5", "0x1F" or "2j" as literals.
  s = re.sub(r"(\d)\s*(?=[A-Za-z])", r"\1*", s)
  if not _SYMPY_CHARS_RE.fullmatch(s):
    return None
  if any(len(w) > 1 and w not in _SYMPY_FUNCTIONS for w in re.findall(r"[A-Za-z]+", s)):
    return None
  if any(len(d) > _MAX_SYMPY_DIGITS for d in re.findall(r"\d+", s)):
    return None
  powers = s.count("**")
  if powers > _MAX_SYMPY_POWERS or len(_SAFE_POWER_RE.findall(s)) != powers:
    return None
  return s


def _parse_sympy(sympy: Any, source: str) -> Any:
  from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

  names = {w for w in re.findall(r"[A-Za-z]+", source) if len(w) == 1}
  # Single letters are plain symbols: sympy's namespace would otherwise turn "E", "I",
  # "S", "N" or "Q" into constants and functions.
  local_dict = {name: sympy.Symbol(name) for name in names}
  global_dict = {
    "__builtins__": {},
    "Integer": sympy.Integer,
    "Float": sympy.Float,
    "Rational": sympy.Rational,
    "Symbol": sympy.Symbol,
    "sqrt": sympy.sqrt,
    "pi": sympy.pi,
  }
  return parse_expr(
    source,
    local_dict=local_dict,
    global_dict=global_dict,
    transformations=(*standard_transformations, implicit_multiplication),
  )


def _sympy_equal(sympy: Any, a: str, b: str) -> bool:
  """Unbounded symbolic comparison of two restricted sources (run under a time limit)."""
  diff = sympy.simplify(_parse_sympy(sympy, a) - _parse_sympy(sympy, b))
  return bool(diff == 0)


# At most this many symbolic checks run at once.  A check that timed out keeps running (a thread
# cannot be killed) and holds its slot until it ends, so a stream of pathological answers leaves at
# most this many threads computing beside the trainer, not one per answer.
_SYMPY_SLOTS = 2
_SYMPY_SLOT = threading.BoundedSemaphore(_SYMPY_SLOTS)


class _SlotBusy(Exception):
  """Every slot is held by an earlier symbolic check that timed out."""


def _call_with_timeout(fn: Any, timeout_s: float) -> Any:
  """Runs ``fn()`` in a daemon thread; returns its result, or None on timeout or error.

  A thread rather than SIGALRM because signals only work on the main thread and would
  clash with handlers the trainer installs.  A thread cannot be killed, so a timed-out
  check keeps running in the background, holding a slot of :data:`_SYMPY_SLOT`: while all are
  held, the next check waits up to ``timeout_s`` for one and then raises :class:`_SlotBusy` (the
  input restrictions of :func:`_to_sympy_source` bound each number's size, not how long sympy may
  take).
  """
  if not _SYMPY_SLOT.acquire(timeout=timeout_s):
    raise _SlotBusy
  result: dict[str, Any] = {}

  def target() -> None:
    try:
      result["value"] = fn()
    except Exception:  # any parser or simplifier failure means "not shown equal"
      result["value"] = None
    finally:
      _SYMPY_SLOT.release()

  thread = threading.Thread(target=target, name="mimo-jax-sympy-check", daemon=True)
  thread.start()
  thread.join(timeout_s)
  return result.get("value")


@functools.lru_cache(maxsize=4096)
def _symbolic_match_cached(pred: str, gold: str, timeout_s: float) -> bool:
  # Cached, timeouts included: an RL group often repeats the same odd answer, and a
  # pathological one should cost one time limit, not one per sample.
  sympy = _import_sympy()
  if sympy is None:
    return False
  a, b = _to_sympy_source(pred), _to_sympy_source(gold)
  if a is None or b is None:
    return False
  return _call_with_timeout(lambda: _sympy_equal(sympy, a, b), timeout_s) is True


_busy_warned = False


def _symbolic_match(pred: str, gold: str, timeout_s: float) -> bool:
  """:func:`_symbolic_match_cached`, or False (not cached: it may be checked later) while every
  slot is held by a check that timed out."""
  global _busy_warned
  try:
    return _symbolic_match_cached(pred, gold, timeout_s)
  except _SlotBusy:
    if not _busy_warned:
      _busy_warned = True
      logging.warning(
        "%d symbolic answer checks that timed out are still running; answers that only sympy could "
        "match count as no match until one ends",
        _SYMPY_SLOTS,
      )
    return False


def answers_match(pred: str | None, gold: str, *, timeout_s: float = 1.0) -> bool:
  """Whether a predicted final answer equals the gold one.

  1. If both read as numbers (:func:`normalize_number`), they match iff the exact
     fractions are equal: ``"0.5" == "1/2" == "\\frac{1}{2}"``, but ``"1/3" != "0.33"``.
     No further check is made, so two different numbers never match.
  2. Otherwise they match if their normalised texts are equal (case, whitespace,
     ``$`` and ``\\text{}`` wrappers ignored).
  3. Otherwise, if sympy is importable and ``timeout_s > 0``, they match if sympy
     simplifies their difference to zero within ``timeout_s`` seconds (e.g.
     ``"2\\sqrt{2}"`` and ``"\\sqrt{8}"``).  Only a restricted expression language is
     passed to sympy; anything else, a timeout or a parse error counts as no match.

  Args:
    pred: the predicted answer, e.g. from :func:`extract_answer`; None never matches.
    gold: the gold answer.
    timeout_s: time limit of the symbolic check; ``<= 0`` disables it.

  Returns:
    True if the answers are judged equivalent.
  """
  if pred is None:
    return False
  a, b = normalize_number(pred), normalize_number(gold)
  if a is not None and b is not None:
    return a == b
  text = _normalize_text(pred)
  if text and text == _normalize_text(gold):
    return True
  if timeout_s <= 0:
    return False
  return _symbolic_match(pred, gold, float(timeout_s))


def math_reward(completion: str, gold_answer: str, *, timeout_s: float = 1.0) -> dict[str, float]:
  """Reward components for a completion of a math problem.

  Args:
    completion: the decoded completion.
    gold_answer: the gold final answer (e.g. ``"72"``), not the full solution.
    timeout_s: time limit of the optional symbolic check (see :func:`answers_match`).

  Returns:
    ``{"correct": 1.0 or 0.0, "format": 1.0 or 0.0}``: ``correct`` is whether the
    extracted answer (any accepted form, no last-number fallback) matches; ``format`` is
    whether the answer was given with ``####`` or ``\\boxed{}`` rather than only in prose, and reads as
    one number or expression (``#### banana`` and ``#### 12 or 13`` are no answers: a format reward
    that paid for the marker alone would pay a policy for writing it before anything).
  """
  found = extract_answer_with_source(completion)
  pred = None if found is None else found[0]
  correct = answers_match(pred, gold_answer, timeout_s=timeout_s)
  formatted = (
    found is not None
    and found[1] in _FORMATTED_SOURCES
    and (correct or normalize_number(pred) is not None or _to_sympy_source(pred) is not None)
  )
  return {"correct": float(correct), "format": float(formatted)}
