"""Shared helpers for the typed, frozen config dataclasses.

Every config field that a user can set carries its own documentation (``help``) and,
for closed sets of values, its allowed ``choices``; numeric fields carry their allowed
range (``gt``/``ge``/``lt``/``le`` bounds plus optional sentinel values ``also``).
List-valued settings are tuples (``items=int`` or ``items=float``, optionally of a fixed
``length``), with the range applying to every element; a command line or a ``config.json``
turns into them once, through :func:`coerce_value`, where it is read.
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
  items: type | None = None,
  length: int | None = None,
  min_length: int = 1,
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
    items: list-valued fields: the element type (``int`` or ``float``); the default is a
      tuple and every bound applies to each element.
    length: list-valued fields: the exact number of elements (None: any).
    min_length: list-valued fields: the fewest elements (0 allows the empty tuple).

  Returns:
    A ``dataclasses.field`` with the documentation and the allowed range in its metadata.
  """
  meta = {
    "help": help,
    "choices": tuple(choices) if choices is not None else None,
    "flag": flag,
    "range": make_range(gt=gt, ge=ge, lt=lt, le=le, also=also),
    "items": items,
    "length": length,
    "min_length": min_length,
  }
  if items is not None:
    if items not in (int, float):
      raise TypeError(f"list-valued fields hold int or float elements, not {items}")
    if not isinstance(default, tuple):
      raise TypeError(f"a list-valued field's default is a tuple, got {default!r}")
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
    if f.metadata.get("items") is not None:
      check_list(f, value)
      continue
    choices = f.metadata.get("choices")
    if choices:
      check_choice(f.name, value, choices)
    allowed = field_range(f)
    if allowed is not None or isinstance(f.default, float):
      check_number(f.name, value, allowed)


def format_list(values: Sequence[Any]) -> str:
  """A list-valued setting as written on a command line: ``(32, 64)`` -> ``"32,64"``."""
  return ",".join(str(v) for v in values)


def _length_requirement(f: dataclasses.Field) -> str:
  length, min_length = f.metadata.get("length"), f.metadata.get("min_length", 1)
  if length is not None:
    return f"exactly {length}"
  return f"at least {min_length}" if min_length else "any number of"


def check_list(f: dataclasses.Field, value: Any) -> None:
  """Checks a list-valued field: a tuple of its element type, of the declared length, each element in range.

  Raises:
    ConfigError: naming the flag, the value (as written on a command line) and what is allowed.
  """
  items, length, min_length = f.metadata["items"], f.metadata.get("length"), f.metadata.get("min_length", 1)
  kind = "integers" if items is int else "numbers"
  if not isinstance(value, tuple) or not all(_is_item(v, items) for v in value):
    raise ConfigError(f"--{f.name}={value!r}: expected a tuple of {kind}")
  shown = format_list(value)
  if (length is not None and len(value) != length) or len(value) < min_length:
    raise ConfigError(f"--{f.name}={shown!r}: expected {_length_requirement(f)} comma-separated {kind}")
  allowed = field_range(f)
  for v in value:
    if not math.isfinite(v):
      raise ConfigError(f"--{f.name}={shown!r}: expected finite numbers (no inf or nan)")
    if allowed is not None and not allowed.contains(v):
      raise ConfigError(f"--{f.name}={shown!r}: every element must be {allowed.describe()}")


def _is_item(v: Any, items: type) -> bool:
  if isinstance(v, bool):
    return False
  return isinstance(v, int) if items is int else isinstance(v, (int, float))


def parse_list(f: dataclasses.Field, text: str) -> tuple[Any, ...]:
  """Parses a list-valued field's command-line text (``"64,128"``) into its tuple; checks nothing else.

  Raises:
    ConfigError: an element that is not a number of the field's type, naming the flag.
  """
  items = f.metadata["items"]
  kind = "integers" if items is int else "numbers"
  try:
    return tuple(items(v) for v in text.split(",") if v.strip())
  except ValueError:
    raise ConfigError(f"--{f.name}={text!r}: expected a comma-separated list of {kind}") from None


def coerce_value(f: dataclasses.Field, value: Any) -> Any:
  """A field's value as read from a command line or a ``config.json``, in the field's own type.

  List-valued fields accept their command-line text (``"1,2"``, also what ``config.json``
  held before these settings were tuples) or a JSON list; float fields accept integers.
  Anything else is returned unchanged, for the field's checks to judge.
  """
  items = f.metadata.get("items")
  if items is not None:
    if isinstance(value, str):
      return parse_list(f, value)
    if isinstance(value, list):
      value = tuple(value)
    if isinstance(value, tuple) and items is float:
      value = tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value)
    return value
  if isinstance(f.default, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  return value
