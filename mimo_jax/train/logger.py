"""Run directory outputs: ``metrics.jsonl`` (one object per step), TensorBoard events, a progress bar."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np


def _scalar(v: Any) -> float | int | str | None:
  if isinstance(v, (str, type(None))):
    return v
  if isinstance(v, (bool, np.bool_)):
    return int(v)
  if isinstance(v, (int, np.integer)):
    return int(v)
  f = float(v)
  return f if math.isfinite(f) else str(f)


class MetricsLogger:
  """Writes each step's metrics once: a JSON line, TensorBoard scalars/histograms.

  Args:
    run_dir: the run directory (created).
    tensorboard: also write TensorBoard event files under ``run_dir/tensorboard``.
  """

  def __init__(self, run_dir: str, *, tensorboard: bool = True, keep_through: int | None = None, write: bool = True):
    """Args:
    run_dir: the run directory (created).
    tensorboard: also write TensorBoard event files.
    keep_through: resuming: keep only records with ``step <= keep_through`` (later
      ones were written after the checkpoint being resumed and will be written again);
      None starts a fresh log.
    write: False: format the records and write nothing (the processes of a multi-process
      run other than process 0, so each step is logged once).
    """
    self.write = write
    if write:
      os.makedirs(run_dir, exist_ok=True)
    self.run_dir = run_dir
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._tensorboard = tensorboard
    self._file = None
    self._tb = None
    self._open(keep_through)

  def _open(self, keep_through: int | None) -> None:
    if not self.write:
      return
    kept = []
    if keep_through is not None and os.path.exists(self.path):
      with open(self.path) as f:
        for line in f:
          try:
            record = json.loads(line)
          except json.JSONDecodeError:
            continue  # a line cut by a kill
          if record.get("step", math.inf) <= keep_through:
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)
    self._file = open(self.path, "a", buffering=1)
    if self._tensorboard:
      from tensorboardX import SummaryWriter

      # purge_step hides events at or after it that an interrupted run had written.
      purge = None if keep_through is None else keep_through + 1
      self._tb = SummaryWriter(os.path.join(self.run_dir, "tensorboard"), flush_secs=10, purge_step=purge)

  def truncate(self, keep_through: int) -> None:
    """Drops records after ``keep_through`` (used by a rollback) and continues appending."""
    self.close()
    self._open(keep_through)

  def log(
    self, step: int, metrics: Mapping[str, Any], histograms: Mapping[str, np.ndarray] | None = None
  ) -> dict[str, Any]:
    """Logs one step; returns the JSON-able record written."""
    record = {"step": int(step), **{k: _scalar(v) for k, v in sorted(metrics.items())}}
    if not self.write:
      return record
    self._file.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
      for k, values in (histograms or {}).items():
        self._tb.add_histogram(k, np.asarray(values), step)
    return record

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def format_progress(record: Mapping[str, Any], keys: tuple[str, ...]) -> str:
  """A compact ``key=value`` line of the chosen metrics."""
  parts = []
  for k in keys:
    v = record.get(k)
    if isinstance(v, float):
      parts.append(f"{k}={v:.3g}")
    elif v is not None:
      parts.append(f"{k}={v}")
  return " ".join(parts)
