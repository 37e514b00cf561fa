"""What a multi-process (multi-host) run needs beyond one global mesh: who writes, what each host owns,
and how hosts agree.

One controller per host runs the same program on its own devices.  The rules this module serves:

- **Process 0 writes the run directory** (``config.json``, ``metrics.jsonl``, ``summary.json``,
  TensorBoard, the lock); checkpoints are written by all processes together (Orbax), each its own shards.
- **Each host owns the batch rows on its devices** (:func:`local_rows`): it decodes and scores only
  those, and the rows' rewards are gathered so every host holds the same global values
  (:func:`gather_rows`); the metrics are the global ones on every host.
- **Host-side decisions are agreed** (:func:`any_process`, :func:`broadcast`): a SIGTERM seen by one
  host stops all at the same step; process 0's refusal of a run directory stops all.

On one process every function is the identity (or its one-process meaning) and costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
  "any_process",
  "barrier",
  "broadcast",
  "gather",
  "gather_rows",
  "is_primary",
  "local_rows",
  "multi_process",
  "put",
  "to_host",
]


def multi_process() -> bool:
  return jax.process_count() > 1


def is_primary() -> bool:
  """Whether this process writes the run directory (process 0)."""
  return jax.process_index() == 0


def gather(x: np.ndarray) -> np.ndarray:
  """``[num_processes, ...]`` on every process: each process's ``x`` (same shape and dtype on all)."""
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))


def gather_texts(texts: Sequence[str], limit: int = 8192) -> list[str]:
  """Every process's ``texts`` on every process, in process order (each process's own order kept).

  One fixed-shape gather: a process's texts travel as one UTF-8 buffer of at most ``limit`` bytes
  (newlines inside a text become spaces; what does not fit is cut, a cut character dropped).
  """
  if not multi_process():
    return list(texts)
  data = "\n".join(t.replace("\n", " ") for t in texts).encode()[:limit]
  mine = np.zeros(limit + 1, np.int32)
  mine[0] = len(data)
  mine[1 : 1 + len(data)] = np.frombuffer(data, np.uint8)
  out = []
  for row in gather(mine):
    text = bytes(row[1 : 1 + int(row[0])].astype(np.uint8)).decode(errors="ignore")
    out.extend(t for t in text.split("\n") if t)
  return out


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier ``name``."""
  if multi_process():
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
  """True on every process if ``flag`` is true on any."""
  if not multi_process():
    return bool(flag)
  return bool(np.any(gather(np.array([bool(flag)]))))


def broadcast(values: np.ndarray) -> np.ndarray:
  """Process 0's ``values`` on every process (same shape and dtype on all)."""
  if not multi_process():
    return np.asarray(values)
  return gather(values)[0]


def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """``jax.device_put(x, sharding)`` that also takes a local array onto a mesh spanning other processes
  (through the host: every process passes the same value, as for a numpy array)."""
  if multi_process() and isinstance(x, jax.Array) and x.is_fully_addressable and not sharding.is_fully_addressable:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      impl = jax.random.key_impl(x)
      return jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(x)), sharding), impl=impl)
    x = np.asarray(x)
  return jax.device_put(x, sharding)


def to_host(x: Any) -> Any:
  """A pytree's arrays as numpy, whole on every process (a global array is gathered where it spans
  other processes' devices; a fully replicated one is read locally)."""

  def one(a):
    if not isinstance(a, jax.Array) or a.is_fully_addressable:
      return np.asarray(a)
    if a.is_fully_replicated:
      return np.asarray(a.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))

  return jax.tree.map(one, x)


def local_rows(x: Any) -> np.ndarray:
  """The sorted global indices of the rows (axis 0) of ``x`` held by this process's devices: all rows of
  a host value or a fully addressable array."""
  n = x.shape[0]
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.arange(n)
  spans = [np.arange(*(s.index[0].indices(n) if s.index else (0, n, 1))) for s in x.addressable_shards]
  return np.unique(np.concatenate(spans)).astype(np.int64)


def local_data(x: Any, rows: np.ndarray) -> np.ndarray:
  """The values of ``rows`` (this process's, from :func:`local_rows`) of a row-sharded array."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)[rows]
  out = np.empty((len(rows), *x.shape[1:]), x.dtype)
  for shard in x.addressable_shards:
    start, stop, _ = shard.index[0].indices(x.shape[0])
    out[np.searchsorted(rows, np.arange(start, stop))] = np.asarray(shard.data)
  return out


def gather_rows(n: int, rows: np.ndarray, values: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Whole ``[n]`` arrays on every process from each process's ``values`` of its own ``rows``, in one gather.

  Every process passes the same number of 1-D arrays of the same dtypes (float32, bool or small ints,
  which float64 holds exactly); rows held by several processes (replicas) must have equal values there.
  """
  table = np.zeros((n, len(values) + 1), np.float64)
  table[rows, 0] = 1.0  # which rows this process filled
  for i, v in enumerate(values):
    table[rows, i + 1] = v
  everyone = gather(table) if multi_process() else table[None]
  owner = np.argmax(everyone[:, :, 0] > 0, axis=0)  # the first process holding each row
  merged = everyone[owner, np.arange(n)]
  return [merged[:, i + 1].astype(v.dtype) for i, v in enumerate(values)]
