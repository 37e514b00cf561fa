"""Packaging: a regular (non-editable) install must contain every module of the source tree."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_source_directory_is_a_regular_package():
  # setup.py lists packages with find_packages, which skips directories without __init__.py (namespace
  # packages): their modules would be missing from `pip install .` while an editable install still finds them.
  missing = []
  for top in ("mimo_jax", "kernels"):
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      if any(f.endswith(".py") for f in filenames) and "__init__.py" not in filenames:
        missing.append(os.path.relpath(dirpath, ROOT))
  assert not missing, f"directories with modules but no __init__.py: {missing}"
