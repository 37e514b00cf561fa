"""Reward functions with scripted misbehaviour, for tests of :mod:`mimo_jax.rewards.base`.

They live in an importable module because per-sample reward functions run in worker
processes started with ``forkserver`` or ``spawn``, which import a function by its module
and name; functions defined in a test file could not be found there.

:func:`scripted` reads what to do from ``sample.row["action"]``, so one batch can mix
well-behaved samples with ones that raise, hang or kill their worker.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence

from mimo_jax.rewards.base import RewardSample

__all__ = [
  "ExitOnUnpickle",
  "batched_length",
  "batched_raises",
  "batched_row_value",
  "batched_wrong_length",
  "fails_on_multiples",
  "row_value",
  "scripted",
  "worker_pid",
]


def scripted(sample: RewardSample) -> object:
  """Behaves as ``sample.row["action"]`` says (default ``"value"``).

  Actions: ``"value"`` returns ``row["value"]`` (default 1.0) as given; ``"raise"`` raises
  ``ValueError("scripted failure")``; ``"hang"`` sleeps for an hour; ``"spin"`` busy-loops
  for an hour; ``"exit"`` calls ``os._exit(3)`` (after ``row["seconds"]``, default 0); ``"sys_exit"`` raises ``SystemExit(2)``;
  ``"segv"`` kills its own process with SIGSEGV; ``"sleep"`` sleeps ``row["seconds"]``
  then returns ``row["value"]``; ``"sandbox_hang"`` runs code that sleeps for an hour in the code
  sandbox (:func:`mimo_jax.rewards.sandbox.run_python`, an hour's limit).
  """
  action = sample.row.get("action", "value")
  if action == "value":
    return sample.row.get("value", 1.0)
  if action == "raise":
    raise ValueError("scripted failure")
  if action == "hang":
    time.sleep(3600)
  elif action == "spin":
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
      pass
  elif action == "exit":
    time.sleep(sample.row.get("seconds", 0.0))
    sys.stdout.flush()
    os._exit(3)
  elif action == "sys_exit":
    raise SystemExit(2)
  elif action == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)
  elif action == "sleep":
    time.sleep(float(sample.row["seconds"]))
    return sample.row.get("value", 1.0)
  elif action == "sandbox_hang":
    from mimo_jax.rewards.sandbox import run_python

    run_python("import time\ntime.sleep(3600)", timeout_s=3600)
  raise ValueError(f"unknown action {action!r}")


def row_value(sample: RewardSample, *, key: str = "value") -> float:
  """``float(sample.row[key])``; a missing key raises ``KeyError``."""
  return float(sample.row[key])


def worker_pid(sample: RewardSample) -> float:
  """The id of the process evaluating the sample."""
  del sample
  return float(os.getpid())


def batched_length(samples: Sequence[RewardSample]) -> list[float]:
  """Batched source: the completion length in characters of each sample."""
  return [float(len(s.completion)) for s in samples]


def batched_row_value(samples: Sequence[RewardSample], *, key: str = "value") -> list[object]:
  """Batched source: ``sample.row[key]`` of each sample, as given (so it may be non-numeric)."""
  return [s.row[key] for s in samples]


def batched_raises(samples: Sequence[RewardSample]) -> list[float]:
  """Batched source that always fails, like a reward-model server that is down."""
  raise RuntimeError(f"judge unavailable for {len(samples)} samples")


def batched_wrong_length(samples: Sequence[RewardSample]) -> list[float]:
  """Batched source that returns one value too few."""
  return [1.0] * (len(samples) - 1)


class ExitOnUnpickle:
  """A reward function whose unpickling exits the process, like a worker whose imports crash.

  Calling it in-process returns 1.0; a worker process dies (exit code 5) while loading it.
  """

  def __call__(self, sample: RewardSample) -> float:
    del sample
    return 1.0

  def __reduce__(self) -> tuple[object, tuple[int]]:
    return os._exit, (5,)


def fails_on_multiples(sample: RewardSample, k: int = 3) -> float:
  """1.0, or raises ``ValueError`` when the completion is a number divisible by ``k``: a failure decided by
  the text alone, so that a run over any number of processes fails on the same rows."""
  text = sample.completion.strip()
  if text.isdigit() and int(text) % k == 0:
    raise ValueError(f"{text} is a multiple of {k}")
  return 1.0
