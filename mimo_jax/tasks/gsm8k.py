"""GSM8K grade-school math word problems, with the same interface as :class:`~mimo_jax.tasks.arith.ArithTask`.

Data are JSON-lines files with one ``{"question": ..., "answer": ...}`` object per line,
where ``answer`` is a worked solution ending in ``#### <final answer>`` (the format of
https://github.com/openai/grade-school-math).  Small samples of the official splits ship
with the package (``mimo_jax/data/gsm8k``: the first 200 training and first 100 test
rows, MIT licence) and are the default; any other file can be passed by path.

Training problems come from the training file and held-out problems from the test file.
Problems are identified by :func:`question_uid`, a hash of the question text normalised
for case and whitespace, so the split is checked by content, not by file position:
duplicate training questions are kept once, and training questions that also occur
anywhere in the test file are dropped and counted (``num_overlap_removed``).

The verifier is :func:`mimo_jax.rewards.math.answers_match` on the answer that
:func:`mimo_jax.rewards.math.extract_answer` finds in the completion (``#### x``,
``\\boxed{x}`` or "the answer is x"; never a bare trailing number).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from mimo_jax.rewards.math import answers_match, extract_answer, extract_answer_with_source, normalize_number
from mimo_jax.tasks.splits import Malformed, SplitTask, check_string_fields, content_uid, read_jsonl_rows

__all__ = [
  "DEFAULT_TEST_PATH",
  "DEFAULT_TRAIN_PATH",
  "TASK_NAME",
  "GSM8KProblem",
  "GSM8KTask",
  "gold_answer",
  "load_gsm8k_jsonl",
  "question_uid",
]

TASK_NAME = "gsm8k"

_logger = logging.getLogger(__name__)

# Package-relative, so an installed package (package_data "data/*/*") finds its samples.
_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gsm8k")
DEFAULT_TRAIN_PATH = os.path.join(_DATA_DIR, "train_sample.jsonl")
DEFAULT_TEST_PATH = os.path.join(_DATA_DIR, "test_sample.jsonl")

DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


def question_uid(question: str) -> str:
  """Returns the content hash of a question (:func:`~mimo_jax.tasks.splits.content_uid`): copies that differ
  only in Unicode form, case or whitespace share it."""
  return content_uid(question)


def gold_answer(solution: str) -> str | None:
  """Returns the final answer of a GSM8K solution: the text after its last ``####``.

  Args:
    solution: a worked solution ending in ``#### x``.

  Returns:
    The answer as written (e.g. ``"1,234"``), or None if there is no ``####`` marker or
    its answer is not a single number (:func:`~mimo_jax.rewards.math.normalize_number`).
  """
  found = extract_answer_with_source(solution)
  if found is None or found[1] != "hash" or normalize_number(found[0]) is None:
    return None
  return found[0]


def _check_row(row: dict[str, Any]) -> Malformed | None:
  """Validates one decoded JSONL object; None if usable, else why not."""
  problem = check_string_fields(row, ("question", "answer"))
  if problem is not None:
    return problem
  if gold_answer(row["answer"]) is None:
    return Malformed("failed_check", "answer has no '#### <number>' final answer")
  return None


def load_gsm8k_jsonl(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
  """Reads and validates a GSM8K JSON-lines file.

  A row is usable if it is a JSON object whose ``"question"`` and ``"answer"`` are
  non-empty strings and whose answer ends in a ``#### <number>`` final answer (see
  :func:`gold_answer`).  Other rows are skipped but never silently: their count and the
  first one's line number and reason are logged as a warning.  Blank lines are not rows
  and are ignored.  Decoding problems (bad UTF-8, bad JSON, too deep, lone surrogates, not
  an object) are rows like any other: counted per kind, never fatal.

  Args:
    path: the file to read (UTF-8; a leading byte-order mark is accepted).

  Returns:
    ``(rows, num_malformed)``: the usable rows as parsed (extra keys kept), in file
    order, and the number of skipped rows (a
    :class:`~mimo_jax.tasks.splits.MalformedCount` with the count of each kind).

  Raises:
    OSError: if the file cannot be read.
    ValueError: if the file has no usable row.
  """
  return read_jsonl_rows(path, _check_row, "GSM8K", logger=_logger)


@dataclasses.dataclass(frozen=True)
class GSM8KProblem:
  """One GSM8K problem, shaped like :class:`mimo_jax.tasks.arith.Problem` (plus the source texts).

  Attributes:
    prompt: the text the model is conditioned on (the task's template applied to ``question``).
    answer: the gold final answer as written after ``####``, e.g. ``"1,234"``.
    level: always 0 (GSM8K has no difficulty levels).
    task: the task name, ``"gsm8k"``.
    uid: :func:`question_uid` of ``question``; computed when left empty.
    question: the question text.
    solution: the full gold solution, ending in ``#### answer``.
  """

  prompt: str
  answer: str
  level: int = 0
  task: str = TASK_NAME
  uid: str = ""
  question: str = ""
  solution: str = ""

  def __post_init__(self) -> None:
    if not self.question:
      raise ValueError("question must not be empty: the uid is derived from it")
    expected = question_uid(self.question)
    if not self.uid:
      # Frozen dataclass: the only way to fill a derived field after construction.
      object.__setattr__(self, "uid", expected)
    elif self.uid != expected:
      raise ValueError(f"uid {self.uid!r} does not match question {self.question[:60]!r} (expected {expected!r})")


class GSM8KTask(SplitTask):
  """GSM8K word problems with a final-answer verifier, a fixed held-out split and SFT data.

  Args:
    train_path: training JSONL file; the shipped 200-row sample by default.
    test_path: held-out JSONL file; the shipped 100-row sample by default.
    prompt_template: :meth:`str.format` template with a single ``{question}`` field.
    heldout_size: use only the first ``heldout_size`` distinct test questions as the
      held-out set (all by default).  Training questions are still checked against the
      whole test file, so shrinking the evaluation set never leaks test questions into
      training.
    loader: ``loader(path) -> (rows, num_malformed)`` reading a split (default: the JSONL
      reader of this module; the trainer passes a TFDS ``array_record`` source, see
      ``mimo_jax.tasks.tfds_sources``).

  Attributes:
    num_overlap_removed: distinct training questions dropped because the test file has them.
    num_duplicates_removed: training rows dropped as repeats of an earlier training question.
    num_malformed_train: malformed rows skipped in the training file.
    num_malformed_test: malformed rows skipped in the test file.

  Raises:
    ValueError: on a template without exactly the ``{question}`` field, a negative or
      too large ``heldout_size``, a file without usable rows, or no training question
      left after removing the overlap.
  """

  def __init__(
    self,
    train_path: str | os.PathLike[str] | None = None,
    test_path: str | os.PathLike[str] | None = None,
    *,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    heldout_size: int | None = None,
    loader: Callable[[str], tuple[list[dict[str, Any]], int]] | None = None,
  ) -> None:
    try:
      # A probe catches templates with other fields or broken braces now, not at the first sample.
      prompt_template.format(question="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"prompt_template must have only a {{question}} field, got {prompt_template!r}: {e!r}") from e
    if "{question}" not in prompt_template:
      raise ValueError(f"prompt_template must contain {{question}}, got {prompt_template!r}")
    self.prompt_template = prompt_template
    self.train_path = os.fspath(train_path if train_path is not None else DEFAULT_TRAIN_PATH)
    self.test_path = os.fspath(test_path if test_path is not None else DEFAULT_TEST_PATH)

    load = loader or load_gsm8k_jsonl
    test_rows, self.num_malformed_test = load(self.test_path)
    test_problems, _ = self._distinct_problems(test_rows)
    train_rows, self.num_malformed_train = load(self.train_path)
    train_problems, self.num_duplicates_removed = self._distinct_problems(train_rows)
    self._set_splits(
      test_problems,
      train_problems,
      heldout_size=heldout_size,
      train_path=self.train_path,
      test_path=self.test_path,
      noun="question",
    )

  def _distinct_problems(self, rows: list[dict[str, Any]]) -> tuple[list[GSM8KProblem], int]:
    """Builds problems from validated rows, keeping the first of each question; returns (problems, repeats)."""
    problems: list[GSM8KProblem] = []
    seen: set[str] = set()
    for row in rows:
      question, solution = row["question"].strip(), row["answer"].strip()
      answer = gold_answer(solution)
      assert answer is not None  # load_gsm8k_jsonl validated it
      problem = GSM8KProblem(
        prompt=self.prompt_template.format(question=question), answer=answer, question=question, solution=solution
      )
      if problem.uid not in seen:
        seen.add(problem.uid)
        problems.append(problem)
    return problems, len(rows) - len(problems)

  # ---- shape ---------------------------------------------------------------------

  @property
  def name(self) -> str:
    """The task name stored on every problem."""
    return TASK_NAME

  def sft_examples(self, rng: np.random.Generator, n: int, *, easiest: bool = False) -> list[tuple[str, str]]:
    """Draws ``n`` supervised demonstrations: each prompt with its full gold solution.

    ``easiest`` (the warm start's curriculum) changes nothing: GSM8K has one difficulty level.

    Args:
      rng: the numpy generator to draw from (advanced in place).
      n: number of demonstrations.

    Returns:
      ``(prompt, " " + solution)`` pairs; the space separates the solution from the
      template's ``"Answer:"``.  Completions carry no EOS, the caller appends it.

    Raises:
      ValueError: if ``n`` is negative.
    """
    return [(p.prompt, " " + p.solution) for p in self.sample(rng, n)]

  def tokenizer_corpus(self) -> list[str]:
    """Returns texts to train a tokenizer on: every training question, then every training solution.

    Held-out texts are left out so that not even the vocabulary is fitted to them.  The
    result is the same on every call.
    """
    return [p.question for p in self._train] + [p.solution for p in self._train]

  # ---- verification ----------------------------------------------------------------

  def reward(self, problem: GSM8KProblem, completion_text: str) -> float:
    """Scores a completion: 1.0 if its extracted final answer matches the gold answer, else 0.0.

    Args:
      problem: the problem that was posed.
      completion_text: the decoded completion (special tokens already removed).

    Returns:
      1.0 or 0.0.
    """
    return 1.0 if answers_match(extract_answer(completion_text), problem.answer) else 0.0
