"""Counting XLA compilations (for no-recompile tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """How many backend compilations happened inside :func:`count_compilations`."""

  def __init__(self):
    self.count = 0

  def _listener(self, event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
      self.count += 1


@contextlib.contextmanager
def count_compilations() -> Iterator[CompileCounter]:
  """Counts XLA backend compilations (cache hits are not compilations)."""
  counter = CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter._listener)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(counter._listener)
