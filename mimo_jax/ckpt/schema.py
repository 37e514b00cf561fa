"""Validation of checkpoint metadata against the versioned JSON schemas in ``checkpoints_schema/``.

A small validator for the JSON-Schema subset the schemas use (``type``, ``required``,
``properties``, ``additionalProperties``, ``items``, ``enum``, ``minimum``), so that no
schema library is needed at run time.  Reading is versioned: this code writes
:data:`SCHEMA_VERSION` and reads every version in :data:`READABLE_VERSIONS`, upgrading
older metadata in :func:`upgrade`; a newer version is refused with a clear message.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)

_TYPES = {
  "object": dict,
  "array": list,
  "string": str,
  "integer": int,
  "number": (int, float),
  "boolean": bool,
}


class SchemaError(ValueError):
  """Checkpoint metadata that does not match its schema."""


def _schema_dir() -> str:
  try:
    import mimo_jax.checkpoints_schema as pkg

    return os.path.dirname(pkg.__file__)
  except ImportError:  # running from a source tree without installation
    return os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints_schema")


@functools.cache
def load_schema(version: int = SCHEMA_VERSION) -> dict[str, Any]:
  with open(os.path.join(_schema_dir(), f"checkpoint_meta.v{version}.json")) as f:
    return json.load(f)


def _check(value: Any, schema: dict[str, Any], path: str) -> None:
  t = schema.get("type")
  if t is not None:
    expected = _TYPES[t]
    ok = isinstance(value, expected) and not (t in ("integer", "number") and isinstance(value, bool))
    if not ok:
      raise SchemaError(f"{path}: expected {t}, got {type(value).__name__}")
  if "enum" in schema and value not in schema["enum"]:
    raise SchemaError(f"{path}: {value!r} is not one of {schema['enum']}")
  if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
    raise SchemaError(f"{path}: {value} is below the minimum {schema['minimum']}")
  if isinstance(value, dict):
    for key in schema.get("required", ()):
      if key not in value:
        raise SchemaError(f"{path}: missing required field {key!r}")
    props = schema.get("properties", {})
    for key, sub in value.items():
      if key in props:
        _check(sub, props[key], f"{path}.{key}")
      elif isinstance(schema.get("additionalProperties"), dict):
        _check(sub, schema["additionalProperties"], f"{path}.{key}")
  if isinstance(value, list) and "items" in schema:
    for i, item in enumerate(value):
      _check(item, schema["items"], f"{path}[{i}]")


def validate(meta: dict[str, Any]) -> None:
  """Raises SchemaError unless ``meta`` matches the schema of its ``schema_version``."""
  version = meta.get("schema_version")
  if not isinstance(version, int):
    raise SchemaError("checkpoint metadata has no integer schema_version")
  if version not in READABLE_VERSIONS:
    raise SchemaError(
      f"checkpoint metadata schema version {version} is not readable by this mimo-jax "
      f"(reads versions {list(READABLE_VERSIONS)}; upgrade mimo-jax to read newer checkpoints)"
    )
  _check(meta, load_schema(version), "meta")


def upgrade(meta: dict[str, Any]) -> dict[str, Any]:
  """Validates ``meta`` and converts it to the current schema version."""
  validate(meta)
  meta = dict(meta)
  # Conversions, oldest first.
  if meta["schema_version"] == 1:
    # Version 1 predates the guarded optimizer: its array half holds the bare chain's state.
    meta.update(schema_version=2, optimizer_layout=1)
  return meta
