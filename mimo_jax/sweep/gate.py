"""The short-run gate: a sweep point's first RL steps, judged before its long run is spent.

A configuration that cannot train usually shows it within a few steps: updates that are not finite,
a reward that never moves (every group's completions scored alike on every step: zero advantages,
nothing to learn), or the KL or entropy alarm firing.  :func:`gate_verdict` reads the point's own ``metrics.jsonl`` and
``alarms.jsonl`` records of RL steps ``1 .. steps`` and says which, with the evidence; the gate's
steps are the first steps of the long run (it resumes from them), so a passing gate costs nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["GATE_ALARMS", "Verdict", "gate_verdict"]

# The alarms that stop a point at its gate (the others need a longer run to mean anything).
GATE_ALARMS = ("kl_blowup", "entropy_collapse")
# Values that must be finite on every gate step.
_FINITE = ("reward_mean", "loss", "kl_k3", "entropy", "grad_norm")


@dataclasses.dataclass(frozen=True)
class Verdict:
  verdict: str  # pass | nan | flat | alarm | incomplete
  detail: str
  steps: int

  @property
  def passed(self) -> bool:
    return self.verdict == "pass"

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def gate_verdict(
  records: Sequence[Mapping[str, Any]],
  alarms: Sequence[Mapping[str, Any]],
  steps: int,
  *,
  min_reward_change: float = 0.0,
) -> Verdict:
  """Judges RL steps ``1 .. steps`` of a run.

  Args:
    records: the run's ``metrics.jsonl`` rows (any steps; those of the gate are read).
    alarms: the run's ``alarms.jsonl`` rows.
    steps: the gate's length in RL steps.
    min_reward_change: also ``flat`` when the batch reward's range over the gate is at most this (0: off;
      without it, ``flat`` means no learning signal: every prompt group's samples scored alike on every
      step, or, where that is not logged, a reward that never changed).

  Returns:
    The first failure found (``nan``, then ``alarm``, then ``flat``), or ``pass``; ``incomplete``
    when the records do not reach the gate's last step.
  """
  rl = {int(r["step"]): r for r in records if 1 <= int(r["step"]) <= steps and "reward_mean" in r}
  if len(rl) < steps:
    return Verdict("incomplete", f"{len(rl)} of the gate's {steps} RL steps were logged", steps)
  ordered = [rl[s] for s in sorted(rl)]
  for r in ordered:
    bad = [k for k in _FINITE if k in r and not _finite(r[k])]
    if bad:
      return Verdict("nan", f"RL step {r['step']}: non-finite {', '.join(bad)}", steps)
    if float(r.get("skipped", 0.0)) >= 1.0 or int(r.get("rollbacks", 0)) > 0:
      return Verdict(
        "nan", f"RL step {r['step']}: a non-finite update was skipped (rollbacks {r.get('rollbacks', 0)})", steps
      )
  for a in alarms:
    if a.get("kind") in GATE_ALARMS and int(a.get("step", 0)) <= steps:
      evidence = ", ".join(f"{k} {_fmt(v)}" for k, v in dict(a.get("evidence", {})).items())
      return Verdict("alarm", f"{a['kind']} at RL step {a['step']} ({evidence})", steps)
  rewards = [float(r["reward_mean"]) for r in ordered]
  spread = max(rewards) - min(rewards)
  equal = [float(r["frac_groups_all_equal"]) for r in ordered if "frac_groups_all_equal" in r]
  if len(equal) == steps:  # the learning signal itself: a group whose samples differ
    if min(equal) >= 1.0:
      return Verdict(
        "flat",
        f"every prompt group scored all its samples alike on all {steps} steps (reward {rewards[0]:.4g}: zero "
        "advantages, nothing to learn)",
        steps,
      )
  elif spread <= 0.0:
    return Verdict("flat", f"the batch reward stayed at {rewards[0]:.4g} for {steps} steps", steps)
  if min_reward_change > 0 and spread <= min_reward_change:
    return Verdict(
      "flat", f"the batch reward moved {spread:.3g} over {steps} steps (at most --gate_min_reward_change)", steps
    )
  return Verdict(
    "pass", f"reward {rewards[0]:.3g} -> {rewards[-1]:.3g} over {steps} steps, finite, no KL/entropy alarm", steps
  )


def _finite(x: Any) -> bool:
  try:
    return math.isfinite(float(x))
  except (TypeError, ValueError):
    return False


def _fmt(v: Any) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)
