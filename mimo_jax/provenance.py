"""What produced a run: the code version (git commit, uncommitted changes) and the library versions.

Written into ``config.json`` at every start and into ``summary.json`` at the end, so a curve or a
sweep point can be traced to the exact code and stack that made it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from typing import Any

__all__ = ["LIBRARIES", "code_version", "provenance"]

LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "tensorflow-datasets")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(["git", *args], cwd=_PACKAGE_DIR, capture_output=True, text=True, timeout=10, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


@functools.cache
def code_version() -> dict[str, Any]:
  """``{"package": version, "commit": sha or None, "dirty": bool or None}``.

  ``commit`` is the checkout's HEAD when mimo-jax runs from a git checkout (None when installed from a
  wheel); ``dirty`` says whether tracked files differ from it (untracked files do not count).
  """
  try:
    version = importlib.metadata.version("mimo-jax")
  except importlib.metadata.PackageNotFoundError:
    version = None
  top = _git("rev-parse", "--show-toplevel")
  if not top or os.path.realpath(os.path.join(top, "mimo_jax")) != os.path.realpath(_PACKAGE_DIR):
    return {"package": version, "commit": None, "dirty": None}
  status = _git("status", "--porcelain", "--untracked-files=no")
  return {"package": version, "commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def provenance() -> dict[str, Any]:
  """The code version, the libraries' versions and the Python version."""
  libs = {}
  for name in LIBRARIES:
    try:
      libs[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      libs[name] = None
  return {"code": code_version(), "libraries": libs, "python": platform.python_version()}
