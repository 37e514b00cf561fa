"""Tests for ``mimo_jax.rewards.base``: samples and sources, the worker pool, mixing, normalisation, metrics."""

from __future__ import annotations

import functools
import inspect
import json
import math
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import pytest

from mimo_jax.rewards import base as rewards_base
from mimo_jax.rewards.base import CompositeReward, Outcome, RewardBatch, RewardPool, RewardSample, RewardSource
from mimo_jax.testing import reward_fns


def _sample(task: str = "", completion: str = "c", **row: object) -> RewardSample:
  return RewardSample(prompt="p", completion=completion, row=row, task=task)


def _process_gone(pid: int) -> bool:
  """Whether ``pid`` no longer runs (absent, or a zombie awaiting a reaper that is not ours)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
  except FileNotFoundError:
    return True
  return state in ("Z", "X")


def _wait_gone(pids: list[int], timeout_s: float = 60.0) -> bool:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if all(_process_gone(pid) for pid in pids):
      return True
    time.sleep(0.05)
  return False


@pytest.fixture(scope="module")
def pool():
  with RewardPool(num_workers=2, default_timeout_s=5.0) as p:
    # Warm up: worker start-up and imports are paid here, not inside timed tests.
    assert [o.value for o in p.map(reward_fns.scripted, [_sample(value=1.0)] * 2)] == [1.0, 1.0]
    yield p


# ---- samples and sources ------------------------------------------------------------------


def test_sample_pickles_and_normalises_tokens() -> None:
  sample = RewardSample("prompt", "completion", [1, 2, 3], {"answer": "4", "tests": ["assert f() == 1"]}, "gsm8k", 1)
  assert sample.completion_tokens == (1, 2, 3) and sample.truncated is True
  copy = pickle.loads(pickle.dumps(sample))
  assert copy == sample and copy.row["tests"] == ["assert f() == 1"]
  assert RewardSample("p", "c").row == {} and RewardSample("p", "c").task == ""
  with pytest.raises(TypeError, match="completion must be a str"):
    RewardSample("p", None)  # type: ignore[arg-type]
  with pytest.raises(TypeError, match="row must be a mapping"):
    RewardSample("p", "c", row=[("a", 1)])  # type: ignore[arg-type]


def test_source_validation() -> None:
  with pytest.raises(ValueError, match="non-empty"):
    RewardSource("", reward_fns.row_value)
  with pytest.raises(ValueError, match="reserved"):
    RewardSource("mixed", reward_fns.row_value)
  with pytest.raises(ValueError, match="finite"):
    RewardSource("a", reward_fns.row_value, weight=math.nan)
  with pytest.raises(TypeError, match="not the string"):
    RewardSource("a", reward_fns.row_value, tasks="gsm8k")  # type: ignore[arg-type]
  with pytest.raises(ValueError, match="per-sample sources only"):
    RewardSource("a", reward_fns.batched_length, batched=True, timeout_s=1.0)
  with pytest.raises(ValueError, match="positive finite"):
    RewardSource("a", reward_fns.row_value, timeout_s=0)
  source = RewardSource("a", reward_fns.row_value, tasks=["x", "y"])
  assert source.tasks == ("x", "y") and source.applies_to("x") and not source.applies_to("z")
  assert RewardSource("b", reward_fns.row_value).applies_to("anything")


def test_composite_validation() -> None:
  src = RewardSource("a", reward_fns.row_value)
  with pytest.raises(ValueError, match="at least one"):
    CompositeReward([])
  with pytest.raises(ValueError, match=r"repeated: \['a'\]"):
    CompositeReward([src, src])
  with pytest.raises(ValueError, match="normalize must be one of"):
    CompositeReward([src], normalize="batch")  # type: ignore[arg-type]
  with pytest.raises(ValueError, match="ema"):
    CompositeReward([src], ema=1.0)
  with pytest.raises(ValueError, match="cannot be pickled"):
    CompositeReward([RewardSource("lam", lambda s: 1.0)])
  # In-process evaluation needs no pickling, and a batched source never runs in a worker.
  with RewardPool(num_workers=0) as in_process:
    CompositeReward([RewardSource("lam", lambda s: 1.0)], pool=in_process)
  CompositeReward([RewardSource("lam", lambda batch: [1.0] * len(batch), batched=True)])


# ---- the pool -------------------------------------------------------------------------------


def test_pool_validation() -> None:
  with pytest.raises(ValueError, match="fork"):
    RewardPool(mp_context="fork")
  with pytest.raises(ValueError, match="num_workers"):
    RewardPool(num_workers=-1)
  with pytest.raises(ValueError, match="default_timeout_s"):
    RewardPool(default_timeout_s=math.inf)
  closed = RewardPool(num_workers=0)
  closed.close()
  with pytest.raises(RuntimeError, match="closed"):
    closed.map(reward_fns.row_value, [_sample(value=1)])


def test_pool_failures_are_isolated(pool: RewardPool) -> None:
  samples = [
    _sample(value=2.5),
    _sample(action="raise"),
    _sample(value=math.nan),
    _sample(value=math.inf),
    _sample(value="1.0"),
    _sample(value=True),
    _sample(value=np.float32(0.25)),
    _sample(action="sys_exit"),
    _sample(value=-3),
  ]
  outcomes = pool.map(reward_fns.scripted, samples)
  assert outcomes[0] == Outcome(2.5)
  assert outcomes[1] == Outcome(0.0, True, "ValueError: scripted failure")
  assert outcomes[2] == Outcome(0.0, True, "returned non-finite value nan")
  assert outcomes[3] == Outcome(0.0, True, "returned non-finite value inf")
  assert outcomes[4].failed and outcomes[4].error == "returned str '1.0', expected a real number"
  assert outcomes[5] == Outcome(1.0) and outcomes[6] == Outcome(0.25)
  assert outcomes[7] == Outcome(0.0, True, "SystemExit: 2")
  assert outcomes[8] == Outcome(-3.0)


def test_workers_are_persistent(pool: RewardPool) -> None:
  first = {o.value for o in pool.map(reward_fns.worker_pid, [_sample()] * 6)}
  second = {o.value for o in pool.map(reward_fns.worker_pid, [_sample()] * 6)}
  pids = {float(p) for p in pool.worker_pids()}
  assert first <= pids and second <= pids and len(pids) == 2
  assert float(os.getpid()) not in pids


def test_a_worker_killed_while_its_sandbox_runs_leaves_no_sandbox_directory(pool: RewardPool) -> None:
  """A reward past its time limit is killed with its worker, whose own clean-up never runs: the pool
  removes the code sandbox's directory it left (the code, and whatever the code wrote there)."""
  import tempfile
  import threading

  def sandbox_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mimo-sandbox-")}

  before = sandbox_dirs()
  outcomes: list[Outcome] = []
  call = threading.Thread(
    target=lambda: outcomes.extend(pool.map(reward_fns.scripted, [_sample(action="sandbox_hang")], timeout_s=20.0))
  )
  call.start()
  deadline = time.monotonic() + 20.0
  while not sandbox_dirs() - before and time.monotonic() < deadline:
    time.sleep(0.05)
  seen = sandbox_dirs() - before
  call.join()
  assert len(seen) == 1  # the sandbox was running when its worker was killed
  assert outcomes == [Outcome(0.0, True, "timeout after 20s")]
  assert sandbox_dirs() == before


def test_hanging_function_times_out_and_pool_recovers(pool: RewardPool) -> None:
  pids_before = set(pool.worker_pids())
  start = time.monotonic()
  outcomes = pool.map(
    reward_fns.scripted, [_sample(action="hang"), _sample(value=1.0), _sample(value=2.0)], timeout_s=1.0
  )
  elapsed = time.monotonic() - start
  assert outcomes[0] == Outcome(0.0, True, "timeout after 1s")
  assert [o.value for o in outcomes[1:]] == [1.0, 2.0] and not any(o.failed for o in outcomes[1:])
  # The hang lasts an hour: any return well short of it proves the timeout fired (the ceiling is
  # generous so a slow, busy machine passes too).
  assert 1.0 <= elapsed < 300.0
  pids_after = set(pool.worker_pids())
  assert len(pids_after) == 2 and len(pids_before & pids_after) == 1  # exactly the hung worker was replaced
  killed = (pids_before - pids_after).pop()
  assert _wait_gone([killed])
  # A busy loop (no blocking call to interrupt) is killed just the same; the next batch is fine.
  outcomes = pool.map(reward_fns.scripted, [_sample(action="spin")], timeout_s=0.5)
  assert outcomes == [Outcome(0.0, True, "timeout after 0.5s")]
  assert [o.value for o in pool.map(reward_fns.scripted, [_sample(value=v) for v in range(5)])] == [0, 1, 2, 3, 4]


def test_dying_worker_is_replaced(pool: RewardPool) -> None:
  samples = [_sample(value=1.0), _sample(action="exit"), _sample(value=2.0), _sample(action="segv"), _sample(value=3.0)]
  outcomes = pool.map(reward_fns.scripted, samples)
  assert outcomes[1] == Outcome(0.0, True, "worker died (exit code 3)")
  assert outcomes[3] == Outcome(0.0, True, "worker died (killed by signal SIGSEGV)")
  assert [outcomes[i].value for i in (0, 2, 4)] == [1.0, 2.0, 3.0]
  assert not any(outcomes[i].failed for i in (0, 2, 4))
  later = pool.map(reward_fns.worker_pid, [_sample()] * 4)
  assert not any(o.failed for o in later) and len(pool.worker_pids()) == 2


def test_worker_dying_while_busy_fails_its_own_sample(monkeypatch) -> None:
  """A busy worker found dead at the start of a scheduling pass is not replaced there: its death is read
  as its sample's outcome. (Replacing it as if idle dropped the sample, and the run waited forever.)"""
  real_monotonic = time.monotonic
  delayed = []

  def monotonic() -> float:
    caller = inspect.currentframe().f_back
    line = (inspect.getframeinfo(caller).code_context or [""])[0]
    if caller.f_code.co_name == "_run_in_workers" and "now = time.monotonic()" in line:
      delayed.append(1)
      # The pass starts late: the worker below has exited by then. (On a machine too slow for that the
      # pass sees it alive and the outcome is the same; only the race goes unexercised.)
      time.sleep(0.3)
    return real_monotonic()

  monkeypatch.setattr(rewards_base, "time", types.SimpleNamespace(monotonic=monotonic))
  pool = RewardPool(num_workers=1, default_timeout_s=5.0)
  # The worker reports the call started, then exits 0.1 s later.
  samples = [_sample(action="exit", seconds=0.1), _sample(value=2.0)]
  result: list = []
  thread = threading.Thread(target=lambda: result.append(pool.map(reward_fns.scripted, samples)), daemon=True)
  thread.start()
  thread.join(60.0)
  # (Not closed on failure: close() would wait for the lock the stuck call holds.)
  assert result, "RewardPool.map did not return within 60 s"
  pool.close()
  assert result[0] == [Outcome(0.0, True, "worker died (exit code 3)"), Outcome(2.0)]
  assert len(delayed) >= 2


def test_workers_that_cannot_start_raise(pool: RewardPool) -> None:
  broken = reward_fns.ExitOnUnpickle()
  # Two in a row is bad luck: each sample fails on its own.
  assert pool.map(broken, [_sample()] * 2) == [Outcome(0.0, True, "worker died (exit code 5)")] * 2
  assert pool.map(reward_fns.row_value, [_sample(value=1.0)]) == [Outcome(1.0)]  # a call that runs resets the count
  # Three in a row means workers cannot start: raise rather than fail the batch one process at a time.
  with pytest.raises(
    RuntimeError,
    match=r"3 reward worker processes in a row died before running a call \(last: worker died \(exit code 5\)\)",
  ):
    pool.map(broken, [_sample()] * 20)
  assert [o.value for o in pool.map(reward_fns.row_value, [_sample(value=v) for v in (1.0, 2.0, 3.0)])] == [
    1.0,
    2.0,
    3.0,
  ]
  assert len(pool.worker_pids()) == 2


def test_unpicklable_sample_fails_alone(pool: RewardPool) -> None:
  samples = [_sample(value=1.0), _sample(value=2.0, handle=lambda: None)]
  outcomes = pool.map(reward_fns.row_value, samples)
  assert outcomes[0] == Outcome(1.0)
  assert outcomes[1].failed and outcomes[1].error.startswith("could not pickle the sample for a worker")
  with pytest.raises(TypeError, match="cannot be pickled"):
    pool.map(lambda s: 1.0, samples[:1])


def test_run_mixes_functions_and_timeouts(pool: RewardPool) -> None:
  value = functools.partial(reward_fns.row_value, key="x")
  calls = [(value, _sample(x=1.5), None), (reward_fns.scripted, _sample(action="sleep", seconds=0.5), 0.1)]
  calls += [(value, _sample(x=2.5), 0.5)]
  assert pool.run(calls) == [Outcome(1.5), Outcome(0.0, True, "timeout after 0.1s"), Outcome(2.5)]
  assert pool.run([]) == []


def test_in_process_pool_catches_errors_and_times_out() -> None:
  with RewardPool(num_workers=0, default_timeout_s=5.0) as in_process:
    samples = [_sample(value=2.0), _sample(action="raise"), _sample(action="sleep", seconds=600.0, value=1.0)]
    start = time.monotonic()
    outcomes = in_process.map(reward_fns.scripted, samples, timeout_s=0.2)
    assert time.monotonic() - start < 300.0  # far short of the 600 s call: the timeout fired
    assert outcomes[:2] == [Outcome(2.0), Outcome(0.0, True, "ValueError: scripted failure")]
    assert outcomes[2].failed and outcomes[2].error.startswith("timeout after 0.2s (in-process")
    # In-process means no pickling: a lambda is fine.
    assert in_process.map(lambda s: len(s.completion), [_sample(completion="abc")]) == [Outcome(3.0)]


def test_close_leaves_no_child_processes() -> None:
  before = {p.pid for p in multiprocessing.active_children()}
  p = RewardPool(num_workers=2, default_timeout_s=5.0, mp_context="spawn")
  assert [o.value for o in p.map(abs, [-1.0, 2.0])] == [1.0, 2.0]
  pids = p.worker_pids()
  assert len(pids) == 2 and set(pids) <= {c.pid for c in multiprocessing.active_children()}
  p.close()
  p.close()  # idempotent
  assert {c.pid for c in multiprocessing.active_children()} <= before
  assert _wait_gone(pids) and p.worker_pids() == []


# Builtins as reward functions (``abs``, ``time.sleep``) on plain numbers keep the child
# process light: no module of the test helpers (and no JAX) is imported there.
_ORPHAN_SCRIPT = textwrap.dedent(
  """
  import os, signal, sys, threading, time
  from mimo_jax.rewards.base import RewardPool

  if __name__ == "__main__":
    pool = RewardPool(num_workers=2, default_timeout_s=60.0)
    assert [o.value for o in pool.map(abs, [-1.0, -2.0])] == [1.0, 2.0]
    print(" ".join(map(str, pool.worker_pids())), flush=True)
    if sys.argv[1] == "kill":
      # Die abruptly while a worker is stuck in a reward: nothing closes the pool.
      threading.Thread(target=pool.map, args=(time.sleep, [3600.0])).start()
      time.sleep(0.5)
      os.kill(os.getpid(), signal.SIGKILL)
    # "exit": fall off the end without closing the pool.
  """
)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_workers_do_not_outlive_the_parent(how: str, tmp_path) -> None:
  # stderr goes to a file: an orphaned worker would hold a pipe open and block reading it.
  with open(tmp_path / "stderr.txt", "w+") as stderr:
    proc = subprocess.Popen(
      [sys.executable, "-c", _ORPHAN_SCRIPT, how], stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    try:
      pids = [int(p) for p in proc.stdout.readline().split()]
      returncode = proc.wait(timeout=60)
    finally:
      if proc.poll() is None:
        proc.kill()
      proc.stdout.close()
    stderr.seek(0)
    assert returncode == (-signal.SIGKILL if how == "kill" else 0), stderr.read()
  assert len(pids) == 2
  try:
    assert _wait_gone(pids), f"workers {pids} still running after the parent {how}"
  finally:
    for pid in pids:  # on failure, do not leave the orphans behind
      if not _process_gone(pid):
        os.kill(pid, signal.SIGKILL)


# ---- mixing ---------------------------------------------------------------------------------


def test_weighted_mix_per_task_applicability_and_raw_components(pool: RewardPool) -> None:
  sources = [
    RewardSource("correct", functools.partial(reward_fns.row_value, key="c"), weight=2.0, tasks=("math",)),
    RewardSource("style", functools.partial(reward_fns.row_value, key="s"), weight=-0.5),
    RewardSource("length", reward_fns.batched_length, weight=0.1, batched=True, tasks=("code",)),
  ]
  samples = [
    _sample("math", "abcd", c=1.0, s=4.0),
    _sample("math", "ab", c=0.0, s=2.0),
    _sample("code", "abcdefghij", s=1.0),  # no "c": calling "correct" here would fail
  ]
  reward = CompositeReward(sources, pool=pool)
  batch = reward(samples)
  np.testing.assert_allclose(batch.rewards, [2.0 * 1 - 0.5 * 4, 2.0 * 0 - 0.5 * 2, -0.5 * 1 + 0.1 * 10])
  assert batch.rewards.dtype == np.float32 and batch.rewards.shape == (3,)
  np.testing.assert_array_equal(batch.components["correct"], [1.0, 0.0, np.nan])
  np.testing.assert_array_equal(batch.components["style"], [4.0, 2.0, 1.0])
  np.testing.assert_array_equal(batch.components["length"], [np.nan, np.nan, 10.0])
  assert not any(f.any() for f in batch.failed.values()) and batch.errors == []
  assert reward.names == ("correct", "style", "length")
  assert reward.state_dict()["stats"] == {}  # "none" keeps no statistics
  assert len(reward([]).rewards) == 0


def test_failed_components_count_as_zero_and_are_reported(pool: RewardPool) -> None:
  sources = [
    RewardSource("verify", reward_fns.scripted, weight=1.0, timeout_s=1.0),
    RewardSource("judge", reward_fns.batched_raises, weight=3.0, batched=True),
    RewardSource("len", reward_fns.batched_length, weight=1.0, batched=True),
  ]
  samples = [
    _sample(completion="ab", value=0.5),
    _sample(completion="abc", action="raise"),
    _sample(completion="", action="hang"),
  ]
  batch = CompositeReward(sources, pool=pool)(samples)
  np.testing.assert_allclose(batch.rewards, [0.5 + 2.0, 0.0 + 3.0, 0.0 + 0.0])
  np.testing.assert_array_equal(batch.components["verify"], [0.5, 0.0, 0.0])
  np.testing.assert_array_equal(batch.failed["verify"], [False, True, True])
  np.testing.assert_array_equal(batch.components["judge"], [0.0, 0.0, 0.0])
  assert batch.failed["judge"].all() and not batch.failed["len"].any()
  assert batch.errors == [
    "verify[1]: ValueError: scripted failure",
    "verify[2]: timeout after 1s",
    "judge[0]: RuntimeError: judge unavailable for 3 samples",
    "judge[1]: RuntimeError: judge unavailable for 3 samples",
    "judge[2]: RuntimeError: judge unavailable for 3 samples",
  ]

  metrics = batch.metrics()
  assert metrics["reward/verify_mean"] == 0.5 and metrics["reward/verify_fail_frac"] == pytest.approx(2 / 3)
  assert math.isnan(metrics["reward/judge_mean"]) and metrics["reward/judge_fail_frac"] == 1.0
  assert metrics["reward/len_mean"] == pytest.approx(5 / 3) and metrics["reward/len_fail_frac"] == 0.0
  assert metrics["reward/failures"] == 5.0
  hists = batch.histograms()
  np.testing.assert_array_equal(hists["reward/verify"], [0.5])
  assert hists["reward/judge"].size == 0 and hists["reward/len"].tolist() == [2.0, 3.0, 0.0]
  np.testing.assert_array_equal(hists["reward/mixed"], batch.rewards)


def test_batched_source_bad_results() -> None:
  sources = [
    RewardSource("short", reward_fns.batched_wrong_length, batched=True),
    RewardSource("vals", reward_fns.batched_row_value, batched=True),
  ]
  batch = CompositeReward(sources)([_sample(value=1.0), _sample(value=math.nan), _sample(value="x")])
  assert batch.failed["short"].all() and batch.errors[0] == "short[0]: batched fn returned 2 values for 3 samples"
  np.testing.assert_array_equal(batch.failed["vals"], [False, True, True])
  np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.0])
  assert batch.errors[3:] == [
    "vals[1]: returned non-finite value nan",
    "vals[2]: returned str 'x', expected a real number",
  ]


def test_scoring_named_sources_only_leaves_the_others_unscored(pool: RewardPool) -> None:
  """What a multi-process run does: its own rows with the local sources, the whole batch with the
  collective ones (a reward model or judge on the global mesh), then both put together and mixed."""
  with pytest.raises(ValueError, match="a collective source must be batched"):
    RewardSource("rm", reward_fns.row_value, collective=True)
  seen: list[int] = []

  def rm(samples):
    seen.append(len(samples))
    return [2.0 * s.row["value"] for s in samples]

  reward = CompositeReward(
    [RewardSource("verify", reward_fns.row_value), RewardSource("rm", rm, batched=True, collective=True)], pool=pool
  )
  samples = [_sample(value=1.0), _sample(value=0.0), _sample(value=0.5)]
  raw, failed, errors = reward.score(samples, ["verify"])
  assert seen == [] and raw["verify"].tolist() == [1.0, 0.0, 0.5] and np.isnan(raw["rm"]).all()
  assert not failed["rm"].any() and errors == []
  raw_rm, failed_rm, _ = reward.score(samples, ["rm"])
  assert seen == [3] and raw_rm["rm"].tolist() == [2.0, 0.0, 1.0] and np.isnan(raw_rm["verify"]).all()
  together = reward.mix({**raw, "rm": raw_rm["rm"]}, {**failed, "rm": failed_rm["rm"]}, [s.task for s in samples])
  whole = reward(samples)
  np.testing.assert_array_equal(together.rewards, whole.rewards)
  assert together.metrics() == whole.metrics()
  with pytest.raises(ValueError, match=r"unknown reward sources \['judge'\]"):
    reward.score(samples, ["judge"])


def test_a_hosts_own_rows_fail_under_their_batch_rows(pool: RewardPool) -> None:
  """A host of a multi-process run scores its own rows of the global batch: a failure message names the
  sample's batch row, not its place in the host's list."""
  reward = CompositeReward([RewardSource("verify", reward_fns.scripted)], pool=pool)
  samples = [_sample(value=1.0), _sample(action="raise"), _sample(value=0.5)]
  raw, failed, errors = reward.score(samples, rows=[16, 17, 18])
  assert errors == ["verify[17]: ValueError: scripted failure"]
  assert failed["verify"].tolist() == [False, True, False] and raw["verify"][[0, 2]].tolist() == [1.0, 0.5]
  assert reward.score(samples)[2] == ["verify[1]: ValueError: scripted failure"]
  with pytest.raises(ValueError, match="rows names 2 batch rows for 3 samples"):
    reward.score(samples, rows=[16, 17])


def test_metrics_of_a_component_that_applies_nowhere() -> None:
  batch = RewardBatch(
    rewards=np.zeros(2, np.float32),
    components={"a": np.full(2, np.nan, np.float32)},
    failed={"a": np.zeros(2, bool)},
  )
  metrics = batch.metrics()
  assert (
    math.isnan(metrics["reward/a_mean"]) and metrics["reward/a_fail_frac"] == 0.0 and metrics["reward/failures"] == 0
  )


# ---- task_running normalisation -------------------------------------------------------------


def _value_source(**kwargs: object) -> RewardSource:
  return RewardSource("v", reward_fns.batched_row_value, batched=True, **kwargs)


def test_running_normaliser_hand_checked() -> None:
  reward = CompositeReward([_value_source(weight=2.0)], normalize="task_running", ema=0.5, eps=1e-12)
  first = reward([_sample("t", value=1.0), _sample("t", value=3.0)])
  # First batch: mean 2, var 1.
  np.testing.assert_allclose(first.normalized["v"], [-1.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(first.rewards, [-2.0, 2.0], rtol=1e-6)
  np.testing.assert_array_equal(first.components["v"], [1.0, 3.0])  # raw values are kept
  # The raw mix (what is logged as the reward): the weight times the raw values, not the normalised ones;
  # it survives selecting and concatenating rows (dynamic sampling).
  np.testing.assert_array_equal(first.raw_rewards, [2.0, 6.0])
  both = RewardBatch.concatenate([first.select(np.array([1])), first.select(np.array([0]))])
  np.testing.assert_array_equal(both.raw_rewards, [6.0, 2.0])
  assert reward.state_dict()["stats"] == {"t": {"v": {"mean": 2.0, "var": 1.0, "updates": 1}}}
  second = reward([_sample("t", value=5.0), _sample("t", value=7.0)])
  # Batch mean 6, var 1: mean' = 0.5*2 + 0.5*6 = 4; var' = 0.5*(1 + (2-4)^2) + 0.5*(1 + (6-4)^2) = 5.
  assert reward.state_dict()["stats"]["t"]["v"] == {"mean": 4.0, "var": 5.0, "updates": 2}
  np.testing.assert_allclose(second.normalized["v"], [1 / math.sqrt(5), 3 / math.sqrt(5)], rtol=1e-6)
  np.testing.assert_allclose(second.rewards, [2 / math.sqrt(5), 6 / math.sqrt(5)], rtol=1e-6)


def test_running_normaliser_makes_task_scales_comparable() -> None:
  rng = np.random.default_rng(0)
  source = _value_source()

  def batch() -> list[RewardSample]:
    big = 1000.0 + 100.0 * rng.standard_normal(32)
    small = rng.integers(0, 2, 32).astype(float)
    return [_sample("big", value=float(v)) for v in big] + [_sample("small", value=float(v)) for v in small]

  raw = CompositeReward([source], normalize="none")(batch())
  np.testing.assert_array_equal(raw.raw_rewards, raw.rewards)  # without normalisation the two are one
  assert np.std(raw.rewards[:32]) > 50 * np.std(raw.rewards[32:])  # unnormalised, "big" dominates

  reward = CompositeReward([source], normalize="task_running", ema=0.9)
  out = reward(batch())
  for part in (out.rewards[:32], out.rewards[32:]):  # first batch: exactly standardised per task
    assert abs(np.mean(part)) < 1e-5 and np.std(part) == pytest.approx(1.0, rel=1e-4)
  for _ in range(10):
    out = reward(batch())
  big, small = out.rewards[:32], out.rewards[32:]
  assert abs(np.mean(big)) < 0.6 and abs(np.mean(small)) < 0.6
  assert 0.5 < np.std(big) / np.std(small) < 2.0
  assert out.components["v"][:32].min() > 500  # logged components stay raw
  stats = reward.state_dict()["stats"]
  assert stats["big"]["v"]["mean"] == pytest.approx(1000, abs=30) and stats["small"]["v"]["mean"] == pytest.approx(
    0.5, abs=0.2
  )


def test_running_normaliser_ignores_failures_and_clips() -> None:
  reward = CompositeReward([_value_source()], normalize="task_running", ema=0.5, clip=0.5)
  out = reward([_sample("t", value=0.0), _sample("t", value=2.0), _sample("t", value=math.nan)])
  assert reward.state_dict()["stats"]["t"]["v"]["mean"] == 1.0  # the failed sample is not in the statistics
  np.testing.assert_allclose(out.normalized["v"], [-0.5, 0.5, 0.0], rtol=1e-5)
  np.testing.assert_allclose(out.rewards, [-0.5, 0.5, 0.0], rtol=1e-5)
  assert out.failed["v"].tolist() == [False, False, True]


def test_state_dict_round_trip_gives_identical_outputs() -> None:
  sources = [_value_source(), RewardSource("len", reward_fns.batched_length, batched=True, weight=0.5, tasks=("a",))]
  rng = np.random.default_rng(1)

  def batch() -> list[RewardSample]:
    return [
      _sample(task, "x" * int(rng.integers(1, 20)), value=float(rng.normal(scale=3.0)))
      for task in ("a", "b", "a", "b", "b", "")
    ]

  original = CompositeReward(sources, normalize="task_running", ema=0.8)
  for _ in range(3):
    original(batch())
  state = json.loads(json.dumps(original.state_dict()))
  assert set(state["stats"]) == {"a", "b", ""} and set(state["stats"]["a"]) == {"v", "len"}
  restored = CompositeReward(sources, normalize="task_running", ema=0.8)
  restored.load_state_dict(state)
  assert restored.state_dict() == original.state_dict()
  nxt = batch()
  a, b = original(nxt), restored(nxt)
  np.testing.assert_array_equal(a.rewards, b.rewards)
  for name in ("v", "len"):
    np.testing.assert_array_equal(a.normalized[name], b.normalized[name])
  assert restored.state_dict() == original.state_dict()
  # A fresh normaliser (no state) gives different rewards on the same batch.
  assert not np.array_equal(CompositeReward(sources, normalize="task_running", ema=0.8)(nxt).rewards, a.rewards)


def test_load_state_dict_rejects_malformed_state() -> None:
  reward = CompositeReward([_value_source()], normalize="task_running")
  good = {"version": 1, "stats": {"t": {"v": {"mean": 0.5, "var": 0.25, "updates": 3}}}}
  with pytest.raises(ValueError, match="version 1"):
    reward.load_state_dict({"version": 2, "stats": {}})
  with pytest.raises(ValueError, match="lacks 'var'"):
    reward.load_state_dict({"version": 1, "stats": {"t": {"v": {"mean": 0.0, "updates": 1}}}})
  with pytest.raises(ValueError, match="var >= 0"):
    reward.load_state_dict({"version": 1, "stats": {"t": {"v": {"mean": 0.0, "var": -1.0, "updates": 1}}}})
  reward.load_state_dict(good)
  assert reward.state_dict()["stats"] == good["stats"]


def test_reward_batches_select_and_concatenate_rows_with_their_metrics():
  from mimo_jax.rewards.base import RewardBatch

  def batch(values, failed):
    values = np.asarray(values, np.float32)
    return RewardBatch(
      rewards=values.copy(),
      components={"correct": values},
      failed={"correct": np.asarray(failed)},
      normalized={"correct": values.copy()},
    )

  a = batch([1, 0, np.nan, 1], [False, True, False, False])
  b = batch([0, 0, 1, 1], [False] * 4)
  joined = RewardBatch.concatenate([a.select(np.array([0, 1])), b.select(np.array([2, 3]))])
  np.testing.assert_array_equal(joined.components["correct"], [1, 0, 1, 1])
  np.testing.assert_array_equal(joined.failed["correct"], [False, True, False, False])
  m = joined.metrics()
  assert m["reward/correct_mean"] == 1.0  # the failed row is not averaged
  assert m["reward/correct_fail_frac"] == 0.25 and m["reward/failures"] == 1.0
  np.testing.assert_array_equal(joined.histograms()["reward/correct"], [1, 1, 1])
