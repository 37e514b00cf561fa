"""Ownership of a run directory: one trainer at a time, and no silent restart over someone else's run.

A trainer holds an exclusive ``flock`` on ``<run_dir>/.lock`` for its whole life (the kernel
drops it when the process dies, even by SIGKILL, so a crash never leaves a stale lock); the
file records the holder's pid for the error message.  Readers (evaluation, export) take no
lock and never delete anything (``Checkpointer(read_only=True)``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from typing import Any

from mimo_jax.config_base import ConfigError

LOCK_NAME = ".lock"
# What makes two runs the same run: a resume with any of these changed would train another model.
IDENTITY = {
  "model": ("model_preset", "hf_checkpoint", "vocab_size", "param_dtype", "max_seq_len"),
  "data": ("task", "tokenizer_path", "arith_levels", "arith_reverse", "data_path"),
  "rollout": ("num_samples",),
  "data_rows": ("prompts_per_step",),
}
# Files a fresh start in place replaces (with --overwrite).
RUN_FILES = ("checkpoints", "reference", "metrics.jsonl", "summary.json", "tensorboard", "config.json")


class RunDirInUse(ConfigError):
  """Another live process holds the run directory."""


class RunDirLock:
  """The exclusive lock of a run directory (a context manager)."""

  def __init__(self, run_dir: str):
    os.makedirs(run_dir, exist_ok=True)
    self.path = os.path.join(run_dir, LOCK_NAME)
    self._file = open(self.path, "a+")  # noqa: SIM115 - held for the trainer's life
    try:
      fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self._file.seek(0)
      holder = self._file.read().strip() or "unknown"
      self._file.close()
      raise RunDirInUse(
        f"--run_dir={run_dir}: in use by another trainer (pid {holder}); wait for it to finish, stop it, or "
        "choose another --run_dir"
      ) from None
    self._file.seek(0)
    self._file.truncate()
    self._file.write(str(os.getpid()))
    self._file.flush()

  def release(self) -> None:
    if self._file is not None and not self._file.closed:
      fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
      self._file.close()

  def __enter__(self) -> RunDirLock:
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def identity_mismatches(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """``--flag: old -> new`` for every identity setting that differs between two ``Config.to_dict()``s.

  Only the :data:`IDENTITY` settings count: other keys of a ``config.json`` (the ``sandbox``
  record of the machine, which a resume elsewhere may change) are ignored.
  """
  out = []
  for section, names in IDENTITY.items():
    section = "data" if section == "data_rows" else section
    for name in names:
      old, new = previous.get(section, {}).get(name), current.get(section, {}).get(name)
      if old != new:
        out.append(f"--{name}: {old!r} -> {new!r}")
  return out


def config_json(config: dict[str, Any], *, sandbox: dict[str, Any] | None = None) -> str:
  """The text of a run's ``config.json``: ``Config.to_dict()``, plus the ``sandbox`` record for tasks that run code.

  The record (:func:`mimo_jax.rewards.sandbox_policy.isolation_record`) describes the machine
  the run last started on, not a setting: :func:`identity_mismatches` never looks at it, and
  readers that rebuild a Config skip it (``mimo_jax.config.RUN_RECORD_KEYS``).  Without a
  record the text is exactly ``Config.to_json()``.
  """
  data = dict(config)
  if sandbox is not None:
    data["sandbox"] = sandbox
  return json.dumps(data, indent=2, sort_keys=True)


def read_config(run_dir: str) -> dict[str, Any] | None:
  """The ``config.json`` a run directory holds (None when there is none); a broken one is an error."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path}: unreadable ({e}); pass --overwrite to start afresh in this directory") from None


def clear(run_dir: str) -> None:
  """Deletes a run's files (for ``--overwrite``); other files in the directory are left alone."""
  for name in RUN_FILES:
    path = os.path.join(run_dir, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif os.path.exists(path):
      os.remove(path)


def write_atomic(path: str, text: str) -> None:
  """Replaces ``path`` with ``text`` in one step (a reader sees the old file or the new one)."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)
