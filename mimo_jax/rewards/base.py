"""Composite rewards: several named reward sources mixed into one scalar per sample, evaluated safely.

The trainer decodes a batch of ``B = prompts * G`` completions on the host and needs one
float reward per sample plus the named components it was mixed from.  This module is the
interface every reward plugs into:

* :class:`RewardSample` is what a reward sees: prompt, completion (text and tokens), the
  dataset row (gold answer, unit tests, schema, ...), the task name and whether the
  completion hit the length limit.
* :class:`RewardSource` is one named component.  Per-sample sources (``fn(sample) ->
  float``: answer checking, unit tests, format checks) run in worker processes, because
  they execute untrusted or expensive code and may raise, hang or crash.  Batched sources
  (``fn(list[sample]) -> list[float]``: a reward model or an LLM judge on the
  accelerator) run in the trainer's own process, once per batch.
* :class:`RewardPool` is a small process pool with a per-sample time limit.  A worker
  holds one sample at a time, so the pool always knows which sample a hung or dead
  worker was evaluating: that sample (and only that one) is marked failed, the worker is
  killed and replaced, and the batch carries on.  Workers are persistent (start-up,
  including module imports, is paid once, not per batch) and are started with
  ``forkserver`` or ``spawn``, never plain ``fork``: the trainer runs JAX, whose threads
  make ``fork`` unsafe.
* :class:`CompositeReward` evaluates all sources on a batch and mixes them:
  ``reward_i = sum_s weight_s * norm_s(component_s,i)`` over the sources that apply to
  sample ``i``'s task.  A failed component is recorded as a raw 0, flagged in
  :attr:`RewardBatch.failed`, and contributes exactly 0 to the mixed reward.  With
  ``normalize="task_running"`` every (task, component) pair is standardised with its own
  running mean and variance, so a task whose rewards live in [0, 100] cannot drown out
  one whose rewards live in [0, 1].  The components returned and logged are always raw.

Running statistics.  For each (task, component) pair, the batch's valid values of that
task (the component applies and did not fail) update the statistics *before* they are
standardised.  The first batch initialises them to the batch mean and (population)
variance; later batches are mixed in with weight ``1 - ema`` per batch, whatever the
number of samples::

  mean' = ema * mean + (1 - ema) * batch_mean
  var'  = ema * (var + (mean - mean')**2) + (1 - ema) * (batch_var + (batch_mean - mean')**2)

``var'`` is the exact variance of the two-part mixture (old distribution, this batch).
Unlike averaging the two variances alone (:func:`mimo_jax.rl.controllers.ema_moments`), it
counts the drift of the mean as spread: after a first batch of all-0 rewards, a batch of
all-1 rewards standardises to about 10 rather than to ``0.99 / eps``.  Values are then
standardised as ``(x - mean') / (sqrt(var') + eps)`` (and optionally clipped).  Failed
values never enter the statistics: an outage of a reward service says nothing about the
reward distribution.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import numpy as np

__all__ = [
  "CompositeReward",
  "NormalizeMode",
  "Outcome",
  "RewardBatch",
  "RewardPool",
  "RewardSample",
  "RewardSource",
]

NormalizeMode = Literal["none", "task_running"]
_NORMALIZE_MODES = ("none", "task_running")

# Error texts are truncated to this many characters: one pathological exception message
# (a repr of a huge object) must not flood the logs.
_MAX_ERROR_CHARS = 500
# RewardBatch.errors keeps at most this many messages, in source order then sample order.
_MAX_BATCH_ERRORS = 10
# Histogram name of the mixed reward; a source may not use it as its name.
_MIXED = "mixed"
_STATE_VERSION = 1


def _truncate(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(e: BaseException) -> str:
  message = str(e)
  return _truncate(f"{type(e).__name__}: {message}" if message else type(e).__name__)


# ---- data --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RewardSample:
  """One decoded completion, as every reward source sees it.

  Picklable (it is sent to worker processes) as long as ``row`` holds picklable values,
  which dataset rows (strings, numbers, lists, dicts) do.

  Attributes:
    prompt: the prompt text the completion continues.
    completion: the decoded completion (special tokens removed).
    completion_tokens: the completion's token ids; a list or array is converted to a tuple.
    row: the dataset row's fields, e.g. ``answer`` (math), ``tests`` and ``entry_point``
      (code), ``schema`` (JSON).  Not copied: do not mutate it from a reward.
    task: the task name, used for per-task applicability and normalisation.
    truncated: whether the completion hit the length limit (it may be cut mid-answer).
  """

  prompt: str
  completion: str
  completion_tokens: tuple[int, ...] = ()
  row: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  task: str = ""
  truncated: bool = False

  def __post_init__(self) -> None:
    for field in ("prompt", "completion", "task"):
      value = getattr(self, field)
      if not isinstance(value, str):
        raise TypeError(f"RewardSample.{field} must be a str, got {type(value).__name__}")
    if not isinstance(self.row, Mapping):
      raise TypeError(f"RewardSample.row must be a mapping, got {type(self.row).__name__}")
    if not isinstance(self.completion_tokens, tuple):
      # Frozen dataclass: the only way to normalise a field after construction.
      object.__setattr__(self, "completion_tokens", tuple(int(t) for t in self.completion_tokens))
    object.__setattr__(self, "truncated", bool(self.truncated))


@dataclasses.dataclass(frozen=True)
class RewardSource:
  """One named reward component.

  Per-sample sources (``batched=False``) are called as ``fn(sample) -> float`` in worker
  processes, so ``fn`` must be picklable: a module-level function, or a
  :func:`functools.partial` of one (lambdas and nested functions are rejected by
  :class:`CompositeReward`).  It may raise, return a non-finite or non-numeric value, hang
  or crash its process: the sample's component is then marked failed.

  Batched sources (``batched=True``) are called as ``fn(list[RewardSample]) ->
  Sequence[float]`` once per batch, in the trainer's process, with the samples they apply
  to (in batch order).  An exception or a result of the wrong length marks the component
  failed for all those samples; a non-finite or non-numeric element marks only its sample, and so
  does an exception instance returned as the element (its message is the failure's).

  Attributes:
    name: the component's name, unique within a :class:`CompositeReward`; metrics are
      ``reward/<name>_mean`` and ``reward/<name>_fail_frac``.
    fn: the reward function.
    weight: multiplier in the mix; 0 computes and logs the component without training on it.
    batched: whether ``fn`` takes the whole batch (see above).
    tasks: task names this component applies to; empty means every task.  Samples of other
      tasks get no contribution and a NaN component.
    timeout_s: per-sample time limit in seconds; None uses the pool's default.  Only for
      per-sample sources: a batched call runs in-process and cannot be interrupted.
    collective: a batched source that runs one program over the devices of every process (a reward
      model or a judge on the global mesh).  With several processes each host scores only its own
      rows with the other sources, but calls a collective one with the whole batch, the same samples
      on every host and in the same order, so that every host issues the same collectives.
  """

  name: str
  fn: Callable[..., Any]
  weight: float = 1.0
  batched: bool = False
  tasks: tuple[str, ...] = ()
  timeout_s: float | None = None
  collective: bool = False

  def __post_init__(self) -> None:
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"RewardSource.name must be a non-empty string, got {self.name!r}")
    if self.name == _MIXED:
      raise ValueError(f"RewardSource.name {_MIXED!r} is reserved for the mixed reward's histogram")
    if not callable(self.fn):
      raise TypeError(f"RewardSource {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
    if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real) or not math.isfinite(self.weight):
      raise ValueError(f"RewardSource {self.name!r}: weight must be a finite number, got {self.weight!r}")
    object.__setattr__(self, "weight", float(self.weight))
    object.__setattr__(self, "batched", bool(self.batched))
    object.__setattr__(self, "collective", bool(self.collective))
    if self.collective and not self.batched:
      raise ValueError(f"RewardSource {self.name!r}: a collective source must be batched (it scores the whole batch)")
    if isinstance(self.tasks, str):
      raise TypeError(
        f"RewardSource {self.name!r}: tasks must be a sequence of task names, not the string {self.tasks!r}"
      )
    tasks = tuple(self.tasks)
    if not all(isinstance(t, str) for t in tasks):
      raise TypeError(f"RewardSource {self.name!r}: tasks must be strings, got {tasks!r}")
    object.__setattr__(self, "tasks", tasks)
    if self.timeout_s is not None:
      if self.batched:
        raise ValueError(
          f"RewardSource {self.name!r}: timeout_s applies to per-sample sources only; a batched source "
          "runs in-process and cannot be interrupted"
        )
      _check_timeout(self.timeout_s, f"RewardSource {self.name!r}: timeout_s")
      object.__setattr__(self, "timeout_s", float(self.timeout_s))

  def applies_to(self, task: str) -> bool:
    """Whether this component is computed for samples of ``task``."""
    return not self.tasks or task in self.tasks


@dataclasses.dataclass(frozen=True)
class Outcome:
  """The result of one reward call.

  Attributes:
    value: the reward as a finite float; 0.0 when the call failed.
    failed: whether the call raised, returned a non-finite or non-numeric value, timed
      out or killed its worker.
    error: why it failed (empty on success), e.g. ``"ValueError: no answer"``,
      ``"timeout after 10s"``, ``"worker died (exit code 1)"``.
  """

  value: float
  failed: bool = False
  error: str = ""


def _failure(error: str) -> Outcome:
  return Outcome(0.0, True, _truncate(error))


def _coerce(value: Any) -> Outcome:
  """Reads a reward function's return value as a finite float; an exception instance is a failure with
  its message (a batched source's way to fail one sample of the batch and say why)."""
  if isinstance(value, BaseException):
    return _failure(_describe(value))
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if isinstance(value, (bool, np.bool_)):
    return Outcome(float(value))
  if not isinstance(value, numbers.Real):
    return _failure(f"returned {type(value).__name__} {_truncate(repr(value), 80)}, expected a real number")
  value = float(value)
  if not math.isfinite(value):
    return _failure(f"returned non-finite value {value}")
  return Outcome(value)


def _evaluate(fn: Callable[[Any], Any], sample: Any) -> Outcome:
  """Calls ``fn(sample)``, turning any exception (``SystemExit`` included) into a failed outcome."""
  try:
    value = fn(sample)
  except BaseException as e:  # a reward must never take its caller down, whatever it raises
    return _failure(_describe(e))
  return _coerce(value)


def _check_timeout(value: Any, what: str) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
    raise ValueError(f"{what} must be a positive finite number of seconds, got {value!r}")


# ---- worker process ----------------------------------------------------------------------

# Worker -> parent messages: (_STARTED, task_id) once the task is unpickled (the per-sample
# clock starts then), then (_DONE, task_id, value, failed, error).
_STARTED = 0
_DONE = 1
# This many workers in a row dying before they run a call means workers cannot start at
# all (an unimportable main module, a crashing import): RewardPool.run raises instead of
# failing every sample of the batch one process start at a time.
_MAX_START_FAILURES = 3
# Unpickled functions a worker keeps, keyed by their pickle: importing a function's module
# is paid once per worker, not once per sample.
_WORKER_FN_CACHE = 16


def _exit_when_parent_dies(sentinel: int) -> None:
  multiprocessing.connection.wait([sentinel])
  os._exit(0)


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
  """Worker loop: receive ``(task_id, fn_pickle, sample_pickle)``, reply, repeat until None or EOF."""
  # Ctrl-C reaches the whole process group; the parent handles it and closes the pool.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  parent = multiprocessing.parent_process()
  if parent is not None:
    # A worker stuck in a reward function would never see EOF on its pipe: exit when the
    # parent does, even if it was killed without closing the pool.
    threading.Thread(target=_exit_when_parent_dies, args=(parent.sentinel,), daemon=True).start()
  fns: dict[bytes, Callable[[Any], Any]] = {}
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message is None:
      return
    task_id, fn_bytes, sample_bytes = message
    try:
      fn = fns.get(fn_bytes)
      if fn is None:
        fn = pickle.loads(fn_bytes)
        if len(fns) >= _WORKER_FN_CACHE:
          fns.clear()
        fns[fn_bytes] = fn
      sample = pickle.loads(sample_bytes)
    except BaseException as e:
      reply = (_DONE, task_id, 0.0, True, f"could not load the function or sample in the worker: {_describe(e)}")
    else:
      try:
        conn.send((_STARTED, task_id))
      except OSError:
        return  # the parent is gone
      outcome = _evaluate(fn, sample)
      reply = (_DONE, task_id, outcome.value, outcome.failed, outcome.error)
    try:
      conn.send(reply)
    except OSError:
      return


def _exit_description(exitcode: int | None) -> str:
  if exitcode is None:
    return "worker died"
  if exitcode < 0:
    try:
      return f"worker died (killed by signal {signal.Signals(-exitcode).name})"
    except ValueError:
      return f"worker died (killed by signal {-exitcode})"
  return f"worker died (exit code {exitcode})"


class _Worker:
  """A worker process, the parent's end of its pipe and the task it holds."""

  def __init__(self, ctx: Any) -> None:
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    self.process = ctx.Process(target=_worker_main, args=(child_conn,), name="mimo-jax-reward-worker", daemon=True)
    self.process.start()
    child_conn.close()
    self.conn = parent_conn
    self.task: int | None = None  # index into the current run's calls
    self.timeout_s = math.inf  # the held call's time limit
    self.started = False  # whether the held call was unpickled (its own clock runs)
    self.deadline = math.inf  # load deadline until started, then the call's deadline
    self.eof = False  # the pipe was closed by the worker's end

  def stop(self, *, graceful: bool) -> None:
    """Stops the process (SIGKILL unless ``graceful`` and it exits on request) and reaps it."""
    if graceful and self.process.is_alive():
      try:
        self.conn.send(None)
      except OSError:
        pass
      self.process.join(1.0)
    if self.process.is_alive():
      self.process.kill()
    self.process.join(5.0)
    self.conn.close()
    if self.process.exitcode != 0:  # killed mid-call: a sandbox it was running left its directory behind
      from mimo_jax.rewards.sandbox import remove_leftovers

      remove_leftovers(self.process.pid)


def _stop_workers(workers: list[_Worker | None]) -> None:
  """Stops every worker; shared by :meth:`RewardPool.close` and the interpreter-exit finaliser."""
  for i, worker in enumerate(workers):
    if worker is not None:
      workers[i] = None
      worker.stop(graceful=worker.task is None)


class RewardPool:
  """Persistent worker processes that evaluate per-sample reward functions with a time limit.

  Each worker holds one sample at a time.  A function that raises (anything, including
  ``SystemExit``) or returns a non-finite or non-numeric value gives a failed
  :class:`Outcome` with the reason; one that runs past its time limit has its worker
  killed and replaced (``"timeout after Xs"``); one that kills its worker (``os._exit``,
  a segfault) gives ``"worker died (...)"`` and a replacement.  The pool keeps going
  either way.

  The per-sample clock starts when the worker has unpickled the function and the sample,
  so importing the function's module in a fresh worker (which can take seconds) is not
  charged to the sample; loading has its own, generous, limit (``load_timeout_s``).

  ``num_workers=0`` evaluates in the calling process, one call at a time, each in a
  daemon thread joined with the time limit.  Exceptions are still caught, but there is no
  isolation: a call that overruns is reported as a timeout and keeps running in its leaked
  thread (Python threads cannot be killed), and a call that exits the process or crashes
  takes the trainer with it.  Meant for tests and trusted, fast functions.

  A ``forkserver`` or ``spawn`` worker imports the parent's main module (as
  ``__mp_main__``), so the trainer's entry point must sit under ``if __name__ ==
  "__main__":``.  Workers that die before running any call, 3 in a row, make :meth:`run`
  raise rather than fail a whole batch one process start at a time.

  Workers are killed by :meth:`close`, by the context manager, when the pool is garbage
  collected and at interpreter exit; a worker also exits by itself when the parent
  process dies.  Workers are daemonic, so a reward function cannot start
  ``multiprocessing`` children of its own; :mod:`subprocess` works (and is what a code
  sandbox should use).  :meth:`run` and :meth:`map` may be called from any thread;
  concurrent calls are serialised.

  Args:
    num_workers: worker processes; 0 evaluates in-process (see above).
    default_timeout_s: time limit per call when none is given.
    mp_context: ``"forkserver"`` (default) or ``"spawn"``; plain ``"fork"`` is refused
      because the trainer's JAX threads make it unsafe.
    load_timeout_s: time limit for a worker to receive and unpickle a call (module
      imports included) before the per-sample clock starts.

  Raises:
    ValueError: on a negative ``num_workers``, a non-positive time limit or an unknown
      or ``"fork"`` start method.
  """

  def __init__(
    self,
    num_workers: int = 2,
    default_timeout_s: float = 10.0,
    mp_context: str = "forkserver",
    *,
    load_timeout_s: float = 120.0,
  ) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) or num_workers < 0:
      raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
    _check_timeout(default_timeout_s, "default_timeout_s")
    _check_timeout(load_timeout_s, "load_timeout_s")
    if mp_context == "fork":
      raise ValueError(
        "mp_context='fork' is not allowed: the trainer process runs JAX threads and a forked copy can deadlock; "
        "use 'forkserver' or 'spawn'"
      )
    if mp_context not in multiprocessing.get_all_start_methods():
      raise ValueError(
        f"mp_context must be one of {[m for m in multiprocessing.get_all_start_methods() if m != 'fork']}, "
        f"got {mp_context!r}"
      )
    self.num_workers = int(num_workers)
    self.default_timeout_s = float(default_timeout_s)
    self.load_timeout_s = float(load_timeout_s)
    self.mp_context = mp_context
    self._ctx = multiprocessing.get_context(mp_context)
    self._lock = threading.Lock()
    self._closed = False
    self._task_counter = 0
    self._start_failures = 0  # consecutive workers that died before running a call
    # Slots are filled lazily (first run) and refilled after a kill.  The list object is
    # shared with the finaliser, so it always sees the current workers.
    self._workers: list[_Worker | None] = [None] * self.num_workers
    self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

  # ---- lifecycle ---------------------------------------------------------------------

  @property
  def closed(self) -> bool:
    """Whether :meth:`close` was called."""
    return self._closed

  def start(self) -> RewardPool:
    """Starts any worker not yet running (otherwise done by the first call); returns ``self``."""
    with self._lock:
      self._check_open()
      for slot in range(self.num_workers):
        self._ensure_worker(slot)
    return self

  def worker_pids(self) -> list[int]:
    """Process ids of the running workers (for tests and debugging)."""
    return [w.process.pid for w in self._workers if w is not None and w.process.pid is not None]

  def close(self) -> None:
    """Stops all workers (killing any that does not exit at once) and reaps them; idempotent."""
    with self._lock:
      self._closed = True
      self._finalizer()

  def __enter__(self) -> RewardPool:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("RewardPool is closed")

  def _ensure_worker(self, slot: int) -> _Worker:
    worker = self._workers[slot]
    if worker is not None and not worker.process.is_alive():
      # Died while idle (killed from outside): replace it before it is handed a sample,
      # which would otherwise be blamed for the death.
      worker.stop(graceful=False)
      worker = None
    if worker is None:
      worker = _Worker(self._ctx)
      self._workers[slot] = worker
    return worker

  def _replace(self, slot: int) -> None:
    worker = self._workers[slot]
    if worker is not None:
      worker.stop(graceful=False)
    self._workers[slot] = None
    # Started at once, so the replacement warms up while the others work.
    self._ensure_worker(slot)

  # ---- evaluation --------------------------------------------------------------------

  def map(self, fn: Callable[[Any], Any], samples: Sequence[Any], timeout_s: float | None = None) -> list[Outcome]:
    """Evaluates ``fn(sample)`` for every sample.

    Args:
      fn: a picklable callable (module-level function or ``functools.partial`` of one)
        when ``num_workers > 0``.
      samples: picklable arguments, usually :class:`RewardSample`.
      timeout_s: per-sample time limit; None uses ``default_timeout_s``.

    Returns:
      One :class:`Outcome` per sample, in order.

    Raises:
      TypeError: if ``fn`` cannot be pickled for the workers.
      RuntimeError: if the pool is closed.
    """
    return self.run([(fn, sample, timeout_s) for sample in samples])

  def run(self, calls: Sequence[tuple[Callable[[Any], Any], Any, float | None]]) -> list[Outcome]:
    """Evaluates ``(fn, sample, timeout_s)`` calls, possibly with different functions, across the workers.

    One run of many functions keeps every worker busy until the end, where separate
    :meth:`map` calls would each wait for their slowest sample.  A sample that cannot be
    pickled fails alone; a function that cannot be pickled is a programming error and
    raises.

    Args:
      calls: ``(fn, sample, timeout_s)`` triples; ``timeout_s`` None uses the default.

    Returns:
      One :class:`Outcome` per call, in order.

    Raises:
      TypeError: if a function cannot be pickled for the workers.
      ValueError: on a non-positive time limit.
      RuntimeError: if the pool is closed, or if 3 workers in a row die before running a
        call (they cannot start: see the class docstring).
    """
    calls = [(fn, sample, self._timeout(timeout_s)) for fn, sample, timeout_s in calls]
    with self._lock:
      self._check_open()
      if not calls:
        return []
      if self.num_workers == 0:
        return [self._run_in_process(fn, sample, timeout_s) for fn, sample, timeout_s in calls]
      return self._run_in_workers(calls)

  def _timeout(self, timeout_s: float | None) -> float:
    if timeout_s is None:
      return self.default_timeout_s
    _check_timeout(timeout_s, "timeout_s")
    return float(timeout_s)

  @staticmethod
  def _run_in_process(fn: Callable[[Any], Any], sample: Any, timeout_s: float) -> Outcome:
    result: list[Outcome] = []
    thread = threading.Thread(
      target=lambda: result.append(_evaluate(fn, sample)), name="mimo-jax-reward-call", daemon=True
    )
    thread.start()
    thread.join(timeout_s)
    if not result:
      return _failure(f"timeout after {timeout_s:g}s (in-process: the call keeps running in a leaked thread)")
    return result[0]

  def _run_in_workers(self, calls: list[tuple[Callable[[Any], Any], Any, float]]) -> list[Outcome]:
    fn_bytes: dict[int, bytes] = {}
    sample_bytes: dict[int, bytes | Outcome] = {}
    for fn, sample, _ in calls:
      if id(fn) not in fn_bytes:
        try:
          fn_bytes[id(fn)] = pickle.dumps(fn, pickle.HIGHEST_PROTOCOL)
        except Exception as e:
          raise TypeError(
            f"reward function {fn!r} cannot be pickled for worker processes ({_describe(e)}); "
            "use a module-level function or a functools.partial of one"
          ) from e
      if id(sample) not in sample_bytes:
        try:
          sample_bytes[id(sample)] = pickle.dumps(sample, pickle.HIGHEST_PROTOCOL)
        except Exception as e:
          sample_bytes[id(sample)] = _failure(f"could not pickle the sample for a worker: {_describe(e)}")

    results: list[Outcome | None] = [None] * len(calls)
    pending: deque[int] = deque()
    for i, (_, sample, _) in enumerate(calls):
      payload = sample_bytes[id(sample)]
      if isinstance(payload, Outcome):
        results[i] = payload
      else:
        pending.append(i)
    # Task ids are unique across runs, so a late message from an earlier, interrupted run
    # can never be taken for an answer to this one.
    base_id = self._task_counter
    self._task_counter += len(calls)
    remaining = len(pending)
    completed = False
    try:
      while remaining:
        now = time.monotonic()
        for slot in range(self.num_workers):
          if not pending:
            break
          current = self._workers[slot]
          if current is not None and current.task is not None:
            # Busy, possibly dead by now: its outcome (or death) is read below. Replacing it here
            # would drop its sample, and the run would wait forever for it.
            continue
          worker = self._ensure_worker(slot)
          i = pending.popleft()
          fn, sample, timeout_s = calls[i]
          try:
            worker.conn.send((base_id + i, fn_bytes[id(fn)], sample_bytes[id(sample)]))
          except OSError:
            # The worker died between the liveness check and the send: retry on a new one.
            pending.appendleft(i)
            self._replace(slot)
            continue
          worker.task, worker.timeout_s, worker.started = i, timeout_s, False
          worker.deadline = now + self.load_timeout_s

        busy = [(slot, w) for slot, w in enumerate(self._workers) if w is not None and w.task is not None]
        if not busy:
          if not pending:
            raise RuntimeError(f"reward pool lost track of {remaining} call(s): no worker holds them")
          continue  # every send failed; the replacements take the samples on the next pass
        wait_s = max(0.0, min(w.deadline for _, w in busy) - time.monotonic())
        handles: list[Any] = [w.process.sentinel for _, w in busy] + [w.conn for _, w in busy if not w.eof]
        multiprocessing.connection.wait(handles, timeout=wait_s)

        for slot, worker in busy:
          i = worker.task
          assert i is not None
          outcome = self._drain(worker, base_id + i)
          replace = False
          if outcome is None and worker.eof:
            # EOF can arrive a moment before the exit status: wait for it briefly.
            worker.process.join(1.0)
          if outcome is None and not worker.process.is_alive():
            outcome, replace = _failure(_exit_description(worker.process.exitcode)), True
            self._check_start_failure(worker, outcome.error)
          if outcome is None and time.monotonic() >= worker.deadline:
            if worker.started:
              outcome = _failure(f"timeout after {worker.timeout_s:g}s")
            else:
              outcome = _failure(f"worker did not load the call within {self.load_timeout_s:g}s")
            replace = True
          if outcome is not None:
            results[i] = outcome
            remaining -= 1
            worker.task = None
            if replace:
              self._replace(slot)
      completed = True
    finally:
      if not completed:
        # Interrupted (KeyboardInterrupt, a bug): workers still holding a sample would
        # answer into the next run; replace them.
        for slot, worker in enumerate(self._workers):
          if worker is not None and worker.task is not None:
            worker.task = None
            self._replace(slot)
    return [r if r is not None else _failure("no result") for r in results]

  def _check_start_failure(self, worker: _Worker, error: str) -> None:
    """Counts a worker that died before running its call; raises when workers cannot start at all."""
    if worker.started:
      self._start_failures = 0
      return
    self._start_failures += 1
    if self._start_failures >= _MAX_START_FAILURES:
      self._start_failures = 0
      raise RuntimeError(
        f"{_MAX_START_FAILURES} reward worker processes in a row died before running a call (last: {error}). "
        f"With mp_context={self.mp_context!r} a worker imports the parent's main module and each reward function's "
        "module: check that they import cleanly (and that the main module guards its entry point with "
        "`if __name__ == '__main__':`); the worker's own traceback is on stderr."
      )

  def _drain(self, worker: _Worker, task_id: int) -> Outcome | None:
    """Reads every message waiting on ``worker``'s pipe; returns the task's outcome if it arrived."""
    try:
      while worker.conn.poll():
        message = worker.conn.recv()
        if message[1] != task_id:
          continue  # stale (cannot happen with one task per worker, kept as a guard)
        if message[0] == _STARTED:
          worker.deadline = time.monotonic() + worker.timeout_s
          worker.started = True
          self._start_failures = 0
        else:
          _, _, value, failed, error = message
          return Outcome(float(value), bool(failed), str(error))
    except (EOFError, OSError):
      worker.eof = True  # the worker died; its exit status follows on the sentinel
    return None


# ---- results -----------------------------------------------------------------------------


@dataclasses.dataclass
class RewardBatch:
  """Rewards of one batch, with the raw components they were mixed from.

  Attributes:
    rewards: float32 ``[B]``, the mixed reward to train on.
    components: per source name, float32 ``[B]`` raw values: NaN where the component does
      not apply to the sample's task, 0 where it failed.
    failed: per source name, bool ``[B]``: the component applies but could not be computed.
    errors: the first few failure messages (``"<name>[<index>]: <error>"``, truncated).
    normalized: per source name, float32 ``[B]`` values as they entered the mix (before the
      weight): the raw value with ``normalize="none"``, the standardised one with
      ``"task_running"``; 0 where failed, NaN where the component does not apply.
    raw_rewards: float32 ``[B]``, the same weighted mix of the *raw* components (what is logged as
      the reward; equal to ``rewards`` with ``normalize="none"``).  None: not computed (then the
      logged reward is ``rewards``).
  """

  rewards: np.ndarray
  components: dict[str, np.ndarray]
  failed: dict[str, np.ndarray]
  errors: list[str] = dataclasses.field(default_factory=list)
  normalized: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  raw_rewards: np.ndarray | None = None

  def _valid(self, name: str) -> np.ndarray:
    return ~np.isnan(self.components[name]) & ~self.failed[name]

  def select(self, rows: np.ndarray) -> RewardBatch:
    """The rewards of ``rows`` of this batch (the failure messages are kept whole)."""
    rows = np.asarray(rows)
    return RewardBatch(
      rewards=self.rewards[rows],
      components={k: v[rows] for k, v in self.components.items()},
      failed={k: v[rows] for k, v in self.failed.items()},
      errors=list(self.errors),
      normalized={k: v[rows] for k, v in self.normalized.items()},
      raw_rewards=None if self.raw_rewards is None else self.raw_rewards[rows],
    )

  @staticmethod
  def concatenate(batches: Sequence[RewardBatch]) -> RewardBatch:
    """One batch of the rows of ``batches`` in order (all of the same reward, so the same components)."""

    def cat(attr: str) -> dict[str, np.ndarray]:
      return {k: np.concatenate([getattr(b, attr)[k] for b in batches]) for k in getattr(batches[0], attr)}

    return RewardBatch(
      rewards=np.concatenate([b.rewards for b in batches]),
      components=cat("components"),
      failed=cat("failed"),
      errors=[e for b in batches for e in b.errors],
      normalized=cat("normalized"),
      raw_rewards=(
        None if any(b.raw_rewards is None for b in batches) else np.concatenate([b.raw_rewards for b in batches])
      ),
    )

  def metrics(self) -> dict[str, float]:
    """Scalar metrics for the logger.

    Returns:
      Per component ``reward/<name>_mean`` (mean raw value over the samples it applies to
      and did not fail on; NaN if there are none) and ``reward/<name>_fail_frac``
      (failures over applicable samples; 0 if none apply), plus ``reward/failures``, the
      number of failed (sample, component) pairs in the batch.
    """
    metrics: dict[str, float] = {}
    total_failures = 0
    for name, values in self.components.items():
      valid = self._valid(name)
      applicable = int(np.count_nonzero(~np.isnan(values)))
      failures = int(np.count_nonzero(self.failed[name]))
      total_failures += failures
      metrics[f"reward/{name}_mean"] = float(np.mean(values[valid], dtype=np.float64)) if valid.any() else math.nan
      metrics[f"reward/{name}_fail_frac"] = failures / applicable if applicable else 0.0
    metrics["reward/failures"] = float(total_failures)
    return metrics

  def histograms(self) -> dict[str, np.ndarray]:
    """Value distributions for the logger: ``reward/<name>`` (valid raw values) and ``reward/mixed``."""
    hists = {f"reward/{name}": values[self._valid(name)] for name, values in self.components.items()}
    hists[f"reward/{_MIXED}"] = self.rewards
    return hists


# ---- composite ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Moments:
  """Running statistics of one (task, component) pair."""

  mean: float
  var: float
  updates: int

  def update(self, x: np.ndarray, ema: float) -> None:
    batch_mean, batch_var = float(np.mean(x)), float(np.var(x))
    mean = ema * self.mean + (1.0 - ema) * batch_mean
    self.var = ema * (self.var + (self.mean - mean) ** 2) + (1.0 - ema) * (batch_var + (batch_mean - mean) ** 2)
    self.mean = mean
    self.updates += 1


class CompositeReward:
  """Evaluates reward sources on a batch and mixes them into one reward per sample.

  ``reward_i = sum_s weight_s * norm_s(component_s,i)`` over the sources whose ``tasks``
  include sample ``i``'s task.  A failed component counts as raw 0, is flagged, and
  contributes 0.  See the module docstring for ``normalize="task_running"``.

  Per-sample sources run in ``pool`` (one :meth:`RewardPool.run` per batch, all sources
  together).  Batched sources run in the calling thread meanwhile, so a reward model on
  the accelerator overlaps with CPU verification in the workers.

  Not thread-safe: one call at a time (the running statistics are updated in place).

  Args:
    sources: the components; names must be unique.
    normalize: ``"none"`` mixes raw values; ``"task_running"`` standardises each
      component per task with running statistics first.
    ema: weight of the old statistics when a batch is mixed in, in ``[0, 1)``; 0 uses
      each batch's own statistics.
    eps: added to the running standard deviation.
    clip: if set, standardised values are clipped to ``[-clip, clip]`` (``task_running``
      only).  Standardising a rare success against a nearly constant history can give
      large values; clipping bounds them.
    pool: where per-sample sources run.  None creates a :class:`RewardPool` with default
      settings on the first batch that needs it, owned (and closed) by this object; a
      pool passed in is left open by :meth:`close`.

  Raises:
    ValueError: on no sources, duplicate names, an unknown ``normalize``, ``ema`` outside
      ``[0, 1)``, a non-positive ``eps`` or ``clip``, or a per-sample function that cannot
      be pickled for worker processes.
  """

  def __init__(
    self,
    sources: Sequence[RewardSource],
    *,
    normalize: NormalizeMode = "none",
    ema: float = 0.99,
    eps: float = 1e-6,
    clip: float | None = None,
    pool: RewardPool | None = None,
  ) -> None:
    self.sources = tuple(sources)
    if not self.sources:
      raise ValueError("CompositeReward needs at least one source")
    for source in self.sources:
      if not isinstance(source, RewardSource):
        raise TypeError(f"sources must be RewardSource instances, got {type(source).__name__}")
    names = [s.name for s in self.sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f"source names must be unique, repeated: {duplicates}")
    if normalize not in _NORMALIZE_MODES:
      raise ValueError(f"normalize must be one of {list(_NORMALIZE_MODES)}, got {normalize!r}")
    if not 0.0 <= ema < 1.0:
      raise ValueError(f"ema must be in [0, 1), got {ema!r}")
    if not eps > 0.0:
      raise ValueError(f"eps must be positive, got {eps!r}")
    if clip is not None and not clip > 0.0:
      raise ValueError(f"clip must be positive or None, got {clip!r}")
    if pool is None or pool.num_workers > 0:
      for source in self.sources:
        if not source.batched:
          try:
            pickle.dumps(source.fn)
          except Exception as e:
            raise ValueError(
              f"RewardSource {source.name!r}: per-sample fn {source.fn!r} cannot be pickled for worker processes "
              f"({_describe(e)}); use a module-level function or a functools.partial of one"
            ) from e
    self.normalize = normalize
    self.ema = float(ema)
    self.eps = float(eps)
    self.clip = None if clip is None else float(clip)
    self._pool = pool
    self._owns_pool = pool is None
    self._stats: dict[tuple[str, str], _Moments] = {}

  @property
  def names(self) -> tuple[str, ...]:
    """The component names, in source order."""
    return tuple(s.name for s in self.sources)

  # ---- lifecycle ---------------------------------------------------------------------

  def close(self) -> None:
    """Closes the pool if this object created it."""
    if self._owns_pool and self._pool is not None:
      self._pool.close()

  def __enter__(self) -> CompositeReward:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  # ---- evaluation --------------------------------------------------------------------

  def __call__(self, samples: Sequence[RewardSample]) -> RewardBatch:
    """Computes the rewards of a batch and updates the running statistics.

    Args:
      samples: the batch's samples, in the trainer's order.

    Returns:
      The mixed rewards and the raw components (see :class:`RewardBatch`).

    Raises:
      TypeError: if an element is not a :class:`RewardSample`.
      RuntimeError: if the pool was closed.
    """
    samples = list(samples)
    raw, failed, errors = self.score(samples)
    return self.mix(raw, failed, [s.task for s in samples], errors)

  def score(
    self,
    samples: Sequence[RewardSample],
    sources: Collection[str] | None = None,
    *,
    rows: Sequence[int] | None = None,
  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """The raw components of ``samples`` without mixing them (no running statistics change).

    ``__call__`` is ``mix(*score(samples))``; a multi-process run scores each host's own rows and
    mixes the gathered rows of all hosts, so the normaliser sees the global batch.

    Args:
      samples: the samples.
      sources: the names of the sources to call (default all); the others' components are NaN and
        not failed (a multi-process run scores its own rows with the local sources and the whole
        batch with the collective ones, then puts the two together).
      rows: the batch row of each sample, the index the failure messages name (default its position in
        ``samples``; a host of a multi-process run scores its own rows of the global batch).

    Returns:
      ``(raw, failed, errors)``: per source name, float64 ``[n]`` raw values (NaN where the source does
      not apply) and bool ``[n]`` failure flags; the failure messages (``"<name>[<index>]: <error>"``).
    """
    samples = list(samples)
    for i, sample in enumerate(samples):
      if not isinstance(sample, RewardSample):
        raise TypeError(f"samples[{i}] must be a RewardSample, got {type(sample).__name__}")
    n = len(samples)
    if rows is not None and len(rows) != n:
      raise ValueError(f"rows names {len(rows)} batch rows for {n} samples")
    chosen = set(self.names if sources is None else sources)
    unknown = sorted(chosen - set(self.names))
    if unknown:
      raise ValueError(f"unknown reward sources {unknown}; the sources are {list(self.names)}")
    tasks = np.array([s.task for s in samples], dtype=object)
    applies = {
      src.name: np.array([src.name in chosen and src.applies_to(t) for t in tasks], dtype=bool) for src in self.sources
    }
    raw = {src.name: np.full(n, np.nan, np.float64) for src in self.sources}
    failed = {src.name: np.zeros(n, bool) for src in self.sources}
    errors: dict[str, list[tuple[int, str]]] = {src.name: [] for src in self.sources}

    def record(name: str, i: int, outcome: Outcome) -> None:
      raw[name][i] = outcome.value
      if outcome.failed:
        failed[name][i] = True
        errors[name].append((i, outcome.error))

    # Per-sample sources: one pool run for all of them, in a helper thread when batched
    # sources can run meanwhile.
    calls: list[tuple[Callable[[Any], Any], Any, float | None]] = []
    where: list[tuple[str, int]] = []
    for src in self.sources:
      if not src.batched:
        for i in np.flatnonzero(applies[src.name]).tolist():
          calls.append((src.fn, samples[i], src.timeout_s))
          where.append((src.name, i))
    outcomes: list[Outcome] = []
    pool_error: list[BaseException] = []

    def run_pool() -> None:
      try:
        outcomes.extend(self._get_pool().run(calls))
      except BaseException as e:
        pool_error.append(e)

    thread = None
    if calls:
      if any(src.batched for src in self.sources):
        thread = threading.Thread(target=run_pool, name="mimo-jax-reward-pool", daemon=True)
        thread.start()
      else:
        run_pool()
    try:
      for src in self.sources:
        if src.batched:
          index = np.flatnonzero(applies[src.name]).tolist()
          if index:
            for i, outcome in zip(index, self._call_batched(src, [samples[i] for i in index]), strict=True):
              record(src.name, i, outcome)
    finally:
      if thread is not None:
        thread.join()
    if pool_error:
      raise pool_error[0]
    for (name, i), outcome in zip(where, outcomes, strict=True):
      record(name, i, outcome)
    row = (lambda i: i) if rows is None else (lambda i: int(rows[i]))
    messages = [f"{name}[{row(i)}]: {error}" for name in self.names for i, error in errors[name]]
    return raw, failed, messages

  def mix(
    self,
    raw: Mapping[str, np.ndarray],
    failed: Mapping[str, np.ndarray],
    tasks: Sequence[str],
    errors: Sequence[str] = (),
  ) -> RewardBatch:
    """Mixes raw components (from :meth:`score`) into one reward per sample, updating the running
    statistics with ``normalize="task_running"``.

    Args:
      raw: per source name, ``[n]`` raw values (NaN where the source does not apply).
      failed: per source name, bool ``[n]``.
      tasks: each sample's task.
      errors: failure messages to keep (the first few).
    """
    tasks = np.array(list(tasks), dtype=object)
    applies = {src.name: np.array([src.applies_to(t) for t in tasks], dtype=bool) for src in self.sources}
    rewards = np.zeros(len(tasks), np.float64)
    raw_rewards = np.zeros(len(tasks), np.float64)
    normalized: dict[str, np.ndarray] = {}
    for src in self.sources:
      values = np.asarray(raw[src.name], np.float64)
      bad = np.asarray(failed[src.name], bool)
      mixed = self._normalize(src.name, values, applies[src.name], bad, tasks)
      normalized[src.name] = mixed.astype(np.float32)
      rewards += src.weight * np.where(applies[src.name], mixed, 0.0)
      raw_rewards += src.weight * np.where(applies[src.name] & ~bad, np.nan_to_num(values), 0.0)
    return RewardBatch(
      rewards=rewards.astype(np.float32),
      raw_rewards=raw_rewards.astype(np.float32),
      components={name: np.asarray(raw[name]).astype(np.float32) for name in self.names},
      failed={name: np.asarray(failed[name], bool) for name in self.names},
      errors=[_truncate(m) for m in list(errors)[:_MAX_BATCH_ERRORS]],
      normalized=normalized,
    )

  def _get_pool(self) -> RewardPool:
    if self._pool is None:
      self._pool = RewardPool()
    return self._pool

  @staticmethod
  def _call_batched(src: RewardSource, samples: list[RewardSample]) -> list[Outcome]:
    try:
      values = src.fn(samples)
      values = list(values)
    except Exception as e:
      return [_failure(_describe(e))] * len(samples)
    if len(values) != len(samples):
      return [_failure(f"batched fn returned {len(values)} values for {len(samples)} samples")] * len(samples)
    return [_coerce(v) for v in values]

  def _normalize(
    self, name: str, raw: np.ndarray, applies: np.ndarray, failed: np.ndarray, tasks: np.ndarray
  ) -> np.ndarray:
    """Values entering the mix: NaN where not applicable, 0 where failed, raw or standardised elsewhere."""
    valid = applies & ~failed
    out = np.where(valid, raw, 0.0)
    out[~applies] = np.nan
    if self.normalize == "none":
      return out
    for task in dict.fromkeys(tasks[valid].tolist()):
      index = valid & (tasks == task)
      x = raw[index]
      stats = self._stats.get((task, name))
      if stats is None:
        stats = self._stats[(task, name)] = _Moments(float(np.mean(x)), float(np.var(x)), 1)
      else:
        stats.update(x, self.ema)
      z = (x - stats.mean) / (math.sqrt(stats.var) + self.eps)
      if self.clip is not None:
        z = np.clip(z, -self.clip, self.clip)
      out[index] = z
    return out

  # ---- checkpointing -----------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """Returns the running statistics as a JSON-serialisable dict (for checkpoints).

    Format: ``{"version": 1, "normalize": ..., "ema": ..., "stats": {task: {component:
    {"mean": float, "var": float, "updates": int}}}}``.  Empty ``stats`` with
    ``normalize="none"`` or before the first batch.  Batched sources with a ``state_dict`` of their
    own (a judge's key stream) add ``"sources": {name: state}``.
    """
    stats: dict[str, dict[str, dict[str, Any]]] = {}
    for (task, name), m in sorted(self._stats.items()):
      stats.setdefault(task, {})[name] = {"mean": m.mean, "var": m.var, "updates": m.updates}
    out = {"version": _STATE_VERSION, "normalize": self.normalize, "ema": self.ema, "stats": stats}
    # Batched sources that keep state of their own (a judge's sampling key stream).
    sources = {s.name: s.fn.state_dict() for s in self.sources if s.batched and hasattr(s.fn, "state_dict")}
    if sources:
      out["sources"] = sources
    return out

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Replaces the running statistics with those of :meth:`state_dict`.

    ``normalize`` and ``ema`` in ``state`` are informational: this object's own settings
    stay in force, so a resumed run may change them.  Statistics of components or tasks
    this object does not know are kept (and saved again), not an error.

    Args:
      state: a dict from :meth:`state_dict`, possibly after a JSON round trip.

    Raises:
      ValueError: if ``state`` is malformed or of another version; nothing is changed then.
    """
    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
      version = state.get("version") if isinstance(state, Mapping) else None
      raise ValueError(f"reward normaliser state must be a dict with version {_STATE_VERSION}, got version {version!r}")
    raw_stats = state.get("stats")
    if not isinstance(raw_stats, Mapping):
      raise ValueError(f"reward normaliser state['stats'] must be a dict, got {type(raw_stats).__name__}")
    loaded: dict[tuple[str, str], _Moments] = {}
    for task, per_task in raw_stats.items():
      if not isinstance(task, str) or not isinstance(per_task, Mapping):
        raise ValueError(f"reward normaliser state['stats'][{task!r}] must be a dict keyed by a task name")
      for name, entry in per_task.items():
        where = f"state['stats'][{task!r}][{name!r}]"
        if not isinstance(name, str) or not isinstance(entry, Mapping):
          raise ValueError(f"reward normaliser {where} must be a dict keyed by a component name")
        try:
          mean, var, updates = entry["mean"], entry["var"], entry["updates"]
        except KeyError as e:
          raise ValueError(f"reward normaliser {where} lacks {e.args[0]!r}") from None
        ok = (
          isinstance(mean, numbers.Real)
          and isinstance(var, numbers.Real)
          and math.isfinite(mean)
          and math.isfinite(var)
          and var >= 0
          and isinstance(updates, numbers.Integral)
          and not isinstance(updates, bool)
          and updates >= 1
        )
        if not ok:
          raise ValueError(
            f"reward normaliser {where} must have a finite mean, a finite var >= 0 and updates >= 1, got {dict(entry)!r}"
          )
        loaded[(task, name)] = _Moments(float(mean), float(var), int(updates))
    sources = state.get("sources", {})
    if not isinstance(sources, Mapping):
      raise ValueError(f"reward normaliser state['sources'] must be a dict, got {type(sources).__name__}")
    self._stats = loaded
    for src in self.sources:
      if src.name in sources and hasattr(src.fn, "load_state_dict"):
        src.fn.load_state_dict(sources[src.name])
