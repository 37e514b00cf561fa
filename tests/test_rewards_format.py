"""Tests for ``mimo_jax.rewards.format``: JSON extraction and schema checks, section headers, math sources."""

from __future__ import annotations

import functools
import json
import pickle

import numpy as np
import pytest

from mimo_jax.rewards.base import CompositeReward, Outcome, RewardPool, RewardSample, RewardSource
from mimo_jax.rewards.format import (
  check_schema,
  find_json,
  json_reward,
  math_correct,
  math_format,
  schema_errors,
  sections_reward,
)


def _sample(completion: str, task: str = "", **row: object) -> RewardSample:
  return RewardSample(prompt="Question: ...\nAnswer:", completion=completion, row=row, task=task)


PERSON = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "address": {
      "type": "object",
      "properties": {"city": {"type": "string"}, "zip": {"type": ["string", "null"]}},
      "required": ["city"],
      "additionalProperties": False,
    },
  },
  "required": ["name", "age"],
  "additionalProperties": False,
  "description": "annotations are ignored",
}


# ---- JSON extraction ------------------------------------------------------------------------


def test_find_json_whole_and_fenced() -> None:
  assert find_json('  {"a": 1}\n') == ({"a": 1}, "whole")
  assert find_json("null") == (None, "whole")
  text = 'Here you go:\n```json\n{"a": [1, 2]}\n```\nand also\n```json\n{"b": 2}\n```'
  assert find_json(text) == ({"a": [1, 2]}, "fenced")
  assert find_json("```JSON\n[true]\n```") == ([True], "fenced")
  # Only the first json block counts, even when it is broken and a later one is fine.
  assert find_json('```json\n{"a": }\n```\n```json\n{"b": 2}\n```') is None
  # Other languages' blocks are not JSON blocks.
  assert find_json('```python\nx = 1\n```\n```json\n{"b": 2}\n```') == ({"b": 2}, "fenced")


def test_find_json_rejects_invalid_and_non_standard_json() -> None:
  assert find_json("") is None
  assert find_json("{'a': 1}") is None  # single quotes
  assert find_json('{"a": 1,}') is None  # trailing comma
  assert find_json('{"a": NaN}') is None and find_json("Infinity") is None
  assert find_json('The answer is {"a": 1}') is None  # prose around an unfenced value
  assert find_json('```json\n{"a": 1}\n') is None  # unclosed fence (truncated completion)
  # Nested past what Python's parser goes (a degenerate completion): no JSON, not an error.
  deep = "[" * 100_000 + "]" * 100_000
  assert find_json(deep) is None and find_json(f"```json\n{deep}\n```") is None
  assert json_reward(_sample(deep), schema={"type": "array"}) == 0.0


# ---- the schema subset ----------------------------------------------------------------------


def test_schema_valid_document() -> None:
  doc = {"name": "Ada", "age": 36, "role": "admin", "tags": ["x"], "address": {"city": "London", "zip": None}}
  assert schema_errors(doc, PERSON) == []
  assert schema_errors({"name": "Ada", "age": 36.0}, PERSON) == []  # 36.0 is an integer in JSON Schema


@pytest.mark.parametrize(
  ("doc", "error"),
  [
    ({"name": "Ada"}, "$: missing required property 'age'"),
    ({"name": "Ada", "age": "36"}, "$.age: expected integer, got string"),
    ({"name": "Ada", "age": 36.5}, "$.age: expected integer, got number"),
    ({"name": "Ada", "age": True}, "$.age: expected integer, got boolean"),
    ({"name": "Ada", "age": -1}, "$.age: -1 is less than the minimum 0"),
    ({"name": "Ada", "age": 200}, "$.age: 200 is greater than the maximum 150"),
    ({"name": "", "age": 1}, "$.name: string shorter than 1"),
    ({"name": "Ada", "age": 1, "role": "root"}, '$.role: "root" is not one of ["admin", "user"]'),
    ({"name": "Ada", "age": 1, "email": "a@b"}, "$: additional property 'email' is not allowed"),
    ({"name": "Ada", "age": 1, "tags": ["a", 2]}, "$.tags[1]: expected string, got integer"),
    ({"name": "Ada", "age": 1, "tags": ["a"] * 4}, "$.tags: more than 3 items"),
    ({"name": "Ada", "age": 1, "address": {"zip": "N1"}}, "$.address: missing required property 'city'"),
    (
      {"name": "Ada", "age": 1, "address": {"city": "L", "zip": 1}},
      "$.address.zip: expected string or null, got integer",
    ),
    ({"name": "Ada", "age": 1, "address": {"city": "L", "x": 1}}, "$.address: additional property 'x' is not allowed"),
    ([{"name": "Ada", "age": 1}], "$: expected object, got array"),
  ],
)
def test_schema_violations(doc: object, error: str) -> None:
  assert schema_errors(doc, PERSON) == [error]


def test_schema_json_equality_and_schema_forms() -> None:
  assert schema_errors(True, {"enum": [1, "a"]}) != []  # true is not 1 in JSON
  assert schema_errors(1.0, {"enum": [1]}) == [] and schema_errors([1, {"a": None}], {"const": [1, {"a": None}]}) == []
  assert schema_errors({"a": 1}, {"additionalProperties": {"type": "integer"}}) == []
  assert schema_errors({"a": "x"}, {"additionalProperties": {"type": "integer"}}) == [
    "$.a: expected integer, got string"
  ]
  assert schema_errors(5, True) == [] and schema_errors(5, False) == ["$: not allowed"]
  # Keywords about other types do not apply: "minimum" says nothing about a string.
  assert schema_errors("x", {"minimum": 3, "properties": {"a": False}}) == []
  assert schema_errors(3, {"exclusiveMinimum": 3}) == ["$: 3 is not greater than 3"]


@pytest.mark.parametrize(
  ("schema", "message"),
  [
    ({"type": "string", "pattern": "^a"}, r"unsupported keyword\(s\) \['pattern'\]"),
    ({"oneOf": [{"type": "string"}]}, "unsupported"),
    ({"type": "float"}, "type must be one of"),
    ({"type": []}, "type must be one of"),
    ({"required": "name"}, "required must be a list of strings"),
    ({"items": [{"type": "string"}]}, "tuple form"),
    ({"properties": {"a": {"type": "object", "$ref": "#"}}}, r"at #/properties/a uses unsupported"),
    ({"minimum": "0"}, "minimum must be a finite number"),
    ({"maxItems": -1}, "maxItems must be a non-negative integer"),
    ([], "must be an object or a boolean"),
  ],
)
def test_bad_schemas_raise(schema: object, message: str) -> None:
  with pytest.raises(ValueError, match=message):
    check_schema(schema)


# ---- json_reward ----------------------------------------------------------------------------


def test_json_reward() -> None:
  good = '{"name": "Ada", "age": 36}'
  assert json_reward(_sample(good), schema=PERSON) == 1.0
  assert json_reward(_sample(f"Sure!\n```json\n{good}\n```"), schema=PERSON) == 1.0
  assert json_reward(_sample('{"name": "Ada"}'), schema=PERSON) == 0.0  # missing required
  assert json_reward(_sample('{"name": "Ada", "age": "x"}'), schema=PERSON) == 0.0  # wrong type
  assert json_reward(_sample('{"name": "Ada", age: 36}'), schema=PERSON) == 0.0  # invalid JSON
  assert json_reward(_sample("no json here"), schema=PERSON) == 0.0
  # The schema may come from the row, as a dict or as a JSON string; the argument wins.
  assert json_reward(_sample(good, schema=PERSON)) == 1.0
  assert json_reward(_sample(good, schema=json.dumps(PERSON))) == 1.0
  assert json_reward(_sample(good, schema={"type": "array"})) == 0.0
  assert json_reward(_sample(good, schema={"type": "array"}), schema={"type": "object"}) == 1.0
  # No schema anywhere: any valid JSON.
  assert json_reward(_sample("[1, 2]")) == 1.0 and json_reward(_sample("[1, 2")) == 0.0
  with pytest.raises(ValueError, match="unsupported keyword"):
    json_reward(_sample(good), schema={"anyOf": []})
  with pytest.raises(ValueError, match="schema string is not valid JSON"):
    json_reward(_sample(good, schema="{type: object}"))


# ---- sections -------------------------------------------------------------------------------


def test_sections_reward() -> None:
  sections = ("Reasoning:", "Answer:")
  both = "Reasoning: 2 + 2 is 4.\nAnswer: 4"
  assert sections_reward(_sample(both), sections=sections) == 1.0
  assert sections_reward(_sample("Reasoning: it is 4."), sections=sections) == 0.5
  assert sections_reward(_sample("## Reasoning:\nx\n  **Answer:** 4"), sections=sections) == 1.0
  # Mid-line mentions and wrong case do not count.
  assert sections_reward(_sample("My Reasoning: x. The Answer: 4"), sections=sections) == 0.0
  assert sections_reward(_sample("reasoning: x\nanswer: 4"), sections=sections) == 0.0
  assert sections_reward(_sample("Reasoning: x"), sections=sections, require_all=True) == 0.0
  assert sections_reward(_sample(both), sections=sections, require_all=True) == 1.0
  assert sections_reward(_sample("Plan:\nReasoning:\nAnswer:"), sections=("Plan:", "Reasoning:", "Check:")) == 2 / 3
  with pytest.raises(TypeError, match="not the string"):
    sections_reward(_sample(both), sections="Answer:")
  with pytest.raises(ValueError, match="non-empty"):
    sections_reward(_sample(both), sections=())


# ---- math -----------------------------------------------------------------------------------

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
  ("completion", "answer", "correct", "formatted"),
  [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
    ("In total 48 + 24 = 72, so the answer is \\boxed{72}.", "72", 1.0, 1.0),
    ("48 + 24 = 72. The answer is 72.", "72", 1.0, 0.0),
    ("48 + 24 = 70.\n#### 70", "72", 0.0, 1.0),
    ("She sold 72 clips in total.", "72", 0.0, 0.0),  # no committed answer
    ("Total cost: $1,234.00\n#### $1,234", "1234", 1.0, 1.0),
    ("#### 72", GSM8K_SOLUTION, 1.0, 1.0),  # the row may hold the full solution
    ("#### 72", 72, 1.0, 1.0),  # or a number
    ("#### 0.00001", 1e-05, 1.0, 1.0),  # a float as its decimal, not "1e-05"
    ("#### 25000000000000000", 2.5e16, 1.0, 1.0),
    ("#### 0.5", np.float64(0.5), 1.0, 1.0),
  ],
)
def test_math_sources(completion: str, answer: object, correct: float, formatted: float) -> None:
  sample = _sample(completion, task="gsm8k", answer=answer)
  assert math_correct(sample) == correct
  assert math_format(sample) == formatted


def test_math_sources_need_an_answer() -> None:
  with pytest.raises(ValueError, match=r"need sample.row\['answer'\].*keys \['question'\]"):
    math_correct(_sample("#### 1", question="q"))
  with pytest.raises(ValueError, match="must be a string or a number"):
    math_format(_sample("#### 1", answer=None))


# ---- as reward sources ------------------------------------------------------------------------


def test_format_rewards_run_in_worker_processes() -> None:
  schema_source = functools.partial(json_reward, schema={"type": "object", "required": ["a"]})
  sections = functools.partial(sections_reward, sections=("Answer:",))
  for fn in (schema_source, sections, math_correct, math_format):
    assert pickle.loads(pickle.dumps(fn))(_sample('{"a": 1}', answer="1")) == fn(_sample('{"a": 1}', answer="1"))
  sources = [
    RewardSource("correct", math_correct, weight=1.0, tasks=("gsm8k",)),
    RewardSource("format", math_format, weight=0.25, tasks=("gsm8k",)),
    RewardSource("json", schema_source, weight=1.0, tasks=("json",)),
    RewardSource("answer_header", sections, weight=0.5),
  ]
  samples = [
    _sample("Answer: 48 + 24 = 72\n#### 72", task="gsm8k", answer=GSM8K_SOLUTION),
    _sample("The answer is 71.", task="gsm8k", answer="72"),
    _sample('```json\n{"a": 1}\n```', task="json"),
    _sample('Answer: {"b": 1}', task="json"),
  ]
  with RewardPool(num_workers=1, default_timeout_s=10.0) as pool:
    batch = CompositeReward(sources, pool=pool)(samples)
    np.testing.assert_allclose(batch.rewards, [1.0 + 0.25 + 0.5, 0.0, 1.0, 0.5])
    np.testing.assert_array_equal(batch.components["format"], [1.0, 0.0, np.nan, np.nan])
    np.testing.assert_array_equal(batch.components["json"], [np.nan, np.nan, 1.0, 0.0])
    # A bad schema in the data is a failed component, not free reward.
    bad = pool.map(json_reward, [_sample("{}", schema={"type": "object", "pattern": "x"})])
    assert bad[0].failed and "unsupported keyword(s) ['pattern']" in bad[0].error
    assert pool.map(math_correct, [_sample("#### 5", answer="5")]) == [Outcome(1.0)]
