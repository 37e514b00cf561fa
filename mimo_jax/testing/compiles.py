"""Counting XLA compilations (for no-recompile tests)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# A persistent-cache hit is a program the caller asked XLA for all the same (a retrace that
# happens to match an executable compiled earlier, perhaps by another test or process).
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


class CompileCounter:
  """How many executables were built or loaded inside :func:`count_compilations`."""

  def __init__(self):
    self.count = 0
    # (thread name, function name) of each program built or loaded, in order (``jit(f)`` as ``f``).
    self.programs: list[tuple[str, str]] = []

  def _listener(self, event: str, duration: float, **kwargs) -> None:
    if event in (_BACKEND_COMPILE_EVENT, _CACHE_HIT_EVENT):
      self.count += 1
    if event == _BACKEND_COMPILE_EVENT:  # around the persistent cache's read too
      name = str(kwargs.get("fun_name", ""))
      if name.startswith("jit(") and name.endswith(")"):
        name = name[4:-1]
      self.programs.append((threading.current_thread().name, name))


@contextlib.contextmanager
def count_compilations() -> Iterator[CompileCounter]:
  """Counts XLA backend compilations and persistent-cache loads (in-memory jit cache hits are free)."""
  counter = CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter._listener)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(counter._listener)
