"""Weights & Biases, optional: the same records, histograms, samples and alarms as ``metrics.jsonl``,
``histograms.jsonl``, ``samples.jsonl`` and ``alarms.jsonl``, to a W&B run (``--wandb_project``).

TensorBoard and the JSON-lines files stay the record of the run; W&B is a view of it.  Decisions:

* One W&B run per run directory: its id is kept in ``RUN_DIR/wandb_id``, and a resume continues it
  (``resume="allow"``).
* The x axis is the trainer's step, logged as ``rl_step`` (``define_metric`` makes it every key's
  step metric), not W&B's own step: W&B refuses a step lower than one it has seen, and a rollback or
  a resume writes steps again.  Rewritten steps therefore show twice on the ``rl_step`` axis, which is
  what happened (the JSON-lines files keep only the surviving ones).
* ``--wandb_mode=offline`` writes the run under ``RUN_DIR/wandb/`` with no network (``wandb sync``
  uploads it later); ``disabled`` makes every call a no-op.
* Only process 0 logs (like every run-directory file).  W&B's own failure to start (no network in
  online mode, a bad key) is reported and the run goes on without it.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["WandbSink", "open_wandb"]

ID_FILE = "wandb_id"


class WandbSink:
  """Logs each step's record, histograms, samples and alarms to one W&B run."""

  def __init__(self, run: Any, wandb: Any):
    self.run = run
    self._wandb = wandb
    self._alarms: list[Mapping[str, Any]] = []

  def alarm(self, row: Mapping[str, Any]) -> None:
    """An ``alarms.jsonl`` row: sent as the ``alarms`` table of the next logged step (the alarm's own
    step, or after a rollback the first redone one), so W&B's history keeps one row per step."""
    self._alarms.append(row)

  def log(
    self,
    record: Mapping[str, Any],
    histograms: Mapping[str, np.ndarray] | None = None,
    samples: Sequence[Mapping[str, Any]] = (),
  ) -> None:
    data: dict[str, Any] = {"rl_step": int(record["step"])}
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
        data[k] = v
    for k, values in (histograms or {}).items():
      x = np.asarray(values, np.float64).ravel()
      x = x[np.isfinite(x)]
      if x.size:
        data[k] = self._wandb.Histogram(x)
    if samples:
      # Every field of a samples.jsonl row; the reward components as one JSON column.
      columns = [
        "step",
        "kind",
        "prompt_id",
        "uid",
        "task",
        "batch_id",
        "policy_version",
        "temperature",
        "top_k",
        "top_p",
        "reward",
        "correct",
        "components",
        "length",
        "finish_reason",
        "kl",
        "prompt_kl",
        "prompt",
        "completion",
      ]
      rows = [[json.dumps(s[c]) if c == "components" and c in s else s.get(c) for c in columns] for s in samples]
      data["samples"] = self._wandb.Table(columns=columns, data=rows)
    if self._alarms:
      columns = ["step", "kind", "onset", "evidence", "look first at", "action"]
      rows = [
        [a["step"], a["kind"], a["onset"], json.dumps(a["evidence"]), a["diagnosis"][0], a["action"]]
        for a in self._alarms
      ]
      data["alarms"] = self._wandb.Table(columns=columns, data=rows)
      self._alarms = []
    self.run.log(data)

  def close(self) -> None:
    self.run.finish()


def open_wandb(run_dir: str, *, project: str, mode: str, config: Mapping[str, Any], name: str) -> WandbSink | None:
  """Starts (or, with ``RUN_DIR/wandb_id``, resumes) the run's W&B run; None when W&B cannot start.

  Raises:
    ImportError: W&B is not installed (the ``wandb`` extra).
  """
  import wandb

  id_path = os.path.join(run_dir, ID_FILE)
  run_id = open(id_path).read().strip() if os.path.exists(id_path) else secrets.token_hex(4)
  try:
    run = wandb.init(
      project=project,
      id=run_id,
      name=name,
      resume="allow",
      dir=run_dir,
      mode=mode,
      config=dict(config),
      settings=wandb.Settings(silent=True, console="off"),
    )
  except Exception as e:  # noqa: BLE001 - W&B is a view; the run's own files stay the record
    print(f"warning: W&B did not start ({type(e).__name__}: {e}); logging to the run directory only", flush=True)
    return None
  run.define_metric("rl_step")
  run.define_metric("*", step_metric="rl_step")
  with open(id_path, "w") as f:
    f.write(run_id)
  return WandbSink(run, wandb)
