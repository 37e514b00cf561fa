"""A fixed problem set split into training and held-out problems, kept apart by content hash.

Shared by the file-backed tasks (GSM8K, HumanEval, JSONL): each builds its problems from
validated rows (:func:`read_jsonl_rows`), keyed by :func:`content_uid`, then
:meth:`SplitTask._set_splits` fixes the held-out split and removes every test problem from
training.

Every JSONL reader of the package (here and ``mimo_jax.tasks.tfds_sources``) decodes rows
with :func:`parse_json_object`: a UTF-8 byte-order mark at the start of a file is
accepted, and a row that is not usable is skipped and counted under one of
:data:`MALFORMED_KINDS` (bad UTF-8 bytes, bad JSON, nesting too deep to parse, a lone
UTF-16 surrogate in a string, not an object, a field missing, not a string or blank, a
task-specific check failing), never aborting the file and never dropping good rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

import numpy as np

_logger = logging.getLogger(__name__)


def content_uid(text: str) -> str:
  """Returns the SHA-1 hex digest of ``text`` normalised.

  Normalisation (Unicode NFKC, case folding, whitespace runs collapsed to one space,
  ends stripped) makes copies that differ only in formatting count as the same problem.

  Args:
    text: a question or prompt.

  Returns:
    A 40-character lowercase hex string.
  """
  text = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()
  return hashlib.sha1(text.encode("utf-8")).hexdigest()


# ---- JSONL rows ---------------------------------------------------------------------------

# Why a row was skipped; every reader counts each kind separately.
MALFORMED_KINDS = (
  "invalid_utf8",  # bytes that are not UTF-8
  "invalid_json",  # not parseable as JSON (a byte-order mark inside the file included)
  "too_deep",  # nested too deeply to parse (RecursionError)
  "lone_surrogate",  # a string holding an unpaired UTF-16 surrogate (e.g. from a "\\ud800" escape)
  "not_object",  # valid JSON, but not an object
  "missing_field",  # a required field is absent
  "not_string",  # a required field is not a string
  "empty_field",  # a required field is blank
  "failed_check",  # a task-specific check (e.g. no final answer, code that does not compile)
)

UTF8_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")


class Malformed(NamedTuple):
  """Why a row is not usable: one of :data:`MALFORMED_KINDS` and a readable reason."""

  kind: str
  reason: str


class MalformedCount(int):
  """The number of skipped rows, an ``int`` that also knows how many of each kind.

  Readers return it where they used to return a bare count, so ``rows, bad = ...`` and
  ``bad == 3`` keep working while ``bad.by_kind`` reports the breakdown.

  Attributes:
    by_kind: ``{kind: count}`` over :data:`MALFORMED_KINDS` (kinds seen only).
    first: ``(line, reason)`` of the first skipped row, or None.
  """

  by_kind: dict[str, int]
  first: tuple[int, str] | None

  def __new__(cls, by_kind: Mapping[str, int] | None = None, first: tuple[int, str] | None = None) -> MalformedCount:
    counts = {k: int(v) for k, v in (by_kind or {}).items() if v}
    self = super().__new__(cls, sum(counts.values()))
    self.by_kind = counts
    self.first = first
    return self

  def __reduce__(self):  # pickles (to reward workers) and copies keep the breakdown
    return (MalformedCount, (self.by_kind, self.first))

  def __repr__(self) -> str:
    return f"MalformedCount({int(self)}, by_kind={self.by_kind})"


def describe_kinds(by_kind: Mapping[str, int]) -> str:
  """``"invalid_json=2, not_object=1"`` in :data:`MALFORMED_KINDS` order."""
  order = {k: i for i, k in enumerate(MALFORMED_KINDS)}
  return ", ".join(f"{k}={n}" for k, n in sorted(by_kind.items(), key=lambda kv: order.get(kv[0], len(order))) if n)


def _find_surrogate(value: Any) -> bool:
  """Whether any string (key or value) anywhere in a parsed JSON value holds a lone surrogate.

  Iterative, so a value nested as deeply as the parser allowed cannot overflow the stack.
  """
  stack = [value]
  while stack:
    x = stack.pop()
    if isinstance(x, str):
      if _SURROGATE.search(x):
        return True
    elif isinstance(x, dict):
      for k, v in x.items():
        if _SURROGATE.search(k):
          return True
        stack.append(v)
    elif isinstance(x, list):
      stack.extend(x)
  return False


def parse_json_object(raw: bytes, *, first_line: bool = False) -> tuple[dict[str, Any] | None, Malformed | None]:
  """Decodes one JSONL line into an object; never raises for bad input.

  Args:
    raw: the line's bytes (a trailing newline is fine).
    first_line: the line starts the file, so a UTF-8 byte-order mark is stripped.

  Returns:
    ``(obj, None)`` for a JSON object whose strings are all encodable as UTF-8, else
    ``(None, Malformed(kind, reason))``.
  """
  if first_line and raw.startswith(UTF8_BOM):
    raw = raw[len(UTF8_BOM) :]
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return None, Malformed("invalid_utf8", f"not valid UTF-8 ({e.reason} at byte {e.start} of the line)")
  if text.startswith("\ufeff"):
    return None, Malformed("invalid_json", "invalid JSON (a byte-order mark that is not at the start of the file)")
  try:
    obj = json.loads(text)
  except RecursionError:
    return None, Malformed("too_deep", "JSON nested too deeply to parse")
  except json.JSONDecodeError as e:
    return None, Malformed("invalid_json", f"invalid JSON ({e.msg})")
  except ValueError as e:  # e.g. an integer literal longer than Python's int conversion limit
    return None, Malformed("invalid_json", f"invalid JSON ({e})")
  if not isinstance(obj, dict):
    return None, Malformed("not_object", f"not a JSON object but {type(obj).__name__}")
  if _find_surrogate(obj):
    return None, Malformed("lone_surrogate", "a string holds a lone UTF-16 surrogate (not encodable as UTF-8)")
  return obj, None


def check_string_fields(obj: Mapping[str, Any], keys: Iterable[str]) -> Malformed | None:
  """The first of ``keys`` that is missing, not a string, or blank in ``obj`` (None: all fine)."""
  for key in keys:
    if key not in obj:
      return Malformed("missing_field", f"missing field {key!r}")
    value = obj[key]
    if not isinstance(value, str):
      return Malformed("not_string", f"field {key!r} is {type(value).__name__}, not a string")
    if not value.strip():
      return Malformed("empty_field", f"field {key!r} is empty")
  return None


def read_jsonl_rows(
  path: str | os.PathLike[str],
  check_row: Callable[[dict[str, Any]], Malformed | None],
  what: str,
  open_binary: Callable[[str | os.PathLike[str]], BinaryIO] | None = None,
  logger: logging.Logger = _logger,
) -> tuple[list[dict[str, Any]], MalformedCount]:
  """Reads a JSON-lines file, decoding each line with :func:`parse_json_object` and then ``check_row``.

  Rows that cannot be used are skipped but never silently: their count per kind and the
  first one's line number and reason are logged as a warning.  One bad row never stops
  the file; blank lines are not rows and are ignored; a UTF-8 byte-order mark at the start
  of the file is accepted.

  Args:
    path: the file to read.
    check_row: ``obj -> None`` for a usable row, else the :class:`Malformed` reason.
    what: the rows' name in messages (e.g. ``"GSM8K"``).
    open_binary: opens ``path`` for reading bytes (default: ``open(path, "rb")``).
    logger: where the warning goes (the calling task's module logger).

  Returns:
    ``(rows, num_malformed)``: the usable rows in file order and a :class:`MalformedCount`
    (an int) of those skipped, with ``by_kind`` and ``first``.

  Raises:
    OSError: if the file cannot be read.
    ValueError: if the file has no usable row.
  """
  rows: list[dict[str, Any]] = []
  by_kind: dict[str, int] = {}
  first_bad: tuple[int, str] | None = None
  with open_binary(path) if open_binary else open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      row, problem = parse_json_object(raw, first_line=lineno == 1)
      if problem is None:
        assert row is not None
        problem = check_row(row)
      if problem is not None:
        by_kind[problem.kind] = by_kind.get(problem.kind, 0) + 1
        if first_bad is None:
          first_bad = (lineno, problem.reason)
      else:
        rows.append(row)
  bad = MalformedCount(by_kind, first_bad)
  if first_bad is not None:
    logger.warning(
      "%s: skipped %d malformed %s row(s); first at line %d: %s; by kind: %s",
      os.fspath(path),
      bad,
      what,
      *first_bad,
      describe_kinds(by_kind),
    )
  if not rows:
    kinds = f": {describe_kinds(by_kind)}" if by_kind else ""
    raise ValueError(f"{os.fspath(path)}: no usable {what} rows ({int(bad)} malformed){kinds}")
  return rows, bad


class SplitTask:
  """Training / held-out bookkeeping and uniform sampling for a fixed set of problems.

  Problems need a ``uid`` (a content hash of the prompt or question).

  Attributes:
    runs_untrusted_code: whether verifying a completion executes it (class attribute; a
      task that does sets it True, and building it then checks the sandbox's isolation,
      see :mod:`mimo_jax.rewards.sandbox_policy`).
    num_overlap_removed: distinct training problems dropped because the test set has them.
  """

  runs_untrusted_code: bool = False
  _train: list[Any]
  _heldout: list[Any]
  _heldout_uids: frozenset[str]
  num_overlap_removed: int

  def _set_splits(
    self,
    test_problems: Sequence[Any],
    train_problems: Sequence[Any],
    *,
    heldout_size: int | None,
    train_path: str,
    test_path: str,
    noun: str = "problem",
  ) -> None:
    """Fixes the held-out split (the first ``heldout_size`` test problems) and the training problems.

    Training problems are checked against *all* test problems, so shrinking the
    evaluation set never leaks test problems into training.

    Raises:
      ValueError: a negative or too large ``heldout_size``, or no training problem left.
    """
    if heldout_size is not None:
      heldout_size = operator.index(heldout_size)
      if not 0 <= heldout_size <= len(test_problems):
        raise ValueError(
          f"heldout_size must be in [0, {len(test_problems)}] (the distinct {noun}s in {test_path}), got {heldout_size}"
        )
      self._heldout = list(test_problems[:heldout_size])
    else:
      self._heldout = list(test_problems)
    self._heldout_uids = frozenset(p.uid for p in self._heldout)
    all_test_uids = frozenset(p.uid for p in test_problems)
    self._train = [p for p in train_problems if p.uid not in all_test_uids]
    self.num_overlap_removed = len(train_problems) - len(self._train)
    if not self._train:
      raise ValueError(f"{train_path}: no training {noun} left after removing those in {test_path}")

  @property
  def num_train(self) -> int:
    """Number of distinct training problems (after removing repeats and held-out ones)."""
    return len(self._train)

  def data_counts(self) -> dict[str, Any]:
    """What reading the task's files kept and dropped (``summary.json``'s ``data``): its training and
    held-out problems, the training problems removed as held out (``overlap_removed``) and, where the task
    counts them, as repeats (``duplicates_removed``), and each file's malformed rows by kind."""
    counts: dict[str, Any] = {
      "train_problems": self.num_train,
      "heldout_problems": len(self._heldout),
      "overlap_removed": int(self.num_overlap_removed),
    }
    if hasattr(self, "num_duplicates_removed"):
      counts["duplicates_removed"] = int(self.num_duplicates_removed)
    for split in ("train", "test"):
      bad = getattr(self, f"num_malformed_{split}", None)
      if bad is not None:
        counts[f"malformed_{split}"] = int(bad)
        by_kind = getattr(bad, "by_kind", None)
        if by_kind:
          counts[f"malformed_{split}_by_kind"] = dict(by_kind)
    return counts

  def train_problems(self) -> list[Any]:
    """Returns all training problems, in file order (a new list)."""
    return list(self._train)

  def heldout(self) -> list[Any]:
    """Returns the held-out problems, in file order (a new list)."""
    return list(self._heldout)

  def is_heldout(self, problem: Any) -> bool:
    """Whether ``problem`` is in the held-out set (compared by uid)."""
    return problem.uid in self._heldout_uids

  def sample(self, rng: np.random.Generator, n: int) -> list[Any]:
    """Draws ``n`` training problems uniformly with replacement.

    Args:
      rng: the numpy generator to draw from (advanced in place), so the caller can
        replay a stream by restoring its state.
      n: number of problems.

    Raises:
      ValueError: if ``n`` is negative.
    """
    n = operator.index(n)
    if n < 0:
      raise ValueError(f"n must be non-negative, got {n}")
    return [self._train[i] for i in rng.integers(len(self._train), size=n).tolist()]
