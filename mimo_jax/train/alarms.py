"""Failure-shape alarms: detectors over the logged metrics that name what went wrong, and what was done.

The field reports describe a handful of ways an RL run dies, and the order in which to look when it
does (reward rises then collapses: look at the value loss first, then the entropy, then the KL).  Each
detector here watches one shape in the stream of ``metrics.jsonl`` records:

================== ======================================================================= ==================
kind               fires when                                                              threshold flag
================== ======================================================================= ==================
reward_collapse    the smoothed reward has lost ``drop`` of its rise above the first        ``--alarm_reward_drop``
                   window (the rise at least ``--alarm_reward_min_rise``; the rise and the
                   fall each above 5 standard errors of the batch noise)
entropy_collapse   the smoothed entropy is below ``floor`` x the first window's, while the  ``--alarm_entropy_floor``
                   smoothed batch accuracy (where a verifier reports one) is below         ``--alarm_entropy_solved``
                   ``solved`` (a policy that answers nearly every prompt right is
                   converged, not collapsed)
kl_blowup          the smoothed KL to the reference exceeds the limit                       ``--alarm_kl_max``
value_loss_spike   the value loss exceeds ``spike`` x the median of the window before it    ``--alarm_value_spike``
length_explosion   the smoothed response length exceeds ``growth`` x the first window's     ``--alarm_length_growth``
grad_norm_collapse the smoothed gradient norm (steps whose every sample is correct left      ``--alarm_grad_floor``
                   out) is below ``floor`` x the first window's
reward_jitter      the reward's step-to-step changes over the last 6 windows have an        ``--alarm_jitter_acf``
                   autocorrelation above the limit at a period P of 2 .. 1 window and at 2P
                   (a repeating data pipeline)
================== ======================================================================= ==================

Smoothing is a mean over the last ``--alarm_window`` steps; nothing fires before two windows of
steps, but a value-loss spike (one step against the median of the window before it: one window and a
step).  A detector fires once when its condition starts to hold and again only after it has cleared,
which takes a whole window of steps without it (a value hovering at the threshold is one episode).
Each alarm carries its ``onset``, the first step of the shape: the reward's peak for a collapse, the
spike's step for the value loss, the first step of the smoothing window that shows it otherwise.  The
record of RL step ``s`` measures the policy after ``s - 1`` updates, so ``--on_alarm=rollback``
restores the last checkpoint of RL step ``onset - 2`` or earlier (the policy before the update that
the onset's record measures).  The detectors' state is checkpointed with the run
(:meth:`Alarms.state_dict`), so a resume or a rollback continues from the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["ALARM_KINDS", "DIAGNOSIS", "Alarm", "AlarmSettings", "Alarms", "alarm_settings"]

ALARM_KINDS = (
  "reward_collapse",
  "entropy_collapse",
  "kl_blowup",
  "value_loss_spike",
  "length_explosion",
  "grad_norm_collapse",
  "reward_jitter",
)

# Where to look, in order (the reports' diagnosis order), per kind.
DIAGNOSIS: dict[str, tuple[str, ...]] = {
  "reward_collapse": (
    "value loss: a diverging critic gives wrong advantages (value_loss, explained_variance)",
    "entropy: a collapsed policy stops exploring (entropy)",
    "KL: the policy drifted far from the reference (kl_k3, kl_prompt_max and its prompt id)",
  ),
  "entropy_collapse": (
    "entropy bonus or controller too weak (entropy_coef)",
    "clip range too tight on the low side (clipfrac_low, clip_high_now)",
    "learning rate too high (lr, grad_norm)",
  ),
  "kl_blowup": (
    "KL coefficient too small for the learning rate (kl_coef, lr)",
    "a few prompts dominate (kl_prompt_max, kl_prompt_max_id, samples.jsonl kl_top rows)",
    "behaviour/learner mismatch (sampler_learner_kl, is_ratio_max)",
  ),
  "value_loss_spike": (
    "critic learning rate or passes (value_passes, value_grad_norm)",
    "return scale changed (return_mean, reward_std)",
    "then the policy: entropy and KL",
  ),
  "length_explosion": (
    "overlong shaping off or too weak (overlong, truncated_frac)",
    "a reward that pays for length (reward components in samples.jsonl)",
    "entropy rising (entropy)",
  ),
  "grad_norm_collapse": (
    "no learning signal: groups all equal (frac_groups_all_equal)",
    "learning rate decayed or phase schedule in fine-tune (lr, phase)",
    "entropy collapse (entropy)",
  ),
  "reward_jitter": (
    "the data pipeline repeats: prompts cycle with a period (curriculum, dataset size)",
    "a scheduled change with a period (temperature, checkpoints, evaluation)",
    "reward noise from a flaky verifier (reward/*_fail_frac)",
  ),
}


# A reward collapse's rise and fall must each exceed this many standard errors of a difference of
# window means (the batch noise), whatever --alarm_reward_min_rise and --alarm_reward_drop allow.
_NOISE_SE = 5.0


@dataclasses.dataclass(frozen=True)
class AlarmSettings:
  window: int = 10
  reward_drop: float = 0.5
  reward_min_rise: float = 0.05
  entropy_floor: float = 0.1
  entropy_solved: float = 0.95
  kl_max: float = 1.0
  value_spike: float = 10.0
  length_growth: float = 3.0
  grad_floor: float = 0.01
  jitter_acf: float = 0.6


def alarm_settings(logging_cfg: Any) -> AlarmSettings:
  """The thresholds of a run's ``LoggingConfig``: each field ``x`` is its flag ``--alarm_x``."""
  return AlarmSettings(**{f.name: getattr(logging_cfg, "alarm_" + f.name) for f in dataclasses.fields(AlarmSettings)})


@dataclasses.dataclass(frozen=True)
class Alarm:
  step: int
  kind: str
  onset: int
  evidence: dict[str, Any]

  def record(self, action: str) -> dict[str, Any]:
    """The ``alarms.jsonl`` row."""
    return {
      "step": self.step,
      "kind": self.kind,
      "onset": self.onset,
      "evidence": self.evidence,
      "diagnosis": list(DIAGNOSIS[self.kind]),
      "action": action,
    }


def _finite(x: Any) -> float | None:
  if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
    return float(x)
  return None


# Keys whose blow-up is the alarm (KL, the critic's loss): a value that is no longer a number, +inf or NaN
# (as the logger writes them: "inf", "nan"), is the largest blow-up there is, not a gap in the record.
_BLOW_UP_KEYS = ("kl_k3", "value_loss")


def _finite_or_blown_up(x: Any) -> float | None:
  if isinstance(x, str) and x in ("inf", "nan"):
    return math.inf
  if isinstance(x, float) and (math.isnan(x) or x == math.inf):
    return math.inf
  return _finite(x)


def _acf_peak(x: np.ndarray, lags: range) -> tuple[float, int]:
  """The largest autocorrelation over ``lags`` of ``x``'s step-to-step changes, and its lag.

  Differencing removes the learning trend (a rising curve's changes are small and smooth) and leaves
  independent noise with no correlation beyond lag 1, while a period-P pattern keeps its period."""
  d = np.diff(x)
  resid = d - d.mean()
  var = float(np.dot(resid, resid))
  if var <= 1e-12:
    return 0.0, 0

  def acf(k: int) -> float:
    return float(np.dot(resid[:-k], resid[k:])) / var

  # A period repeats: its autocorrelation is high at one and at two periods (noise rarely is at both).
  best, lag = -1.0, 0
  for k in lags:
    r = min(acf(k), acf(2 * k))
    if r > best:
      best, lag = r, k
  return best, lag


class Alarms:
  """The detectors' state over one run's records.

  Args:
    settings: the thresholds.
    kinds: which detectors run (all by default).
  """

  def __init__(self, settings: AlarmSettings, kinds: Sequence[str] = ALARM_KINDS):
    self.s = settings
    self.kinds = tuple(kinds)
    # Per watched key: its first window (the baselines), its last 6 windows (all any detector reads)
    # and how many values it has had.  Bounded, so the checkpointed state does not grow with the run.
    self.first: dict[str, list[float]] = {}
    self.recent: dict[str, list[float]] = {}
    self.count: dict[str, int] = {}
    self.active: dict[str, int] = {}  # kind -> onset of the shape currently holding (or clearing)
    self.calm: dict[str, int] = {}  # kind -> steps in a row an active shape has not held
    self.peak = (-1, -math.inf)  # the smoothed reward's peak (step, value)

  def state_dict(self) -> dict[str, Any]:
    """The detectors' state (JSON-able; checkpointed, so a resume or a rollback continues from it)."""
    return {
      "first": {k: list(v) for k, v in self.first.items()},
      "recent": {k: list(v) for k, v in self.recent.items()},
      "count": dict(self.count),
      "active": dict(self.active),
      "calm": dict(self.calm),
      "peak": [int(self.peak[0]), None if math.isinf(self.peak[1]) else float(self.peak[1])],
    }

  def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
    """Restores :meth:`state_dict` (None: a checkpoint written before the alarms; from scratch)."""
    state = state or {}
    self.first = {k: [float(x) for x in v] for k, v in state.get("first", {}).items()}
    self.recent = {k: [float(x) for x in v] for k, v in state.get("recent", {}).items()}
    self.count = {k: int(v) for k, v in state.get("count", {}).items()}
    self.active = {k: int(v) for k, v in state.get("active", {}).items()}
    self.calm = {k: int(v) for k, v in state.get("calm", {}).items()}
    step, value = state.get("peak", [-1, None])
    self.peak = (int(step), -math.inf if value is None else float(value))

  def _add(self, key: str, value: float) -> None:
    w = self.s.window
    self.count[key] = self.count.get(key, 0) + 1
    first = self.first.setdefault(key, [])
    if len(first) < w:
      first.append(value)
    recent = self.recent.setdefault(key, [])
    recent.append(value)
    del recent[: -6 * w]

  def _values(self, key: str) -> list[float]:
    """The key's last (up to) 6 windows of values."""
    return self.recent.get(key, [])

  def _ready(self, key: str) -> bool:
    return self.count.get(key, 0) >= 2 * self.s.window

  def _smooth(self, key: str) -> float | None:
    return float(np.mean(self._values(key)[-self.s.window :])) if self._ready(key) else None

  def _window_noise(self, key: str) -> float:
    """The standard error of the difference of two window means of ``key``, from its step-to-step changes
    over the last 6 windows (median absolute deviation: a collapse's few large steps do not count)."""
    d = np.diff(self._values(key))
    if d.size < 2:
      return 0.0
    per_step = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)
    return per_step * math.sqrt(2.0 / self.s.window)

  def _first(self, key: str) -> float | None:
    return float(np.mean(self.first[key])) if self._ready(key) else None

  def update(self, step: int, record: Mapping[str, Any]) -> list[Alarm]:
    """Feeds one RL step's record; returns the alarms that start firing at it."""
    for key in ("reward_mean", "entropy", "kl_k3", "value_loss", "response_len", "accuracy"):
      v = (_finite_or_blown_up if key in _BLOW_UP_KEYS else _finite)(record.get(key))
      if v is not None:
        self._add(key, v)
    # A batch every sample of which is correct has nothing left to teach (success, not a collapse); a
    # batch whose groups are all alike otherwise (a saturated policy, a task it never solves) is the
    # shape: the gradient vanished while there is still something to learn.
    g = _finite(record.get("grad_norm"))
    solved = record.get("frac_groups_all_equal", 0.0) >= 1.0 and record.get("accuracy", 0.0) >= 1.0
    if g is not None and not solved:
      self._add("grad_norm", g)
    holding: dict[str, tuple[int, dict[str, Any]]] = {}
    for kind in self.kinds:
      found = getattr(self, "_" + kind)(step)
      if found is not None:
        holding[kind] = found
    fired = []
    for kind in self.kinds:
      if kind in holding:
        self.calm.pop(kind, None)
        if kind not in self.active:
          onset, evidence = holding[kind]
          self.active[kind] = onset
          evidence = {
            k: (float(f"{v:.6g}") if math.isfinite(v) else str(v)) if isinstance(v, float) else v
            for k, v in evidence.items()
          }
          fired.append(Alarm(step=step, kind=kind, onset=onset, evidence=evidence))
      elif kind in self.active:
        # Cleared only after a whole window without the shape: a value hovering at the threshold is one
        # episode, not an alarm every few steps.
        self.calm[kind] = self.calm.get(kind, 0) + 1
        if self.calm[kind] >= self.s.window:
          del self.active[kind], self.calm[kind]
    return fired

  def _onset(self, kind: str, step: int, *, smoothed: bool = True) -> int:
    """The shape's first step: where it was first seen, else the start of the window that shows it."""
    return self.active.get(kind, max(1, step - self.s.window + 1) if smoothed else step)

  # ---- the detectors: (onset, evidence) while the shape holds, else None --------------------------

  def _reward_collapse(self, step):
    now, first = self._smooth("reward_mean"), self._first("reward_mean")
    if now is None:
      return None
    if now > self.peak[1]:
      self.peak = (step, now)
    rise, fall = self.peak[1] - first, self.peak[1] - now
    # The batch noise: the peak is the highest of many noisy window means, so on a small batch a plateau
    # alone makes a "rise" and a "fall" of a few standard errors.  Both must exceed the margin.
    margin = _NOISE_SE * self._window_noise("reward_mean")
    if rise < max(self.s.reward_min_rise, margin) or fall < max(self.s.reward_drop * rise, margin):
      return None
    return self.peak[0], {
      "reward_smoothed": now,
      "peak": self.peak[1],
      "peak_step": self.peak[0],
      "first": first,
      "noise_margin": margin,
    }

  def _entropy_collapse(self, step):
    now, first = self._smooth("entropy"), self._first("entropy")
    if now is None or first is None or first <= 0 or now >= self.s.entropy_floor * first:
      return None
    # Low entropy is the goal once the policy answers (nearly) everything right: convergence on a task it
    # has solved, not the premature collapse that stops exploration while there is still reward to earn.
    accuracy = self._smooth("accuracy")
    if accuracy is not None and accuracy >= self.s.entropy_solved:
      return None
    evidence = {"entropy_smoothed": now, "first": first}
    if accuracy is not None:
      evidence["accuracy_smoothed"] = accuracy
    return self._onset("entropy_collapse", step), evidence

  def _kl_blowup(self, step):
    now = self._smooth("kl_k3")
    if now is None or now <= self.s.kl_max:
      return None
    return self._onset("kl_blowup", step), {"kl_smoothed": now, "limit": self.s.kl_max}

  def _value_loss_spike(self, step):
    values = self._values("value_loss")
    w = self.s.window
    if len(values) < w + 1:
      return None
    before = float(np.median(values[-w - 1 : -1]))
    if before <= 0 or values[-1] <= self.s.value_spike * before:
      return None
    return self._onset("value_loss_spike", step, smoothed=False), {"value_loss": values[-1], "median_before": before}

  def _length_explosion(self, step):
    now, first = self._smooth("response_len"), self._first("response_len")
    if now is None or first is None or first <= 0 or now <= self.s.length_growth * first:
      return None
    return self._onset("length_explosion", step), {"response_len_smoothed": now, "first": first}

  def _grad_norm_collapse(self, step):
    now, first = self._smooth("grad_norm"), self._first("grad_norm")
    if now is None or first is None or first <= 0 or now >= self.s.grad_floor * first:
      return None
    return self._onset("grad_norm_collapse", step), {"grad_norm_smoothed": now, "first": first}

  def _reward_jitter(self, step):
    values = self._values("reward_mean")
    w = self.s.window
    n = 6 * w
    if len(values) < n:
      return None
    acf, lag = _acf_peak(np.asarray(values[-n:], np.float64), range(2, w + 1))
    if acf <= self.s.jitter_acf:
      return None
    return self._onset("reward_jitter", step), {"autocorrelation": acf, "period": lag, "steps": n}
