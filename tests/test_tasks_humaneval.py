"""Tests for ``mimo_jax.tasks.humaneval``: loading and validation, held-out split, sampling, SFT data, verifier."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil

import numpy as np
import pytest

from mimo_jax.tasks import humaneval
from mimo_jax.tasks.humaneval import HumanEvalProblem, HumanEvalTask, load_humaneval_jsonl, problem_uid

# SHA-256 of the shipped samples' rows (see ``_rows_digest``), computed from the official
# HumanEval.jsonl.gz (rows HumanEval/0-39 for train, HumanEval/40-59 for test) when the samples were cut.
SOURCE_DIGESTS = {
  "train_sample.jsonl": "e2b2c136eb772c794aa9c2f8fbab4e8f96973d69a5e48315725caa710803b348",
  "test_sample.jsonl": "f0950c147966ce1a1d1daca33408c65b0e38760a4d1f524ecf325e59c4a5e853",
}


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
  return HumanEvalTask()


def _write_jsonl(path: os.PathLike[str] | str, lines: list[object]) -> str:
  """Writes each item as one line: strings verbatim, anything else as JSON."""
  with open(path, "w", encoding="utf-8") as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
  return os.fspath(path)


def _row(name: str = "inc", body: str = "    return x + 1\n") -> dict[str, str]:
  return {
    "task_id": f"Test/{name}",
    "prompt": f'def {name}(x):\n    """Returns x plus one ({name})."""\n',
    "canonical_solution": body,
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n",
    "entry_point": name,
  }


def _shipped(path: str) -> list[dict[str, str]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _rows_digest(rows: list[dict[str, str]]) -> str:
  """SHA-256 of the rows' required fields, independent of key order and JSON formatting."""
  text = "\n".join(json.dumps({k: r[k] for k in humaneval.REQUIRED_FIELDS}, sort_keys=True) for r in rows)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _gzip_shipped(path: os.PathLike[str] | str) -> str:
  """Writes the shipped train then test samples (HumanEval/0-59, in order) to ``path`` as gzip JSONL."""
  with gzip.open(path, "wb") as dst:
    for src_path in (humaneval.DEFAULT_TRAIN_PATH, humaneval.DEFAULT_TEST_PATH):
      with open(src_path, "rb") as src:
        shutil.copyfileobj(src, dst)
  return os.fspath(path)


# ---- the shipped samples ------------------------------------------------------------------


def test_default_paths_are_package_relative_and_licensed() -> None:
  package_dir = os.path.dirname(os.path.dirname(os.path.abspath(humaneval.__file__)))
  for path in (humaneval.DEFAULT_TRAIN_PATH, humaneval.DEFAULT_TEST_PATH):
    assert os.path.commonpath([package_dir, path]) == package_dir
    assert os.path.isfile(path)
  with open(os.path.join(os.path.dirname(humaneval.DEFAULT_TRAIN_PATH), "LICENSE"), encoding="utf-8") as f:
    text = f.read()
  assert "HumanEval" in text and "The MIT License" in text and "Copyright (c) OpenAI" in text


def test_loads_shipped_samples(task: HumanEvalTask) -> None:
  train_rows, bad_train = load_humaneval_jsonl(humaneval.DEFAULT_TRAIN_PATH)
  test_rows, bad_test = load_humaneval_jsonl(humaneval.DEFAULT_TEST_PATH)
  assert (len(train_rows), bad_train, len(test_rows), bad_test) == (40, 0, 20, 0)
  assert [r["task_id"] for r in train_rows] == [f"HumanEval/{i}" for i in range(40)]
  assert [r["task_id"] for r in test_rows] == [f"HumanEval/{i}" for i in range(40, 60)]
  assert (task.num_train, task.num_overlap_removed, task.num_duplicates_removed) == (40, 0, 0)
  assert len(task.heldout()) == 20
  assert task.name == "humaneval"


def test_shipped_samples_are_verbatim_copies_of_the_source() -> None:
  # Pinned digests of the official rows: any edit to a shipped prompt, solution or test fails here.
  for path in (humaneval.DEFAULT_TRAIN_PATH, humaneval.DEFAULT_TEST_PATH):
    rows = _shipped(path)
    for row in rows:
      assert set(row) == set(humaneval.REQUIRED_FIELDS)
    assert _rows_digest(rows) == SOURCE_DIGESTS[os.path.basename(path)], path


def test_problem_fields(task: HumanEvalTask) -> None:
  rows = _shipped(humaneval.DEFAULT_TEST_PATH)
  for row, problem in zip(rows, task.heldout(), strict=True):
    assert problem.prompt == row["prompt"]
    assert problem.answer == row["canonical_solution"]
    assert problem.tests == row["test"]
    assert problem.entry_point == row["entry_point"]
    assert problem.task_id == row["task_id"]
    assert (problem.level, problem.task) == (0, "humaneval")
    assert problem.uid == problem_uid(row["prompt"])
    assert task.is_heldout(problem)
  assert not any(task.is_heldout(p) for p in task.train_problems())


def test_problem_uid_is_validated() -> None:
  p = HumanEvalProblem(prompt="def f():\n    pass\n", answer="")
  assert p.uid == problem_uid("def f():\n    pass\n") and len(p.uid) == 40
  assert problem_uid("def  f():\n  pass") == p.uid  # whitespace-insensitive
  with pytest.raises(ValueError, match="does not match"):
    HumanEvalProblem(prompt="def f():\n    pass\n", answer="", uid="0" * 40)
  with pytest.raises(ValueError, match="empty"):
    HumanEvalProblem(prompt="  \n", answer="")


# ---- loading -----------------------------------------------------------------------------


def test_reads_gzip_and_the_full_source(tmp_path: os.PathLike[str]) -> None:
  plain = _write_jsonl(os.path.join(tmp_path, "p.jsonl"), [_row("a"), _row("b")])
  packed = os.path.join(tmp_path, "p.jsonl.gz")
  with open(plain, "rb") as src, gzip.open(packed, "wb") as dst:
    shutil.copyfileobj(src, dst)
  assert load_humaneval_jsonl(packed) == load_humaneval_jsonl(plain)
  # A gzip file of real HumanEval rows (the shipped samples, in source order) loads every row unchanged.
  source = _gzip_shipped(os.path.join(tmp_path, "HumanEval.jsonl.gz"))
  rows, bad = load_humaneval_jsonl(source)
  assert (len(rows), bad) == (60, 0)
  assert rows == _shipped(humaneval.DEFAULT_TRAIN_PATH) + _shipped(humaneval.DEFAULT_TEST_PATH)
  assert [r["task_id"] for r in rows] == [f"HumanEval/{i}" for i in range(60)]


@pytest.mark.parametrize(
  ("line", "reason"),
  [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "not a JSON object"),
    ({**_row(), "test": ""}, "'test'"),
    ({k: v for k, v in _row().items() if k != "entry_point"}, "'entry_point'"),
    ({**_row(), "prompt": 7}, "'prompt'"),
    ({**_row(), "entry_point": "inc()"}, "not a Python identifier"),
    ({**_row(), "entry_point": "dec"}, "does not define the entry point"),
    ({**_row(), "canonical_solution": "    return (\n"}, "does not compile"),
    ({**_row(), "test": "def verify(candidate):\n    pass\n"}, "does not define check"),
  ],
)
def test_malformed_rows_are_counted_and_logged(
  tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture, line: object, reason: str
) -> None:
  path = _write_jsonl(os.path.join(tmp_path, "rows.jsonl"), [_row("a"), "", line, _row("b"), line])
  with caplog.at_level(logging.WARNING, logger="mimo_jax.tasks.humaneval"):
    rows, bad = load_humaneval_jsonl(path)
  assert [r["entry_point"] for r in rows] == ["a", "b"]
  assert bad == 2
  assert "skipped 2 malformed HumanEval row(s); first at line 3" in caplog.text
  assert reason in caplog.text


def test_gzip_file_with_bom_and_bad_bytes_keeps_good_rows(tmp_path: os.PathLike[str]) -> None:
  good = [json.dumps(_row(name)).encode() for name in ("a", "b", "c")]
  raw = b"\n".join([b"\xef\xbb\xbf" + good[0], b'{"prompt": "\xe9"}', good[1], b"[" * 50_000, good[2]]) + b"\n"
  packed = os.path.join(tmp_path, "rows.jsonl.gz")
  with gzip.open(packed, "wb") as f:
    f.write(raw)
  rows, bad = load_humaneval_jsonl(packed)
  assert [r["entry_point"] for r in rows] == ["a", "b", "c"]
  assert bad == 2 and bad.by_kind == {"invalid_utf8": 1, "too_deep": 1}


def test_no_usable_rows_is_an_error(tmp_path: os.PathLike[str]) -> None:
  path = _write_jsonl(os.path.join(tmp_path, "bad.jsonl"), ["{", "", "[]"])
  with pytest.raises(ValueError, match=r"no usable HumanEval rows \(2 malformed\)"):
    load_humaneval_jsonl(path)
  empty = _write_jsonl(os.path.join(tmp_path, "empty.jsonl"), [])
  with pytest.raises(ValueError, match="no usable"):
    HumanEvalTask(empty, humaneval.DEFAULT_TEST_PATH)


# ---- the split ---------------------------------------------------------------------------


def test_overlap_and_duplicates_are_removed(tmp_path: os.PathLike[str]) -> None:
  test_rows = _shipped(humaneval.DEFAULT_TEST_PATH)
  # A held-out prompt copied with different whitespace must still count as overlap.
  disguised = {**test_rows[3], "prompt": "\n" + test_rows[3]["prompt"].replace("\n", "   \n") + "\n"}
  assert disguised["prompt"] != test_rows[3]["prompt"]
  train_rows = _shipped(humaneval.DEFAULT_TRAIN_PATH)[:5]
  lines: list[object] = [*train_rows, train_rows[0], test_rows[0], test_rows[-1], disguised]
  train = _write_jsonl(os.path.join(tmp_path, "train.jsonl"), lines)
  task = HumanEvalTask(train, humaneval.DEFAULT_TEST_PATH, heldout_size=2)
  assert task.num_duplicates_removed == 1
  assert task.num_overlap_removed == 3  # test rows 0 and -1 (outside the 2 held out) and the disguised copy
  assert [p.task_id for p in task.train_problems()] == [r["task_id"] for r in train_rows]
  assert [p.task_id for p in task.heldout()] == ["HumanEval/40", "HumanEval/41"]
  test_uids = {problem_uid(r["prompt"]) for r in test_rows}
  assert not test_uids & {p.uid for p in task.train_problems()}


def test_full_source_as_training_file_excludes_the_heldout(tmp_path: os.PathLike[str]) -> None:
  # A gzipped training file that, like the full source, also contains every held-out problem.
  source = _gzip_shipped(os.path.join(tmp_path, "HumanEval.jsonl.gz"))
  task = HumanEvalTask(source, humaneval.DEFAULT_TEST_PATH)
  assert (task.num_train, task.num_overlap_removed, task.num_duplicates_removed) == (40, 20, 0)
  assert [p.task_id for p in task.train_problems()] == [f"HumanEval/{i}" for i in range(40)]
  assert not any(task.is_heldout(p) for p in task.train_problems())


def test_heldout_size_bounds() -> None:
  assert len(HumanEvalTask(heldout_size=0).heldout()) == 0
  assert len(HumanEvalTask(heldout_size=20).heldout()) == 20
  for bad in (-1, 21):
    with pytest.raises(ValueError, match=r"heldout_size must be in \[0, 20\]"):
      HumanEvalTask(heldout_size=bad)


def test_no_training_problem_left_is_an_error() -> None:
  with pytest.raises(ValueError, match="no training problem left"):
    HumanEvalTask(humaneval.DEFAULT_TEST_PATH, humaneval.DEFAULT_TEST_PATH)


def test_rejects_a_bad_timeout() -> None:
  with pytest.raises(ValueError, match="timeout_s"):
    HumanEvalTask(timeout_s=0)


# ---- training data -----------------------------------------------------------------------


def test_sample_is_reproducible_and_from_training(task: HumanEvalTask) -> None:
  a = task.sample(np.random.default_rng(5), 50)
  b = task.sample(np.random.default_rng(5), 50)
  assert a == b and len(a) == 50
  train_uids = {p.uid for p in task.train_problems()}
  assert all(p.uid in train_uids and not task.is_heldout(p) for p in a)
  assert len({p.uid for p in a}) > 10
  assert task.sample(np.random.default_rng(0), 0) == []
  with pytest.raises(ValueError, match="non-negative"):
    task.sample(np.random.default_rng(0), -1)


def test_sft_examples_are_prompt_and_canonical_solution(task: HumanEvalTask) -> None:
  examples = task.sft_examples(np.random.default_rng(1), 12)
  by_prompt = {p.prompt: p for p in task.train_problems()}
  assert len(examples) == 12
  for prompt, solution in examples:
    assert solution == by_prompt[prompt].answer
    compile(prompt + solution, "<sft>", "exec")


def test_tokenizer_corpus_is_training_text_only(task: HumanEvalTask) -> None:
  corpus = task.tokenizer_corpus()
  train = task.train_problems()
  assert corpus == [p.prompt for p in train] + [p.answer for p in train]
  heldout_prompts = {p.prompt for p in task.heldout()}
  assert not heldout_prompts & set(corpus)
  assert not any(p.tests in text for p in task.heldout() for text in corpus)


# ---- verification ------------------------------------------------------------------------


def test_reward_of_canonical_wrong_and_fenced_completions(task: HumanEvalTask) -> None:
  problem = task.train_problems()[2]  # HumanEval/2, truncate_number
  assert problem.entry_point == "truncate_number"
  assert task.reward(problem, problem.answer) == 1.0
  assert task.reward(problem, "    return number\n") == 0.0
  assert task.reward(problem, "    return number % 1.0 +\n") == 0.0  # syntax error
  fenced = "Sure:\n```python\ndef truncate_number(number: float) -> float:\n    return number - int(number)\n```\n"
  assert task.reward(problem, fenced) == 1.0
  verdict = task.verdict(problem, "    return number\n")
  assert (verdict.passed, verdict.reason) == (False, "failed")


def test_heldout_canonical_solutions_pass(task: HumanEvalTask) -> None:
  for problem in task.heldout()[:5]:
    assert task.reward(problem, problem.answer) == 1.0, problem.task_id


def test_reward_components_flag_a_hack(task: HumanEvalTask) -> None:
  problem = task.train_problems()[0]
  hack = "    return None\nimport sys\nsys.exit(0)\n"
  assert task.reward(problem, hack) == 0.0
  assert task.reward_components(problem, hack) == {"strict": 0.0, "weak": 1.0, "hacked": 1.0}
  assert task.reward_components(problem, problem.answer) == {"strict": 1.0, "weak": 1.0, "hacked": 0.0}


@pytest.mark.parametrize("workers", [0, 1], ids=["in_process", "worker"])
def test_a_program_that_never_ends_fails_its_tests_inside_the_reward_limit(workers: int) -> None:
  """The trainer's task (built from the flags) runs each program for less than the reward call's limit,
  so an infinite loop is a failing verdict (a valid 0, in the reward statistics) and not an outage of
  the reward source (a failed component, counted as 0 and left out of them: under running
  normalisation it would be paid more than a wrong answer); the hacking probe's two runs fit too."""
  from mimo_jax.config import DataConfig
  from mimo_jax.rewards.task_rewards import build_task_reward, reward_samples
  from mimo_jax.tasks.registry import build_task

  cfg = DataConfig(task="humaneval", reward_timeout_s=3.0)
  task, _ = build_task(cfg, seed=0)
  problem = task.train_problems()[0]
  texts = [problem.answer, "    return None\n", "    while True:\n        pass\n"]
  reward = build_task_reward(
    task, workers=workers, timeout_s=cfg.reward_timeout_s, normalize="task_running", hacking_probe=True
  )
  try:
    batch = reward(reward_samples([problem], texts, group_size=3, truncated=[False] * 3))
  finally:
    reward.close()
  assert batch.errors == [] and not np.any(batch.failed["correct"]) and not np.any(batch.failed["hacked"])
  assert list(batch.components["correct"]) == [1.0, 0.0, 0.0]
  assert batch.rewards[2] == batch.rewards[1] < batch.rewards[0]
