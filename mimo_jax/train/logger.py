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

  def __init__(self, run_dir: str, *, tensorboard: bool = True):
    os.makedirs(run_dir, exist_ok=True)
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._file = open(self.path, "a", buffering=1)
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), flush_secs=10)

  def log(
    self, step: int, metrics: Mapping[str, Any], histograms: Mapping[str, np.ndarray] | None = None
  ) -> dict[str, Any]:
    """Logs one step; returns the JSON-able record written."""
    record = {"step": int(step), **{k: _scalar(v) for k, v in sorted(metrics.items())}}
    self._file.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
      for k, values in (histograms or {}).items():
        self._tb.add_histogram(k, np.asarray(values), step)
    return record

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


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
