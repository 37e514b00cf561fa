"""The saturating compute-to-performance curve of the ScaleRL paper, fitted with bootstrap intervals.

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)

``R0`` is the performance before RL (the warm start), ``A`` the asymptote (the ceiling more compute
approaches), ``B`` the efficiency exponent (how sharply the curve turns) and ``C_mid`` the compute at
which half of the gain ``A - R0`` is reached.  ``A`` enters linearly: for fixed ``(B, C_mid)`` the
best ``A`` is a closed-form least-squares solution, so the fit searches only the two others: a grid
in ``(log B, log C_mid)``, zoomed in on around each of its best few cells, then a pattern search from
the best of those (a steep curve's valley is long and narrow, and one zoomed cell could sit in the
wrong part of it).  No optimiser dependency, deterministic; on random steep curves it reaches a
multi-start least-squares solver's residual (the tests compare the two).

:func:`bootstrap` resamples the seeds of each point with replacement and refits, giving percentile
intervals; :func:`diminishing_returns` is the compute at which the fitted curve has made a given
fraction of its gain (the point past which another decade of compute buys little).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["SigmoidFit", "bootstrap", "diminishing_returns", "fit_sigmoid", "sigmoid"]


def sigmoid(compute, r0: float, a: float, b: float, c_mid: float) -> np.ndarray:
  """``R(C)`` of the fitted form."""
  c = np.asarray(compute, np.float64)
  return r0 + (a - r0) / (1.0 + (c_mid / c) ** b)


@dataclasses.dataclass(frozen=True)
class SigmoidFit:
  r0: float
  a: float  # the asymptote
  b: float  # the efficiency exponent
  c_mid: float  # the compute at half the gain
  rmse: float

  def predict(self, compute) -> np.ndarray:
    return sigmoid(compute, self.r0, self.a, self.b, self.c_mid)


def _best_a(g: np.ndarray, y: np.ndarray, gain_max: float | None) -> np.ndarray:
  """Least-squares gain ``A - R0`` for each row of ``g`` (``[..., n]``), clipped to ``[0, gain_max]``."""
  gain = np.einsum("...n,n->...", g, y) / np.maximum(np.einsum("...n,...n->...", g, g), 1e-300)
  return np.clip(gain, 0.0, np.inf if gain_max is None else gain_max)


def fit_sigmoid(
  compute: Sequence[float],
  performance: Sequence[float],
  *,
  r0: float,
  a_max: float | None = 1.0,
  b_range: tuple[float, float] = (0.1, 20.0),
  grid: int = 64,
  zooms: int = 4,
  starts_kept: int = 6,
  polish_rounds: int = 2000,
) -> SigmoidFit:
  """Least-squares fit of ``A``, ``B`` and ``C_mid`` for a known ``R0``.

  Args:
    compute: the compute of each point (FLOPs, device-seconds, samples: any positive measure).
    performance: the metric at each point (a mean over seeds).
    r0: the performance before RL.
    a_max: the largest meaningful asymptote (1.0 for an accuracy; None: unbounded).
    b_range: the exponents searched.
    grid: grid points per dimension.
    zooms: refinements of the grid around each start.
    starts_kept: the coarse grid's best cells (at least 3 cells apart) zoomed in on, each on its own.
    polish_rounds: most rounds of the closing pattern search.
  """
  c = np.asarray(compute, np.float64)
  y = np.asarray(performance, np.float64) - r0
  if c.shape != y.shape or c.ndim != 1 or c.shape[0] < 3:
    raise ValueError("fit_sigmoid: needs at least 3 points, compute and performance of the same length")
  if np.any(c <= 0):
    raise ValueError("fit_sigmoid: compute must be positive")
  gain_max = None if a_max is None else a_max - r0
  lc = np.log(c)
  box_b = (float(np.log(b_range[0])), float(np.log(b_range[1])))
  box_m = (float(lc.min() - 3.0), float(lc.max() + 3.0))  # a midpoint up to e^3 (20x) outside the data

  def sse_of(lb: np.ndarray, lm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    B, M = np.meshgrid(np.exp(lb), lm, indexing="ij")
    g = 1.0 / (1.0 + np.exp(B[..., None] * (M[..., None] - lc)))  # [len(lb), len(lm), n]
    gain = _best_a(g, y, gain_max)
    return np.sum((y - gain[..., None] * g) ** 2, axis=-1), gain

  # The whole box, then each of the best few basins of it zoomed in on: on a near-step curve the
  # valley is narrow in C_mid and long in B, and the coarse grid's best cell can lie in the wrong one.
  lb0, lm0 = np.linspace(*box_b, grid), np.linspace(*box_m, grid)
  sse0, _ = sse_of(lb0, lm0)
  step_b, step_m = (box_b[1] - box_b[0]) / (grid - 1), (box_m[1] - box_m[0]) / (grid - 1)
  starts: list[tuple[int, int]] = []
  for flat in np.argsort(sse0, axis=None):
    i, j = np.unravel_index(flat, sse0.shape)
    if all(abs(i - i2) > 2 or abs(j - j2) > 2 for i2, j2 in starts):
      starts.append((int(i), int(j)))
      if len(starts) == starts_kept:
        break
  best = None
  for i0, j0 in starts:
    lo_b, hi_b = max(lb0[i0] - 2 * step_b, box_b[0]), min(lb0[i0] + 2 * step_b, box_b[1])
    lo_m, hi_m = lm0[j0] - 2 * step_m, lm0[j0] + 2 * step_m
    for _ in range(zooms):
      lb, lm = np.linspace(lo_b, hi_b, grid), np.linspace(lo_m, hi_m, grid)
      sse, gain = sse_of(lb, lm)
      i, j = np.unravel_index(np.argmin(sse), sse.shape)
      sb, sm = (hi_b - lo_b) / (grid - 1), (hi_m - lo_m) / (grid - 1)
      # The exponent's window stays inside b_range (a zoom at the edge would otherwise walk past it).
      lo_b, hi_b = max(lb[i] - 2 * sb, box_b[0]), min(lb[i] + 2 * sb, box_b[1])
      lo_m, hi_m = lm[j] - 2 * sm, lm[j] + 2 * sm
    if best is None or sse[i, j] < best[0]:
      best = (float(sse[i, j]), float(lb[i]), float(lm[j]), float(gain[i, j]))
  # A pattern search from the best of them (axis and diagonal moves, halving the step until it is
  # negligible): a long, tilted valley can hold the optimum just outside the last zoom window.
  sse_best, lb_best, m, gain_best = best
  step0 = np.array([step_b, step_m]) / 4
  step = step0
  moves = np.array([(1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)], np.float64)
  for _ in range(polish_rounds):
    if step.max() < 1e-6:
      break
    cand = np.array([lb_best, m]) + moves * step
    cand[:, 0] = np.clip(cand[:, 0], *box_b)
    cand[:, 1] = np.clip(cand[:, 1], *box_m)
    g = 1.0 / (1.0 + np.exp(np.exp(cand[:, :1]) * (cand[:, 1:] - lc)))  # [8, n]
    gain = _best_a(g, y, gain_max)
    sse = np.sum((y - gain[:, None] * g) ** 2, axis=-1)
    k = int(np.argmin(sse))
    if sse[k] < sse_best:  # a step that gains is lengthened (up to the first): a long valley is crossed fast
      sse_best, lb_best, m, gain_best = float(sse[k]), float(cand[k, 0]), float(cand[k, 1]), float(gain[k])
      step = np.minimum(step * 2, step0)
    else:
      step = step / 2
  b = float(np.exp(lb_best))
  return SigmoidFit(
    r0=float(r0),
    a=float(r0 + gain_best),
    b=b,
    c_mid=float(np.exp(m)),
    rmse=float(np.sqrt(sse_best / c.shape[0])),
  )


def bootstrap(
  compute: Sequence[float],
  per_seed: Sequence[Sequence[float]],
  *,
  r0: float,
  samples: int = 200,
  level: float = 0.9,
  seed: int = 0,
  **fit_kwargs,
) -> dict[str, tuple[float, float]]:
  """Percentile intervals of ``a``, ``b``, ``c_mid`` from resampling each point's seeds.

  Args:
    compute: the compute of each point.
    per_seed: for each point, the metric of each seed.
    r0: the performance before RL.
    samples: bootstrap refits.
    level: the interval's coverage.
    seed: of the resampling (the intervals are reproducible).
  """
  rng = np.random.default_rng(seed)
  fits = []
  for _ in range(samples):
    means = [float(np.mean(rng.choice(np.asarray(v, np.float64), size=len(v), replace=True))) for v in per_seed]
    fits.append(fit_sigmoid(compute, means, r0=r0, **fit_kwargs))
  q = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
  out = {}
  for name in ("a", "b", "c_mid"):
    lo, hi = np.percentile([getattr(f, name) for f in fits], q)
    out[name] = (float(lo), float(hi))
  return out


def diminishing_returns(fit: SigmoidFit, fraction: float = 0.9) -> float:
  """The compute at which the fitted curve has made ``fraction`` of its gain ``A - R0``."""
  if not 0 < fraction < 1:
    raise ValueError(f"diminishing_returns: fraction={fraction} must be in (0, 1)")
  return fit.c_mid * (fraction / (1 - fraction)) ** (1 / fit.b)
