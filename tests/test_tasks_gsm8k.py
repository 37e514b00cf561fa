"""Tests for ``mimo_jax.tasks.gsm8k``: loading and validation, held-out split, sampling, SFT data, verifier."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from mimo_jax.tasks import gsm8k
from mimo_jax.tasks.gsm8k import GSM8KProblem, GSM8KTask, gold_answer, load_gsm8k_jsonl, question_uid


@pytest.fixture(scope="module")
def task() -> GSM8KTask:
  return GSM8KTask()


def _write_jsonl(path: os.PathLike[str] | str, lines: list[object]) -> str:
  """Writes each item as one line: strings verbatim, anything else as JSON."""
  with open(path, "w", encoding="utf-8") as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
  return os.fspath(path)


def _row(question: str, answer: str = "2 + 2 = <<2+2=4>>4\n#### 4") -> dict[str, str]:
  return {"question": question, "answer": answer}


# ---- the shipped samples ------------------------------------------------------------------


def test_default_paths_are_package_relative() -> None:
  package_dir = os.path.dirname(os.path.dirname(os.path.abspath(gsm8k.__file__)))
  for path in (gsm8k.DEFAULT_TRAIN_PATH, gsm8k.DEFAULT_TEST_PATH):
    assert os.path.commonpath([package_dir, path]) == package_dir
    assert os.path.isfile(path)
  licence = os.path.join(os.path.dirname(gsm8k.DEFAULT_TRAIN_PATH), "LICENSE")
  with open(licence, encoding="utf-8") as f:
    text = f.read()
  assert "GSM8K" in text and "MIT License" in text and "Copyright (c) 2021 OpenAI" in text


def test_loads_shipped_samples(task: GSM8KTask) -> None:
  train_rows, bad_train = load_gsm8k_jsonl(gsm8k.DEFAULT_TRAIN_PATH)
  test_rows, bad_test = load_gsm8k_jsonl(gsm8k.DEFAULT_TEST_PATH)
  assert (len(train_rows), bad_train, len(test_rows), bad_test) == (200, 0, 100, 0)
  assert task.num_malformed_train == task.num_malformed_test == 0
  assert len(task.heldout()) == 100
  assert task.num_train + task.num_overlap_removed + task.num_duplicates_removed == 200
  assert task.num_train == len(task.train_problems())
  assert task.name == "gsm8k"


def test_problem_fields(task: GSM8KTask) -> None:
  rows, _ = load_gsm8k_jsonl(gsm8k.DEFAULT_TEST_PATH)
  for row, problem in zip(rows, task.heldout(), strict=True):
    assert isinstance(problem, GSM8KProblem)
    assert problem.question == row["question"].strip()
    assert problem.solution == row["answer"].strip()
    assert problem.prompt == f"Question: {problem.question}\nAnswer:"
    assert problem.answer == row["answer"].rsplit("####", 1)[1].strip()
    assert problem.level == 0
    assert problem.task == "gsm8k"
    assert problem.uid == question_uid(problem.question)
    assert len(problem.uid) == 40


def test_heldout_is_disjoint_from_training(task: GSM8KTask) -> None:
  heldout = task.heldout()
  train = task.train_problems()
  heldout_uids = {p.uid for p in heldout}
  heldout_texts = {" ".join(p.question.split()).casefold() for p in heldout}
  assert len(heldout_uids) == len(heldout)
  assert len({p.uid for p in train}) == len(train)
  for problem in train:
    assert problem.uid not in heldout_uids
    assert " ".join(problem.question.split()).casefold() not in heldout_texts
    assert not task.is_heldout(problem)
  assert all(task.is_heldout(p) for p in heldout)
  rng = np.random.default_rng(0)
  assert not any(task.is_heldout(p) for p in task.sample(rng, 500))


def test_heldout_returns_a_copy(task: GSM8KTask) -> None:
  first = task.heldout()
  first.clear()
  assert len(task.heldout()) == 100


def test_uid_ignores_case_and_whitespace() -> None:
  assert question_uid("How many  apples?\n") == question_uid("how many apples?")
  assert question_uid("How many apples?") != question_uid("How many pears?")
  with pytest.raises(ValueError, match="uid"):
    GSM8KProblem(prompt="p", answer="1", question="q", uid="0" * 40)
  with pytest.raises(ValueError, match="question"):
    GSM8KProblem(prompt="p", answer="1")


# ---- overlap, duplicates, malformed rows --------------------------------------------------


def test_injected_overlap_is_removed_and_counted(tmp_path) -> None:
  test_rows, _ = load_gsm8k_jsonl(gsm8k.DEFAULT_TEST_PATH)
  leaked = test_rows[5]
  train_path = _write_jsonl(
    tmp_path / "train.jsonl",
    [
      _row("Tom has 2 apples and buys 2 more. How many apples does he have?"),
      leaked,
      # The same test question again, reformatted: still the same uid.
      _row("  " + leaked["question"].upper().replace(" ", "   ") + "\n", leaked["answer"]),
      _row("Ann has 3 pens and loses 1. How many pens are left?", "3 - 1 = 2\n#### 2"),
      # A repeat of a training question is kept once.
      _row("Ann has 3 pens and loses 1. How many pens are left?", "3 - 1 = 2\n#### 2"),
    ],
  )
  task = GSM8KTask(train_path=train_path, test_path=gsm8k.DEFAULT_TEST_PATH)
  assert task.num_overlap_removed == 1
  assert task.num_duplicates_removed == 2
  assert task.num_train == 2
  assert [p.answer for p in task.train_problems()] == ["4", "2"]
  assert question_uid(leaked["question"]) not in {p.uid for p in task.train_problems()}
  # Held-out size does not let test questions back into training.
  small = GSM8KTask(train_path=train_path, heldout_size=1)
  assert len(small.heldout()) == 1
  assert small.num_overlap_removed == 1


def test_only_overlapping_training_rows_raise(tmp_path) -> None:
  test_rows, _ = load_gsm8k_jsonl(gsm8k.DEFAULT_TEST_PATH)
  train_path = _write_jsonl(tmp_path / "train.jsonl", test_rows[:3])
  with pytest.raises(ValueError, match="no training question left"):
    GSM8KTask(train_path=train_path)


def test_malformed_rows_are_counted_and_reported(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
  path = _write_jsonl(
    tmp_path / "mixed.jsonl",
    [
      _row("Good question one?"),
      "{not json",  # line 2: the first bad one
      "",  # blank lines are not rows
      ["a", "list"],
      {"question": "No answer field?"},
      {"answer": "#### 3"},
      _row("", "#### 3"),
      _row("Answer is not a string?", 3),
      _row("Answer without a final marker?", "It is 4."),
      _row("Final answer that is not a number?", "#### four"),
      _row("Good question two?", "1,000 + 234 = 1,234\n#### 1,234"),
    ],
  )
  with caplog.at_level(logging.WARNING, logger=gsm8k.__name__):
    rows, num_bad = load_gsm8k_jsonl(path)
  assert [r["question"] for r in rows] == ["Good question one?", "Good question two?"]
  assert num_bad == 8
  messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(messages) == 1
  assert "8 malformed" in messages[0] and "line 2" in messages[0] and path in messages[0]

  task = GSM8KTask(train_path=path)
  assert task.num_malformed_train == 8
  assert task.num_train == 2
  assert [p.answer for p in task.train_problems()] == ["4", "1,234"]


def test_file_without_usable_rows_raises(tmp_path) -> None:
  path = _write_jsonl(tmp_path / "bad.jsonl", ["{oops", {"question": "q?"}, _row("q?", "no marker")])
  with pytest.raises(ValueError, match="bad.jsonl"):
    load_gsm8k_jsonl(path)
  with pytest.raises(ValueError, match="bad.jsonl"):
    GSM8KTask(test_path=path)
  empty = _write_jsonl(tmp_path / "empty.jsonl", [])
  with pytest.raises(ValueError, match="empty.jsonl"):
    load_gsm8k_jsonl(empty)


def test_gold_answer() -> None:
  assert gold_answer("a\n#### 1\nb\n#### 1,234") == "1,234"
  assert gold_answer("\\boxed{5}") is None  # a gold solution needs the GSM8K marker
  assert gold_answer("#### five") is None


def _good(i: int) -> bytes:
  return json.dumps(_row(f"Good question {i}?", f"{i} + 0 = {i}\n#### {i}")).encode("utf-8")


# One line per malformed-row kind; several of these used to abort the whole file.
BAD_LINES: list[tuple[str, bytes]] = [
  ("invalid_utf8", b'{"question": "caf\xe9?", "answer": "#### 1"}'),  # Latin-1 bytes
  ("lone_surrogate", b'{"question": "broken \\ud800 text?", "answer": "#### 2"}'),
  ("lone_surrogate", b'{"\\udc00": 1, "question": "Key with a surrogate?", "answer": "#### 2"}'),
  ("too_deep", b"[" * 100_000 + b"]" * 100_000),
  ("invalid_json", b'{"question": "q?", "answer": ' + b"1" * 5000 + b"}"),  # beyond int()'s digit limit
  ("invalid_json", b"\xef\xbb\xbf" + json.dumps(_row("BOM inside the file?")).encode()),
  ("invalid_json", b"{not json"),
  ("not_object", b'["a", "list"]'),
  ("missing_field", b'{"answer": "#### 3"}'),
  ("not_string", b'{"question": 5, "answer": "#### 3"}'),
  ("empty_field", b'{"question": "   ", "answer": "#### 3"}'),
  ("failed_check", b'{"question": "No marker?", "answer": "It is 4."}'),
]


def _mixed_file(path: os.PathLike[str] | str) -> str:
  """A leading UTF-8 BOM, then good rows interleaved with one bad line of every kind."""
  lines = [b"\xef\xbb\xbf" + _good(0)]
  for i, (_, bad) in enumerate(BAD_LINES, start=1):
    lines += [bad, _good(i)]
  with open(path, "wb") as f:
    f.write(b"\n".join(lines) + b"\n")
  return os.fspath(path)


def test_every_kind_of_malformed_row_is_counted_without_losing_good_rows(tmp_path, caplog) -> None:
  path = _mixed_file(tmp_path / "mixed.jsonl")
  with caplog.at_level(logging.WARNING, logger=gsm8k.__name__):
    rows, bad = load_gsm8k_jsonl(path)
  # The BOM row is accepted and every good row survives, in order.
  assert [r["question"] for r in rows] == [f"Good question {i}?" for i in range(len(BAD_LINES) + 1)]
  expected: dict[str, int] = {}
  for kind, _ in BAD_LINES:
    expected[kind] = expected.get(kind, 0) + 1
  assert bad == len(BAD_LINES) and bad.by_kind == expected
  assert bad.first is not None and bad.first[0] == 2 and "UTF-8" in bad.first[1]
  message = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
  assert f"skipped {len(BAD_LINES)} malformed GSM8K row(s); first at line 2" in message
  assert "invalid_utf8=1" in message and "too_deep=1" in message and "lone_surrogate=2" in message
  task = GSM8KTask(train_path=path)
  assert task.num_malformed_train.by_kind == expected and task.num_train == len(BAD_LINES) + 1


def test_malformed_count_survives_pickling() -> None:
  import pickle

  from mimo_jax.tasks.splits import MalformedCount

  count = MalformedCount({"invalid_json": 2, "too_deep": 1}, (3, "invalid JSON"))
  again = pickle.loads(pickle.dumps(count))
  assert again == 3 and again.by_kind == count.by_kind and again.first == (3, "invalid JSON")


def test_all_malformed_file_names_the_kinds(tmp_path) -> None:
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b"\xff\n[1]\n")
  with pytest.raises(ValueError, match=r"no usable GSM8K rows \(2 malformed\): invalid_utf8=1, not_object=1"):
    load_gsm8k_jsonl(path)


# ---- construction options -----------------------------------------------------------------


def test_prompt_template_applied() -> None:
  task = GSM8KTask(prompt_template="Q: {question}\nThink step by step.\nA:")
  for problem in task.heldout()[:5] + task.train_problems()[:5]:
    assert problem.prompt == f"Q: {problem.question}\nThink step by step.\nA:"
  # Braces in a question are data, not template fields.
  assert GSM8KTask(prompt_template="<{question}>").train_problems()[0].prompt.startswith("<")


@pytest.mark.parametrize("template", ["no field", "{question} {other}", "{question} {", "{0}"])
def test_bad_prompt_template_raises(template: str) -> None:
  with pytest.raises(ValueError, match="prompt_template"):
    GSM8KTask(prompt_template=template)


def test_heldout_size(task: GSM8KTask) -> None:
  small = GSM8KTask(heldout_size=10)
  assert small.heldout() == task.heldout()[:10]
  assert small.num_train == task.num_train
  assert GSM8KTask(heldout_size=0).heldout() == []
  for size in (-1, 101):
    with pytest.raises(ValueError, match="heldout_size"):
      GSM8KTask(heldout_size=size)


# ---- sampling and SFT data ----------------------------------------------------------------


def test_sample_is_reproducible(task: GSM8KTask) -> None:
  a = task.sample(np.random.default_rng(7), 64)
  b = task.sample(np.random.default_rng(7), 64)
  c = task.sample(np.random.default_rng(8), 64)
  assert a == b
  assert a != c
  assert len(a) == 64
  assert task.sample(np.random.default_rng(7), 0) == []
  with pytest.raises(ValueError):
    task.sample(np.random.default_rng(7), -1)
  # Drawing continues the caller's stream.
  rng = np.random.default_rng(7)
  assert task.sample(rng, 32) + task.sample(rng, 32) == a


def test_sample_covers_training_set(task: GSM8KTask) -> None:
  drawn = task.sample(np.random.default_rng(0), 20 * task.num_train)
  assert {p.uid for p in drawn} == {p.uid for p in task.train_problems()}


def test_sft_examples(task: GSM8KTask) -> None:
  examples = task.sft_examples(np.random.default_rng(3), 16)
  problems = task.sample(np.random.default_rng(3), 16)
  assert examples == [(p.prompt, " " + p.solution) for p in problems]
  for (_, completion), problem in zip(examples, problems, strict=True):
    assert completion.endswith("#### " + problem.answer)
    assert task.reward(problem, completion) == 1.0


def test_tokenizer_corpus(task: GSM8KTask) -> None:
  corpus = task.tokenizer_corpus()
  train = task.train_problems()
  assert corpus == [p.question for p in train] + [p.solution for p in train]
  heldout_questions = {p.question for p in task.heldout()}
  assert not heldout_questions & set(corpus)
  assert corpus == task.tokenizer_corpus()


# ---- verifier -----------------------------------------------------------------------------


def test_reward_on_gold_and_wrong_solutions(task: GSM8KTask) -> None:
  for problem in task.heldout() + task.train_problems():
    assert task.reward(problem, problem.solution) == 1.0
    assert task.reward(problem, " " + problem.solution) == 1.0
    wrong = problem.solution.rsplit("####", 1)[0] + "#### 999999999"
    assert task.reward(problem, wrong) == 0.0


def test_reward_forms() -> None:
  task = GSM8KTask()
  problem = task.heldout()[0]
  gold = problem.answer
  assert task.reward(problem, f"The answer is {gold}.") == 1.0
  assert task.reward(problem, f"so \\boxed{{{gold}}}") == 1.0
  assert task.reward(problem, f"#### ${gold}.00") == 1.0
  assert task.reward(problem, f"I think {gold}") == 0.0  # no committed answer
  assert task.reward(problem, f"#### {gold} or 7") == 0.0
  assert task.reward(problem, "") == 0.0
