"""Async rollout: the rollout worker runs ahead of the learner by a bounded number of policy versions.

A producer thread owns the :class:`~mimo_jax.train.rollout_worker.RolloutWorker` (its sampler,
data RNG, curriculum, reward state and loop key) and generates the batches of RL steps
``b = next, next + 1, ...``; the learner takes batch ``b`` at RL step ``b``.  With several
processes the producer runs in the learner's thread instead (``threaded=False``): the same
batches from the same versions, every program issued in one order on every host.  Versions count the
learner's RL steps: version ``v`` is the policy after ``v`` steps (version 0 the warm start).

**Admission control, exact and deterministic.**  Batch ``b`` is generated with exactly version
``max(b - K, v0)`` (``K = --max_staleness``, ``v0`` the version the producer started from).  The
producer waits until that version is published, so it never runs more than ``K`` batches ahead
(at most ``K + 1`` batches exist between generation and consumption), and which weights drew
which batch never depends on thread timing: a run is reproducible, and ``K = 0`` is the
synchronous loop step for step (batch ``b`` waits for the policy of step ``b``; the learner
waits for batch ``b``).  After the first ``K`` steps every batch is exactly ``K`` versions stale.

**Weights move once per step, device to device.**  :meth:`AsyncRollout.publish` hands the
producer a copy of the learner's new parameters made on the device by the caller's
``to_rollout`` (the learner donates its state into the next step, so the producer must not
hold the learner's own buffers); nothing goes through the host.

**Checkpoints hold the producer's state before the oldest batch not yet trained on.**  The
producer records the worker's host state (loop key, data RNG, curriculum, reward statistics,
batch records) as it was before each batch.  A checkpoint at RL step ``s`` stores the record of
batch ``s``; batches ``s .. s + K - 1`` generated but not trained on are listed as pending and
*regenerated* on resume, from that record, with the restored weights.  They are not persisted:
``K`` rollout batches per checkpoint would tie the checkpoint's layout to ``K`` and grow it with
the batch size, and the only thing regeneration changes is that those batches come from a
fresher policy (their prompts, order and count are the same; nothing is lost or trained on
twice).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mimo_jax.train.rollout_worker import RolloutBatch, RolloutWorker


class RolloutStopped(RuntimeError):
  """The producer was stopped while the learner waited for a batch."""


class AsyncRollout:
  """The producer and its bounded, version-stamped hand-off to the learner.

  Args:
    worker: the rollout worker (owned by the producer while it runs).
    max_staleness: ``K``, the versions a batch may lag the learner step that trains on it.
    to_rollout: makes the producer's own copy of published parameters (on the rollout devices,
      in the generation layout).
    end: the producer makes batches up to ``end - 1`` (the run's last RL step).
    threaded: the producer is a thread of its own (the default).  False: the learner's thread makes
      the batches itself, each once its version is published and the learner reaches a hand-off
      point (:meth:`get`, :meth:`produce_ahead` after each step, :meth:`paused`).  The batches,
      their versions and the worker's state at every hand-off are the same either way (admission
      depends on versions only); what changes is that every program is issued from one thread in
      one order, which several processes need (their collectives must run in the same order on
      every host), and that nothing overlaps: generation and learning take turns.
  """

  def __init__(
    self,
    worker: RolloutWorker,
    *,
    max_staleness: int,
    to_rollout: Callable[[Any], Any],
    end: int,
    threaded: bool = True,
  ):
    if max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    self.worker = worker
    self.max_staleness = max_staleness
    self.to_rollout = to_rollout
    self.end = end
    self.threaded = threaded
    self._cv = threading.Condition()
    self._thread: threading.Thread | None = None
    self._inline = False  # an in-line producer is started
    self._reset_state()

  def _reset_state(self) -> None:
    self._versions: dict[int, Any] = {}  # version -> the producer's copy of its params
    self._ready: dict[int, RolloutBatch] = {}  # batch id -> batch, not yet taken
    self._before: dict[int, dict[str, Any]] = {}  # batch id -> worker host state before producing it
    self._next = 0  # the next batch the producer makes (or is making)
    self._making = False  # batch ``_next`` is being made
    self._first_version = 0
    self._stop = False
    self._waiting = False  # the producer is blocked on a version not yet published
    self._error: BaseException | None = None
    self._idle_s = 0.0  # producer seconds spent waiting for a version (finished waits)
    self._wait_since = 0.0  # when the current wait began
    self.learner_idle_s = 0.0  # learner seconds spent waiting for a batch

  @property
  def running(self) -> bool:
    """Whether a producer is started (a thread may be waiting)."""
    return self._thread is not None or self._inline

  def version_for(self, batch_id: int) -> int:
    """The policy version that generates batch ``batch_id``: ``max(batch_id - K, v0)``."""
    return self._required(batch_id)

  def _host_state(self) -> dict[str, Any]:
    return copy.deepcopy(self.worker.host_state(with_data=True))

  # ---- control ---------------------------------------------------------------------------------

  def start(self, first_batch: int, version: int, params: Any) -> None:
    """Starts producing batches ``first_batch, ...`` from ``version`` (whose weights are ``params``).

    The worker's host state must be the one from before batch ``first_batch`` (a fresh run, or a
    checkpoint's record).  Any previous producer is stopped first.
    """
    self.stop()
    self._reset_state()
    self._next = first_batch
    self._first_version = version
    self._versions[version] = self.to_rollout(params)
    self._before[first_batch] = self._host_state()
    if not self.threaded:
      self._inline = True
      return
    self._thread = threading.Thread(target=self._run, name="mimo-rollout", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    """Stops the producer (its current batch is finished first) and drops everything queued."""
    if self._inline:
      self._inline = False
      self._versions.clear()
      self._ready.clear()
      return
    thread = self._thread
    if thread is None:
      return
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    thread.join()
    self._thread = None
    self._versions.clear()
    self._ready.clear()

  def publish(self, version: int, params: Any) -> None:
    """Makes the learner's policy of ``version`` available to the producer."""
    params_copy = self.to_rollout(params)
    with self._cv:
      self._versions[version] = params_copy
      # Versions no batch still to be made can use (the batch in the making holds its own reference).
      for old in [v for v in self._versions if v < self._required(self._next)]:
        del self._versions[old]
      self._cv.notify_all()

  def get(self, batch_id: int) -> RolloutBatch:
    """The batch of RL step ``batch_id`` (blocks until produced; re-raises the producer's error)."""
    t0 = time.perf_counter()
    if self._inline:
      self._make_admitted()
      if batch_id not in self._ready:
        raise RolloutStopped(f"batch {batch_id} is not admitted by the published versions {sorted(self._versions)}")
      self.learner_idle_s += time.perf_counter() - t0
      return self._ready.pop(batch_id)
    with self._cv:
      while batch_id not in self._ready:
        if self._error is not None:
          raise self._error
        if self._stop or self._thread is None:
          raise RolloutStopped(f"the rollout producer stopped before batch {batch_id}")
        self._cv.wait()
      batch = self._ready.pop(batch_id)
      self._cv.notify_all()
    self.learner_idle_s += time.perf_counter() - t0
    return batch

  @contextlib.contextmanager
  def paused(self) -> Iterator[RolloutWorker]:
    """The worker, lent to the caller while the producer waits (e.g. an evaluation, which uses the
    sampler).

    First waits until the producer has made every batch the published versions admit, so what the
    caller draws falls between the same two batches on every run; afterwards the record of the next
    batch is refreshed to include it.  Nothing may be published inside.
    """
    if self._inline:
      self._make_admitted()
      yield self.worker
      self._before[self._next] = self._host_state()
      return
    with self._cv:
      # Not the producer's waiting flag: right after a publish it still reads True until the producer
      # takes the lock back, and the batch the new version admits would come after the caller's draw.
      while not (self._stop or self._error is not None or self._made_all_admitted()):
        self._cv.wait()
      if self._error is not None:
        raise self._error
      yield self.worker
      self._before[self._next] = self._host_state()

  def produce_ahead(self) -> None:
    """In-line producer: makes every batch the published versions admit, now (the learner calls it once
    its step is done).  A thread needs no call."""
    if self._inline:
      self._make_admitted()

  def record_before(self, batch_id: int) -> dict[str, Any]:
    """The worker's host state from before batch ``batch_id`` (what a checkpoint at that step keeps)."""
    with self._cv:
      if batch_id not in self._before:
        raise KeyError(f"no record of the rollout state before batch {batch_id}")
      return self._before[batch_id]

  @property
  def rollout_idle_s(self) -> float:
    """Seconds the producer has waited for policy versions so far, the wait in progress included."""
    with self._cv:
      ongoing = time.perf_counter() - self._wait_since if self._waiting else 0.0
      return self._idle_s + ongoing

  def queue_len(self) -> int:
    """Batches produced and not yet taken."""
    with self._cv:
      return len(self._ready)

  def pending(self, after: int) -> list[int]:
    """Batch ids from ``after`` on that the producer has made or is making (regenerated on a resume)."""
    with self._cv:
      return list(range(after, max(self._next + int(self._making), after)))

  # ---- the producer ----------------------------------------------------------------------------

  def _made_all_admitted(self) -> bool:
    """Whether the producer is making nothing and the next batch is not admitted (call holding the lock)."""
    return not self._making and (self._next >= self.end or self._required(self._next) not in self._versions)

  def _required(self, batch_id: int) -> int:
    return max(batch_id - self.max_staleness, self._first_version)

  def _make_one(self, b: int, need: int, params: Any) -> None:
    """Makes batch ``b`` with ``params``, version ``need`` (the worker is the caller's to use)."""
    self.worker.update_params(params)
    batch = self.worker.produce(b, need)
    with self._cv:
      self._ready[b] = batch
      self._making = False
      self._next = b + 1
      self._before[b + 1] = self._host_state()
      for old in [k for k in self._before if k < b - self.max_staleness - 1]:
        del self._before[old]
      self._cv.notify_all()

  def _make_admitted(self) -> None:
    """In-line producer: every batch from ``_next`` on whose version is published, in order."""
    while self._next < self.end and self._required(self._next) in self._versions:
      need = self._required(self._next)
      self._make_one(self._next, need, self._versions[need])

  def _run(self) -> None:
    try:
      while True:
        with self._cv:
          b = self._next
          need = self._required(b)
          self._wait_since = time.perf_counter()
          while (need not in self._versions or b >= self.end) and not self._stop:
            self._waiting = True
            self._cv.notify_all()
            self._cv.wait()
          self._waiting = False
          self._idle_s += time.perf_counter() - self._wait_since
          if self._stop:
            return
          params = self._versions[need]
          self._making = True
        self._make_one(b, need, params)
    except BaseException as e:  # noqa: BLE001 - handed to the learner, which re-raises it
      with self._cv:
        self._error = e
        self._cv.notify_all()
