"""The scaling report: ``DIR/report.html`` from a sweep's results and its runs' own files.

For each axis (the points that vary it, and the base): curves per point against RL steps and against
cumulative FLOPs (reward, held-out accuracy, KL, entropy); the final held-out metric against compute
with the ScaleRL saturating fit (:mod:`mimo_jax.sweep.fit`: asymptote, efficiency exponent, midpoint,
seed-bootstrap intervals) and its point of diminishing returns; each point's own held-out curve
fitted against its training compute (its ceiling ``A``); and a plain-language verdict of what paid,
what saturated and what made things worse, with the seed spread it was judged against.  Redrawn from
the files at any time (``--report_only``), a running sweep's included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mimo_jax.config import ConfigError
from mimo_jax.files import read_json, read_jsonl
from mimo_jax.report.page import Page, fmt
from mimo_jax.report.plots import figure, lines
from mimo_jax.sweep.fit import bootstrap, diminishing_returns, fit_sigmoid

__all__ = ["axis_groups", "judge_axis", "write_report"]

METRIC = "greedy_accuracy"
REPORT = "report.html"


def _median(xs: Sequence[float]) -> float:
  return float(np.median(np.asarray(xs, np.float64)))


def _point_stats(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """A point's seeds together: final / gain / compute medians and spreads (finished runs only)."""
  done = [r for r in rows if r["status"] == "done" and METRIC in r.get("final", {})]
  finals = [r["final"][METRIC] for r in done]
  gains = [r["final"][METRIC] - r["warm_start"].get(METRIC, 0.0) for r in done]
  flops = [r["flops_total"] for r in done if r.get("flops_total")]
  return {
    "seeds": len(rows),
    "done": len(done),
    "finals": finals,
    "final_min": min(finals) if finals else None,
    "final_median": _median(finals) if finals else None,
    "final_max": max(finals) if finals else None,
    "gain_median": _median(gains) if gains else None,
    "warm_median": _median([r["warm_start"].get(METRIC, 0.0) for r in done]) if done else None,
    "best_median": _median([r["best"].get(METRIC, 0.0) for r in done]) if done else None,
    "flops_median": _median(flops) if flops else None,
    "wall_median": _median([r["wall_time_s"] for r in done]) if done else None,
    "gates": sorted({(r.get("gate") or {}).get("verdict", "none") for r in rows}),
  }


def axis_groups(definition: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
  """``[(axis name, [point names in the axis's value order])]`` from the rows' ``members``; where the
  base's own value is not on an axis, the base goes where its value falls among the axis's numeric
  values (first when they are not numbers, or the rows do not record them); a grid is one group."""
  names = ["grid"] if definition.get("grid") else [":".join(a["flags"]) for a in definition.get("axes", [])]
  groups = []
  for name in names:
    order: dict[str, int] = {}
    for r in rows:
      for axis, index in r.get("members", []):
        if axis == name:
          order.setdefault(r["point"], index)
    if name != "grid" and "base" not in order and any(r["point"] == "base" for r in rows):
      values = _axis_values(name, rows, [*order, "base"])
      if values is None:
        order["base"] = -1
      else:  # sorted by value (the axis lists its values in the order it was given)
        order = {p: i for i, p in enumerate(sorted(values, key=values.get))}
    groups.append((name, sorted(order, key=order.get)))
  return groups


def _axis_values(name: str, rows: Sequence[Mapping[str, Any]], points: Sequence[str]) -> dict[str, tuple] | None:
  """Each point's values of the axis's flags, where every one is a number (else None)."""
  flags, values = name.split(":"), {}
  for r in rows:
    if r["point"] in points and r["point"] not in values:
      v = tuple((r.get("values") or {}).get(f) for f in flags)
      if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return None
      values[r["point"]] = v
  return values if len(values) == len(points) else None


def judge_axis(name: str, stats: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
  """A plain-language verdict for one axis from its points' final medians (in the axis's order), judged
  against the seed spread (half the median min-max range across points; 2 points with a single seed): no
  effect when the medians differ by less than one seed range."""
  known = [(p, s) for p, s in stats if s["final_median"] is not None]
  if len(known) < 2:
    return f"{name}: fewer than two finished points, nothing to compare yet."
  ranges = [s["final_max"] - s["final_min"] for _, s in known if s["done"] >= 2]
  noise = max(_median(ranges) / 2, 0.005) if ranges else 0.02
  meds = [s["final_median"] for _, s in known]
  best = int(np.argmax(meds))
  desc = ", ".join(f"{p} {100 * m:.1f}%" for (p, _), m in zip(known, meds, strict=True))
  basis = f"(median final held-out {METRIC} over seeds: {desc}; noise +/-{100 * noise:.1f} points)"
  if max(meds) - min(meds) <= 2 * noise:  # the points differ by less than one seed range
    return f"{name}: no effect beyond the seed spread {basis}."
  if best < len(meds) - 1 and min(meds[best + 1 :]) < meds[best] - noise:  # a drop past the best, beyond the noise
    return f"{name}: made things worse past {known[best][0]} {basis}."
  if best == len(meds) - 1 and (len(meds) < 3 or meds[-1] - meds[-2] > noise):
    return f"{name}: paid; the largest setting is best and still gaining {basis}."
  enough = next(i for i, m in enumerate(meds) if m >= max(meds) - noise)
  return f"{name}: saturated at {known[enough][0]}; the settings past it gain no more than the noise {basis}."


def _run_records(run_dir: str) -> tuple[list[dict], list[dict]]:
  metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  rl = [r for r in metrics if "reward_mean" in r]
  evals = [r for r in metrics if f"eval/{METRIC}" in r]
  return rl, evals


def _smooth(y: np.ndarray, w: int = 10) -> np.ndarray:
  if len(y) < w:
    return y
  c = np.cumsum(np.insert(y, 0, 0.0))
  head = c[1:w] / np.arange(1, w)
  return np.concatenate([head, (c[w:] - c[:-w]) / w])


def _eval_flops(rl: Sequence[Mapping[str, Any]], step: int) -> float | None:
  """The cumulative FLOPs behind an evaluation at ``step`` (the final one, past the last RL step: that
  step's; the warm start's: none)."""
  flops = {r["step"]: r.get("flops_total") for r in rl}
  if step in flops:
    return flops[step]
  if rl and step > rl[-1]["step"]:
    return rl[-1].get("flops_total")
  return None


def _mean_curve(runs: Sequence[tuple[list, list]], key: str, source: str, x: str) -> tuple[np.ndarray, np.ndarray]:
  """``key`` against ``x`` (``step``: the seed mean at the steps every seed has; ``flops``: the first
  seed's curve against its cumulative FLOPs, which differ between seeds with the token counts)."""
  if not runs:
    return np.asarray([]), np.asarray([])
  per_seed = []
  for rl, evals in runs:
    d = {}
    for r in rl if source == "rl" else evals:
      v = r.get(key)
      if not isinstance(v, (int, float)) or not np.isfinite(v):
        continue
      if x == "step":
        d[r["step"]] = float(v)
      else:
        f = r.get("flops_total") if source == "rl" else _eval_flops(rl, r["step"])
        if f:
          d[float(f)] = float(v)
    per_seed.append(d)
  if x != "step":
    xs = sorted(per_seed[0])
    return np.asarray(xs, float), np.asarray([per_seed[0][s] for s in xs])
  common = sorted(set.intersection(*(set(d) for d in per_seed)))
  return np.asarray(common, float), np.asarray([np.mean([d[s] for d in per_seed]) for s in common])


def _within_run_fit(runs: Sequence[tuple[list, list]], r0: float) -> dict[str, Any] | None:
  """The point's held-out curve against its cumulative FLOPs, fitted (seed means at common evaluations)."""
  per_seed = []
  for rl, evals in runs:
    pts = {}
    for r in evals:
      f = _eval_flops(rl, r["step"])
      if f:
        pts[r["step"]] = (f, r[f"eval/{METRIC}"])
    per_seed.append(pts)
  if not per_seed:
    return None
  common = sorted(set.intersection(*(set(p) for p in per_seed)))
  if len(common) < 3:
    return None
  compute = [float(np.mean([p[s][0] for p in per_seed])) for s in common]
  seeds = [[p[s][1] for p in per_seed] for s in common]
  fit = fit_sigmoid(compute, [float(np.mean(v)) for v in seeds], r0=r0)
  out = {"fit": fit, "compute": compute}
  if len(per_seed) >= 2:
    out["ci"] = bootstrap(compute, seeds, r0=r0, samples=100)
  return out


def write_report(out: str) -> str:
  """Writes ``DIR/report.html`` from the sweep directory's files and returns its path.

  Raises:
    ConfigError: ``DIR`` holds no sweep.
  """
  definition = read_json(os.path.join(out, "sweep.json"))
  if definition is None:
    raise ConfigError(f"--out={out}: no sweep.json there (not a sweep directory)")
  from mimo_jax.sweep.runner import read_results

  rows = read_results(out)
  page = Page("mimo-jax scaling report", os.path.abspath(out))
  axes_text = "; ".join(
    f"{':'.join(a['flags'])} = {', '.join(':'.join(v) for v in a['values'])}" for a in definition["axes"]
  )
  page.paragraph(
    f"Base {definition['base']}; axes {axes_text} ({'grid' if definition.get('grid') else 'one at a time'}); seeds "
    f"{', '.join(map(str, definition['seeds']))}; coupling {'on' if definition.get('coupling') else 'off'}; gate "
    f"{definition.get('gate_steps', 0)} RL steps; {len(rows)} run(s) recorded."
  )
  if not rows:
    page.paragraph("No run has finished yet.", cls="warn")
    return page.write(os.path.join(out, REPORT))

  by_point: dict[str, list[dict]] = {}
  for r in rows:
    by_point.setdefault(r["point"], []).append(r)
  stats = {p: _point_stats(rs) for p, rs in by_point.items()}
  records = {p: [_run_records(r["run_dir"]) for r in rs if r["status"] == "done"] for p, rs in by_point.items()}
  groups = axis_groups(definition, rows)

  # --- what paid ---------------------------------------------------------------------------------------------
  page.heading("What paid, what saturated", anchor="summary")
  fits: dict[str, dict[str, Any]] = {}
  for name, members in groups:
    page.paragraph(judge_axis(name, [(p, stats[p]) for p in members]))
    fits[name] = _axis_fit(members, stats, by_point)
    f = fits[name]
    if f.get("fit") is not None:
      fit = f["fit"]
      ci = f.get("ci", {})
      page.paragraph(
        f"{name}: final {METRIC} against compute fits R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) with "
        f"R0 {fit.r0:.3f}, A {fit.a:.3f}{_ci(ci, 'a')}, B {fit.b:.2f}{_ci(ci, 'b')}, C_mid {fit.c_mid:.3g} "
        f"FLOPs{_ci(ci, 'c_mid')} (rmse {fit.rmse:.3f}); 90% of the gain by {diminishing_returns(fit):.3g} FLOPs."
      )
    elif f.get("why"):
      page.paragraph(f"{name}: no compute fit ({f['why']}).")

  # --- points ------------------------------------------------------------------------------------------------
  page.heading("Points", anchor="points")
  table = []
  for p, s in stats.items():
    warm = s["warm_median"]
    wf = _within_run_fit(records[p], warm) if warm is not None and records[p] else None
    table.append(
      {
        "point": p,
        "seeds done": f"{s['done']}/{len(definition['seeds'])}",  # planned, whether recorded yet or not
        "gate": ", ".join(s["gates"]),
        "warm start": warm,
        "final min": s["final_min"],
        "final median": s["final_median"],
        "final max": s["final_max"],
        "gain median": s["gain_median"],
        "best median": s["best_median"],
        "ceiling A (within-run fit)": None if wf is None else wf["fit"].a,
        "FLOPs": s["flops_median"],
        "wall s": s["wall_median"],
      }
    )
  columns = list(table[0])
  page.table(table, columns)
  page.paragraph(
    f"Held-out {METRIC} (fractions). 'ceiling A': each point's own held-out curve fitted against its cumulative "
    "training FLOPs (needs 3 evaluations after the warm start: --eval_every)."
  )
  failed = [r for r in rows if r["status"] != "done"]
  if failed:
    page.heading("Stopped runs", level=3)
    page.table(
      [
        {
          "run": r["run"],
          "status": r["status"],
          "gate": (r.get("gate") or {}).get("verdict"),
          "detail": (r.get("gate") or {}).get("detail"),
          "RL steps": r.get("rl_steps_done"),
        }
        for r in failed
      ],
      ["run", "status", "gate", "detail", "RL steps"],
    )

  # --- curves and fits per axis ------------------------------------------------------------------------------
  for name, members in groups:
    page.heading(f"Axis {name}", anchor=f"axis-{name}")
    live = [p for p in members if records.get(p)]
    for key, source, label in (
      ("reward_mean", "rl", "batch reward (10-step mean)"),
      (f"eval/{METRIC}", "evals", f"held-out {METRIC}"),
      ("kl_k3", "rl", "KL to the reference (10-step mean)"),
      ("entropy", "rl", "entropy (10-step mean)"),
    ):
      data = {}
      for p in live:
        x, y = _mean_curve(records[p], key, source, "step")
        data[p] = (x, _smooth(y) if source == "rl" else y)
      page.figure(
        lines(
          data, title=f"{label} vs RL step", ylabel=label, styles={p: "o-" for p in live} if source == "evals" else None
        ),
        f"{label}: the seed mean per point",
      )
    for key, source, label in (
      ("reward_mean", "rl", "batch reward"),
      (f"eval/{METRIC}", "evals", f"held-out {METRIC}"),
    ):
      data = {}
      for p in live:
        x, y = _mean_curve(records[p], key, source, "flops")
        data[p] = (x, _smooth(y) if source == "rl" else y)
      page.figure(
        lines(
          data,
          title=f"{label} vs compute",
          xlabel="cumulative FLOPs",
          ylabel=label,
          logx=True,
          styles={p: "o-" for p in live} if source == "evals" else None,
        ),
        f"{label} against the compute ledger's cumulative FLOPs (first seed)",
      )
    page.figure(
      _final_vs_compute(name, members, stats, by_point, fits.get(name, {})),
      f"final held-out {METRIC} per seed against compute, the seed means and the fitted curve",
    )

  # --- every run ----------------------------------------------------------------------------------------------
  page.heading("Every run (results.jsonl)", anchor="runs")
  page.table(
    [
      {
        "run": r["run"],
        "status": r["status"],
        "gate": (r.get("gate") or {}).get("verdict"),
        "coupled": "; ".join(f"{c['flag']} {fmt(c['before'])}->{fmt(c['after'])}" for c in r.get("coupled", [])),
        "warm": r["warm_start"].get(METRIC),
        "final": r["final"].get(METRIC),
        "best": r["best"].get(METRIC),
        "FLOPs": r.get("flops_total"),
        "wall s": r.get("wall_time_s"),
        "run_dir": r["run_dir"],
      }
      for r in rows
    ],
    ["run", "status", "gate", "coupled", "warm", "final", "best", "FLOPs", "wall s", "run_dir"],
  )
  return page.write(os.path.join(out, REPORT))


def _ci(ci: Mapping[str, tuple[float, float]], k: str) -> str:
  if k not in ci:
    return ""
  lo, hi = ci[k]
  return f" [{lo:.3g}, {hi:.3g}]"


# Compute values closer than this (relative) are one value to a fit against compute: the points of an
# axis that does not change compute (learning rate, advantage) differ only by their completions' lengths.
DISTINCT_COMPUTE = 0.1


def _distinct(values: Sequence[float], rel: float = DISTINCT_COMPUTE) -> list[float]:
  """The values, ascending, each kept only when more than ``rel`` above the last kept one."""
  kept: list[float] = []
  for v in sorted(values):
    if not kept or v > kept[-1] * (1 + rel):
      kept.append(v)
  return kept


def _axis_fit(members, stats, by_point) -> dict[str, Any]:
  pts = [p for p in members if stats[p]["final_median"] is not None and stats[p]["flops_median"]]
  computes = _distinct([stats[p]["flops_median"] for p in pts])
  if len(computes) < 3:
    return {
      "why": f"{len(computes)} distinct compute value(s) (more than {DISTINCT_COMPUTE:.0%} apart) among the "
      "finished points; the fit needs 3"
    }
  pts.sort(key=lambda p: stats[p]["flops_median"])
  compute = [stats[p]["flops_median"] for p in pts]
  finals = [stats[p]["finals"] for p in pts]
  r0 = _median([stats[p]["warm_median"] for p in pts])
  fit = fit_sigmoid(compute, [float(np.mean(v)) for v in finals], r0=r0)
  out: dict[str, Any] = {"fit": fit, "points": pts}
  if min(len(v) for v in finals) >= 2:
    out["ci"] = bootstrap(compute, finals, r0=r0, samples=200)
  return out


def _final_vs_compute(name, members, stats, by_point, fitted):
  fig = figure()
  ax = fig.add_subplot()
  for i, p in enumerate(members):
    done = [r for r in by_point.get(p, []) if r["status"] == "done" and r.get("flops_total")]
    if not done:
      continue
    xs = [r["flops_total"] for r in done]
    ys = [r["final"].get(METRIC) for r in done]
    ax.scatter(xs, ys, s=14, color=f"C{i}", alpha=0.6)
    ax.scatter([np.median(xs)], [np.mean(ys)], s=50, color=f"C{i}", marker="D", label=p)
  fit = fitted.get("fit")
  if fit is not None:
    compute = [stats[p]["flops_median"] for p in fitted["points"]]
    c = np.geomspace(min(compute) / 3, max(compute) * 3, 100)
    ax.plot(c, fit.predict(c), "k-", lw=1, label=f"fit: A {fit.a:.3f}, B {fit.b:.2f}")
    ax.axhline(fit.a, color="k", ls=":", lw=0.8)
    ax.axvline(diminishing_returns(fit), color="#888", ls="--", lw=0.8, label="90% of the gain")
  ax.set_xscale("log")
  ax.set_xlabel("cumulative FLOPs", fontsize=9)
  ax.set_ylabel(f"final held-out {METRIC}", fontsize=9)
  ax.set_title(f"{name}: final metric vs compute", fontsize=10)
  ax.tick_params(labelsize=8)
  ax.grid(True, alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7, loc="lower right")
  return fig
