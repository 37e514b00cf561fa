"""Tests for ``mimo_jax.data.curriculum``: pass-rate weights and the stratified prompt sampler.

The sampler tests drive it with a simulated policy: every prompt has a true pass
probability, each drawn prompt gets ``Binomial(G=8, p) / 8`` as its group pass rate, and
the sampler is judged by the true probabilities of what it draws.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import numpy as np
import pytest

from mimo_jax.data.curriculum import PassRateCurriculum, PromptSampler, pass_rate_metrics
from mimo_jax.tasks.arith import ArithTask, Problem

G = 8
BAND = (0.4, 0.7)


def _problems(n: int, task: str = "sim", level: int = 0) -> list[Problem]:
  return [Problem(prompt=f"{task}{level}q{i}=", answer="0", level=level, task=task) for i in range(n)]


def _refill_from(problems: list[Problem]) -> Callable[[np.random.Generator, int], list[Problem]]:
  """A finite source: up to k distinct problems in random order."""

  def refill(rng: np.random.Generator, k: int) -> list[Problem]:
    return [problems[i] for i in rng.permutation(len(problems))[:k].tolist()]

  return refill


def _simulate(
  sampler: PromptSampler,
  index: dict[str, int],
  true_p: Callable[[int], np.ndarray],
  steps: int,
  n: int = 16,
  seed: int = 0,
) -> list[tuple[np.ndarray, np.ndarray]]:
  """Runs ``steps`` sample/observe rounds; returns (drawn indices, their true p at draw time) per step."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    batch = sampler.sample(rng, n)
    ids = np.array([index[p.uid] for p in batch])
    p = true_p(t)[ids]
    sampler.observe(batch, rng.binomial(G, p) / G)
    out.append((ids, p))
  return out


def _in_band(p: np.ndarray) -> np.ndarray:
  return (p >= BAND[0]) & (p <= BAND[1])


# ---- PassRateCurriculum -----------------------------------------------------------------


def test_weights_prefer_the_band_and_ramp_smoothly() -> None:
  cur = PassRateCurriculum(BAND, ramp=0.15, min_weight=0.05, unseen_weight=0.8)
  rates = np.array([0.0, 0.1, 0.25, 0.3, 0.4, 0.55, 0.7, 0.8, 0.85, 0.95, 1.0])
  w = cur.weight_of_rate(rates)
  np.testing.assert_allclose(w[[4, 5, 6]], 1.0)  # in the band
  np.testing.assert_allclose(w[[0, 1, 2, 8, 9, 10]], 0.05)  # at least `ramp` outside it
  assert 0.05 < w[3] < 1.0 and 0.05 < w[7] < 1.0  # on the ramps
  # Monotone towards the band from both sides, and continuous at the band edges.
  grid = np.linspace(0, 1, 1001)
  wg = cur.weight_of_rate(grid)
  assert np.all(np.diff(wg[grid <= 0.4]) >= 0) and np.all(np.diff(wg[grid >= 0.7]) <= 0)
  assert np.max(np.abs(np.diff(wg))) < 0.02
  assert cur.weight_of_rate(np.nan) == pytest.approx(0.8)
  assert cur.weights(["never-seen"]).tolist() == [0.8]


def test_ema_update_and_classification() -> None:
  cur = PassRateCurriculum(BAND, ema=0.5)
  cur.update(["a", "b", "c"], [1.0, 0.0, 0.5])
  assert cur.estimate("a") == 1.0 and cur.estimate("b") == 0.0 and cur.estimate("z") is None
  cur.update(["a", "a"], [0.5, 0.0])  # repeats apply in order: 1 -> 0.75 -> 0.375
  assert cur.estimate("a") == pytest.approx(0.375)
  assert cur.observations("a") == 3 and cur.observations("z") == 0
  assert cur.classify(["a", "b", "c", "z"]) == ["too_hard", "too_hard", "in_band", "unseen"]
  cur.update(["b"], [1.0])
  assert cur.classify(["b"]) == ["in_band"]  # 0.5
  cur.update(["b"], [1.0])
  assert cur.classify(["b"]) == ["too_easy"]  # 0.75
  metrics = pass_rate_metrics(cur, ["a", "b", "c", "z"])
  assert metrics["in_band"] == 0.25 and metrics["too_easy"] == 0.25
  assert metrics["too_hard"] == 0.25 and metrics["unseen"] == 0.25
  assert metrics["mean_estimate"] == pytest.approx((0.375 + 0.75 + 0.5) / 3)
  with pytest.raises(ValueError):
    cur.update(["a"], [1.5])
  with pytest.raises(ValueError):
    cur.update(["a", "b"], [0.5])


def test_curriculum_memory_is_bounded_lru_and_state_round_trips() -> None:
  cur = PassRateCurriculum(max_prompts=3)
  cur.update(["a", "b", "c"], [0.1, 0.2, 0.3])
  cur.update(["a"], [0.5])  # a becomes the most recently seen
  cur.update(["d"], [0.9])  # evicts b, the least recently seen
  assert len(cur) == 3 and "b" not in cur and all(u in cur for u in "acd")
  assert cur.num_evicted == 1
  assert cur.weights(["b"]).tolist() == [cur.unseen_weight]

  state = json.loads(json.dumps(cur.state_dict()))
  restored = PassRateCurriculum(max_prompts=3)
  restored.load_state_dict(state)
  assert restored.state_dict() == cur.state_dict()
  for c in (cur, restored):
    c.update(["e", "a"], [0.4, 1.0])
  assert restored.state_dict() == cur.state_dict()
  assert "c" not in restored  # the LRU order survived the round trip
  smaller = PassRateCurriculum(max_prompts=2)
  smaller.load_state_dict(state)
  assert len(smaller) == 2 and "c" not in smaller and smaller.num_evicted == 2


# ---- simulated policy -------------------------------------------------------------------


def test_curriculum_draws_the_band_far_more_than_uniform() -> None:
  problems = _problems(200)
  index = {p.uid: i for i, p in enumerate(problems)}
  true_p = np.linspace(0.0, 1.0, 200)  # prompt 0 is never solved, prompt 199 always

  def run(curriculum):
    sampler = PromptSampler(_refill_from(problems), pool_size=200, curriculum=curriculum)
    return np.concatenate([p for _, p in _simulate(sampler, index, lambda t: true_p, steps=150)])

  drawn_cur = run(PassRateCurriculum(BAND))
  drawn_uni = run(None)
  band_cur, band_uni = _in_band(drawn_cur).mean(), _in_band(drawn_uni).mean()
  assert 0.25 < band_uni < 0.37  # the band holds 30% of the prompts
  assert band_cur > band_uni + 0.25, (band_cur, band_uni)
  # Prompts (nearly) always or never solved: about 10% of uniform draws, rare with the curriculum.
  extreme_cur = ((drawn_cur < 0.05) | (drawn_cur > 0.95)).mean()
  extreme_uni = ((drawn_uni < 0.05) | (drawn_uni > 0.95)).mean()
  assert extreme_uni > 0.07
  assert extreme_cur < 0.35 * extreme_uni, (extreme_cur, extreme_uni)
  assert np.sum(drawn_cur == 0.0) < 0.3 * np.sum(drawn_uni == 0.0)


def test_curriculum_follows_an_improving_policy() -> None:
  problems = _problems(200)
  index = {p.uid: i for i, p in enumerate(problems)}
  steps = 300
  logit0 = np.linspace(-4.0, 2.0, 200)

  def true_p(t: int) -> np.ndarray:  # the policy improves on every prompt over time
    return 1.0 / (1.0 + np.exp(-(logit0 + 4.0 * t / steps)))

  start, end = true_p(0), true_p(steps)
  became_easy = np.flatnonzero(_in_band(start) & (end > 0.9))
  became_useful = np.flatnonzero((start < 0.1) & _in_band(end))
  assert len(became_easy) > 20 and len(became_useful) > 20

  def run(curriculum):
    sampler = PromptSampler(_refill_from(problems), pool_size=200, curriculum=curriculum)
    rounds = _simulate(sampler, index, true_p, steps=steps)
    early, late = rounds[: steps // 4], rounds[3 * steps // 4 :]

    def share(rs, selected):
      return np.concatenate([np.isin(ids, selected) for ids, _ in rs]).mean()

    def band(rs):
      return _in_band(np.concatenate([p for _, p in rs])).mean()

    return (
      share(early, became_easy),
      share(late, became_easy),
      share(early, became_useful),
      share(late, became_useful),
      band(late),
    )

  easy_early, easy_late, useful_early, useful_late, band_late = run(PassRateCurriculum(BAND))
  *_, uni_band_late = run(None)
  # Prompts that left the band upwards stop being preferred ...
  assert easy_late < 0.3 * easy_early, (easy_early, easy_late)
  # ... and prompts that were hopeless at first are picked up once they enter the band.
  assert useful_late > 3.0 * useful_early, (useful_early, useful_late)
  # Throughout, draws stay concentrated on the (moving) band.
  assert band_late > uni_band_late + 0.2, (band_late, uni_band_late)


# ---- sampler mechanics ------------------------------------------------------------------


def _arith_sampler(task: ArithTask, **kwargs) -> PromptSampler:
  return PromptSampler(task.sample, problem_factory=lambda d: Problem(**d), **kwargs)


def _pass_rate(problem: Problem) -> float:
  """A fixed, uid-dependent true pass probability."""
  return int(problem.uid[:4], 16) / 0xFFFF


def test_sampler_state_round_trip_continues_identically() -> None:
  task = ArithTask(levels=(1, 2, 3), seed=1, heldout_size=30)

  def make() -> PromptSampler:
    return _arith_sampler(
      task,
      pool_size=96,
      curriculum=PassRateCurriculum(BAND, max_prompts=200),
      strata={("arith", 1): 0.2, ("arith", 2): 0.5, ("arith", 3): 0.3},
      band=0.1,
      heldout_uids={p.uid for p in task.heldout()},
      dedup_window=2,
      refresh_fraction=0.25,
    )

  def steps(sampler: PromptSampler, rng: np.random.Generator, k: int) -> list[list[str]]:
    out = []
    for _ in range(k):
      batch = sampler.sample(rng, 12)
      sampler.observe(batch, rng.binomial(G, [_pass_rate(p) for p in batch]) / G)
      out.append([p.uid for p in batch])
    return out

  sampler, rng = make(), np.random.default_rng(7)
  steps(sampler, rng, 15)
  saved = json.dumps(sampler.state_dict())
  saved_rng = copy.deepcopy(rng.bit_generator.state)
  expected = steps(sampler, rng, 15)

  restored = make()
  restored.load_state_dict(json.loads(saved))
  rng2 = np.random.default_rng(12345)
  rng2.bit_generator.state = saved_rng
  assert steps(restored, rng2, 15) == expected
  assert json.dumps(restored.state_dict(), allow_nan=False) == json.dumps(sampler.state_dict(), allow_nan=False)
  assert json.dumps(restored.pass_rate_metrics()) == json.dumps(sampler.pass_rate_metrics())
  assert set(restored.pass_rate_metrics()) >= {"in_band", "too_easy", "too_hard", "unseen"}

  # A pool needs a factory to come back; a different stratification is refused.
  with pytest.raises(ValueError, match="problem_factory"):
    PromptSampler(task.sample, curriculum=PassRateCurriculum(), strata=make().target_shares()).load_state_dict(
      json.loads(saved)
    )
  with pytest.raises(ValueError, match="strata"):
    _arith_sampler(task, curriculum=PassRateCurriculum()).load_state_dict(json.loads(saved))


@pytest.mark.parametrize("with_curriculum", [False, True])
def test_stratified_shares_stay_within_the_band(with_curriculum: bool) -> None:
  # The source offers the three levels equally often; the targets are 0.5/0.3/0.2.
  task = ArithTask(levels=(1, 2, 3), seed=2, heldout_size=30)
  targets = {("arith", 1): 0.5, ("arith", 2): 0.3, ("arith", 3): 0.2}
  band = 0.05
  curriculum = PassRateCurriculum(BAND) if with_curriculum else None
  sampler = _arith_sampler(task, pool_size=240, curriculum=curriculum, strata=targets, band=band)
  rng = np.random.default_rng(3)
  counts = {key: 0 for key in targets}
  for step in range(60):
    batch = sampler.sample(rng, 32)
    for p in batch:
      counts[(p.task, p.level)] += 1
    # Level 1 is always solved: the curriculum pulls its share down, but only within the band.
    sampler.observe(batch, [1.0 if p.level == 1 else 0.5 for p in batch])
    if step >= 4:
      total = sum(counts.values())
      for key, target in targets.items():
        assert abs(counts[key] / total - target) <= band + 1.0 / total, (step, key, counts)
  shares = sampler.realized_shares()
  assert shares == {key: counts[key] / sum(counts.values()) for key in targets}
  if with_curriculum:
    assert shares[("arith", 1)] < 0.5 - 0.03  # the soft part: tilted towards useful prompts
  else:
    for key, target in targets.items():
      assert abs(shares[key] - target) < 0.01


def test_a_small_stratum_the_pool_often_lacks_gets_its_share() -> None:
  """The trainer's mixture sampler (a pool of 4 batches, refreshed whole, refilled by a multinomial draw
  by weight): a 2% task is missing from about a quarter of the pools.  What it could not get then is
  owed to it and paid back when it is there, so its long-run share is its weight (it was half of it)."""
  from mimo_jax.tasks.mixture import MixtureTask

  small = _problems(400, task="small")

  class Small:
    name = "small"

    def heldout(self):
      return []

    def sample(self, rng, k):
      return [small[i] for i in rng.choice(len(small), size=k, replace=False).tolist()]

  mix = MixtureTask(
    [(ArithTask(levels=(1, 2), seed=1, heldout_size=16), 0.98), (Small(), 0.02)],
    levels={"arith": (1, 2)},
    heldout_size=16,
  )
  sampler = PromptSampler(mix.sample, pool_size=32, strata=mix.strata(), refresh_fraction=1.0)
  rng = np.random.default_rng(0)
  lacked = drawn = 0
  for _ in range(2000):
    drawn += sum(p.task == "small" for p in sampler.sample(rng, 8))
    lacked += not any(p.task == "small" for p in sampler.pool)
  assert lacked > 300  # the pool often has none
  assert abs(drawn / 16000 - 0.02) < 0.002, drawn
  assert sampler.realized_shares()[("small", 0)] == drawn / 16000


def test_strata_by_task_name_and_unlisted_groups() -> None:
  a, b, c = _problems(40, task="a", level=1), _problems(40, task="b", level=2), _problems(10, task="c")
  sampler = PromptSampler(_refill_from(a + b + c), pool_size=90, strata={"a": 0.75, ("b", 2): 0.25}, band=0.0)
  rng = np.random.default_rng(0)
  drawn = [p for _ in range(20) for p in sampler.sample(rng, 8)]
  assert sum(p.task == "a" for p in drawn) == 120 and sum(p.task == "b" for p in drawn) == 40
  assert not any(p.task == "c" for p in drawn)
  assert sampler.num_unmatched_rejected >= 10


def test_dedup_within_batch_and_window() -> None:
  problems = _problems(64)
  sampler = PromptSampler(_refill_from(problems), pool_size=64, curriculum=PassRateCurriculum(), dedup_window=3)
  rng = np.random.default_rng(1)
  batches = [[p.uid for p in sampler.sample(rng, 16)] for _ in range(12)]
  for i, batch in enumerate(batches):
    assert len(set(batch)) == 16
    for previous in batches[max(0, i - 3) : i]:
      assert not set(batch) & set(previous)
  assert sampler.num_window_relaxed == 0
  # A window larger than the pool allows is relaxed (and counted), never duplicated within a batch.
  tight = PromptSampler(_refill_from(problems), pool_size=64, dedup_window=4)
  for _ in range(6):
    assert len({p.uid for p in tight.sample(rng, 16)}) == 16
  assert tight.num_window_relaxed > 0
  with pytest.raises(ValueError, match="fewer than n=65"):
    tight.sample(rng, 65)


def test_heldout_uids_are_never_returned() -> None:
  task = ArithTask(levels=(1,), seed=4, heldout_size=200)
  heldout = task.heldout()
  heldout_uids = {p.uid for p in heldout}

  def leaky_refill(rng: np.random.Generator, k: int) -> list[Problem]:
    # Half of every refill is held out.
    half = k // 2 + 1
    return [heldout[i] for i in rng.integers(len(heldout), size=half).tolist()] + task.sample(rng, k - half)

  sampler = PromptSampler(
    leaky_refill, pool_size=64, curriculum=PassRateCurriculum(), heldout_uids=heldout_uids, refresh_fraction=0.5
  )
  rng = np.random.default_rng(5)
  for _ in range(40):
    batch = sampler.sample(rng, 16)
    assert not {p.uid for p in batch} & heldout_uids
    sampler.observe(batch, [0.5] * len(batch))
  assert sampler.num_heldout_rejected > 100
  assert sampler.stats()["num_heldout_rejected"] == sampler.num_heldout_rejected

  only_heldout = PromptSampler(lambda rng, k: heldout[:k], pool_size=16, heldout_uids=heldout_uids)
  with pytest.raises(ValueError, match="only held-out"):
    only_heldout.sample(rng, 4)
  assert only_heldout.num_heldout_rejected > 0

  # A saved pool whose members became held out is refused on load.
  clean = _arith_sampler(task, pool_size=8)
  clean.sample(rng, 4)
  state = clean.state_dict()
  strict = _arith_sampler(task, pool_size=8, heldout_uids={state["pool_uids"][0]})
  with pytest.raises(ValueError, match="held out"):
    strict.load_state_dict(state)


def test_refresh_replaces_low_weight_candidates() -> None:
  task = ArithTask(levels=(2,), seed=0, heldout_size=10)
  sampler = _arith_sampler(task, pool_size=50, curriculum=PassRateCurriculum(BAND), refresh_fraction=0.2)
  rng = np.random.default_rng(0)
  first = sampler.sample(rng, 10)
  sampler.observe(first, [1.0] * len(first))  # all mastered: weight min_weight
  sampler.sample(rng, 10)
  pool_uids = {p.uid for p in sampler.pool}
  assert len(pool_uids) == 50 and sampler.num_evicted == 10
  assert not pool_uids & {p.uid for p in first}  # the 10 lowest-weight candidates went first


def test_pass_rate_metrics_of_the_last_batch() -> None:
  problems = _problems(20)
  cur = PassRateCurriculum(BAND)
  cur.update([p.uid for p in problems[:5]], [1.0] * 5)
  cur.update([p.uid for p in problems[5:10]], [0.0] * 5)
  cur.update([p.uid for p in problems[10:15]], [0.5] * 5)
  sampler = PromptSampler(_refill_from(problems), pool_size=20, curriculum=cur)
  assert sampler.pass_rate_metrics() == {}
  batch = sampler.sample(np.random.default_rng(0), 20)
  metrics = sampler.pass_rate_metrics()
  assert metrics == pass_rate_metrics(cur, [p.uid for p in batch])
  assert {k: metrics[k] for k in ("in_band", "too_easy", "too_hard", "unseen")} == {
    "in_band": 0.25,
    "too_easy": 0.25,
    "too_hard": 0.25,
    "unseen": 0.25,
  }
