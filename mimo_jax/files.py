"""Small JSON file helpers shared by the run directory, the reports and the sweep: an atomic replace,
and readers that tolerate a file being written (a missing file is empty, a line cut by a live writer or
a kill is skipped)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

__all__ = ["read_json", "read_jsonl", "write_atomic"]


def write_atomic(path: str, text: str) -> None:
  """Replaces ``path`` with ``text`` in one step (a reader sees the old file or the new one)."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The rows of a JSON-lines file (none if absent; a line cut by a writer, or one that holds no JSON
  object, is skipped)."""
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        with contextlib.suppress(json.JSONDecodeError):
          row = json.loads(line)
          if isinstance(row, dict):
            rows.append(row)
  return rows


def read_json(path: str) -> dict[str, Any] | None:
  """A JSON file's object (None if absent, half-written, or not an object)."""
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except json.JSONDecodeError:
    return None
  return value if isinstance(value, dict) else None
