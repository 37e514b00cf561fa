"""Packaging: a regular (non-editable) install must contain every module of the source tree."""

from __future__ import annotations

import os
import runpy

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_packages() -> set[str]:
  """Importable names of every source directory holding modules (``kernels/`` installs as ``mimo_jax.kernels``)."""
  names = set()
  for top, prefix in (("mimo_jax", "mimo_jax"), ("kernels", "mimo_jax.kernels")):
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      if any(f.endswith(".py") for f in filenames):
        rel = os.path.relpath(dirpath, os.path.join(ROOT, top))
        names.add(prefix if rel == "." else prefix + "." + rel.replace(os.sep, "."))
  return names


def test_every_source_directory_is_a_regular_package():
  # find_packages skips directories without __init__.py (namespace packages): their modules would be missing
  # from `pip install .` while an editable install still finds them.
  missing = [
    name
    for name in _source_packages()
    if not os.path.exists(os.path.join(ROOT, *name.replace("mimo_jax.kernels", "kernels", 1).split("."), "__init__.py"))
  ]
  assert not missing, f"directories with modules but no __init__.py: {sorted(missing)}"


def test_setup_installs_every_package(monkeypatch):
  captured = {}
  monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
  monkeypatch.chdir(ROOT)
  runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
  missing = _source_packages() - set(captured["packages"])
  assert not missing, f"setup.py does not install: {sorted(missing)}"


def test_the_readme_lists_every_metric_name_of_the_convention():
  from mimo_jax.train.metric_names import METRICS, describe

  readme = open(os.path.join(ROOT, "README.md")).read()
  for key, meaning in METRICS:
    assert f"| `{key}` | {meaning} |" in readme, key
  assert describe("reward/correct_mean") and describe("time_generate_s") and describe("mem_peak_gib")
  assert describe("rewards_mean") is None and describe("time_generate") is None
