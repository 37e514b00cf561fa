"""A resumable, reproducible stream of indices into a finite dataset (epochs, shuffled or in order).

:class:`PromptStream` turns a dataset size into a stream of indices: one permutation per epoch,
derived from ``(seed, epoch)`` alone, with a JSON-able ``state_dict`` from which a restored stream
continues identically.  The RL prompt order of ``--data_order=shuffle|sequential`` and the TFDS
sources (:mod:`mimo_jax.tasks.tfds_sources`) read through it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["PromptStream"]

_STREAM_TAG = 0x53545245  # "STRE"


class PromptStream:
  """An endless, reproducible stream of indices into a dataset of ``size`` rows.

  Epoch ``e`` visits every index once, in the order ``permutation(e)``, a numpy
  permutation seeded by ``(tag, seed, e)`` alone, so any epoch can be recomputed without
  replaying the ones before it, and :meth:`index_at` gives random access to the whole
  stream.  The position (``epoch``, ``position`` within it) is the only state; restoring
  it with :meth:`load_state_dict` makes the stream continue exactly where it was.

  Args:
    size: number of rows (positive).
    seed: non-negative seed.
    shuffle: False visits ``0..size-1`` in order every epoch.
  """

  def __init__(self, size: int, seed: int = 0, *, shuffle: bool = True) -> None:
    size, seed = operator.index(size), operator.index(seed)
    if size <= 0:
      raise ValueError(f"size must be positive, got {size}")
    if seed < 0:
      raise ValueError(f"seed must be non-negative, got {seed}")
    self.size = size
    self.seed = seed
    self.shuffle = bool(shuffle)
    self.epoch = 0
    self.position = 0
    self._cached: tuple[int, np.ndarray] | None = None

  def permutation(self, epoch: int) -> np.ndarray:
    """The visiting order of ``epoch`` (a permutation of ``range(size)``)."""
    epoch = operator.index(epoch)
    if epoch < 0:
      raise ValueError(f"epoch must be non-negative, got {epoch}")
    if self._cached is None or self._cached[0] != epoch:
      if self.shuffle:
        order = np.random.default_rng([_STREAM_TAG, self.seed, epoch]).permutation(self.size)
      else:
        order = np.arange(self.size)
      self._cached = (epoch, order)
    return self._cached[1]

  def index_at(self, step: int) -> int:
    """The index the stream yields at absolute step ``step`` (``epoch * size + position``)."""
    epoch, position = divmod(operator.index(step), self.size)
    return int(self.permutation(epoch)[position])

  @property
  def step(self) -> int:
    """Indices drawn so far, over all epochs."""
    return self.epoch * self.size + self.position

  def next(self, n: int) -> list[int]:
    """Draws the next ``n`` indices, crossing epoch boundaries as needed.

    Args:
      n: how many (non-negative).

    Returns:
      The indices, in stream order.
    """
    n = operator.index(n)
    if n < 0:
      raise ValueError(f"n must be non-negative, got {n}")
    out: list[int] = []
    while len(out) < n:
      take = min(n - len(out), self.size - self.position)
      out.extend(self.permutation(self.epoch)[self.position : self.position + take].tolist())
      self.position += take
      if self.position == self.size:
        self.epoch += 1
        self.position = 0
    return out

  def reshuffle(self) -> None:
    """From now on every epoch in a fresh order; the next epoch starts at once (the rest of the current
    one is skipped, so each epoch still visits every index once).  No-op on a shuffled stream."""
    if self.shuffle:
      return
    self.shuffle = True
    self._cached = None
    if self.position:
      self.epoch, self.position = self.epoch + 1, 0

  def state_dict(self) -> dict[str, Any]:
    """The JSON-able position: ``{"epoch", "position", "seed", "size", "shuffle"}``."""
    return {
      "epoch": self.epoch,
      "position": self.position,
      "seed": self.seed,
      "size": self.size,
      "shuffle": self.shuffle,
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a position saved by :meth:`state_dict` (the seed and the order kind too).

    Raises:
      ValueError: if the state is for a dataset of a different size, or out of range.
    """
    size = operator.index(state.get("size", self.size))
    if size != self.size:
      raise ValueError(f"state is for a dataset of {size} rows, this stream has {self.size}")
    epoch, position, seed = (operator.index(state[k]) for k in ("epoch", "position", "seed"))
    if epoch < 0 or not 0 <= position < self.size or seed < 0:
      raise ValueError(f"invalid stream state {dict(state)}")
    self.epoch, self.position = epoch, position
    shuffle = bool(state.get("shuffle", self.shuffle))
    if seed != self.seed or shuffle != self.shuffle:
      self.seed, self.shuffle = seed, shuffle
      self._cached = None
