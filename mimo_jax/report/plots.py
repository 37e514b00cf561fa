"""The report's figures: matplotlib's object API on the Agg canvas (no pyplot state, no display, no
change to a notebook's backend).

:func:`lines` draws named series against a shared x axis (steps, or FLOPs on a log axis) with marked
events (alarms) as vertical lines; :func:`quantile_heatmap` draws a distribution over time from the
per-step quantiles that ``histograms.jsonl`` keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["figure", "lines", "quantile_heatmap", "series"]

_MARK_COLOURS = ("#b00020", "#d35400", "#8e44ad", "#16a085", "#2c3e50", "#c0392b", "#7f8c8d")


def figure(width: float = 6.4, height: float = 3.4):
  from matplotlib.figure import Figure

  return Figure(figsize=(width, height), layout="constrained")


def series(records: Sequence[Mapping[str, Any]], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
  """The finite values of ``key`` and their ``x`` over the records that have both."""
  xs, ys = [], []
  for r in records:
    v, xv = r.get(key), r.get(x)
    if isinstance(v, (int, float)) and isinstance(xv, (int, float)) and np.isfinite(v) and np.isfinite(xv):
      xs.append(float(xv))
      ys.append(float(v))
  return np.asarray(xs), np.asarray(ys)


def lines(
  data: Mapping[str, tuple[Sequence[float], Sequence[float]]],
  *,
  title: str,
  xlabel: str = "RL step",
  ylabel: str = "",
  marks: Sequence[tuple[float, str]] = (),
  logx: bool = False,
  logy: bool = False,
  right: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
  right_label: str = "",
  styles: Mapping[str, str] | None = None,
):
  """A line figure: each named ``(x, y)`` series; ``right`` series on a second y axis; ``marks`` as
  labelled vertical lines (an alarm's step and kind)."""
  fig = figure()
  ax = fig.add_subplot()
  drawn = 0
  for name, (x, y) in data.items():
    if len(x):
      style = (styles or {}).get(name, "-")
      ax.plot(x, y, style, label=name, lw=1.3, ms=4)
      drawn += 1
  if right:
    ax2 = ax.twinx()
    for i, (name, (x, y)) in enumerate(right.items()):
      if len(x):
        ax2.plot(x, y, "--", label=name, lw=1.0, color=f"C{drawn + i}")
    ax2.set_ylabel(right_label)
    handles, labels = ax2.get_legend_handles_labels()
    if handles:
      ax2.legend(handles, labels, loc="upper right", fontsize=7)
  seen = {}
  for x, kind in marks:
    label = kind.replace("$", r"\$")  # text, not matplotlib's mathtext
    colour = seen.setdefault(label, _MARK_COLOURS[len(seen) % len(_MARK_COLOURS)])
    ax.axvline(x, color=colour, lw=1.0, ls=":", label=label if label not in ax.get_legend_handles_labels()[1] else None)
  if logx:
    ax.set_xscale("log")
  if logy and any(np.any(np.asarray(y) > 0) for _, y in data.values()):  # a log axis needs a positive value
    ax.set_yscale("log")
  ax.set_title(title, fontsize=10)
  ax.set_xlabel(xlabel, fontsize=9)
  ax.set_ylabel(ylabel, fontsize=9)
  ax.tick_params(labelsize=8)
  ax.grid(True, alpha=0.3)
  if drawn or marks:
    ax.legend(loc="upper left", fontsize=7)
  else:
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="#888")
  return fig


def quantile_heatmap(
  steps: Sequence[float],
  quantiles: Sequence[Sequence[float]],
  *,
  title: str,
  ylabel: str,
  bins: int = 40,
  marks: Sequence[tuple[float, str]] = (),
):
  """A distribution over time: column ``i`` is step ``steps[i]``, its colour the share of the values in
  each of ``bins`` common value bins, spread from the step's quantiles (each of the 20 quantile intervals
  holds 1/20 of the values, uniformly between its ends; a point mass falls in one bin)."""
  fig = figure()
  ax = fig.add_subplot()
  if not len(steps):
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="#888")
    ax.set_title(title, fontsize=10)
    return fig
  q = np.asarray(quantiles, np.float64)
  lo, hi = float(np.min(q)), float(np.max(q))
  if hi - lo < 1e-9:
    lo, hi = lo - 0.5, hi + 0.5
  edges = np.linspace(lo, hi, bins + 1)
  density = np.zeros((bins, len(steps)))
  share = 1.0 / (q.shape[1] - 1)
  for j, row in enumerate(q):
    for a, b in zip(row[:-1], row[1:], strict=True):
      if b - a < 1e-12:  # a point mass: all of this interval's share in the bin holding it
        k = min(int(np.searchsorted(edges, a, side="right")) - 1, bins - 1)
        density[max(k, 0), j] += share
      else:  # spread uniformly over [a, b]
        overlap = np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0, None)
        density[:, j] += share * overlap / (b - a)
  s = np.asarray(steps, np.float64)
  half = np.diff(s).min() / 2 if len(s) > 1 else 0.5
  image = ax.imshow(
    density,
    origin="lower",
    aspect="auto",
    extent=(s[0] - half, s[-1] + half, lo, hi),
    cmap="viridis",
    interpolation="nearest",
  )
  fig.colorbar(image, ax=ax, label="share of the batch")
  for x, label in marks:
    ax.axvline(x, color="#ff5252", lw=1.0, ls=":")
    del label
  ax.set_title(title, fontsize=10)
  ax.set_xlabel("RL step", fontsize=9)
  ax.set_ylabel(ylabel, fontsize=9)
  ax.tick_params(labelsize=8)
  return fig
