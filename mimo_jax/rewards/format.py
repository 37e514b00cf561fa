"""Format rewards (JSON output, required sections) and math rewards as per-sample reward sources.

Every reward here has the per-sample source signature of
:class:`mimo_jax.rewards.base.RewardSource`, ``fn(sample) -> float``, and is a
module-level function, so it can be pickled to worker processes; options are bound with
:func:`functools.partial` (``partial(sections_reward, sections=("Reasoning:",
"Answer:"))``).

* :func:`json_reward`: 1.0 if the completion is JSON matching a schema.  The JSON is
  either the whole completion or, failing that, the first fenced block tagged ``json``
  (only the first: a model cannot hedge with several).  Strict JSON: ``NaN`` and
  ``Infinity`` are refused.  The schema language is a small subset of JSON Schema,
  validated by :func:`schema_errors`; a schema using a validation keyword outside the
  subset raises rather than being half-checked, so a mistake in the data shows up as a
  failed component instead of as free reward.
* :func:`sections_reward`: the fraction of required section headers present, each at the
  start of a line.
* :func:`math_correct` / :func:`math_format`: the components of
  :func:`mimo_jax.rewards.math.math_reward` against ``sample.row["answer"]``.

Length shaping (overlong penalties) is the trainer's job, not a reward source's.
"""

from __future__ import annotations

import decimal
import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mimo_jax.rewards.base import RewardSample
from mimo_jax.rewards.math import extract_answer_with_source, math_reward

__all__ = [
  "check_schema",
  "find_json",
  "json_reward",
  "math_correct",
  "math_format",
  "schema_errors",
  "sections_reward",
]

# ---- JSON extraction ---------------------------------------------------------------------

# The first fence tagged "json" (any case) up to the next closing fence.  An unclosed fence
# (a truncated completion) does not match.
_JSON_FENCE_RE = re.compile(r"```[ \t]*json\b(.*?)```", re.IGNORECASE | re.DOTALL)


def _reject_constant(name: str) -> Any:
  raise ValueError(f"{name} is not valid JSON")


def _loads_strict(text: str) -> Any:
  """``json.loads`` without Python's extensions (``NaN``, ``Infinity``, ``-Infinity``)."""
  return json.loads(text, parse_constant=_reject_constant)


def find_json(text: str) -> tuple[Any, str] | None:
  """Finds the JSON value a completion commits to.

  The whole text (stripped) if it parses; otherwise the content of the first fenced block
  tagged ``json`` (```` ```json ... ``` ````), if it parses.  Later fenced blocks are never
  looked at.

  Args:
    text: a completion.

  Returns:
    ``(value, where)`` with ``where`` ``"whole"`` or ``"fenced"``, or None if there is no
    valid JSON in either place (a value nested deeper than Python's parser goes counts as none).
    ``value`` may be None (the JSON ``null``).
  """
  try:
    return _loads_strict(text.strip()), "whole"
  except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's parser goes
    pass
  m = _JSON_FENCE_RE.search(text)
  if m is None:
    return None
  try:
    return _loads_strict(m.group(1).strip()), "fenced"
  except (ValueError, RecursionError):
    return None


# ---- JSON schema subset ------------------------------------------------------------------

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Keywords that only describe: accepted and ignored.
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples"})
_VALIDATORS = frozenset(
  {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
  }
)


def _is_number(x: Any) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_count(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_schema(schema: Any, path: str = "#") -> None:
  """Checks that ``schema`` uses only the supported subset of JSON Schema, correctly.

  Supported: boolean schemas (``true`` accepts anything, ``false`` nothing); ``type`` (one
  of ``object array string number integer boolean null``, or a list of them);
  ``properties``, ``required``, ``additionalProperties`` (``false``, ``true`` or a schema
  for the extra properties); ``items`` (one schema for every element), ``minItems``,
  ``maxItems``; ``enum``, ``const``; ``minimum``, ``maximum``, ``exclusiveMinimum``,
  ``exclusiveMaximum`` (numbers, draft-6 style); ``minLength``, ``maxLength``.  The
  annotations ``title description $schema $id $comment default examples`` are ignored.

  Args:
    schema: the schema (a dict or a bool).
    path: where ``schema`` sits in the enclosing schema, for messages.

  Raises:
    ValueError: on any other keyword (e.g. ``pattern``, ``oneOf``, ``$ref``) or a keyword
      with a malformed value.
  """
  if isinstance(schema, bool):
    return
  if not isinstance(schema, Mapping):
    raise ValueError(f"schema at {path} must be an object or a boolean, got {type(schema).__name__}")
  unsupported = sorted(k for k in schema if k not in _VALIDATORS and k not in _ANNOTATIONS)
  if unsupported:
    raise ValueError(f"schema at {path} uses unsupported keyword(s) {unsupported}; supported: {sorted(_VALIDATORS)}")
  if "type" in schema:
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not types or any(t not in _TYPES for t in types):
      raise ValueError(
        f"schema at {path}: type must be one of {list(_TYPES)} or a non-empty list of them, got {schema['type']!r}"
      )
  if "properties" in schema:
    if not isinstance(schema["properties"], Mapping):
      raise ValueError(f"schema at {path}: properties must be an object")
    for key, sub in schema["properties"].items():
      check_schema(sub, f"{path}/properties/{key}")
  if "required" in schema:
    required = schema["required"]
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
      raise ValueError(f"schema at {path}: required must be a list of strings, got {required!r}")
  if "additionalProperties" in schema:
    check_schema(schema["additionalProperties"], f"{path}/additionalProperties")
  if "items" in schema:
    if isinstance(schema["items"], list):
      raise ValueError(f"schema at {path}: items must be a single schema (the tuple form is not supported)")
    check_schema(schema["items"], f"{path}/items")
  if "enum" in schema and not isinstance(schema["enum"], list):
    raise ValueError(f"schema at {path}: enum must be a list, got {schema['enum']!r}")
  for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
    if key in schema and not (_is_number(schema[key]) and math.isfinite(schema[key])):
      raise ValueError(f"schema at {path}: {key} must be a finite number, got {schema[key]!r}")
  for key in ("minItems", "maxItems", "minLength", "maxLength"):
    if key in schema and not _is_count(schema[key]):
      raise ValueError(f"schema at {path}: {key} must be a non-negative integer, got {schema[key]!r}")


def _json_type(x: Any) -> str:
  if x is None:
    return "null"
  if isinstance(x, bool):
    return "boolean"
  if isinstance(x, int):
    return "integer"
  if isinstance(x, float):
    return "number"
  if isinstance(x, str):
    return "string"
  if isinstance(x, list):
    return "array"
  if isinstance(x, dict):
    return "object"
  return type(x).__name__


def _has_type(x: Any, t: str) -> bool:
  if t == "integer":
    # JSON Schema counts 1.0 as an integer: JSON has one number type.
    return _is_number(x) and (isinstance(x, int) or (math.isfinite(x) and float(x).is_integer()))
  if t == "number":
    return _is_number(x)
  return _json_type(x) == t


def _json_equal(a: Any, b: Any) -> bool:
  """JSON equality: ``1 == 1.0``, but ``true != 1`` (unlike Python's ``==``)."""
  if isinstance(a, bool) or isinstance(b, bool):
    return isinstance(a, bool) and isinstance(b, bool) and a == b
  if _is_number(a) and _is_number(b):
    return a == b
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
  return type(a) is type(b) and a == b


def _validate(x: Any, schema: Any, path: str, errors: list[str]) -> None:
  if schema is True:
    return
  if schema is False:
    errors.append(f"{path}: not allowed")
    return
  if "type" in schema:
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not any(_has_type(x, t) for t in types):
      errors.append(f"{path}: expected {' or '.join(types)}, got {_json_type(x)}")
      return  # the other keywords would only repeat the mismatch
  if "enum" in schema and not any(_json_equal(x, v) for v in schema["enum"]):
    errors.append(f"{path}: {json.dumps(x)[:80]} is not one of {json.dumps(schema['enum'])[:200]}")
  if "const" in schema and not _json_equal(x, schema["const"]):
    errors.append(f"{path}: {json.dumps(x)[:80]} is not {json.dumps(schema['const'])[:200]}")
  if _is_number(x):
    if "minimum" in schema and x < schema["minimum"]:
      errors.append(f"{path}: {x} is less than the minimum {schema['minimum']}")
    if "maximum" in schema and x > schema["maximum"]:
      errors.append(f"{path}: {x} is greater than the maximum {schema['maximum']}")
    if "exclusiveMinimum" in schema and x <= schema["exclusiveMinimum"]:
      errors.append(f"{path}: {x} is not greater than {schema['exclusiveMinimum']}")
    if "exclusiveMaximum" in schema and x >= schema["exclusiveMaximum"]:
      errors.append(f"{path}: {x} is not less than {schema['exclusiveMaximum']}")
  if isinstance(x, str):
    if "minLength" in schema and len(x) < schema["minLength"]:
      errors.append(f"{path}: string shorter than {schema['minLength']}")
    if "maxLength" in schema and len(x) > schema["maxLength"]:
      errors.append(f"{path}: string longer than {schema['maxLength']}")
  if isinstance(x, list):
    if "minItems" in schema and len(x) < schema["minItems"]:
      errors.append(f"{path}: fewer than {schema['minItems']} items")
    if "maxItems" in schema and len(x) > schema["maxItems"]:
      errors.append(f"{path}: more than {schema['maxItems']} items")
    if "items" in schema:
      for i, item in enumerate(x):
        _validate(item, schema["items"], f"{path}[{i}]", errors)
  if isinstance(x, dict):
    properties = schema.get("properties", {})
    for key in schema.get("required", ()):
      if key not in x:
        errors.append(f"{path}: missing required property {key!r}")
    extra = schema.get("additionalProperties", True)
    for key, value in x.items():
      if key in properties:
        _validate(value, properties[key], f"{path}.{key}", errors)
      elif extra is False:
        errors.append(f"{path}: additional property {key!r} is not allowed")
      else:
        _validate(value, extra, f"{path}.{key}", errors)


def schema_errors(instance: Any, schema: Any) -> list[str]:
  """Validates a parsed JSON value against a schema of the supported subset (see :func:`check_schema`).

  Keywords apply to the types they are about (``properties`` to objects, ``minimum`` to
  numbers, ...) and are ignored for other types, as in JSON Schema; use ``type`` to pin
  the type.

  Args:
    instance: the value, as parsed by :func:`json.loads`.
    schema: the schema (a dict or a bool).

  Returns:
    Messages such as ``"$.user.age: expected integer, got string"``; empty if it matches.

  Raises:
    ValueError: if the schema is outside the supported subset or malformed.
  """
  check_schema(schema)
  errors: list[str] = []
  _validate(instance, schema, "$", errors)
  return errors


def json_reward(sample: RewardSample, *, schema: Mapping[str, Any] | bool | str | None = None) -> float:
  """1.0 if the completion is (or has, in its first ```` ```json ```` block) JSON matching the schema, else 0.0.

  Args:
    sample: the sample; its completion is searched with :func:`find_json`.
    schema: the schema (a dict, a bool, or the same as a JSON string).  None uses
      ``sample.row["schema"]`` (also a dict or JSON string); with no schema there either,
      any valid JSON value earns 1.0.

  Returns:
    1.0 or 0.0.

  Raises:
    ValueError: if the schema is not valid JSON, outside the supported subset or
      malformed (a data error, reported as a failed component rather than as 0).
  """
  if schema is None:
    schema = sample.row.get("schema")
  if isinstance(schema, str):
    try:
      schema = _loads_strict(schema)
    except ValueError as e:
      raise ValueError(f"schema string is not valid JSON: {e}") from None
  if schema is not None:
    check_schema(schema)
  found = find_json(sample.completion)
  if found is None:
    return 0.0
  if schema is None:
    return 1.0
  return 0.0 if schema_errors(found[0], schema) else 1.0


# ---- sections ----------------------------------------------------------------------------


def sections_reward(sample: RewardSample, *, sections: Sequence[str], require_all: bool = False) -> float:
  """The fraction of required section headers that start a line of the completion.

  Partial credit by default: a denser signal than all-or-nothing while a model learns the
  layout.  A header counts when a line starts with it, after optional indentation and an
  optional Markdown heading (``## ``) or bold (``**``) marker, so ``"Answer: 4"``,
  ``"## Answer:"`` and ``"**Answer:**"`` all have ``"Answer:"``, but ``"The Answer: 4"``
  does not.  Matching is case-sensitive and each header counts once; order and content
  are not checked.

  Args:
    sample: the sample.
    sections: the headers, e.g. ``("Reasoning:", "Answer:")``.
    require_all: give 1.0 only if every header is present, else 0.0.

  Returns:
    A value in [0, 1].

  Raises:
    TypeError: if ``sections`` is a single string.
    ValueError: if ``sections`` is empty or has an empty header.
  """
  if isinstance(sections, str):
    raise TypeError(f"sections must be a sequence of headers, not the string {sections!r}")
  sections = list(sections)
  if not sections or not all(isinstance(s, str) and s.strip() for s in sections):
    raise ValueError(f"sections must be a non-empty sequence of non-empty strings, got {sections!r}")
  found = sum(
    1
    for header in sections
    if re.search(r"^[ \t]*(?:#{1,6}[ \t]*|\*\*|__)?" + re.escape(header.strip()), sample.completion, re.MULTILINE)
  )
  if require_all:
    return 1.0 if found == len(sections) else 0.0
  return found / len(sections)


# ---- math --------------------------------------------------------------------------------


def _gold_answer(sample: RewardSample) -> str:
  """``sample.row["answer"]`` as a final answer; a full GSM8K solution gives the text after its ``####``."""
  if "answer" not in sample.row:
    raise ValueError(f"math rewards need sample.row['answer'] (the gold answer); row has keys {sorted(sample.row)}")
  answer = sample.row["answer"]
  if isinstance(answer, bool) or not isinstance(answer, (str, numbers.Real)):
    raise ValueError(f"sample.row['answer'] must be a string or a number, got {type(answer).__name__}")
  # A float as written in decimal: str() gives "1e-05", which no answer matches.
  answer = format(decimal.Decimal(repr(float(answer))), "f") if isinstance(answer, float) else str(answer)
  if "####" in answer:
    found = extract_answer_with_source(answer)
    if found is not None and found[1] == "hash":
      return found[0]
  return answer


def math_correct(sample: RewardSample, *, timeout_s: float = 1.0) -> float:
  """1.0 if the completion's final answer matches ``sample.row["answer"]``, else 0.0.

  The ``"correct"`` component of :func:`mimo_jax.rewards.math.math_reward`.  The row's
  answer may be the final answer (``"72"``, ``72``) or a whole GSM8K solution ending in
  ``#### 72``.

  Args:
    sample: the sample.
    timeout_s: time limit of the optional symbolic check.

  Raises:
    ValueError: if the row has no usable ``answer``.
  """
  return math_reward(sample.completion, _gold_answer(sample), timeout_s=timeout_s)["correct"]


def math_format(sample: RewardSample) -> float:
  """1.0 if the completion gives its final answer as ``#### x`` or ``\\boxed{x}``, else 0.0.

  The ``"format"`` component of :func:`mimo_jax.rewards.math.math_reward`; it does not
  depend on correctness (the symbolic check is skipped).

  Raises:
    ValueError: if the row has no usable ``answer``.
  """
  return math_reward(sample.completion, _gold_answer(sample), timeout_s=0.0)["format"]
