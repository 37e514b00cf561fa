"""When model-written code may run: under kernel isolation, or under Python-level guards the user accepted.

:mod:`mimo_jax.rewards.sandbox` picks its isolation mode once per process by a probe
(:func:`~mimo_jax.rewards.sandbox.isolation`): ``"namespace"`` (user, mount, network and
PID namespaces: kernel guarantees) where the kernel allows it, else ``"guard"``, a
Python-level best effort that determined code defeats.  The sandbox itself never refuses
to run in guard mode, so the decision is made here, for tasks that run untrusted code
(``runs_untrusted_code`` on the task class):

* :func:`require_isolation`, where a task is built (trainer, evaluator, dry run): without
  kernel isolation it raises :class:`~mimo_jax.config_base.ConfigError` unless
  ``--allow_weak_sandbox`` is set, in which case it warns; either way it announces the
  isolation in effect and returns the record a run stores (:func:`isolation_record`).
* :func:`check_before_running`, before each verification: the same rule in the process
  that actually runs the code.  Reward workers are separate processes that probe again,
  and a probe that fails there (e.g. for lack of memory) would otherwise fall back to
  guard mode silently.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

from absl import logging

from mimo_jax.config_base import ConfigError
from mimo_jax.rewards import sandbox

__all__ = [
  "WEAK_FLAG",
  "check_before_running",
  "describe",
  "isolation_record",
  "require_isolation",
]

WEAK_FLAG = "--allow_weak_sandbox"

# Records already announced in this process: a process that builds its task more than once (the
# dry run's vocabulary, tests) prints the isolation line and the warning once per distinct record.
_announced: set[str] = set()
_announce_lock = threading.Lock()


def describe(record: dict[str, Any]) -> str:
  """The one-line summary of an isolation record: ``mode=..., network=..., filesystem=..., ...``."""
  names = ("mode", "network", "filesystem", "processes", "proc", "uid")
  return ", ".join(f"{name}={record.get(name)}" for name in names)


def isolation_record(*, allow_weak: bool) -> dict[str, Any]:
  """The isolation in effect in this process, as stored in ``config.json`` and ``summary.json``.

  Args:
    allow_weak: whether ``--allow_weak_sandbox`` is set.

  Returns:
    Every field of :class:`~mimo_jax.rewards.sandbox.SandboxIsolation` (``dataclasses.asdict``,
    so fields added later are recorded too), plus ``allow_weak_sandbox`` (the flag) and
    ``weak_accepted`` (code runs without kernel isolation because the flag allowed it).
  """
  iso = sandbox.isolation()  # looked up on the module at call time, so tests can patch it
  return {
    **dataclasses.asdict(iso),
    "allow_weak_sandbox": bool(allow_weak),
    "weak_accepted": iso.mode != "namespace" and bool(allow_weak),
  }


def require_isolation(*, allow_weak: bool, what: str = "the task") -> dict[str, Any]:
  """Refuses to go on without kernel isolation unless weak mode is accepted; announces and returns the record.

  Called where a task that runs untrusted code is built, before any compute: the probe
  costs about 0.1 s once per process.

  Args:
    allow_weak: whether ``--allow_weak_sandbox`` is set.
    what: what runs the code, for the message (e.g. ``"--task=humaneval"``).

  Returns:
    The :func:`isolation_record`.

  Raises:
    ConfigError: no kernel isolation here and ``allow_weak`` is false; the message gives
      the probe's reason and names ``--allow_weak_sandbox``.
  """
  record = isolation_record(allow_weak=allow_weak)
  if record["mode"] != "namespace" and not allow_weak:
    raise ConfigError(
      f"{what} runs model-written code, but no kernel isolation is available on this machine (sandbox mode "
      f"{record['mode']!r}: {record['reason'] or 'no reason given'}). Fix the machine (user namespaces), or "
      f"pass {WEAK_FLAG} to accept Python-level guards only, which stop accidents, not determined code"
    )
  key = json.dumps(record, sort_keys=True, default=str)
  with _announce_lock:
    first = key not in _announced
    _announced.add(key)
  if first:
    print(f"sandbox isolation: {describe(record)}", flush=True)
    if record["weak_accepted"]:
      message = (
        f"warning: {what} runs model-written code WITHOUT kernel isolation ({record['reason']}); "
        f"{WEAK_FLAG} accepts Python-level guards only, which determined code defeats"
      )
      print(message, flush=True)
      logging.warning(message)
  return record


def check_before_running(*, allow_weak: bool) -> None:
  """Raises unless this process may run untrusted code now (see the module docstring).

  Args:
    allow_weak: whether guard mode was accepted (``--allow_weak_sandbox``).

  Raises:
    sandbox.SandboxError: this process's sandbox has no kernel isolation and ``allow_weak``
      is false; the code is not run (a reward worker records the sample as a failure).
  """
  iso = sandbox.isolation()
  if iso.mode != "namespace" and not allow_weak:
    raise sandbox.SandboxError(
      f"refusing to run model-written code: no kernel isolation in this process (sandbox mode {iso.mode!r}: "
      f"{iso.reason or 'no reason given'}) and {WEAK_FLAG} is not set"
    )
