"""A fixed problem set split into training and held-out problems, kept apart by content hash.

Shared by the file-backed tasks (GSM8K, HumanEval, JSONL): each builds its problems from
validated rows (:func:`read_jsonl_rows`), keyed by :func:`content_uid`, then
:meth:`SplitTask._set_splits` fixes the held-out split and removes every test problem from
training.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import re
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any, TextIO

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


def read_jsonl_rows(
  path: str | os.PathLike[str],
  parse_line: Callable[[str], tuple[dict[str, Any] | None, str]],
  what: str,
  open_text: Callable[[str | os.PathLike[str]], TextIO] | None = None,
  logger: logging.Logger = _logger,
) -> tuple[list[dict[str, Any]], int]:
  """Reads a JSON-lines file through a validating line parser.

  Rows the parser rejects are skipped but never silently: their count and the first one's
  line number and reason are logged as a warning.  Blank lines are not rows and are ignored.

  Args:
    path: the file to read.
    parse_line: ``line -> (row, "")`` for a usable row, ``(None, reason)`` otherwise.
    what: the rows' name in messages (e.g. ``"GSM8K"``).
    open_text: opens ``path`` as text (default: UTF-8 ``open``).
    logger: where the warning goes (the calling task's module logger).

  Returns:
    ``(rows, num_malformed)``: the usable rows in file order and the number skipped.

  Raises:
    OSError: if the file cannot be read.
    ValueError: if the file has no usable row.
  """
  rows: list[dict[str, Any]] = []
  num_bad = 0
  first_bad: tuple[int, str] | None = None
  with open_text(path) if open_text else open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      row, reason = parse_line(line)
      if row is None:
        num_bad += 1
        if first_bad is None:
          first_bad = (lineno, reason)
      else:
        rows.append(row)
  if first_bad is not None:
    _logger.warning(
      "%s: skipped %d malformed %s row(s); first at line %d: %s", os.fspath(path), num_bad, what, *first_bad
    )
  if not rows:
    raise ValueError(f"{os.fspath(path)}: no usable {what} rows ({num_bad} malformed)")
  return rows, num_bad


class SplitTask:
  """Training / held-out bookkeeping and uniform sampling for a fixed set of problems.

  Problems need a ``uid`` (a content hash of the prompt or question).

  Attributes:
    num_overlap_removed: distinct training problems dropped because the test set has them.
  """

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
