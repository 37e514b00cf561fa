"""Ownership of a run directory: one trainer at a time, and no silent restart over someone else's run.

A trainer holds an exclusive ``flock`` on ``<run_dir>/.lock`` for its whole life (the kernel
drops it when the process dies, even by SIGKILL, so a crash never leaves a stale lock); the
file records the holder's pid for the error message.  Readers (evaluation, export) take no
lock and never delete anything (``Checkpointer(read_only=True)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from mimo_jax.ckpt import Checkpointer
from mimo_jax.config import CONCERN_CLASSES
from mimo_jax.config_base import ConfigError, coerce_value
from mimo_jax.files import write_atomic
from mimo_jax.train.logger import MetricsLogger

LOCK_NAME = ".lock"
# What makes two runs the same run: a resume with any of these changed would train another model.
IDENTITY = {
  "model": (
    "model_preset",
    "hf_checkpoint",
    "vocab_size",
    "param_dtype",
    "max_seq_len",
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
  ),
  "data": ("task", "tokenizer_path", "arith_levels", "arith_reverse", "data_path"),
  "rollout": ("num_samples",),
  "data_rows": ("prompts_per_step",),
  # Checkpoints are numbered SFT steps first: another count would renumber the run's RL checkpoints.
  "run": ("sft_steps",),
}
# Files a fresh start in place replaces (with --overwrite).
RUN_FILES = (
  "checkpoints",
  "reference",
  "best",
  "checkpoints.unreadable",  # unreadable checkpoints moved aside on resume (`Checkpointer.restore_latest`)
  "reference.unreadable",
  "best.unreadable",
  "metrics.jsonl",
  "samples.jsonl",
  "histograms.jsonl",
  "alarms.jsonl",
  "report.html",
  "wandb",
  "wandb_id",
  "summary.json",
  "tensorboard",
  "eval_curve.jsonl",  # `python -m mimo_jax.eval --all`'s rows of the old run's checkpoints
  "config.json",
)


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


def identity_mismatches(
  previous: dict[str, Any], current: dict[str, Any], settings: Mapping[str, Sequence[str]] = IDENTITY
) -> list[str]:
  """``--flag: old -> new`` for every identity setting that differs between two ``Config.to_dict()``s.

  Only the ``settings`` (section -> names; default :data:`IDENTITY`) count: other keys of a
  ``config.json`` (the ``sandbox`` record of the machine, which a resume elsewhere may change) are
  ignored.
  """
  out = []
  for section, names in settings.items():
    section = "data" if section == "data_rows" else section
    fields = {f.name: f for f in dataclasses.fields(CONCERN_CLASSES[section])}
    for name in names:
      # A setting added after the run was written counts as its default there.
      default = fields[name].default
      old, new = previous.get(section, {}).get(name, default), current.get(section, {}).get(name, default)
      # Compared as the field's type: a config.json holds a tuple as a list (or, written before
      # list settings were tuples, as its command-line text).
      if old is not None:
        old = coerce_value(fields[name], old)
      if new is not None:
        new = coerce_value(fields[name], new)
      if old != new:
        out.append(f"--{name}: {old!r} -> {new!r}")
  return out


# Where this command runs or stops, not what it trains: never a change of the run's configuration.
NOT_SETTINGS = frozenset({"run_dir", "stop_at_step", "overwrite"})


def setting_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """``--flag: old -> new`` for every setting (but :data:`NOT_SETTINGS`) that differs between two
  ``Config.to_dict()``s."""
  settings = {
    section: tuple(f.name for f in dataclasses.fields(cls) if f.name not in NOT_SETTINGS)
    for section, cls in CONCERN_CLASSES.items()
  }
  return identity_mismatches(previous, current, settings)


def config_json(
  config: dict[str, Any], *, sandbox: dict[str, Any] | None = None, provenance: dict[str, Any] | None = None
) -> str:
  """The text of a run's ``config.json``: ``Config.to_dict()``, plus the ``sandbox`` record for tasks that run code.

  The record (:func:`mimo_jax.rewards.sandbox_policy.isolation_record`) describes the machine
  the run last started on, not a setting: :func:`identity_mismatches` never looks at it, and
  readers that rebuild a Config skip it (``mimo_jax.config.RUN_RECORD_KEYS``).  Without a
  record the text is exactly ``Config.to_json()``.  ``provenance`` (:func:`mimo_jax.provenance.provenance`:
  the code version and the libraries of the start) is such a record too.
  """
  data = dict(config)
  if sandbox is not None:
    data["sandbox"] = sandbox
  if provenance is not None:
    data["provenance"] = provenance
  return json.dumps(data, indent=2, sort_keys=True)


def read_config(run_dir: str) -> dict[str, Any] | None:
  """The ``config.json`` a run directory holds (None when there is none); a broken one is an error."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path}: unreadable ({e}); pass --overwrite to start afresh in this directory") from None
  sections = {"data" if s == "data_rows" else s for s in IDENTITY}
  if not isinstance(data, dict) or any(not isinstance(data.get(s, {}), dict) for s in sections):
    raise ConfigError(
      f"{path}: not a run's configuration (a JSON object of sections); pass --overwrite to start afresh in "
      "this directory"
    )
  return data


# Where --overwrite sets the old run's files aside until the new run is built (then they are deleted).
SET_ASIDE = ".overwritten"


def set_aside(run_dir: str) -> None:
  """Moves a run's files into ``SET_ASIDE`` (for ``--overwrite``; one left by a start killed before
  it settled is deleted first): :func:`put_back` restores them, :meth:`RunDir.settle_overwrite`
  deletes them once the new run is built."""
  aside = os.path.join(run_dir, SET_ASIDE)
  if os.path.isdir(aside):
    shutil.rmtree(aside)
  os.makedirs(aside)
  for name in RUN_FILES:
    if os.path.lexists(os.path.join(run_dir, name)):
      os.rename(os.path.join(run_dir, name), os.path.join(aside, name))


def put_back(run_dir: str) -> None:
  """Undoes :func:`set_aside`: deletes the run files made since and moves the old ones back."""
  aside = os.path.join(run_dir, SET_ASIDE)
  if not os.path.isdir(aside):
    return
  for name in RUN_FILES:
    path = os.path.join(run_dir, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    elif os.path.lexists(path):
      os.remove(path)
  for name in os.listdir(aside):
    os.rename(os.path.join(aside, name), os.path.join(run_dir, name))
  os.rmdir(aside)


class RunDir:
  """Every file of one run, owned in one place.

  ``<path>/`` holds ``config.json`` (the configuration, plus the machine's sandbox record for
  tasks that run code), ``metrics.jsonl`` and ``tensorboard/`` (the logger), ``checkpoints/``
  and ``reference/`` (Orbax), ``summary.json`` (written once, when the run completes) and
  ``.lock`` (held by the one live trainer).  The trainer reaches these files only through this
  object; readers (evaluation, export) open checkpoints read-only and never delete anything.

  In a multi-process run every process holds a ``RunDir`` of the same (shared) directory; only the
  writer (process 0) takes the lock, claims the directory and writes its files, and the others'
  writes are no-ops.  Checkpoints are the exception: every process writes its own shards (Orbax).

  Args:
    path: the run directory (created on first write).
    writer: whether this process writes the run's files (process 0 of a multi-process run).
  """

  CONFIG = "config.json"
  METRICS = "metrics.jsonl"
  SUMMARY = "summary.json"
  CHECKPOINTS = "checkpoints"
  REFERENCE = "reference"
  BEST = "best"

  def __init__(self, path: str, *, writer: bool = True):
    self.path = path
    self.writer = writer

  def file(self, name: str) -> str:
    """The path of one of the run's files (e.g. ``RunDir.SUMMARY``)."""
    return os.path.join(self.path, name)

  # ---- ownership ----------------------------------------------------------------------------

  def lock(self) -> RunDirLock | contextlib.nullcontext:
    """Takes the directory's exclusive lock (for the trainer's life; raises :class:`RunDirInUse`); a
    non-writer takes none (its writer holds it for the whole run)."""
    return RunDirLock(self.path) if self.writer else contextlib.nullcontext()

  def claim(self, config: dict[str, Any], *, overwrite: bool) -> None:
    """Refuses a directory holding another configuration's run unless ``overwrite``, which sets its files
    aside until :meth:`settle_overwrite` deletes them or puts them back.

    Args:
      config: the new run's ``Config.to_dict()``.
      overwrite: ``--overwrite``.

    Raises:
      ConfigError: the directory's run differs in an :data:`IDENTITY` setting, naming each one.
    """
    if not self.writer:
      return
    if overwrite:  # the old run's config.json is not read: a broken one is replaced too
      set_aside(self.path)
      return
    previous = read_config(self.path)
    if previous is not None:
      mismatches = identity_mismatches(previous, config)
      if mismatches:
        raise ConfigError(
          f"--run_dir={self.path} holds another configuration's run ({'; '.join(mismatches)}); resuming would "
          "train another model. Pass --overwrite to replace it, or choose another --run_dir"
        )

  def settle_overwrite(self, *, started: bool) -> None:
    """After ``claim(overwrite=True)``: the old run's files are deleted once the new run is built
    (``started``), or put back when it is refused (nothing of the old run is lost to a refusal)."""
    if not self.writer:
      return
    if started:
      shutil.rmtree(os.path.join(self.path, SET_ASIDE), ignore_errors=True)
    else:
      put_back(self.path)

  # ---- files --------------------------------------------------------------------------------

  def read_config(self) -> dict[str, Any] | None:
    return read_config(self.path)

  def write_config(
    self, config: dict[str, Any], *, sandbox: dict[str, Any] | None = None, provenance: dict[str, Any] | None = None
  ) -> None:
    """Replaces ``config.json`` atomically (see :func:`config_json`)."""
    if not self.writer:
      return
    os.makedirs(self.path, exist_ok=True)
    write_atomic(self.file(self.CONFIG), config_json(config, sandbox=sandbox, provenance=provenance))

  def read_summary(self) -> dict[str, Any] | None:
    """The completed run's ``summary.json`` (None before the run completes)."""
    if not os.path.exists(self.file(self.SUMMARY)):
      return None
    with open(self.file(self.SUMMARY)) as f:
      return json.load(f)

  def write_summary(self, summary: dict[str, Any]) -> None:
    if not self.writer:
      return
    write_atomic(self.file(self.SUMMARY), json.dumps(summary, indent=2))

  def checkpointer(self, **options: Any) -> Checkpointer:
    """The run's checkpoints (``checkpoints/``); ``options`` go to :class:`~mimo_jax.ckpt.Checkpointer`."""
    return Checkpointer(self.file(self.CHECKPOINTS), **options)

  def reference_checkpointer(self) -> Checkpointer:
    """The frozen reference policy, saved once at the SFT -> RL transition (``reference/``)."""
    return Checkpointer(self.file(self.REFERENCE), keep_last=1, async_save=False)

  def best_checkpointer(self) -> Checkpointer:
    """The checkpoint with the best held-out metric so far (``best/``, ``--keep_best``)."""
    return Checkpointer(self.file(self.BEST), keep_last=1, async_save=False)

  def logger(self, *, tensorboard: bool, keep_through: int | None, wandb: Any = None) -> MetricsLogger:
    """The metrics logger (``metrics.jsonl``, ``tensorboard/``, and W&B when given), truncated past
    ``keep_through`` on a resume."""
    return MetricsLogger(self.path, tensorboard=tensorboard, keep_through=keep_through, write=self.writer, wandb=wandb)
