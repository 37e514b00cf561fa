"""Tests for ``mimo_jax.tasks.tfds_sources``: TFDS builders over local files and the resumable index stream."""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds

from mimo_jax.tasks import humaneval, tfds_sources
from mimo_jax.tasks.arith import ArithTask
from mimo_jax.tasks.gsm8k import DEFAULT_TEST_PATH, DEFAULT_TRAIN_PATH, load_gsm8k_jsonl
from mimo_jax.tasks.tfds_sources import (
  ArithSpec,
  Gsm8kBuilder,
  JsonlSourceConfig,
  PromptStream,
  load_prompt_source,
  prepare_builder,
)

# Rows in the generated "full-size" GSM8K file (the size of the official test split).
LARGE_GSM8K_ROWS = 1319


def _write_lines(path: os.PathLike[str] | str, lines: list[object]) -> str:
  """Writes each item as one line: bytes and strings verbatim, anything else as JSON."""
  with open(path, "wb") as f:
    for line in lines:
      if isinstance(line, bytes):
        f.write(line + b"\n")
      elif isinstance(line, str):
        f.write(line.encode("utf-8") + b"\n")
      else:
        f.write(json.dumps(line).encode("utf-8") + b"\n")
  return os.fspath(path)


def _json_rows(path: str) -> list[tuple[int, dict]]:
  """(line number, object) of every non-blank line, read independently of the module under test."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    return [(i, json.loads(line)) for i, line in enumerate(f, start=1) if line.strip()]


def _gsm8k_row(i: int) -> dict[str, str]:
  return {"question": f"Question number {i}: what is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}


def _array_record_files(source: tfds_sources.PromptSource) -> list[str]:
  data_dir = os.fspath(source.builder.data_dir)
  return sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir) if ".array_record" in f)


# ---- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize(("split", "path"), [("train", DEFAULT_TRAIN_PATH), ("test", DEFAULT_TEST_PATH)])
def test_gsm8k_default_samples_round_trip(tmp_path, split: str, path: str) -> None:
  source = load_prompt_source("gsm8k", None, tmp_path, split=split)
  expected = _json_rows(path)
  assert len(source) == len(expected) > 0
  assert source.num_malformed == 0 and source.first_malformed is None
  assert source.name == f"gsm8k:{split}"
  assert source.path == os.path.abspath(path)
  for got, (lineno, row) in zip(source, expected, strict=True):
    assert got == {"question": row["question"], "answer": row["answer"], "source_line": lineno}
    assert isinstance(got["question"], str) and isinstance(got["source_line"], int)
  # Random access, including negative indices, matches iteration order.
  assert source[-1] == source[len(source) - 1]
  with pytest.raises(IndexError):
    source[len(source)]


def test_gsm8k_full_size_file_has_no_silent_drops(tmp_path) -> None:
  # A file the size of the official test split, built from the shipped real rows (cycled,
  # each question made unique): every one of its lines is a valid, distinct row, so the
  # dataset must hold exactly that many (a format that drops or dedups rows would fail here).
  shipped = [row for _, row in _json_rows(DEFAULT_TRAIN_PATH) + _json_rows(DEFAULT_TEST_PATH)]
  rows = []
  for i in range(LARGE_GSM8K_ROWS):
    row = shipped[i % len(shipped)]
    rows.append({**row, "question": f"{row['question']} (variant {i})"})
  path = _write_lines(tmp_path / "test.jsonl", rows)
  with open(path, encoding="utf-8") as f:
    nonblank = sum(1 for line in f if line.strip())
  valid_rows, num_bad = load_gsm8k_jsonl(path)
  assert nonblank == LARGE_GSM8K_ROWS and num_bad == 0 and len(valid_rows) == LARGE_GSM8K_ROWS
  assert len({r["question"] for r in valid_rows}) == LARGE_GSM8K_ROWS

  source = load_prompt_source("gsm8k", path, tmp_path / "cache", split="test")
  assert len(source) == len(valid_rows) == LARGE_GSM8K_ROWS
  assert source.num_malformed == 0
  got = list(source)
  assert [r["question"] for r in got] == [r["question"] for r in rows]
  assert [r["answer"] for r in got] == [r["answer"] for r in rows]
  assert [r["source_line"] for r in got] == list(range(1, LARGE_GSM8K_ROWS + 1))


def test_gsm8k_builder_with_both_splits(tmp_path) -> None:
  builder = prepare_builder("gsm8k", tmp_path)
  assert isinstance(builder, Gsm8kBuilder)
  assert builder.info.splits["train"].num_examples == len(_json_rows(DEFAULT_TRAIN_PATH))
  assert builder.info.splits["test"].num_examples == len(_json_rows(DEFAULT_TEST_PATH))
  # Written as array_record, read back through a random-access data source.
  assert str(builder.info.file_format.value) == "array_record"
  test = builder.as_data_source(split="test")
  assert test[0]["question"] == _json_rows(DEFAULT_TEST_PATH)[0][1]["question"].encode("utf-8")


def test_humaneval_gz_round_trip(tmp_path) -> None:
  # The shipped HumanEval samples (train then test), gzipped like the official HumanEval.jsonl.gz.
  path = os.fspath(tmp_path / "HumanEval.jsonl.gz")
  with gzip.open(path, "wb") as dst:
    for sample in (humaneval.DEFAULT_TRAIN_PATH, humaneval.DEFAULT_TEST_PATH):
      with open(sample, "rb") as src:
        shutil.copyfileobj(src, dst)
  source = load_prompt_source("humaneval", path, tmp_path / "cache", split="test")
  expected = _json_rows(path)
  assert len(source) == len(expected) == 60
  assert [r["task_id"] for r in source] == [f"HumanEval/{i}" for i in range(60)]
  assert source.num_malformed == 0
  for got, (lineno, row) in zip(source, expected, strict=True):
    assert got == {**{k: row[k] for k in tfds_sources.HUMANEVAL_FIELDS}, "source_line": lineno}
  # Code is stored verbatim: indentation and trailing newlines survive.
  assert source[0]["prompt"] == expected[0][1]["prompt"] and source[0]["prompt"].endswith("\n")
  # Gzip is told by its bytes, as the direct reader tells it: the same file named .jsonl loads the same
  # rows (it was read as text: "no usable rows"), and a plain file named .jsonl.gz loads (BadGzipFile).
  renamed = os.fspath(tmp_path / "gzipped.jsonl")
  shutil.copy(path, renamed)
  again = load_prompt_source("humaneval", renamed, tmp_path / "cache2", split="test")  # (not the cached build)
  assert [dict(r, source_line=0) for r in again] == [dict(r, source_line=0) for r in source]
  plain = os.fspath(tmp_path / "plain.jsonl.gz")
  with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
    shutil.copyfileobj(src, dst)
  assert len(load_prompt_source("humaneval", plain, tmp_path / "cache3", split="test")) == 60


def test_humaneval_plain_jsonl_with_malformed_row(tmp_path) -> None:
  good = {
    "task_id": "Tiny/0",
    "prompt": "def add(a, b):\n",
    "canonical_solution": "    return a + b\n",
    "test": "def check(f):\n    assert f(1, 2) == 3\n",
    "entry_point": "add",
  }
  path = _write_lines(tmp_path / "he.jsonl", [good, {**good, "task_id": "Tiny/1", "entry_point": ""}])
  source = load_prompt_source("humaneval", path, tmp_path / "cache", split="train")
  assert len(source) == 1 and source[0]["task_id"] == "Tiny/0"
  assert source.num_malformed == 1
  assert source.first_malformed["line"] == 2 and "entry_point" in source.first_malformed["reason"]


def test_jsonl_field_mapping(tmp_path) -> None:
  rows = [{"question": f"q{i}", "solution": f"s{i}", "extra": i} for i in range(7)]
  path = _write_lines(tmp_path / "p.jsonl", rows)
  source = load_prompt_source(
    "jsonl", path, tmp_path / "cache", split="train", field_map={"prompt": "question", "answer": "solution"}
  )
  assert source.features == ("answer", "prompt", "source_line")
  assert [source[i] for i in range(len(source))] == [
    {"prompt": f"q{i}", "answer": f"s{i}", "source_line": i + 1} for i in range(7)
  ]
  # A different mapping of the same file is a different dataset, in its own cache directory.
  other = load_prompt_source("jsonl", path, tmp_path / "cache", split="train", field_map={"text": "solution"})
  assert [r["text"] for r in other] == [f"s{i}" for i in range(7)]
  assert other.builder.data_dir != source.builder.data_dir
  # A mapped key that no row has makes every row malformed: nothing usable.
  with pytest.raises(ValueError, match="p.jsonl"):
    load_prompt_source("jsonl", path, tmp_path / "cache", split="train", field_map={"prompt": "missing"})
  # The default mapping is prompt/answer.
  plain = _write_lines(tmp_path / "plain.jsonl", [{"prompt": "a", "answer": "b"}])
  assert load_prompt_source("jsonl", plain, tmp_path / "cache", split="train")[0] == {
    "prompt": "a",
    "answer": "b",
    "source_line": 1,
  }


@pytest.mark.parametrize("field_map", [{}, {"source_line": "x"}, {"not an identifier": "x"}, {"prompt": ""}])
def test_jsonl_bad_field_map_raises(tmp_path, field_map) -> None:
  path = _write_lines(tmp_path / "p.jsonl", [{"x": "y"}])
  with pytest.raises(ValueError, match="field_map"):
    load_prompt_source("jsonl", path, tmp_path / "cache", split="train", field_map=field_map)


# ---- malformed rows -----------------------------------------------------------------------


def test_malformed_rows_are_counted_logged_and_stored(tmp_path, caplog) -> None:
  lines: list[object] = [
    _gsm8k_row(0),
    _gsm8k_row(1),
    '{"question": "broken json", ',  # line 3: bad JSON
    _gsm8k_row(2),
    {"question": "no answer field"},  # line 5: missing field
    "",  # blank: not a row at all
    _gsm8k_row(3),
    {"question": 17, "answer": "#### 17"},  # line 8: wrong type
    _gsm8k_row(4),
  ]
  path = _write_lines(tmp_path / "bad.jsonl", lines)
  with caplog.at_level(logging.WARNING, logger="mimo_jax.tasks.tfds_sources"):
    source = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  assert source.num_malformed == 3
  assert [r["question"] for r in source] == [_gsm8k_row(i)["question"] for i in range(5)]
  assert [r["source_line"] for r in source] == [1, 2, 4, 7, 9]
  assert source.first_malformed["line"] == 3 and "invalid JSON" in source.first_malformed["reason"]
  assert "broken json" in source.first_malformed["text"]
  # Logged with the count and the first bad line.
  messages = [r.getMessage() for r in caplog.records]
  assert any("3 malformed" in m and "line 3" in m and path in m for m in messages), messages
  # Stored with the dataset (metadata.json), so a cached load still reports it.
  with open(os.path.join(os.fspath(source.builder.data_dir), "metadata.json"), encoding="utf-8") as f:
    meta = json.load(f)
  assert meta["splits"]["train"]["num_malformed"] == 3
  assert meta["splits"]["train"]["num_rows"] == 5
  again = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  assert again.num_malformed == 3 and len(again) == 5


@pytest.mark.parametrize(
  ("bad_line", "reason"),
  [
    (b"\xff\xfe not utf-8", "UTF-8"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"question": "   ", "answer": "#### 1"}).encode(), "empty"),
    (json.dumps({"question": "q", "answer": "no final answer"}).encode(), "####"),
  ],
)
def test_each_kind_of_malformed_row(tmp_path, bad_line: bytes, reason: str) -> None:
  path = _write_lines(tmp_path / "x.jsonl", [_gsm8k_row(0), bad_line, _gsm8k_row(1)])
  source = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  assert len(source) == 2 and source.num_malformed == 1
  assert source.first_malformed["line"] == 2 and reason in source.first_malformed["reason"]


def test_every_malformed_kind_is_counted_and_stored_and_a_bom_is_accepted(tmp_path, caplog) -> None:
  bad_lines = {
    "invalid_utf8": b'{"question": "caf\xe9?", "answer": "#### 1"}',
    "lone_surrogate": b'{"question": "broken \\ud800 text?", "answer": "#### 2"}',
    "too_deep": b"[" * 100_000 + b"]" * 100_000,
    "invalid_json": b"{not json",
    "not_object": b"[1, 2]",
    "missing_field": b'{"answer": "#### 3"}',
    "not_string": b'{"question": 5, "answer": "#### 3"}',
    "empty_field": b'{"question": " ", "answer": "#### 3"}',
    "failed_check": b'{"question": "q?", "answer": "no final answer"}',
  }
  lines: list[object] = [b"\xef\xbb\xbf" + json.dumps(_gsm8k_row(0)).encode()]
  for i, raw in enumerate(bad_lines.values(), start=1):
    lines += [raw, _gsm8k_row(i)]
  path = _write_lines(tmp_path / "kinds.jsonl", lines)
  with caplog.at_level(logging.WARNING, logger="mimo_jax.tasks.tfds_sources"):
    source = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  assert [r["question"] for r in source] == [_gsm8k_row(i)["question"] for i in range(len(bad_lines) + 1)]
  assert source.num_malformed == len(bad_lines)
  assert source.malformed_by_kind == dict.fromkeys(bad_lines, 1)
  assert source.first_malformed["line"] == 2 and source.first_malformed["kind"] == "invalid_utf8"
  assert "too_deep=1" in caplog.text and "lone_surrogate=1" in caplog.text
  # Stored in metadata.json: a cached load reports the same breakdown.
  again = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  assert again.malformed_by_kind == source.malformed_by_kind and len(again) == len(source)


def test_all_bad_file_raises_naming_it(tmp_path) -> None:
  path = _write_lines(tmp_path / "all_bad.jsonl", ["nope", {"question": "q"}, {"answer": 3}])
  with pytest.raises(ValueError, match=r"all_bad\.jsonl.*no usable.*3 malformed"):
    load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  empty = _write_lines(tmp_path / "empty.jsonl", ["", "  "])
  with pytest.raises(ValueError, match="empty.jsonl"):
    load_prompt_source("jsonl", empty, tmp_path / "cache", split="train")


# ---- caching ------------------------------------------------------------------------------


def test_cache_is_reused_and_rebuilt_when_the_file_changes(tmp_path) -> None:
  path = _write_lines(tmp_path / "g.jsonl", [_gsm8k_row(i) for i in range(4)])
  first = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  files = _array_record_files(first)
  mtimes = [os.stat(f).st_mtime_ns for f in files]

  # Same content: same directory, files untouched.
  again = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  assert again.builder.data_dir == first.builder.data_dir
  assert [os.stat(f).st_mtime_ns for f in _array_record_files(again)] == mtimes

  # Changed content (same path): a new dataset with the new rows.
  _write_lines(path, [_gsm8k_row(i) for i in range(10, 16)])
  changed = load_prompt_source("gsm8k", path, tmp_path / "cache", split="train")
  assert changed.builder.data_dir != first.builder.data_dir
  assert [r["question"] for r in changed] == [_gsm8k_row(i)["question"] for i in range(10, 16)]
  # The old dataset is still intact where it was.
  assert [r["question"] for r in first] == [_gsm8k_row(i)["question"] for i in range(4)]


def test_file_changed_during_build_is_an_error(tmp_path) -> None:
  path = _write_lines(tmp_path / "g.jsonl", [_gsm8k_row(0)])
  config = JsonlSourceConfig.create(Gsm8kBuilder.name, {"train": path})
  _write_lines(path, [_gsm8k_row(1)])
  builder = Gsm8kBuilder(data_dir=os.fspath(tmp_path / "cache"), config=config, file_format="array_record")
  with pytest.raises(RuntimeError, match="changed while"):
    builder.download_and_prepare(
      file_format="array_record", download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )


def test_argument_errors(tmp_path) -> None:
  with pytest.raises(ValueError, match="unknown source kind"):
    load_prompt_source("mnist", None, tmp_path, split="train")
  with pytest.raises(ValueError, match="field_map"):
    load_prompt_source("gsm8k", None, tmp_path, split="train", field_map={"a": "b"})
  with pytest.raises(ValueError, match="need a path"):
    load_prompt_source("jsonl", None, tmp_path, split="train")
  with pytest.raises(ValueError, match="path must be None"):
    load_prompt_source("arith", DEFAULT_TRAIN_PATH, tmp_path, split="train")
  with pytest.raises(FileNotFoundError):
    load_prompt_source("gsm8k", tmp_path / "missing.jsonl", tmp_path, split="train")
  with pytest.raises(ValueError, match="no split"):
    tfds_sources.PromptSource(prepare_builder("gsm8k", tmp_path), "validation")


# ---- synthetic arithmetic -----------------------------------------------------------------


def test_arith_source(tmp_path) -> None:
  spec = ArithSpec(levels=(1, 3), seed=5, num_rows=300, heldout_size=40)
  train = load_prompt_source("arith", None, tmp_path, split="train", arith=spec)
  test = load_prompt_source("arith", None, tmp_path, split="test", arith=spec)
  task = ArithTask(spec.levels, seed=spec.seed, heldout_size=spec.heldout_size)
  heldout = task.heldout()
  assert [r["prompt"] for r in test] == [p.prompt for p in heldout]
  assert [(r["uid"], r["level"], r["answer"]) for r in test] == [(p.uid, p.level, p.answer) for p in heldout]

  rows = list(train)
  assert len(rows) == 300 and train.num_malformed == 0
  uids = [r["uid"] for r in rows]
  assert len(set(uids)) == 300
  assert not set(uids) & {p.uid for p in heldout}
  for r in rows:
    assert r["task"] == "arith" and r["level"] in (1, 3)
    assert int(r["answer"]) == sum(int(x) for x in r["prompt"][:-1].split("+"))
  assert {r["level"] for r in rows} == {1, 3}
  # Deterministic: a fresh cache directory generates the same rows.
  fresh = load_prompt_source("arith", None, tmp_path / "other", split="train", arith=spec)
  assert [r["uid"] for r in fresh] == uids
  # A different spec is a different dataset.
  other = load_prompt_source(
    "arith", None, tmp_path, split="train", arith=ArithSpec(levels=(1, 3), seed=6, num_rows=300)
  )
  assert [r["uid"] for r in other] != uids


# ---- shuffled index stream ----------------------------------------------------------------


def test_stream_epochs_are_permutations_and_deterministic() -> None:
  stream = PromptStream(37, seed=3)
  drawn = stream.next(37 * 3)
  epochs = [drawn[i * 37 : (i + 1) * 37] for i in range(3)]
  for e, order in enumerate(epochs):
    assert sorted(order) == list(range(37))
    assert order == stream.permutation(e).tolist()
  assert epochs[0] != epochs[1] != epochs[2]
  assert epochs[0] != list(range(37))
  assert stream.state_dict() == {"epoch": 3, "position": 0, "seed": 3, "size": 37, "shuffle": True}
  assert PromptStream(37, seed=3).next(50) == drawn[:50]
  assert PromptStream(37, seed=4).next(37) != epochs[0]
  assert [stream.index_at(s) for s in range(37 * 3)] == drawn
  assert PromptStream(5, shuffle=False).next(7) == [0, 1, 2, 3, 4, 0, 1]


def test_a_reshuffled_fixed_order_starts_a_fresh_epoch_and_keeps_it_through_a_resume() -> None:
  stream = PromptStream(6, seed=2, shuffle=False)
  assert stream.next(8) == [0, 1, 2, 3, 4, 5, 0, 1]
  stream.reshuffle()  # mid-epoch: the rest of epoch 1 is skipped, epoch 2 starts shuffled
  assert (stream.epoch, stream.position) == (2, 0)
  state = json.loads(json.dumps(stream.state_dict()))
  assert state["shuffle"] is True
  drawn = stream.next(12)
  assert drawn[:6] == stream.permutation(2).tolist() and sorted(drawn[:6]) == list(range(6))
  assert sorted(drawn[6:]) == list(range(6)) and drawn[:6] != drawn[6:] and drawn[:6] != list(range(6))
  resumed = PromptStream(6, seed=2, shuffle=False)  # built from the flags; the order kind comes from the state
  resumed.load_state_dict(state)
  assert resumed.next(12) == drawn
  at_boundary = PromptStream(4, shuffle=False)
  at_boundary.next(4)
  at_boundary.reshuffle()  # at an epoch boundary nothing is skipped
  assert (at_boundary.epoch, at_boundary.position) == (1, 0)


def test_stream_resume_continues_identically() -> None:
  rng = np.random.default_rng(0)
  sizes = rng.integers(0, 20, size=40).tolist()
  reference = PromptStream(23, seed=11)
  expected = [reference.next(k) for k in sizes]

  stream = PromptStream(23, seed=11)
  got = [stream.next(k) for k in sizes[:13]]
  state = json.loads(json.dumps(stream.state_dict()))
  assert state["position"] != 0  # resuming mid-epoch
  resumed = PromptStream(23, seed=999)  # the seed comes from the state
  resumed.load_state_dict(state)
  got += [resumed.next(k) for k in sizes[13:]]
  assert got == expected
  assert resumed.state_dict() == reference.state_dict()


def test_stream_rejects_bad_state() -> None:
  stream = PromptStream(10, seed=1)
  with pytest.raises(ValueError, match="11 rows, this stream has 10"):
    stream.load_state_dict({"epoch": 0, "position": 0, "seed": 1, "size": 11})
  with pytest.raises(ValueError, match="invalid"):
    stream.load_state_dict({"epoch": 0, "position": 10, "seed": 1})
  with pytest.raises(ValueError):
    PromptStream(0)


def test_a_damaged_cache_that_reads_back_empty_rows_is_a_named_error(tmp_path) -> None:
  """A prepared dataset is reused as it is. Its shard cut at a 64 KiB block boundary reads back rows of
  nothing (every field None) instead of failing: reading one names the cache and what to do."""
  import glob

  path = tmp_path / "a.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": f"a{i}"}) + "\n" for i in range(50)))
  source = load_prompt_source("jsonl", str(path), tmp_path / "cache", split="train")
  assert source[0] == {"prompt": "p0", "answer": "a0", "source_line": 1}
  (shard,) = glob.glob(os.path.join(source.builder.data_dir, "*.array_record*"))
  assert os.path.getsize(shard) > 65536
  with open(shard, "r+b") as f:
    f.truncate(65536)
  again = load_prompt_source("jsonl", str(path), tmp_path / "cache", split="train")
  with pytest.raises(RuntimeError, match="reads back empty \\(a damaged cache\\); delete that directory"):
    again[0]
