"""Shared helpers for the typed, frozen config dataclasses.

Every config field that a user can set carries its own documentation (``help``) and,
for closed sets of values, its allowed ``choices``; numeric fields carry their allowed
range (``gt``/``ge``/``lt``/``le`` bounds plus optional sentinel values ``also``).
``mimo_jax/main.py`` turns these fields into absl flags; everything below ``main.py``
only sees the dataclasses.  :func:`check_fields` checks every declared choice and range
in one place, and refuses non-finite floats (``inf``, ``-inf``, ``nan``) in every float
field, bounded or not.  Validation raises :class:`ConfigError`, whose message names the
flag, the value and what is allowed, so a bad command line fails before any compute.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
  """An invalid configuration value or combination of values."""


def _num(x: float) -> str:
  """A bound as written in messages: ``1`` rather than ``1.0``, ``1e-05`` for small ones."""
  return f"{x:g}"


@dataclasses.dataclass(frozen=True)
class Range:
  """The allowed values of a numeric field: an interval, plus optional sentinel values.

  Attributes:
    low: the lower bound, or None for none.
    high: the upper bound, or None for none.
    low_open: the lower bound itself is excluded (``> low`` rather than ``>= low``).
    high_open: the upper bound itself is excluded.
    also: sentinel values allowed outside the interval (e.g. ``-1`` meaning "off").
  """

  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  also: tuple[float, ...] = ()

  def __post_init__(self):
    if self.low is not None and self.high is not None and self.low > self.high:
      raise ValueError(f"empty range: low {self.low} > high {self.high}")

  def contains(self, value: float) -> bool:
    """Whether ``value`` (a finite number) is allowed."""
    if value in self.also:
      return True
    if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
      return False
    if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
      return False
    return True

  def describe(self) -> str:
    """The range as it reads after "must be": ``> 0``, ``in [0, 1)``, ``-1 or >= 0``."""
    if self.low is not None and self.high is not None:
      interval = (
        f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
      )
    elif self.low is not None:
      interval = f"{'>' if self.low_open else '>='} {_num(self.low)}"
    elif self.high is not None:
      interval = f"{'<' if self.high_open else '<='} {_num(self.high)}"
    else:
      interval = "any finite number"
    if self.also:
      return " or ".join([*(_num(v) for v in self.also), interval])
    return interval


def make_range(
  *,
  gt: float | None = None,
  ge: float | None = None,
  lt: float | None = None,
  le: float | None = None,
  also: Sequence[float] = (),
) -> Range | None:
  """A :class:`Range` from pydantic-style bounds; None when no bound or sentinel is given."""
  if gt is not None and ge is not None:
    raise ValueError("give at most one of gt and ge")
  if lt is not None and le is not None:
    raise ValueError("give at most one of lt and le")
  if gt is None and ge is None and lt is None and le is None and not also:
    return None
  return Range(
    low=gt if gt is not None else ge,
    high=lt if lt is not None else le,
    low_open=gt is not None,
    high_open=lt is not None,
    also=tuple(also),
  )


def field(
  default: Any,
  help: str,
  *,
  choices: Sequence[Any] | None = None,
  flag: bool = True,
  gt: float | None = None,
  ge: float | None = None,
  lt: float | None = None,
  le: float | None = None,
  also: Sequence[float] = (),
):
  """A documented dataclass field.

  Args:
    default: the default value (immutable).
    help: one-line documentation, shown by ``--help``.
    choices: the allowed values, if the set is closed.
    flag: whether ``main.py`` exposes the field as a command-line flag.
    gt: numeric fields: the value must be greater than this.
    ge: numeric fields: the value must be at least this.
    lt: numeric fields: the value must be less than this.
    le: numeric fields: the value must be at most this.
    also: numeric fields: sentinel values allowed outside the bounds (e.g. ``-1``: off).

  Returns:
    A ``dataclasses.field`` with the documentation and the allowed range in its metadata.
  """
  meta = {
    "help": help,
    "choices": tuple(choices) if choices is not None else None,
    "flag": flag,
    "range": make_range(gt=gt, ge=ge, lt=lt, le=le, also=also),
  }
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


def check_number(name: str, value: Any, allowed: Range | None = None, *, finite: bool = True) -> None:
  """Raises ConfigError unless ``value`` is a number (finite if ``finite``) inside ``allowed``.

  Args:
    name: the flag, for the message.
    value: the value to check.
    allowed: the allowed range (None: any number).
    finite: refuse ``inf``, ``-inf`` and ``nan``.
  """
  desc = allowed.describe() if allowed is not None else "any finite number"
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ConfigError(f"--{name}={value!r}: must be a number ({desc})")
  if finite and not math.isfinite(value):
    raise ConfigError(f"--{name}={value!r}: must be a finite number ({desc})")
  if allowed is not None and not allowed.contains(value):
    raise ConfigError(f"--{name}={value!r}: must be {desc}")


def field_range(f: dataclasses.Field) -> Range | None:
  """The allowed range declared on a config field (None: unbounded or not numeric)."""
  return f.metadata.get("range")


def check_choices(cfg: Any) -> None:
  """Checks every field with declared ``choices`` of a config dataclass."""
  for f in dataclasses.fields(cfg):
    choices = f.metadata.get("choices")
    if choices:
      check_choice(f.name, getattr(cfg, f.name), choices)


def check_fields(cfg: Any) -> None:
  """Checks every field of a config dataclass against what it declares, in field order.

  Declared ``choices`` must contain the value; declared ranges must contain it; every
  float field (bounded or not) must be finite.  Checks that relate several fields stay
  in the dataclass's ``__post_init__``, after this.

  Raises:
    ConfigError: naming the first offending flag, its value and what is allowed.
  """
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    choices = f.metadata.get("choices")
    if choices:
      check_choice(f.name, value, choices)
    allowed = field_range(f)
    if allowed is not None or isinstance(f.default, float):
      check_number(f.name, value, allowed)
