"""Pass-rate curriculum and a stratified, de-duplicating prompt sampler for RL.

GRPO-style training learns nothing from a prompt whose group of completions is all right
or all wrong: the group-relative advantages are zero.  :class:`PassRateCurriculum` keeps
an estimate of every prompt's pass rate and turns it into a sampling weight that prefers
prompts of intermediate difficulty; :class:`PromptSampler` draws each step's prompts from
a candidate pool with those weights, while keeping the mix of tasks and levels close to
given proportions, never repeating a prompt within a batch or a window of recent
batches, and never returning a held-out prompt.

Weights (:meth:`PassRateCurriculum.weight_of_rate`): with estimated pass rate ``r`` and
target band ``[lo, hi]``, the weight is 1 inside the band, ``min_weight`` at distance
``ramp`` or more outside it, and a smoothstep (C1) ramp in between; so prompts that are
always solved (``r`` near 1) or never solved (``r`` near 0) keep a small but non-zero
chance (``min_weight``) of being drawn again, which is what lets the estimate notice when
the policy improves on them.  Prompts never observed get ``unseen_weight`` (1 by default:
new prompts are explored first).

The estimate is an exponential moving average over the pass rates of a prompt's groups:
the first observation sets it, and each later one moves it to
``ema * old + (1 - ema) * observed``.  With ``ema = 0.5`` two observations nearly replace
the history, so a policy that improves (pass rates drift up) is followed within a few
visits, at the cost of noise: with groups of 8 the standard deviation of one
observation at ``p = 0.5`` is 0.18, and about 0.10 after averaging.

Stratification (:class:`PromptSampler`): each candidate belongs to a *group*, either its
``(task, level)`` or, if only the task is listed in ``strata``, its task.  Per step:

1. *Share*: every group with eligible candidates gets the target fraction (renormalised
   over the groups present), tilted by the group's mean curriculum weight (a group whose
   prompts are all mastered asks for fewer draws), then projected back into
   ``[target - band, target + band]`` with the shares summing to 1 (bisection on a common
   shift, then clipping).  The proportions are therefore *soft*: the curriculum may move
   a group's share, but never out of its band.
2. *Apportionment with a running deficit*: group ``g`` is owed ``share_g * n + carry_g``
   draws; the integer counts are the floors plus largest remainders (capped by the
   group's eligible candidates), and ``carry_g`` keeps the unpaid (or overpaid)
   remainder for the next step.  Cumulative draws thus track the summed shares within a
   few draws, so the realised share stays inside the band up to ``O(1 / total draws)``.
3. *Within a group*: candidates are drawn without replacement with probability
   proportional to their curriculum weight.

Held-out isolation: candidates whose uid is in ``heldout_uids`` are rejected (and counted)
when they enter the pool, and every returned batch is checked again.

All randomness comes from the ``rng`` passed to :meth:`PromptSampler.sample` (also
forwarded to ``refill``), and every piece of sampler state is in
:meth:`PromptSampler.state_dict`, so restoring the sampler state together with the
generator's state continues the stream identically.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

__all__ = [
  "CurriculumProblem",
  "PassRateCurriculum",
  "PromptSampler",
  "pass_rate_metrics",
]

_STATE_VERSION = 1
# PromptSampler counters, saved in its state and reported by its stats().
_COUNTERS = (
  "num_heldout_rejected",
  "num_duplicates_skipped",
  "num_unmatched_rejected",
  "num_window_relaxed",
  "num_evicted",
)
# Classes of :func:`pass_rate_metrics`, in reporting order.
_CLASSES = ("in_band", "too_easy", "too_hard", "unseen")


class CurriculumProblem(Protocol):
  """What the sampler needs from a problem (e.g. :class:`mimo_jax.tasks.arith.Problem`)."""

  @property
  def uid(self) -> str: ...

  @property
  def task(self) -> str: ...

  @property
  def level(self) -> int: ...

  @property
  def prompt(self) -> str: ...


P = TypeVar("P", bound=CurriculumProblem)


# ---- pass-rate curriculum ---------------------------------------------------------------


class PassRateCurriculum:
  """Per-prompt pass-rate estimates and the sampling weights derived from them.

  Args:
    target_band: ``(lo, hi)``, the pass rates to prefer; ``0 <= lo <= hi <= 1``.
    ema: weight of the old estimate in each update, in ``[0, 1)``; 0 keeps only the last
      observation.
    ramp: width of the weight ramp outside the band (0: a step).
    min_weight: weight of prompts at least ``ramp`` outside the band, in ``(0, 1]``.
    unseen_weight: weight of prompts never observed (or evicted), positive.
    max_prompts: most prompts tracked; beyond it the least recently observed are evicted
      (and become unseen again).

  Attributes:
    step: number of :meth:`update` calls.
    num_evicted: estimates dropped to respect ``max_prompts``.
  """

  def __init__(
    self,
    target_band: tuple[float, float] = (0.4, 0.7),
    *,
    ema: float = 0.5,
    ramp: float = 0.15,
    min_weight: float = 0.05,
    unseen_weight: float = 1.0,
    max_prompts: int = 100_000,
  ) -> None:
    lo, hi = (float(x) for x in target_band)
    if not 0.0 <= lo <= hi <= 1.0:
      raise ValueError(f"target_band must satisfy 0 <= lo <= hi <= 1, got {target_band}")
    if not 0.0 <= ema < 1.0:
      raise ValueError(f"ema must be in [0, 1), got {ema}")
    if not ramp >= 0.0:
      raise ValueError(f"ramp must be non-negative, got {ramp}")
    if not 0.0 < min_weight <= 1.0:
      raise ValueError(f"min_weight must be in (0, 1], got {min_weight}")
    if not unseen_weight > 0.0:
      raise ValueError(f"unseen_weight must be positive, got {unseen_weight}")
    max_prompts = operator.index(max_prompts)
    if max_prompts <= 0:
      raise ValueError(f"max_prompts must be positive, got {max_prompts}")
    self.target_band = (lo, hi)
    self.ema = float(ema)
    self.ramp = float(ramp)
    self.min_weight = float(min_weight)
    self.unseen_weight = float(unseen_weight)
    self.max_prompts = max_prompts
    self.step = 0
    self.num_evicted = 0
    # uid -> [rate, observations, step of last observation]; least recently observed first.
    self._entries: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, uid: object) -> bool:
    return uid in self._entries

  def update(self, uids: Sequence[str], pass_rates: Sequence[float]) -> None:
    """Folds one observed pass rate per prompt into the estimates (one step).

    Args:
      uids: prompt uids; a uid may repeat (its observations are applied in order).
      pass_rates: the fraction of each prompt's group that passed, in ``[0, 1]``.

    Raises:
      ValueError: on different lengths or a rate outside ``[0, 1]`` (or NaN).
    """
    rates = [float(r) for r in pass_rates]
    if len(rates) != len(uids):
      raise ValueError(f"got {len(uids)} uids but {len(rates)} pass rates")
    for r in rates:
      if not 0.0 <= r <= 1.0:
        raise ValueError(f"pass rates must be in [0, 1], got {r}")
    self.step += 1
    for uid, r in zip(uids, rates, strict=True):
      entry = self._entries.get(uid)
      if entry is None:
        self._entries[uid] = [r, 1, self.step]
      else:
        entry[0] = self.ema * entry[0] + (1.0 - self.ema) * r
        entry[1] += 1
        entry[2] = self.step
        self._entries.move_to_end(uid)
    while len(self._entries) > self.max_prompts:
      self._entries.popitem(last=False)
      self.num_evicted += 1

  def estimate(self, uid: str) -> float | None:
    """The estimated pass rate of ``uid``, or None if it was never observed (or was evicted)."""
    entry = self._entries.get(uid)
    return None if entry is None else float(entry[0])

  def observations(self, uid: str) -> int:
    """How many groups of ``uid`` were folded into its estimate (0 if unseen)."""
    entry = self._entries.get(uid)
    return 0 if entry is None else int(entry[1])

  def rates(self, uids: Sequence[str]) -> np.ndarray:
    """Estimated pass rates as float64, NaN for unseen prompts."""
    return np.array([self._entries[u][0] if u in self._entries else np.nan for u in uids], dtype=np.float64)

  def weight_of_rate(self, rates: np.ndarray | float) -> np.ndarray:
    """The weight of given pass rates (NaN, i.e. unseen, maps to ``unseen_weight``).

    Args:
      rates: pass rates in ``[0, 1]`` or NaN.

    Returns:
      Weights in ``[min_weight, 1]`` (``unseen_weight`` for NaN), same shape.
    """
    r = np.asarray(rates, dtype=np.float64)
    lo, hi = self.target_band
    distance = np.maximum(np.maximum(lo - r, r - hi), 0.0)
    if self.ramp > 0:
      t = np.clip(1.0 - distance / self.ramp, 0.0, 1.0)
    else:
      t = (distance <= 0).astype(np.float64)
    smooth = t * t * (3.0 - 2.0 * t)
    w = self.min_weight + (1.0 - self.min_weight) * smooth
    return np.where(np.isnan(r), self.unseen_weight, w)

  def weights(self, uids: Sequence[str]) -> np.ndarray:
    """Sampling weights of ``uids`` (see :meth:`weight_of_rate`)."""
    return self.weight_of_rate(self.rates(uids))

  def classify(self, uids: Sequence[str]) -> list[str]:
    """Each uid's class by its estimate: ``"in_band"``, ``"too_easy"``, ``"too_hard"`` or ``"unseen"``."""
    lo, hi = self.target_band
    out = []
    for r in self.rates(uids).tolist():
      if math.isnan(r):
        out.append("unseen")
      elif r > hi:
        out.append("too_easy")
      elif r < lo:
        out.append("too_hard")
      else:
        out.append("in_band")
    return out

  def state_dict(self) -> dict[str, Any]:
    """JSON-able state: the estimates (least recently observed first), counters and settings.

    The settings are informational: :meth:`load_state_dict` keeps this object's own, so a
    resumed run may change the band or the weights.
    """
    return {
      "version": _STATE_VERSION,
      "step": self.step,
      "num_evicted": self.num_evicted,
      "settings": {
        "target_band": list(self.target_band),
        "ema": self.ema,
        "ramp": self.ramp,
        "min_weight": self.min_weight,
        "unseen_weight": self.unseen_weight,
        "max_prompts": self.max_prompts,
      },
      "entries": [[uid, float(r), int(c), int(s)] for uid, (r, c, s) in self._entries.items()],
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores estimates saved by :meth:`state_dict` (evicting the oldest beyond ``max_prompts``).

    Raises:
      ValueError: on an unknown state version or a malformed entry.
    """
    if state.get("version") != _STATE_VERSION:
      raise ValueError(f"unsupported curriculum state version {state.get('version')!r}")
    entries: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
    for uid, r, c, s in state["entries"]:
      r = float(r)
      if not isinstance(uid, str) or not 0.0 <= r <= 1.0:
        raise ValueError(f"malformed curriculum entry {[uid, r, c, s]}")
      entries[uid] = [r, int(c), int(s)]
    self.step = int(state["step"])
    self.num_evicted = int(state["num_evicted"])
    while len(entries) > self.max_prompts:
      entries.popitem(last=False)
      self.num_evicted += 1
    self._entries = entries


def pass_rate_metrics(curriculum: PassRateCurriculum, uids: Sequence[str]) -> dict[str, float]:
  """Fractions of ``uids`` whose estimated pass rate is in the band, above, below, or unknown.

  Args:
    curriculum: the estimates to use.
    uids: e.g. the prompts drawn for a step.

  Returns:
    ``{"in_band", "too_easy", "too_hard", "unseen"}`` fractions (summing to 1, or all 0
    for no uids) and ``"mean_estimate"``, the mean estimated rate of the seen ones (NaN if
    none).
  """
  classes = curriculum.classify(uids)
  n = len(classes)
  out = {c: (classes.count(c) / n if n else 0.0) for c in _CLASSES}
  rates = curriculum.rates(uids)
  seen = rates[~np.isnan(rates)]
  out["mean_estimate"] = float(seen.mean()) if seen.size else float("nan")
  return out


# ---- prompt sampler ---------------------------------------------------------------------

GroupKey = tuple[str, int] | str


def _project_shares(raw: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  """The shares ``clip(raw + tau, lo, hi)`` summing to 1 (needs ``sum(lo) <= 1 <= sum(hi)``)."""
  lo_tau, hi_tau = -1.0 - float(raw.max()), 1.0 - float(raw.min()) + 1.0
  for _ in range(100):
    tau = 0.5 * (lo_tau + hi_tau)
    if np.clip(raw + tau, lo, hi).sum() < 1.0:
      lo_tau = tau
    else:
      hi_tau = tau
  shares = np.clip(raw + 0.5 * (lo_tau + hi_tau), lo, hi)
  return shares / shares.sum()


class PromptSampler(Generic[P]):
  """Draws each step's training prompts from a refreshed candidate pool.

  See the module docstring for the method.  Problems need ``uid``, ``task``, ``level``
  and ``prompt`` attributes (:class:`CurriculumProblem`); to save the pool in
  :meth:`state_dict` they must also be dataclasses, rebuilt on load by
  ``problem_factory(dataclasses.asdict(problem))``.

  Args:
    refill: ``refill(rng, k)`` returns up to ``k`` new candidate problems (fewer or
      repeats are fine: repeats of pool members are skipped and counted).
    pool_size: number of candidates the pool is topped up to before each draw; should be
      at least ``n * (dedup_window + 1)`` for batches of ``n``.
    curriculum: the pass-rate curriculum giving the weights; None draws uniformly.
    strata: target fractions per group, keyed by ``(task, level)`` or by task name (a
      problem uses its ``(task, level)`` entry if there is one, else its task's); they
      are normalised to sum to 1.  Candidates of unlisted groups are rejected (and
      counted).  None puts every problem into one group.
    band: how far, in absolute share, a group's share may move away from its target.
    heldout_uids: uids that must never be returned.
    dedup_window: a uid drawn in one of the last ``dedup_window`` calls of :meth:`sample`
      is not drawn again (relaxed, oldest step first, and counted, only if the pool runs
      short).  Within a batch uids are always distinct.
    refresh_fraction: fraction of the pool evicted before each draw (the lowest-weight
      candidates, oldest first among ties) and replaced from ``refill``; 0 keeps the pool
      until the source runs dry.
    problem_factory: rebuilds a problem from ``dataclasses.asdict`` output in
      :meth:`load_state_dict`.
    max_refill_rounds: most ``refill`` calls per top-up.

  Attributes:
    num_heldout_rejected: candidates rejected because their uid is held out.
    num_duplicates_skipped: candidates skipped because the pool already had their uid.
    num_unmatched_rejected: candidates rejected because no stratum lists their group.
    num_window_relaxed: calls of :meth:`sample` that had to shorten the de-duplication window.
    num_evicted: candidates evicted by the refresh.
  """

  def __init__(
    self,
    refill: Callable[[np.random.Generator, int], Sequence[P]],
    *,
    pool_size: int = 1024,
    curriculum: PassRateCurriculum | None = None,
    strata: Mapping[GroupKey, float] | None = None,
    band: float = 0.1,
    heldout_uids: Iterable[str] = (),
    dedup_window: int = 0,
    refresh_fraction: float = 0.0,
    problem_factory: Callable[[dict[str, Any]], P] | None = None,
    max_refill_rounds: int = 8,
  ) -> None:
    self.refill = refill
    self.pool_size = operator.index(pool_size)
    if self.pool_size <= 0:
      raise ValueError(f"pool_size must be positive, got {pool_size}")
    self.curriculum = curriculum
    if not 0.0 <= band <= 1.0:
      raise ValueError(f"band must be in [0, 1], got {band}")
    self.band = float(band)
    self.heldout_uids = frozenset(heldout_uids)
    self.dedup_window = operator.index(dedup_window)
    if self.dedup_window < 0:
      raise ValueError(f"dedup_window must be non-negative, got {dedup_window}")
    if not 0.0 <= refresh_fraction <= 1.0:
      raise ValueError(f"refresh_fraction must be in [0, 1], got {refresh_fraction}")
    self.refresh_fraction = float(refresh_fraction)
    self.problem_factory = problem_factory
    self.max_refill_rounds = operator.index(max_refill_rounds)
    if self.max_refill_rounds <= 0:
      raise ValueError(f"max_refill_rounds must be positive, got {max_refill_rounds}")

    if strata is None:
      self._groups: list[GroupKey] = ["*"]
      targets = [1.0]
    else:
      if not strata:
        raise ValueError("strata must not be empty (use None for no stratification)")
      self._groups = []
      targets = []
      for key, value in strata.items():
        if isinstance(key, tuple):
          task, level = key
          key = (str(task), operator.index(level))
        elif not isinstance(key, str):
          raise ValueError(f"strata keys must be (task, level) or a task name, got {key!r}")
        if not value >= 0.0 or math.isinf(value):
          raise ValueError(f"strata fractions must be finite and non-negative, got {key!r}: {value}")
        self._groups.append(key)
        targets.append(float(value))
      if sum(targets) <= 0.0:
        raise ValueError("strata fractions must not all be zero")
    self._targets = np.asarray(targets, dtype=np.float64) / sum(targets)
    self._group_index = {g: i for i, g in enumerate(self._groups)}

    self._pool: list[P] = []
    self._pool_uids: set[str] = set()
    self._carry = np.zeros(len(self._groups))
    self._drawn = np.zeros(len(self._groups), dtype=np.int64)
    self._strata_drawn: collections.Counter[tuple[str, int]] = collections.Counter()
    self._recent: collections.deque[list[str]] = collections.deque(maxlen=self.dedup_window or None)
    self._last_metrics: dict[str, float] = {}
    self.num_heldout_rejected = 0
    self.num_duplicates_skipped = 0
    self.num_unmatched_rejected = 0
    self.num_window_relaxed = 0
    self.num_evicted = 0

  # ---- pool ---------------------------------------------------------------------------

  def _group_of(self, problem: CurriculumProblem) -> int | None:
    if self._groups == ["*"]:
      return 0
    index = self._group_index.get((problem.task, int(problem.level)))
    if index is None:
      index = self._group_index.get(problem.task)
    return index

  def _weights(self, problems: Sequence[P]) -> np.ndarray:
    if self.curriculum is None:
      return np.ones(len(problems))
    return self.curriculum.weights([p.uid for p in problems])

  @property
  def pool(self) -> list[P]:
    """The current candidates (a new list)."""
    return list(self._pool)

  def _add(self, problem: P) -> None:
    if problem.uid in self.heldout_uids:
      self.num_heldout_rejected += 1
    elif problem.uid in self._pool_uids:
      self.num_duplicates_skipped += 1
    elif self._group_of(problem) is None:
      self.num_unmatched_rejected += 1
    else:
      self._pool.append(problem)
      self._pool_uids.add(problem.uid)

  def _fill(self, rng: np.random.Generator) -> None:
    """Tops the pool up to ``pool_size`` from ``refill``."""
    heldout_before = self.num_heldout_rejected
    offered = 0
    for _ in range(self.max_refill_rounds):
      missing = self.pool_size - len(self._pool)
      if missing <= 0:
        break
      items = self.refill(rng, missing)
      if not items:
        break
      offered += len(items)
      for problem in items:
        self._add(problem)
    if not self._pool:
      rejected = self.num_heldout_rejected - heldout_before
      if offered and rejected == offered:
        raise ValueError(f"refill returned only held-out problems ({rejected} rejected); nothing left to train on")
      raise ValueError(f"the candidate pool is empty after refilling ({offered} offered, {rejected} held out)")

  def _refresh(self) -> None:
    k = int(round(self.refresh_fraction * len(self._pool)))
    if k <= 0:
      return
    order = np.argsort(self._weights(self._pool), kind="stable")
    drop = set(order[:k].tolist())
    for i in sorted(drop):
      self._pool_uids.discard(self._pool[i].uid)
    self._pool = [p for i, p in enumerate(self._pool) if i not in drop]
    self.num_evicted += len(drop)

  # ---- sampling -----------------------------------------------------------------------

  def _eligible(self, n: int) -> list[P]:
    """Pool members outside the de-duplication window, relaxing it (oldest first) if fewer than ``n``."""
    window = list(self._recent)
    while True:
      blocked = {uid for uids in window for uid in uids}
      eligible = [p for p in self._pool if p.uid not in blocked]
      if len(eligible) >= n:
        if len(window) < len(self._recent):
          self.num_window_relaxed += 1
        return eligible
      if not window:
        raise ValueError(f"the candidate pool has only {len(self._pool)} distinct problems, fewer than n={n}")
      window.pop(0)

  def _shares(self, groups: list[list[P]]) -> np.ndarray:
    present = np.array([len(g) > 0 for g in groups])
    targets = np.where(present, self._targets, 0.0)
    if targets.sum() <= 0.0:
      # Only groups with target 0 have candidates; they cannot be drawn.
      raise ValueError("no candidate belongs to a stratum with a positive target fraction")
    targets = targets / targets.sum()
    mean_w = np.array([self._weights(g).mean() if g else 0.0 for g in groups])
    raw = targets * mean_w
    raw = raw / raw.sum() if raw.sum() > 0 else targets
    lo = np.where(present & (targets > 0), np.maximum(targets - self.band, 0.0), 0.0)
    hi = np.where(present & (targets > 0), np.minimum(targets + self.band, 1.0), 0.0)
    return _project_shares(raw, lo, hi)

  def _apportion(self, shares: np.ndarray, caps: np.ndarray, n: int) -> np.ndarray:
    """Counts per group summing to ``n``: ``shares`` (over the groups with candidates) plus what each group
    is owed, largest remainders first, none past its ``caps``.

    What a group is owed carries over between draws: its share of every draw less what it got.  A group
    with no candidate this draw (a small stratum the pool's refill missed) is owed its whole share of
    the whole mix, and the groups that filled in for it owe it back, so every group's long-run share
    is its target's (a stratum of 2% that half the pools lack was drawn at half its weight)."""
    present = caps > 0
    owed_share = np.where(present, shares * self._targets[present].sum(), self._targets)
    quota = shares * n + np.where(present, self._carry, 0.0)
    desired = np.clip(quota, 0.0, caps)
    counts = np.minimum(np.floor(desired).astype(np.int64), caps)
    # Largest remainders first (ties by group order), never past a group's candidates.
    while counts.sum() < n:
      room = np.where(counts < caps, desired - counts, -np.inf)
      i = int(np.argmax(room))
      if room[i] == -np.inf:
        raise ValueError(f"not enough eligible candidates for n={n}")
      counts[i] += 1
    while counts.sum() > n:
      excess = np.where(counts > 0, counts - desired, -np.inf)
      counts[int(np.argmax(excess))] -= 1
    self._carry = np.where(self._targets > 0, np.clip(self._carry + owed_share * n - counts, -n, n), 0.0)
    return counts

  def sample(self, rng: np.random.Generator, n: int) -> list[P]:
    """Draws ``n`` distinct training problems for one step.

    Args:
      rng: the generator for every random choice (advanced in place; also passed to
        ``refill``).
      n: number of problems.

    Returns:
      ``n`` problems with distinct uids, in random order; none held out.

    Raises:
      ValueError: if ``n`` is negative, the pool cannot supply ``n`` distinct problems,
        or ``refill`` offers only held-out problems.
    """
    n = operator.index(n)
    if n < 0:
      raise ValueError(f"n must be non-negative, got {n}")
    if n == 0:
      return []
    self._refresh()
    self._fill(rng)
    eligible = self._eligible(n)
    groups: list[list[P]] = [[] for _ in self._groups]
    for p in eligible:
      index = self._group_of(p)
      assert index is not None  # unmatched candidates never enter the pool
      groups[index].append(p)
    caps = np.array([len(g) for g in groups], dtype=np.int64)
    caps = np.where(self._targets > 0, caps, 0)
    if caps.sum() < n:
      raise ValueError(f"only {caps.sum()} eligible candidates in strata with a positive target, fewer than n={n}")
    counts = self._apportion(self._shares(groups), caps, n)

    batch: list[P] = []
    for g, count in zip(groups, counts.tolist(), strict=True):
      if count == 0:
        continue
      w = np.maximum(self._weights(g), 1e-12)
      picks = rng.choice(len(g), size=count, replace=False, p=w / w.sum())
      batch.extend(g[i] for i in sorted(picks.tolist()))
    batch = [batch[i] for i in rng.permutation(len(batch)).tolist()]

    uids = [p.uid for p in batch]
    leaked = [u for u in uids if u in self.heldout_uids]
    if leaked or len(set(uids)) != len(uids):
      raise RuntimeError(f"sampler invariant broken: held out {leaked}, duplicates {len(uids) - len(set(uids))}")
    self._drawn += counts
    self._strata_drawn.update((p.task, int(p.level)) for p in batch)
    if self.dedup_window:
      self._recent.append(uids)
    if self.curriculum is not None:
      self._last_metrics = pass_rate_metrics(self.curriculum, uids)
    return batch

  def observe(self, problems: Sequence[P], pass_rates: Sequence[float]) -> None:
    """Reports each problem's group pass rate to the curriculum (no-op without one)."""
    if self.curriculum is not None:
      self.curriculum.update([p.uid for p in problems], pass_rates)

  # ---- reporting ----------------------------------------------------------------------

  def pass_rate_metrics(self) -> dict[str, float]:
    """:func:`pass_rate_metrics` of the last batch, as estimated when it was drawn ({} before any)."""
    return dict(self._last_metrics)

  def realized_shares(self) -> dict[GroupKey, float]:
    """Each group's share of all problems drawn so far (zeros before any draw)."""
    total = int(self._drawn.sum())
    return {g: (int(c) / total if total else 0.0) for g, c in zip(self._groups, self._drawn, strict=True)}

  def target_shares(self) -> dict[GroupKey, float]:
    """Each group's normalised target fraction."""
    return {g: float(t) for g, t in zip(self._groups, self._targets, strict=True)}

  def stats(self) -> dict[str, Any]:
    """Counters and sizes, for logging."""
    return {
      "pool_size": len(self._pool),
      "num_drawn": int(self._drawn.sum()),
      **{k: getattr(self, k) for k in _COUNTERS},
    }

  # ---- state --------------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """JSON-able state: the pool (as ``dataclasses.asdict`` dicts), deficits, window, counters, curriculum.

    Raises:
      TypeError: if a pool problem is not a dataclass instance.
    """
    pool = []
    for p in self._pool:
      if not dataclasses.is_dataclass(p) or isinstance(p, type):
        raise TypeError(f"pool problems must be dataclass instances to be saved, got {type(p).__name__}")
      pool.append(dataclasses.asdict(p))
    return {
      "version": _STATE_VERSION,
      "groups": [list(g) if isinstance(g, tuple) else g for g in self._groups],
      "pool": pool,
      "pool_uids": [p.uid for p in self._pool],
      "carry": self._carry.tolist(),
      "drawn": self._drawn.tolist(),
      "strata_drawn": [[task, level, count] for (task, level), count in sorted(self._strata_drawn.items())],
      "recent": [list(uids) for uids in self._recent],
      # NaN (no seen prompt) is not JSON: stored as None.
      "last_metrics": {k: (None if math.isnan(v) else v) for k, v in self._last_metrics.items()},
      "counters": {key: getattr(self, key) for key in _COUNTERS},
      "curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a state saved by :meth:`state_dict` into a sampler built with the same strata.

    Raises:
      ValueError: on a different version or strata, a non-empty pool without
        ``problem_factory``, a rebuilt problem whose uid differs from the saved one, or a
        saved pool member that is now held out.
    """
    if state.get("version") != _STATE_VERSION:
      raise ValueError(f"unsupported sampler state version {state.get('version')!r}")
    groups = [tuple(g) if isinstance(g, list) else g for g in state["groups"]]
    if groups != self._groups:
      raise ValueError(f"state has strata {groups}, this sampler has {self._groups}")
    if state["pool"] and self.problem_factory is None:
      raise ValueError("restoring a non-empty pool needs a problem_factory")
    pool: list[P] = []
    for data, uid in zip(state["pool"], state["pool_uids"], strict=True):
      assert self.problem_factory is not None
      problem = self.problem_factory(dict(data))
      if problem.uid != uid:
        raise ValueError(f"problem_factory rebuilt uid {problem.uid!r}, the state saved {uid!r}")
      if uid in self.heldout_uids:
        raise ValueError(f"saved pool member {uid!r} is held out")
      pool.append(problem)
    if state["curriculum"] is not None:
      if self.curriculum is None:
        raise ValueError("state has a curriculum but this sampler has none")
      self.curriculum.load_state_dict(state["curriculum"])
    self._pool = pool
    self._pool_uids = {p.uid for p in pool}
    self._carry = np.asarray(state["carry"], dtype=np.float64)
    self._drawn = np.asarray(state["drawn"], dtype=np.int64)
    self._strata_drawn = collections.Counter({(t, int(lv)): int(c) for t, lv, c in state["strata_drawn"]})
    self._recent = collections.deque((list(u) for u in state["recent"]), maxlen=self.dedup_window or None)
    self._last_metrics = {k: (float("nan") if v is None else float(v)) for k, v in state["last_metrics"].items()}
    for key in _COUNTERS:
      setattr(self, key, int(state["counters"][key]))
