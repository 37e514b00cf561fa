"""HumanEval Python programming problems, with the same interface as :class:`~mimo_jax.tasks.gsm8k.GSM8KTask`.

Data are JSON-lines files (optionally gzip-compressed) with one object per line holding
``task_id``, ``prompt`` (imports, helpers and a function signature with its docstring),
``canonical_solution`` (the function body that continues the prompt), ``test`` (source
defining ``check(candidate)``) and ``entry_point`` (the function's name): the format of
https://github.com/openai/human-eval.  Small samples ship with the package
(``mimo_jax/data/humaneval``, MIT licence) and are the default: problems HumanEval/0-39
for training and HumanEval/40-59 held out.  Any other file can be passed by path, e.g.
the full ``HumanEval.jsonl.gz`` as the training file: problems that are also in the
held-out file are then dropped from training.

The model sees the prompt and continues it, as in the reference evaluation.  Problems
are identified by :func:`problem_uid`, a hash of the prompt normalised for case and
whitespace, so the split is checked by content, not by file position: duplicate
training prompts are kept once, and training prompts that also occur anywhere in the
test file are dropped and counted (``num_overlap_removed``).

The verifier is :func:`mimo_jax.rewards.code.unit_test_reward`: the problem's tests run
against the program in a sandbox, with the prompt as trusted context for helpers the
tests call, and a pass needs the tests to have really completed (exiting early, forging
output or patching the test harness all score 0).  :func:`~mimo_jax.rewards.code.extract_code`
accepts both a raw continuation of the prompt and a fenced code block.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from mimo_jax.rewards import sandbox_policy
from mimo_jax.rewards.code import CodeVerdict, extract_code, probe_components, unit_test_result
from mimo_jax.tasks.splits import Malformed, SplitTask, check_string_fields, content_uid, read_jsonl_rows

__all__ = [
  "DEFAULT_TEST_PATH",
  "DEFAULT_TRAIN_PATH",
  "REQUIRED_FIELDS",
  "TASK_NAME",
  "HumanEvalProblem",
  "HumanEvalTask",
  "load_humaneval_jsonl",
  "problem_uid",
]

TASK_NAME = "humaneval"

_logger = logging.getLogger(__name__)

# Package-relative, so an installed package (package_data "data/*/*") finds its samples.
_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "humaneval")
DEFAULT_TRAIN_PATH = os.path.join(_DATA_DIR, "train_sample.jsonl")
DEFAULT_TEST_PATH = os.path.join(_DATA_DIR, "test_sample.jsonl")

REQUIRED_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")

_GZIP_MAGIC = b"\x1f\x8b"


def problem_uid(prompt: str) -> str:
  """Returns the SHA-1 hex digest of a prompt's normalised text (:func:`~mimo_jax.tasks.splits.content_uid`).

  Args:
    prompt: the problem's prompt.

  Returns:
    A 40-character lowercase hex string; prompts that differ only in case or whitespace share it.
  """
  return content_uid(prompt)


def _check_row(row: dict[str, Any]) -> Malformed | None:
  """Validates one decoded JSONL object; None if usable, else why not."""
  problem = check_string_fields(row, REQUIRED_FIELDS)
  if problem is not None:
    return problem
  entry = row["entry_point"]
  if not entry.isidentifier():
    return Malformed("failed_check", f"entry_point {entry!r} is not a Python identifier")
  if not re.search(rf"^def {re.escape(entry)}\s*\(", row["prompt"], re.MULTILINE):
    return Malformed("failed_check", f"prompt does not define the entry point {entry!r} at top level")
  for name, source in (
    ("prompt + canonical_solution", row["prompt"] + row["canonical_solution"]),
    ("test", row["test"]),
  ):
    try:
      compile(source, f"<{name}>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
      return Malformed("failed_check", f"{name} does not compile ({type(e).__name__}: {e})")
  if not re.search(r"^def check\s*\(", row["test"], re.MULTILINE):
    return Malformed("failed_check", "test does not define check(candidate)")
  return None


def _open_bytes(path: str | os.PathLike[str]) -> Any:
  """Opens a file for reading bytes, decompressing it if it starts with the gzip magic bytes."""
  with open(path, "rb") as f:
    magic = f.read(2)
  if magic == _GZIP_MAGIC:
    return gzip.open(path, "rb")
  return open(path, "rb")


def load_humaneval_jsonl(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
  """Reads and validates a HumanEval JSON-lines file (``.jsonl`` or gzip-compressed ``.jsonl.gz``).

  A row is usable if it is a JSON object whose :data:`REQUIRED_FIELDS` are non-empty
  strings, whose ``entry_point`` is an identifier defined at top level in the prompt,
  whose prompt plus canonical solution and whose test compile, and whose test defines
  ``check``.  Other rows are skipped but never silently: their count and the first one's
  line number and reason are logged as a warning.  Blank lines are not rows and are ignored.
  Decoding problems (bad UTF-8, bad JSON, too deep, lone surrogates, not an object) are
  rows like any other: counted per kind, never fatal.

  Args:
    path: the file to read; compression is detected from its first bytes (a leading
      UTF-8 byte-order mark is accepted).

  Returns:
    ``(rows, num_malformed)``: the usable rows as parsed (extra keys kept), in file
    order, and the number of skipped rows (a
    :class:`~mimo_jax.tasks.splits.MalformedCount` with the count of each kind).

  Raises:
    OSError: if the file cannot be read (or is corrupt gzip).
    ValueError: if the file has no usable row.
  """
  return read_jsonl_rows(path, _check_row, "HumanEval", open_binary=_open_bytes, logger=_logger)


@dataclasses.dataclass(frozen=True)
class HumanEvalProblem:
  """One HumanEval problem, shaped like :class:`mimo_jax.tasks.arith.Problem` (plus the test data).

  Attributes:
    prompt: the text the model continues: imports, helpers, signature and docstring.
    answer: the canonical solution (a function body continuing the prompt).
    level: always 0 (HumanEval has no difficulty levels).
    task: the task name, ``"humaneval"``.
    uid: :func:`problem_uid` of ``prompt``; computed when left empty.
    task_id: the dataset's identifier, e.g. ``"HumanEval/0"``.
    tests: test source defining ``check(candidate)``.
    entry_point: name of the function under test.
  """

  prompt: str
  answer: str
  level: int = 0
  task: str = TASK_NAME
  uid: str = ""
  task_id: str = ""
  tests: str = ""
  entry_point: str = ""

  def __post_init__(self) -> None:
    if not self.prompt.strip():
      raise ValueError("prompt must not be empty: the uid is derived from it")
    expected = problem_uid(self.prompt)
    if not self.uid:
      # Frozen dataclass: the only way to fill a derived field after construction.
      object.__setattr__(self, "uid", expected)
    elif self.uid != expected:
      raise ValueError(f"uid {self.uid!r} does not match prompt {self.prompt.strip()[:60]!r} (expected {expected!r})")


class HumanEvalTask(SplitTask):
  """HumanEval problems with a sandboxed unit-test verifier, a fixed held-out split and SFT data.

  Args:
    train_path: training JSONL file (``.jsonl`` or ``.jsonl.gz``); the shipped 40-problem sample by default.
    test_path: held-out JSONL file; the shipped 20-problem sample by default.
    heldout_size: use only the first ``heldout_size`` distinct test problems as the
      held-out set (all by default).  Training problems are still checked against the
      whole test file, so shrinking the evaluation set never leaks test problems into training.
    loader: ``loader(path) -> (rows, num_malformed)`` reading a split (default: the JSONL
      reader of this module; the trainer passes a TFDS ``array_record`` source, see
      ``mimo_jax.tasks.tfds_sources``).
    timeout_s: wall-clock limit of one verification (interpreter start-up included).
    memory_mb: address-space limit per sandbox process, in MiB.
    require_kernel_isolation: refuse every verification (raising
      :class:`~mimo_jax.rewards.sandbox.SandboxError`, nothing run) in a process whose
      sandbox has no kernel isolation.  The trainer's tasks set it unless
      ``--allow_weak_sandbox`` is given: reward workers probe the sandbox again, and a
      worker whose probe fails must not fall back to guard mode silently.  Off: the
      sandbox runs in whatever mode it found (direct use, tests).

  Attributes:
    runs_untrusted_code: True (class attribute): verification executes the completion.
    num_overlap_removed: distinct training problems dropped because the test file has them.
    num_duplicates_removed: training rows dropped as repeats of an earlier training prompt.
    num_malformed_train: malformed rows skipped in the training file.
    num_malformed_test: malformed rows skipped in the test file.

  Raises:
    ValueError: on a non-positive ``timeout_s``, a negative or too large
      ``heldout_size``, a file without usable rows, or no training problem left after
      removing the overlap.
  """

  # Verification runs the model's program: building the task checks the sandbox (tasks/registry.py).
  runs_untrusted_code = True

  def __init__(
    self,
    train_path: str | os.PathLike[str] | None = None,
    test_path: str | os.PathLike[str] | None = None,
    *,
    heldout_size: int | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    loader: Callable[[str], tuple[list[dict[str, Any]], int]] | None = None,
    require_kernel_isolation: bool = False,
  ) -> None:
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    self.timeout_s = float(timeout_s)
    self.memory_mb = memory_mb
    self.require_kernel_isolation = bool(require_kernel_isolation)
    self.train_path = os.fspath(train_path if train_path is not None else DEFAULT_TRAIN_PATH)
    self.test_path = os.fspath(test_path if test_path is not None else DEFAULT_TEST_PATH)

    load = loader or load_humaneval_jsonl
    test_rows, self.num_malformed_test = load(self.test_path)
    test_problems, _ = _distinct_problems(test_rows)
    train_rows, self.num_malformed_train = load(self.train_path)
    train_problems, self.num_duplicates_removed = _distinct_problems(train_rows)
    self._set_splits(
      test_problems, train_problems, heldout_size=heldout_size, train_path=self.train_path, test_path=self.test_path
    )

  # ---- shape ---------------------------------------------------------------------

  @property
  def name(self) -> str:
    """The task name stored on every problem."""
    return TASK_NAME

  def sft_examples(self, rng: np.random.Generator, n: int, *, easiest: bool = False) -> list[tuple[str, str]]:
    """Draws ``n`` supervised demonstrations: each prompt with its canonical solution.

    ``easiest`` (the warm start's curriculum) changes nothing: HumanEval has one difficulty level.

    Args:
      rng: the numpy generator to draw from (advanced in place).
      n: number of demonstrations.

    Returns:
      ``(prompt, canonical_solution)`` pairs; the solution continues the prompt as is.
      Completions carry no EOS, the caller appends it.

    Raises:
      ValueError: if ``n`` is negative.
    """
    return [(p.prompt, p.answer) for p in self.sample(rng, n)]

  def tokenizer_corpus(self) -> list[str]:
    """Returns texts to train a tokenizer on: every training prompt, then every training solution.

    Held-out texts (and all tests) are left out so that not even the vocabulary is fitted
    to them.  The result is the same on every call.
    """
    return [p.prompt for p in self._train] + [p.answer for p in self._train]

  # ---- verification ----------------------------------------------------------------

  def verdict(self, problem: HumanEvalProblem, completion_text: str) -> CodeVerdict:
    """Runs the problem's tests on a completion and returns the full verdict (reason, detail, sandbox output).

    Args:
      problem: the problem that was posed.
      completion_text: the decoded completion: a continuation of the prompt or a fenced code block.

    Returns:
      The :class:`~mimo_jax.rewards.code.CodeVerdict`.

    Raises:
      SandboxError: ``require_kernel_isolation`` is set and this process has no kernel isolation.
    """
    self._check_isolation()
    return unit_test_result(*self._test_args(problem, completion_text), **self._limits(problem))

  @staticmethod
  def _test_args(problem: HumanEvalProblem, completion_text: str) -> tuple[str, str, str]:
    """``(program, tests, entry_point)``: the prompt plus the completion (or its fenced function)."""
    return extract_code(completion_text, problem.prompt), problem.tests, problem.entry_point

  def _check_isolation(self) -> None:
    # In the process that runs the code (a reward worker probes on its own): cached after one probe.
    if self.require_kernel_isolation:
      sandbox_policy.check_before_running(allow_weak=False)

  def _limits(self, problem: HumanEvalProblem) -> dict[str, Any]:
    return {"context": problem.prompt, "timeout_s": self.timeout_s, "memory_mb": self.memory_mb}

  def reward(self, problem: HumanEvalProblem, completion_text: str) -> float:
    """Scores a completion: 1.0 if the problem's tests really ran and passed, else 0.0.

    Args:
      problem: the problem that was posed.
      completion_text: the decoded completion (special tokens already removed).

    Returns:
      1.0 or 0.0.
    """
    return 1.0 if self.verdict(problem, completion_text).passed else 0.0

  def reward_components(self, problem: HumanEvalProblem, completion_text: str) -> dict[str, float]:
    """Strict and naive verdicts, to track reward hacking (:func:`~mimo_jax.rewards.code.probe_components`).

    Args:
      problem: the problem that was posed.
      completion_text: the decoded completion.

    Returns:
      ``{"strict": ..., "weak": ..., "hacked": ...}``, each 0.0 or 1.0; ``strict`` equals :meth:`reward`.

    Raises:
      SandboxError: ``require_kernel_isolation`` is set and this process has no kernel isolation.
    """
    self._check_isolation()
    return probe_components(*self._test_args(problem, completion_text), **self._limits(problem))


def _distinct_problems(rows: list[dict[str, Any]]) -> tuple[list[HumanEvalProblem], int]:
  """Builds problems from validated rows, keeping the first of each prompt; returns (problems, repeats)."""
  problems: list[HumanEvalProblem] = []
  seen: set[str] = set()
  for row in rows:
    problem = HumanEvalProblem(
      prompt=row["prompt"],
      answer=row["canonical_solution"],
      task_id=row["task_id"],
      tests=row["test"],
      entry_point=row["entry_point"],
    )
    if problem.uid not in seen:
      seen.add(problem.uid)
      problems.append(problem)
  return problems, len(rows) - len(problems)
