"""Shared helpers for the typed, frozen config dataclasses.

Every config field that a user can set carries its own documentation (``help``) and,
for closed sets of values, its allowed ``choices``.  ``mimo_jax/main.py`` turns these
fields into absl flags; everything below ``main.py`` only sees the dataclasses.
Validation raises :class:`ConfigError`, whose message names the flag, the value and
what is allowed, so a bad command line fails before any compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
  """An invalid configuration value or combination of values."""


def field(default: Any, help: str, *, choices: Sequence[Any] | None = None, flag: bool = True):
  """A documented dataclass field.

  Args:
    default: the default value (immutable).
    help: one-line documentation, shown by ``--help``.
    choices: the allowed values, if the set is closed.
    flag: whether ``main.py`` exposes the field as a command-line flag.

  Returns:
    A ``dataclasses.field`` with the documentation in its metadata.
  """
  meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "flag": flag}
  return dataclasses.field(default=default, metadata=meta)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
  """Raises ConfigError unless ``value`` is one of ``choices``."""
  if value not in choices:
    allowed = ", ".join(repr(c) for c in choices)
    raise ConfigError(f"--{name}={value!r} is not allowed; allowed values: {allowed}")


def check(condition: bool, name: str, value: Any, requirement: str) -> None:
  """Raises ConfigError naming the flag when ``condition`` is false."""
  if not condition:
    raise ConfigError(f"--{name}={value!r}: {requirement}")


def check_choices(cfg: Any) -> None:
  """Checks every field with declared ``choices`` of a config dataclass."""
  for f in dataclasses.fields(cfg):
    choices = f.metadata.get("choices")
    if choices:
      check_choice(f.name, getattr(cfg, f.name), choices)
