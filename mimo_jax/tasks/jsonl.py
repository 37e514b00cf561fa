"""Any JSONL file of prompts with a verifiable final answer, through a field mapping.

Rows come from a TFDS ``array_record`` source (``mimo_jax.tasks.tfds_sources``, kind
``jsonl``) whose field map names the file's prompt and answer fields, e.g.
``prompt=question,answer=final``.  The prompt is used verbatim; the verifier is the math
reward's: the completion's extracted final answer (``####``, ``\\boxed{}``, "the answer is",
or the last number) must match the gold answer (numerically, textually or symbolically).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from mimo_jax.rewards.math import answers_match, extract_answer
from mimo_jax.tasks.splits import SplitTask, content_uid

TASK_NAME = "jsonl"


def parse_field_map(text: str) -> dict[str, str]:
  """``"prompt=question,answer=final"`` -> ``{"prompt": "question", "answer": "final"}`` (both keys required)."""
  pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
  if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
    raise ValueError(f"expected 'prompt=<field>,answer=<field>', got {text!r}")
  mapping = {k.strip(): v.strip() for k, v in pairs}
  if set(mapping) != {"prompt", "answer"}:
    raise ValueError(f"the field map must name exactly 'prompt' and 'answer', got {sorted(mapping)}")
  return mapping


@dataclasses.dataclass(frozen=True)
class JsonlProblem:
  """A prompt with its gold answer; ``uid`` is the prompt's :func:`~mimo_jax.tasks.splits.content_uid`."""

  prompt: str
  answer: str
  level: int = 0
  task: str = TASK_NAME
  uid: str = ""

  def __post_init__(self) -> None:
    expected = content_uid(self.prompt)
    if not self.uid:
      object.__setattr__(self, "uid", expected)
    elif self.uid != expected:
      raise ValueError(f"uid {self.uid!r} does not match prompt {self.prompt[:60]!r}")


class JsonlTask(SplitTask):
  """Prompts and answers from two row sources (training and held-out), held-out prompts removed from training.

  Args:
    train_rows: rows with ``prompt`` and ``answer`` (after the field map).
    test_rows: held-out rows, same fields.
    train_path, test_path: where the rows came from (for messages).
    num_malformed_train, num_malformed_test: the rows their readers skipped as malformed (counts, or
      :class:`~mimo_jax.tasks.splits.MalformedCount` with their kinds), reported in ``data_counts``.

  Raises:
    ValueError: no training prompt left after removing the held-out ones.
  """

  def __init__(
    self,
    train_rows: Sequence[dict[str, Any]],
    test_rows: Sequence[dict[str, Any]],
    *,
    train_path: str = "train",
    test_path: str = "test",
    num_malformed_train: int = 0,
    num_malformed_test: int = 0,
  ) -> None:
    self.num_malformed_train, self.num_malformed_test = num_malformed_train, num_malformed_test
    train = _distinct(train_rows)
    self.num_duplicates_removed = len(train_rows) - len(train)
    self._set_splits(_distinct(test_rows), train, heldout_size=None, train_path=train_path, test_path=test_path)

  @property
  def name(self) -> str:
    return TASK_NAME

  def sft_examples(self, rng: np.random.Generator, n: int, *, easiest: bool = False) -> list[tuple[str, str]]:
    """``(prompt, " " + answer)`` demonstrations (no reasoning is available in a bare answer field); ``easiest``
    changes nothing (one difficulty level)."""
    return [(p.prompt, " " + p.answer) for p in self.sample(rng, n)]

  def tokenizer_corpus(self) -> list[str]:
    return [p.prompt for p in self._train] + [p.answer for p in self._train]

  def reward(self, problem: JsonlProblem, completion_text: str) -> float:
    """1.0 if the completion's final answer matches the gold answer, else 0.0."""
    return 1.0 if answers_match(extract_answer(completion_text, fallback_last_number=True), problem.answer) else 0.0


def _distinct(rows: Sequence[dict[str, Any]]) -> list[JsonlProblem]:
  seen: set[str] = set()
  problems = []
  for row in rows:
    problem = JsonlProblem(prompt=row["prompt"], answer=row["answer"].strip())
    if problem.uid not in seen:
      seen.add(problem.uid)
      problems.append(problem)
  return problems
