"""Run directory outputs: ``metrics.jsonl`` (one object per step), ``samples.jsonl`` (the sample replay,
rows per step), TensorBoard events, a progress bar."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
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


GIB = 1024**3


def memory_metrics(stats: Sequence[Mapping[str, Any] | None]) -> dict[str, float]:
  """``mem_in_use_gib`` / ``mem_peak_gib`` (the largest over the devices) and ``mem_limit_gib`` (the
  smallest) from the devices' ``memory_stats()``; empty when the backend reports none (CPU)."""
  stats = [s for s in stats if s and "bytes_in_use" in s]
  if not stats:
    return {}
  out = {
    "mem_in_use_gib": max(s["bytes_in_use"] for s in stats) / GIB,
    "mem_peak_gib": max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats) / GIB,
  }
  limits = [s["bytes_limit"] for s in stats if s.get("bytes_limit")]
  if limits:
    out["mem_limit_gib"] = min(limits) / GIB
  return out


def device_memory() -> dict[str, float]:
  """:func:`memory_metrics` of this process's devices (the backend's allocator statistics)."""
  import jax

  stats = []
  for d in jax.local_devices():
    if d.platform == "cpu":  # the CPU backend keeps no allocator statistics: not asked every step
      continue
    try:
      stats.append(d.memory_stats())
    except Exception:  # a backend without allocator statistics
      stats.append(None)
  return memory_metrics(stats)


# The quantiles of each histogram kept in ``histograms.jsonl``: 0%, 5%, ..., 100% (each interval holds
# a twentieth of the values; a point mass shows as equal neighbours), enough for the report's heatmaps.
QUANTILES = tuple(i / 20 for i in range(21))


def histogram_quantiles(values: Any) -> list[float] | None:
  """The :data:`QUANTILES` of a histogram's finite values (6 significant digits; None when there are none)."""
  x = np.asarray(values, np.float64).ravel()
  x = x[np.isfinite(x)]
  if x.size == 0:
    return None
  return [float(f"{q:.6g}") for q in np.quantile(x, QUANTILES)]


class MetricsLogger:
  """Writes each step's metrics once: a JSON line, TensorBoard scalars/histograms.

  ``metrics.jsonl`` holds the scalars, ``samples.jsonl`` the sample replay, ``histograms.jsonl`` each
  histogram's quantiles (:func:`histogram_quantiles`; the run report draws them as heatmaps).

  Args:
    run_dir: the run directory (created).
    tensorboard: also write TensorBoard event files under ``run_dir/tensorboard``.
  """

  def __init__(
    self,
    run_dir: str,
    *,
    tensorboard: bool = True,
    keep_through: int | None = None,
    write: bool = True,
    wandb: Any = None,
  ):
    """Args:
    run_dir: the run directory (created).
    tensorboard: also write TensorBoard event files.
    keep_through: resuming: keep only records with ``step <= keep_through`` (later
      ones were written after the checkpoint being resumed and will be written again);
      None starts a fresh log.
    write: False: format the records and write nothing (the processes of a multi-process
      run other than process 0, so each step is logged once).
    wandb: a :class:`~mimo_jax.train.wandb_sink.WandbSink` that gets every record too (None: off);
      kept across :meth:`truncate`, closed by :meth:`close`.
    """
    self.write = write
    self._wandb = wandb if write else None
    if write:
      os.makedirs(run_dir, exist_ok=True)
    self.run_dir = run_dir
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self.samples_path = os.path.join(run_dir, "samples.jsonl")
    self.alarms_path = os.path.join(run_dir, "alarms.jsonl")
    self.histograms_path = os.path.join(run_dir, "histograms.jsonl")
    self._tensorboard = tensorboard
    self._file = None
    self._samples = None
    self._histograms = None
    self._tb = None
    self._open(keep_through)
    # Alarms are history: a rollback keeps the alarm that caused it (truncate() leaves this file alone);
    # a resume drops the ones of steps it will redo.
    self._alarms = self._reopen(self.alarms_path, keep_through)[0] if write else None

  @staticmethod
  def _reopen(path: str, keep_through: int | None):
    """Opens a JSON-lines file for appending, keeping only its rows with ``step <= keep_through``;
    returns the file and the last step kept (-1: none)."""
    kept, last = [], -1
    if keep_through is not None and os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            record = json.loads(line)
          except json.JSONDecodeError:
            continue  # a line cut by a kill
          if record.get("step", math.inf) <= keep_through:
            kept.append(line if line.endswith("\n") else line + "\n")
            last = max(last, record["step"])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, path)
    return open(path, "a", buffering=1), last  # noqa: SIM115 - closed by close()

  def _open(self, keep_through: int | None) -> None:
    self.last_step = -1  # the last step in metrics.jsonl
    if not self.write:
      return
    self._file, self.last_step = self._reopen(self.path, keep_through)
    self._samples, _ = self._reopen(self.samples_path, keep_through)
    self._histograms, _ = self._reopen(self.histograms_path, keep_through)
    if self._tensorboard:
      from tensorboardX import SummaryWriter

      # purge_step hides events at or after it that an interrupted run had written.
      purge = None if keep_through is None else keep_through + 1
      self._tb = SummaryWriter(os.path.join(self.run_dir, "tensorboard"), flush_secs=10, purge_step=purge)

  def truncate(self, keep_through: int) -> None:
    """Drops metrics, samples and histograms after ``keep_through`` (used by a rollback) and continues
    appending."""
    self._close_logs()
    self._open(keep_through)

  def write_alarm(self, row: Mapping[str, Any]) -> None:
    """Appends one ``alarms.jsonl`` row (process 0)."""
    if self._alarms is not None:
      self._alarms.write(json.dumps(row) + "\n")
    if self._wandb is not None:
      self._wandb.alarm(row)

  def log(
    self,
    step: int,
    metrics: Mapping[str, Any],
    histograms: Mapping[str, np.ndarray] | None = None,
    samples: Sequence[Mapping[str, Any]] = (),
  ) -> dict[str, Any]:
    """Logs one step (and its sample-replay rows, each with its ``step``); returns the JSON-able record."""
    return self.write_record(self.record(step, metrics), histograms, samples)

  @staticmethod
  def record(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-able record of one step's metrics, as :meth:`log` writes it."""
    return {"step": int(step), **{k: _scalar(v) for k, v in sorted(metrics.items())}}

  def write_record(
    self,
    record: dict[str, Any],
    histograms: Mapping[str, np.ndarray] | None = None,
    samples: Sequence[Mapping[str, Any]] = (),
  ) -> dict[str, Any]:
    """Writes a record made by :meth:`record` (and the step's samples); returns it."""
    step = record["step"]
    if not self.write:
      return record
    self.last_step = max(self.last_step, step)
    self._file.write(json.dumps(record) + "\n")
    for row in samples:
      self._samples.write(json.dumps(row, allow_nan=False) + "\n")
    if histograms:
      self.write_quantiles(step, {k: histogram_quantiles(v) for k, v in histograms.items()})
    if self._wandb is not None:
      self._wandb.log(record, histograms, samples)
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
      for k, values in (histograms or {}).items():
        self._tb.add_histogram(k, np.asarray(values), step)
      if samples:
        from mimo_jax.train.samples import samples_markdown

        self._tb.add_text("samples", samples_markdown(list(samples)), step)
    return record

  def write_quantiles(self, step: int, quantiles: Mapping[str, list[float] | None]) -> None:
    """Appends one ``histograms.jsonl`` row: each histogram's :func:`histogram_quantiles`."""
    if self._histograms is not None and quantiles:
      self._histograms.write(json.dumps({"step": int(step), **dict(sorted(quantiles.items()))}) + "\n")

  def _close_logs(self) -> None:
    for name in ("_file", "_samples", "_histograms"):
      if getattr(self, name) is not None:
        getattr(self, name).close()
        setattr(self, name, None)
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def close(self) -> None:
    self._close_logs()
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None
    if self._alarms is not None:
      self._alarms.close()
      self._alarms = None


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
