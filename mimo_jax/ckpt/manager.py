"""Transactional Orbax checkpoints of the whole RL state.

On-disk layout (one directory per checkpointed step, committed atomically by Orbax: a
killed save leaves ``<step>.orbax-checkpoint-tmp*``, which is never read and is
cleaned up by the next manager)::

    <run_dir>/checkpoints/<step>/state/   # Orbax pytree: params, optimizer state, controller
                                          # scalars, PRNG key data (uint32), step counters
    <run_dir>/checkpoints/<step>/meta/    # JSON, validated against checkpoints_schema/:
                                          # phase, step, data-sampler RNG state, buffer
                                          # metadata, per-array fingerprints, ...

A step is either fully there or absent.  On restore, every array's fingerprint (a
uint32 checksum of its bits, computed on device at save time) is recomputed and
compared, so a truncated or corrupted file is detected; :meth:`Checkpointer.restore_latest`
then falls back to the previous step and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mimo_jax import multihost
from mimo_jax.ckpt import schema
from mimo_jax.config_base import ConfigError


class CheckpointCorrupted(RuntimeError):
  """A checkpoint that cannot be read back intact."""


class CheckpointMismatch(ConfigError):
  """An intact checkpoint of another state than the one asked for: other entries, shapes or dtypes (a
  setting that shapes the state changed since it was written).  Never skipped or set aside as unreadable."""


def layout_differences(stored: Any, target: Any, limit: int = 3) -> list[str]:
  """How an Orbax tree's stored array metadata and a restore target differ: entries only one has, and
  shapes or dtypes (at most ``limit`` of them, then a count); [] when they agree."""
  have, want = ocp.tree.to_flat_dict(stored), ocp.tree.to_flat_dict(target)
  out = [f"{_path_str(k)}: stored, not built" for k in sorted(set(have) - set(want), key=str)]
  out += [f"{_path_str(k)}: built, not stored" for k in sorted(set(want) - set(have), key=str)]
  for k in sorted(set(have) & set(want), key=str):
    a, b = have[k], want[k]
    a_shape, b_shape = tuple(getattr(a, "shape", ()) or ()), tuple(getattr(b, "shape", ()) or ())
    a_dtype, b_dtype = getattr(a, "dtype", None), getattr(b, "dtype", None)
    if a_shape != b_shape:
      out.append(f"{_path_str(k)}: stored shape {a_shape}, built {b_shape}")
    elif a_dtype is not None and b_dtype is not None and np.dtype(a_dtype) != np.dtype(b_dtype):
      out.append(f"{_path_str(k)}: stored {np.dtype(a_dtype).name}, built {np.dtype(b_dtype).name}")
  return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


def _unreadable(step: int, e: BaseException) -> CheckpointCorrupted:
  """The error for a read of ``step`` that raised ``e``: its first line, without the TensorStore spec
  Orbax appends (a page of JSON)."""
  _quiet_failed_reads()
  return CheckpointCorrupted(f"checkpoint {step} could not be read: {type(e).__name__}: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
  """An Orbax or TensorStore error's first line, without the TensorStore spec it appends (a page of JSON)."""
  why = str(e).split("\n", 1)[0].split(" See full TensorStore details", 1)[0]
  return why.rstrip(". ") if len(why) <= 300 else why[:300] + "..."


@functools.cache
def _quiet_failed_reads() -> None:
  """Orbax runs a restore's reads as tasks of an event loop that it closes as soon as one read fails.
  The reads still in flight then end in a closed loop (TensorStore's callbacks print "Event loop is
  closed" through ``sys.excepthook`` or, as a bare traceback, ``sys.unraisablehook``), and their coroutines, collected whenever the garbage collector
  runs, print one "Exception ignored" traceback each, with a page of TensorStore spec: dozens, in the
  middle of the resumed run's output, for a failure already reported in one line.  From the first
  restore on (some are collected before the failure reaches its handler), this process leaves those two
  kinds out (every other exception prints as before)."""
  unraisable, excepthook = sys.unraisablehook, sys.excepthook

  def closed_loop(kind, value, tb) -> bool:
    top = tb.tb_frame.f_code.co_filename if tb is not None else ""
    is_closed = kind is RuntimeError and str(value) == "Event loop is closed"
    return is_closed and top.endswith(os.path.join("asyncio", "base_events.py"))

  def quiet_unraisable(u):
    code = getattr(u.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
      return
    # TensorStore reports a callback into the closed loop as an unraisable of no object (a bare traceback).
    if not closed_loop(*(getattr(u, k, None) for k in ("exc_type", "exc_value", "exc_traceback"))):
      unraisable(u)

  def quiet_excepthook(kind, value, tb):
    if not closed_loop(kind, value, tb):
      excepthook(kind, value, tb)

  sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_excepthook
  gc.collect()


class CheckpointWriteFailed(RuntimeError):
  """A checkpoint that could not be written (a full disk, a read-only directory): the steps committed
  before it are intact."""


@contextlib.contextmanager
def _writing(directory: str):
  """Turns a failed write (raised by the save, or by a later wait for an asynchronous one) into one
  :class:`CheckpointWriteFailed` line (a failed write leaves Orbax's tasks in a closed loop as a failed
  read does: their noise kept quiet the same way)."""
  _quiet_failed_reads()
  try:
    yield
  except CheckpointWriteFailed:
    raise
  except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many kinds for one failed write
    raise CheckpointWriteFailed(
      f"{directory}: a checkpoint could not be written ({type(e).__name__}: {_first_line(e)}); the checkpoints committed "
      "before it are intact: free space (or fix the directory) and rerun the same command to resume"
    ) from e


def _path_str(path) -> str:
  return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def _weighted_bits_sum(x: jax.Array, flat_index: jax.Array) -> jax.Array:
  """Sum of ``x``'s bits * odd(``flat_index``), mod 2^32 (``flat_index``: each element's global
  row-major position, uint32)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  width = x.dtype.itemsize
  bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width])
  if width == 8:  # two uint32 words per element
    bits = bits.reshape(flat_index.shape + (2,))
    flat_index = flat_index[..., None] * 2 + jnp.arange(2, dtype=jnp.uint32)
  weights = (flat_index * jnp.uint32(2654435761)) | jnp.uint32(1)
  return jnp.sum(bits.astype(jnp.uint32) * weights, dtype=jnp.uint32)


@jax.jit
def _shard_checksum(x: jax.Array, offsets: jax.Array, strides: jax.Array) -> jax.Array:
  """Sum over the elements of one shard of bits * odd(global position), mod 2^32, on the shard's device.

  ``offsets``: where the shard starts in the global array, per axis; ``strides``: the global array's
  row-major strides; both uint32, so the global position is made here, in uint32 arithmetic (exact
  mod 2^32, all the weight uses): nothing of the shard's size is built on the host or copied over.
  """
  flat_index = jnp.zeros(x.shape, jnp.uint32)
  for axis in range(x.ndim):
    flat_index = flat_index + (offsets[axis] + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)) * strides[axis]
  return _weighted_bits_sum(x, flat_index)


def _row_major_strides(shape: tuple[int, ...]) -> np.ndarray:
  """A global array's row-major element strides, mod 2^32."""
  strides = np.cumprod((1,) + tuple(shape[::-1])[:-1], dtype=np.uint64)[::-1] if shape else np.zeros(0, np.uint64)
  return (strides % (1 << 32)).astype(np.uint32)


def _block_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
  return tuple(sl.indices(n) for sl, n in zip(index, shape, strict=True))


def _shard_checksums(x: Any) -> list[jax.Array]:
  """This process's part of the checksum of an array that is not laid out over a mesh (or not evenly):
  one uint32 device scalar per block it counts, each computed on the block's own device by a one-device
  program.  Each block counts once over all processes: on the process holding the lowest-id device
  among its replicas; :func:`fingerprint` adds the processes' parts."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    if not multihost.is_primary():  # a host value, the same on every process: counted once, on process 0
      return []
    x = jnp.asarray(x)
  owner: dict[tuple, int] = {}
  if not x.is_fully_addressable:
    for device, index in x.sharding.devices_indices_map(x.shape).items():
      key = _block_key(index, x.shape)
      owner[key] = min(owner.get(key, device.id), device.id)
  strides = _row_major_strides(x.shape)
  seen, parts = set(), []
  for shard in x.addressable_shards:
    key = _block_key(shard.index, x.shape)
    if key in seen or owner.get(key, shard.device.id) != shard.device.id:  # a replica counted elsewhere
      continue
    seen.add(key)
    offsets = np.asarray([start % (1 << 32) for start, _, _ in key], np.uint32)
    parts.append(_shard_checksum(shard.data, offsets, strides))
  return parts


def _spec_axes(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
  """The mesh axes each of an array's ``ndim`` dims is split over (major first; () for whole)."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in entries]


def _on_mesh(x: Any) -> bool:
  """Whether ``x`` is laid out over a mesh in device memory, every split dim evenly (a
  :func:`_mesh_checksums` input; an array in host memory, such as an offloaded reference, is not)."""
  if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
    return False
  if x.sharding.memory_kind not in (None, "device"):
    return False
  mesh = x.sharding.mesh
  if not isinstance(mesh, Mesh):
    return False
  splits = _spec_axes(x.sharding.spec, x.ndim)
  return all(n % math.prod(mesh.shape[a] for a in axes) == 0 for n, axes in zip(x.shape, splits, strict=True))


@functools.lru_cache(maxsize=256)
def _mesh_checksums(mesh: Mesh, layout: tuple[tuple[tuple[int, ...], PartitionSpec], ...]) -> Any:
  """One program over ``mesh`` for arrays of ``layout`` (global shape, spec): every device sums its own
  block of each (bits * odd(global position), mod 2^32; the block's offsets from its mesh coordinates),
  and returns its sums, concatenated over the devices in the mesh's order: ``[mesh.size * len(layout)]``,
  uint32.  Nothing is communicated between devices, so no collective runs beside a background save or
  another thread's program; replicas are told apart on the host (:func:`_counted_here`)."""

  def per_device(*blocks):
    sums = []
    for x, (shape, spec) in zip(blocks, layout, strict=True):
      strides = _row_major_strides(shape)
      flat_index = jnp.zeros(x.shape, jnp.uint32)
      for axis, axes in enumerate(_spec_axes(spec, x.ndim)):
        block = jnp.uint32(0)
        for name in axes:
          block = block * jnp.uint32(mesh.shape[name]) + jax.lax.axis_index(name).astype(jnp.uint32)
        start = block * jnp.uint32(x.shape[axis] % (1 << 32))
        flat_index = flat_index + (start + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)) * jnp.uint32(
          int(strides[axis])
        )
      sums.append(_weighted_bits_sum(x, flat_index))
    return jnp.stack(sums)

  specs = tuple(spec for _, spec in layout)
  program = jax.shard_map(
    per_device, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(mesh.axis_names), check_vma=False
  )
  return jax.jit(program)


@functools.lru_cache(maxsize=1024)
def _counted_here(sharding: NamedSharding, shape: tuple[int, ...]) -> np.ndarray:
  """Per device of ``sharding``'s mesh (in its order): whether its block of an array of ``shape`` counts,
  i.e. it is the lowest-id device holding that block (a replica elsewhere counts nowhere)."""
  index = sharding.devices_indices_map(shape)
  owner: dict[tuple, int] = {}
  for device, idx in index.items():
    key = _block_key(idx, shape)
    owner[key] = min(owner.get(key, device.id), device.id)
  return np.asarray([owner[_block_key(index[d], shape)] == d.id for d in sharding.mesh.devices.flat])


# How many bytes of its blocks a process sums in one program, or before it waits (:func:`fingerprint`).
_FETCH_BYTES = 64 << 20


def _local_block_bytes(x: jax.Array) -> int:
  return sum(shard.data.nbytes for shard in x.addressable_shards)


def fingerprint(tree: Any) -> dict[str, int]:
  """``{path: uint32 checksum}`` of every array in ``tree``, the same on every process of a multi-process
  run (the processes' parts are added with one gather).

  The arrays laid out over a mesh are summed by one program for them all (:func:`_mesh_checksums`)
  while the blocks this process sums are at most ``_FETCH_BYTES``: one dispatch and one fetch for a small
  state.  A larger state takes one program per array, waited for once per ``_FETCH_BYTES`` of blocks:
  XLA:CPU keeps each block's weighted bits as a temporary (an unsigned sum is not fused with what it
  sums), so it never holds more than about that much of them.  Other arrays (on one device, uncommitted,
  host values, in host memory) take one-device programs per block (:func:`_shard_checksums`).
  """
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  names = [_path_str(p) for p, _ in with_paths]
  leaves = [
    jax.random.key_data(x) if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    for _, x in with_paths
  ]
  groups: dict[Mesh, list[int]] = {}
  others: list[int] = []
  for i, x in enumerate(leaves):
    if _on_mesh(x):
      groups.setdefault(x.sharding.mesh, []).append(i)
    else:
      others.append(i)
  # One program for a mesh's arrays while their blocks here fit the window; past it, one per array: a
  # program per kind of array (shape, layout, dtype), so a large state compiles as few as it has kinds.
  chunks: list[tuple[Mesh, list[int]]] = []
  for mesh, ids in groups.items():
    if sum(_local_block_bytes(leaves[i]) for i in ids) <= _FETCH_BYTES:
      chunks.append((mesh, ids))
    else:
      chunks += [(mesh, [i]) for i in ids]
  other_parts = [_shard_checksums(leaves[i]) for i in others]
  outs, mesh_parts, pending_bytes = [], [], 0
  for mesh, ids in chunks:
    layout = tuple((leaves[i].shape, leaves[i].sharding.spec) for i in ids)
    outs.append(_mesh_checksums(mesh, layout)(*(leaves[i] for i in ids)))
    parts = [s.data for s in outs[-1].addressable_shards]
    pending_bytes += sum(_local_block_bytes(leaves[i]) for i in ids)
    if pending_bytes >= _FETCH_BYTES:  # wait for the programs so far: their temporaries live until they end
      parts, pending_bytes = jax.device_get(parts), 0
    mesh_parts.append(parts)
  fetched_mesh, fetched_other = jax.device_get((mesh_parts, other_parts))
  sums = np.zeros(len(leaves), np.uint64)
  for (_, ids), out, datas in zip(chunks, outs, fetched_mesh, strict=True):
    counted = [_counted_here(leaves[i].sharding, leaves[i].shape) for i in ids]
    for shard, data in zip(out.addressable_shards, datas, strict=True):
      # The device's place in the mesh's order (a one-device mesh's only shard has the index slice(None)).
      device = shard.index[0].indices(out.shape[0])[0] // len(ids)
      for k, i in enumerate(ids):
        if counted[k][device]:
          sums[i] += int(data[k])
  for i, parts in zip(others, fetched_other, strict=True):
    sums[i] += sum(int(v) for v in parts)
  sums %= np.uint64(1 << 32)
  if multihost.multi_process() and len(sums):
    every = multihost.gather(sums.astype(np.int64)).astype(np.uint64)
    sums = every.sum(axis=0) % np.uint64(1 << 32)
  return {name: int(v) for name, v in zip(names, sums, strict=True)}


@dataclasses.dataclass(frozen=True)
class _EveryPhaseStep:
  """Orbax preservation policy: keeps the checkpoints whose phase step (SFT step, or RL step counted from
  checkpoint ``rl_start``) is a multiple of ``every`` (on the checkpoint step, RL step k of a run of S SFT
  steps is kept when ``S + 1 + k`` is a multiple: at the usual settings never, beside ``--checkpoint_every``)."""

  every: int
  rl_start: int

  def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
    del context
    return [(c.step - self.rl_start if c.step >= self.rl_start else c.step) % self.every == 0 for c in checkpoints]


class Checkpointer:
  """Saves and restores ``(state pytree, metadata dict)`` pairs by step.

  Args:
    directory: where step directories live.
    keep_last: how many of the newest checkpoints to keep.
    keep_every: also keep every checkpoint whose phase's step is divisible by this (0: none).
    rl_start: the checkpoint step of RL step 0 (``sft_steps + 1``): a checkpoint's phase step is its
      step below it (SFT), its step minus it from it (RL).
    async_save: let saves run in the background (``wait`` before relying on them).
    read_only: open for reading only: nothing is created, saved or deleted (partial saves
      are left alone; they may belong to a live trainer).
  """

  def __init__(
    self,
    directory: str,
    *,
    keep_last: int = 3,
    keep_every: int = 0,
    rl_start: int = 0,
    async_save: bool = True,
    read_only: bool = False,
  ):
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    if read_only:
      # A reader (evaluation, export, inspection) never deletes or creates anything: a partial
      # save may be a live trainer's save in progress.
      if not os.path.isdir(self.directory):
        raise FileNotFoundError(f"{self.directory}: no checkpoints directory")
      # save_interval_steps=0: what Orbax forces for a reader anyway (it warns on every open otherwise).
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None, save_interval_steps=0)
    else:
      if multihost.is_primary():  # one process tidies the shared directory; the others wait for it
        os.makedirs(self.directory, exist_ok=True)
        self._remove_partial_saves()
      multihost.barrier(f"mimo_jax_checkpointer_open:{self.directory}")
      policies = [ocp.checkpoint_managers.LatestN(n=keep_last)]
      if keep_every:
        policies.append(_EveryPhaseStep(keep_every, rl_start))
      options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        create=True,
        enable_async_checkpointing=async_save,
      )
    self._mgr = ocp.CheckpointManager(
      self.directory,
      options=options,
      item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )

  def _remove_partial_saves(self) -> None:
    """Deletes directories left by saves that were killed before they committed."""
    for name in os.listdir(self.directory):
      if ".orbax-checkpoint-tmp" in name:
        logging.warning("removing partial checkpoint %s (a save that never committed)", name)
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
    """Starts saving ``state`` (arrays) and ``meta`` (schema-validated JSON) as ``step``."""
    if self.read_only:
      raise PermissionError(f"{self.directory}: opened read-only")
    meta = {**meta, "schema_version": schema.SCHEMA_VERSION, "fingerprint": fingerprint(state)}
    schema.validate(meta)
    with _writing(self.directory):
      self._mgr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
      )

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  def resolve_step(self, step: int | None = None) -> int:
    """``step`` if it is a committed checkpoint, the newest one for None.

    Raises:
      FileNotFoundError: no checkpoints, or not ``step`` (the message lists those there are).
    """
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoints")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoint {step}; available: {steps}")
    return step

  def read_meta(self, step: int) -> dict[str, Any]:
    restored = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return schema.upgrade(dict(restored.meta))

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores ``step`` into the shapes/dtypes/shardings of ``abstract_state``.

    Raises:
      CheckpointCorrupted: unreadable files, invalid metadata or a fingerprint mismatch.
      CheckpointMismatch: the step holds other entries, shapes or dtypes than ``abstract_state``.
    """
    error = None
    _quiet_failed_reads()
    try:
      stored = self._mgr.item_metadata(step)["state"]
    except Exception:  # noqa: BLE001 - an unreadable description fails the restore below, as unreadable
      stored = None
    differences = layout_differences(stored, abstract_state) if stored is not None else []
    if differences:  # read from the same files by every process: the same answer everywhere
      raise CheckpointMismatch(
        f"checkpoint {os.path.join(self.directory, str(step))} holds another state than this configuration "
        f"builds ({'; '.join(differences)})"
      )
    try:
      restored = self._mgr.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
      )
      meta = schema.upgrade(dict(restored.meta))
    except schema.SchemaError as e:
      error = CheckpointCorrupted(f"checkpoint {step}: {e}")
    except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable
      error = _unreadable(step, e)
    # Every process takes the same branch (the fingerprint is a collective in a multi-process run).
    if multihost.any_process(error is not None):
      raise error or CheckpointCorrupted(f"checkpoint {step} could not be read by another process")
    got = fingerprint(restored.state)
    bad = [k for k, v in meta["fingerprint"].items() if got.get(k) != v]
    if bad or set(got) != set(meta["fingerprint"]):
      raise CheckpointCorrupted(f"checkpoint {step}: contents do not match their fingerprints ({', '.join(bad[:3])})")
    return restored.state, meta

  def restore_part(self, step: int, abstract_part: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores only some top-level entries of ``step`` (e.g. ``{"params": abstract_params}``), verified
    against their fingerprints; nothing else of the checkpoint is read (no optimizer state for an
    evaluation).

    Raises:
      CheckpointCorrupted: unreadable files, invalid metadata, a missing entry or a fingerprint mismatch.
    """
    try:
      meta = self.read_meta(step)
    except Exception as e:  # noqa: BLE001 - unreadable or invalid metadata means this step is unusable
      raise CheckpointCorrupted(f"checkpoint {step}: metadata could not be read: {type(e).__name__}: {e}") from e
    path = os.path.join(self.directory, str(step), "state")
    _quiet_failed_reads()
    try:
      restored = ocp.PyTreeCheckpointer().restore(
        path,
        args=ocp.args.PyTreeRestore(
          item=dict(abstract_part),
          restore_args=ocp.checkpoint_utils.construct_restore_args(dict(abstract_part)),
          partial_restore=True,
        ),
      )
    except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable
      raise _unreadable(step, e) from None
    got = fingerprint(restored)
    expected = {k: v for k, v in meta["fingerprint"].items() if k.split("/", 1)[0] in abstract_part}
    bad = [k for k, v in expected.items() if got.get(k) != v]
    if bad or set(got) != set(expected):
      raise CheckpointCorrupted(f"checkpoint {step}: contents do not match their fingerprints ({', '.join(bad[:3])})")
    return dict(restored), meta

  def restore_untyped(self, step: int) -> Any:
    """The array tree of ``step`` on this process's first device, whatever mesh saved it
    (for export and inspection)."""
    metadata = self._mgr.item_metadata(step)["state"]
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    restored = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return restored.state

  def restore_untyped_part(self, step: int, names: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Top-level entries ``names`` of ``step`` on this process's first device, whatever mesh saved
    them, verified against their fingerprints (:meth:`restore_part`), and the step's metadata.

    Raises:
      CheckpointCorrupted: unreadable files or metadata, a missing entry or a fingerprint mismatch.
    """
    try:
      metadata = self._mgr.item_metadata(step)["state"]
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      target = {
        name: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata[name])
        for name in names
      }
    except Exception as e:  # noqa: BLE001 - any unreadable description means this step is unusable
      raise CheckpointCorrupted(f"checkpoint {step} could not be read: {type(e).__name__}: {e}") from e
    return self.restore_part(step, target)

  def restore_latest(
    self, abstract_state: Callable[[dict[str, Any]], Any] | Any, *, at_most: int | None = None
  ) -> tuple[int, Any, dict[str, Any]] | None:
    """Restores the newest intact step (``<= at_most``), falling back past corrupted ones.

    Args:
      abstract_state: the restore target, or a function of the step's metadata returning
        it (the target can depend on the phase recorded in the metadata).
      at_most: ignore steps above this.

    Returns:
      ``(step, state, meta)``, or None when no intact checkpoint exists.

    A writer moves the unreadable steps above the one restored to ``<directory>.unreadable/`` (the run
    writes those step numbers again as it continues; the files stay for a look at what went wrong).
    """
    unreadable = []
    for step in reversed(self.all_steps()):
      if at_most is not None and step > at_most:
        continue
      try:
        target = abstract_state(self.read_meta(step)) if callable(abstract_state) else abstract_state
        state, meta = self.restore(step, target)
      except CheckpointMismatch:  # intact, of another configuration: never skipped past or set aside
        raise
      except Exception as e:  # noqa: BLE001 - any unreadable step is skipped the same way
        why = (
          str(e) if isinstance(e, CheckpointCorrupted) else f"checkpoint {step} is unreadable ({type(e).__name__}: {e})"
        )
        logging.error("%s; falling back to an earlier checkpoint", why)
        print(f"warning: {why}; falling back to an earlier checkpoint", flush=True)
        unreadable.append(step)
        continue
      if unreadable and not self.read_only:
        self._set_aside(unreadable)
      return step, state, meta
    return None

  def _set_aside(self, steps: Sequence[int]) -> None:
    aside = f"{self.directory}.unreadable"
    if multihost.is_primary():
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        to, n = os.path.join(aside, str(step)), 1
        while os.path.lexists(to):  # one set aside before under that number
          to, n = os.path.join(aside, f"{step}.{n}"), n + 1
        os.rename(os.path.join(self.directory, str(step)), to)
        print(f"warning: unreadable checkpoint {step} moved to {to} (the run writes step {step} again)", flush=True)
    multihost.barrier(f"mimo_jax_checkpointer_set_aside:{self.directory}")
    self._mgr.reload()

  def delete_after(self, step: int) -> None:
    """Deletes every checkpoint newer than ``step`` (used by rollback)."""
    if self.read_only:
      raise PermissionError(f"{self.directory}: opened read-only")
    self.wait()
    for s in self.all_steps():
      if s > step:
        self._mgr.delete(s)

  def wait(self) -> None:
    with _writing(self.directory):
      self._mgr.wait_until_finished()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._mgr.close()


def abstract_like(tree: Any, mesh: jax.sharding.Mesh | None = None) -> Any:
  """``ShapeDtypeStruct``s (with shardings) matching a concrete pytree.

  With ``mesh``, leaves that are not laid out on a named mesh (scalars, PRNG key data)
  are restored replicated over it, so every restored array lives on the same devices.
  """

  def one(x):
    sharding = getattr(x, "sharding", None)
    if mesh is not None and not isinstance(sharding, jax.sharding.NamedSharding):
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(one, tree)
