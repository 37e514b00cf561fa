"""Trainer tasks reading their prompts through TFDS array_record sources."""

import json

import pytest

from mimo_jax.config import DataConfig
from mimo_jax.config_base import ConfigError
from mimo_jax.tasks.registry import build_task, data_counts


def test_gsm8k_and_humaneval_through_tfds_equal_the_jsonl_reader(tmp_path):
  for name in ("gsm8k", "humaneval"):
    direct, _ = build_task(DataConfig(task=name), seed=0)
    via_tfds, _ = build_task(DataConfig(task=name, tfds_dir=str(tmp_path)), seed=0)
    assert via_tfds.train_problems() == direct.train_problems()
    assert via_tfds.heldout() == direct.heldout()
    assert (tmp_path / f"mimo_{name}").is_dir()  # the array_record cache was written


def _write(path, rows, bad_lines=()):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    for line in bad_lines:
      f.write(line + "\n")


def _jsonl_config(tmp_path, train_rows, test_rows, bad_lines=()) -> DataConfig:
  """``--task=jsonl`` on two files written from the rows (``q`` the prompt, ``a`` the answer), the
  training file followed by ``bad_lines``."""
  train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
  _write(train, train_rows, bad_lines=bad_lines)
  _write(test, test_rows)
  return DataConfig(
    task="jsonl",
    data_path=str(train),
    eval_data_path=str(test),
    jsonl_fields="prompt=q,answer=a",
    tfds_dir=str(tmp_path),
  )


def test_jsonl_task_with_a_field_map_counts_malformed_rows(tmp_path, caplog):
  rows = [{"q": f"What is {i} + {i}?", "a": str(2 * i), "extra": i} for i in range(50)]
  cfg = _jsonl_config(tmp_path, rows[:40] + rows[45:], rows[40:], ["{not json", json.dumps({"q": "no answer"})])
  task, tokenizer = build_task(cfg, seed=0)
  assert len(task.heldout()) == 10 and len(task.train_problems()) == 40  # 45..49 are held out: removed
  assert task.num_overlap_removed == 5
  assert "malformed" in caplog.text  # the two bad rows are reported, not silently dropped
  # ... and counted where a run's summary.json reads them.
  assert data_counts(task) == {
    "jsonl": {
      "train_problems": 40,
      "heldout_problems": 10,
      "overlap_removed": 5,
      "duplicates_removed": 0,
      "malformed_train": 2,
      "malformed_train_by_kind": {"invalid_json": 1, "missing_field": 1},
      "malformed_test": 0,
    }
  }
  _write(cfg.data_path, rows[:40] + rows[:3])  # three repeats: counted as duplicates
  assert data_counts(build_task(cfg, seed=0)[0])["jsonl"]["duplicates_removed"] == 3
  problem = task.heldout()[0]
  assert (problem.prompt, problem.answer) == ("What is 40 + 40?", "80")
  assert task.reward(problem, "40 + 40 = 80. The answer is 80.") == 1.0
  assert task.reward(problem, "The answer is 81.") == 0.0
  assert tokenizer.decode(tokenizer.encode(problem.prompt)) == problem.prompt


def test_a_jsonl_answer_may_be_a_json_number(tmp_path, caplog):
  """``"answer": 18`` (how many datasets write a final answer) is the answer "18", graded as any other;
  ``2.5`` is "2.5".  A boolean, a non-finite number (Python's JSON reads NaN) or a number as the prompt
  is still refused, counted as ``not_string``."""
  rows = [{"q": f"What is {i} + {i}?", "a": 2 * i} for i in range(8)] + [{"q": "Half of 5?", "a": 2.5}]
  bad = ['{"q": "True?", "a": true}', '{"q": "NaN?", "a": NaN}', '{"q": 7, "a": 7}']
  task, _ = build_task(_jsonl_config(tmp_path, rows[:6], rows[6:], bad), seed=0)
  assert sorted(p.answer for p in task.train_problems()) == ["0", "10", "2", "4", "6", "8"]
  held = [(p.prompt, p.answer) for p in task.heldout()]
  assert held == [("What is 6 + 6?", "12"), ("What is 7 + 7?", "14"), ("Half of 5?", "2.5")]
  assert task.reward(task.heldout()[2], "Half of 5 is 2.5. #### 2.5") == 1.0
  assert task.reward(task.heldout()[0], "#### 15") == 0.0
  assert "skipped 3 malformed row(s) of 9 (not_string=3)" in caplog.text


@pytest.mark.parametrize(
  "changes, message",
  [
    ({}, "--task=jsonl needs --data_path and --eval_data_path"),
    ({"data_path": "X", "eval_data_path": "X", "jsonl_fields": "prompt=q"}, "--jsonl_fields='prompt=q'"),
  ],
)
def test_jsonl_task_errors_name_the_flag(tmp_path, changes, message):
  path = tmp_path / "rows.jsonl"
  _write(path, [{"q": "1+1?", "a": "2"}])
  changes = {k: (str(path) if v == "X" else v) for k, v in changes.items()}
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
    build_task(DataConfig(task="jsonl", tfds_dir=str(tmp_path), **changes), seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("name, task", [("grpo_gsm8k_small", "gsm8k"), ("grpo_code_small", "humaneval")])
def test_small_text_and_code_runs_end_to_end(tmp_path, name, task):
  """The GSM8K (math reward) and HumanEval (sandboxed unit tests) flagfiles, shortened, through the whole loop."""
  import os

  from mimo_jax.main import main
  from mimo_jax.testing import kill_resume

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  flags = [
    f"--flagfile={os.path.join(root, 'experiments', name + '.flags')}",
    f"--run_dir={tmp_path / 'run'}",
    f"--tfds_dir={tmp_path / 'tfds'}",
    "--sft_steps=4",
    "--max_steps=2",
    "--eval_every=0",
    "--eval_prompts=4",
    "--tensorboard=false",
  ]
  assert main(["prog", *flags]) == 0
  rl = [r for r in kill_resume.load_metrics(str(tmp_path / "run")) if "reward_mean" in r]
  assert [r["step"] for r in rl] == [1, 2]
  for r in rl:
    assert r["reward/failures"] == 0 and 0.0 <= r["reward/correct_mean"] <= 1.0
    assert "reward/hacked_mean" in r if task == "humaneval" else "reward/format_mean" in r
  assert (tmp_path / "tfds" / f"mimo_{task}").is_dir()
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["rl_steps"] == 2 and "pass@1" in summary["final"]
  # What reading the shipped files kept: every row well formed, the held-out problems as evaluated.
  data = summary["data"][task]
  assert data["malformed_train"] == data["malformed_test"] == 0 and data["heldout_problems"] >= 4
  assert data["train_problems"] > 0 and {"overlap_removed", "duplicates_removed"} <= set(data)
