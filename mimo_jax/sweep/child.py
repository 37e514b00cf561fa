"""A sweep's (or the launcher's) trainer process: ``python -m mimo_jax.sweep.child --parent=PID -- <main flags>``.

It asks the kernel for SIGKILL when its parent (the sweep) dies (Linux ``prctl(PR_SET_PDEATHSIG)``),
checks the parent is still the one that started it (a sweep killed in between would never deliver
the signal), then runs :func:`mimo_jax.main.main`.  A sweep killed outright therefore never leaves a
trainer running on, holding its run directory's lock.  Set here rather than between fork and exec in
the sweep, where a multithreaded parent (JAX's) must not run Python code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
  if len(argv) < 2 or not argv[0].startswith("--parent=") or argv[1] != "--":
    print("usage: python -m mimo_jax.sweep.child --parent=PID -- <main flags>", file=sys.stderr)
    return 2
  parent = int(argv[0].removeprefix("--parent="))
  with contextlib.suppress(OSError, AttributeError):  # not Linux: the sweep's SIGTERM still reaches it
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != parent:
    print(f"its parent (pid {parent}, the sweep or launcher) is gone; not starting", file=sys.stderr)
    return 3
  from mimo_jax.main import main as trainer

  return trainer(["mimo_jax.main", *argv[2:]])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
