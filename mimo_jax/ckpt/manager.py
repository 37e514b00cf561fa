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

import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from mimo_jax import multihost
from mimo_jax.ckpt import schema


class CheckpointCorrupted(RuntimeError):
  """A checkpoint that cannot be read back intact."""


def _path_str(path) -> str:
  return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


@jax.jit
def _shard_checksum(x: jax.Array, offsets: jax.Array, strides: jax.Array) -> jax.Array:
  """Sum over the elements of one shard of bits * odd(global position), mod 2^32, on the shard's device.

  ``offsets``: where the shard starts in the global array, per axis; ``strides``: the global array's
  row-major strides; both uint32, so the global position is made here, in uint32 arithmetic (exact
  mod 2^32, all the weight uses): nothing of the shard's size is built on the host or copied over.
  """
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  flat_index = jnp.zeros(x.shape, jnp.uint32)
  for axis in range(x.ndim):
    flat_index = flat_index + (offsets[axis] + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)) * strides[axis]
  width = x.dtype.itemsize
  bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width])
  if width == 8:  # two uint32 words per element
    bits = bits.reshape(flat_index.shape + (2,))
    flat_index = flat_index[..., None] * 2 + jnp.arange(2, dtype=jnp.uint32)
  weights = (flat_index * jnp.uint32(2654435761)) | jnp.uint32(1)
  return jnp.sum(bits.astype(jnp.uint32) * weights, dtype=jnp.uint32)


def _row_major_strides(shape: tuple[int, ...]) -> np.ndarray:
  """A global array's row-major element strides, mod 2^32."""
  strides = np.cumprod((1,) + tuple(shape[::-1])[:-1], dtype=np.uint64)[::-1] if shape else np.zeros(0, np.uint64)
  return (strides % (1 << 32)).astype(np.uint32)


def _shard_checksums(x: Any) -> tuple[list[jax.Array], int]:
  """This process's part of an array's layout-independent checksum: one uint32 device scalar per block it
  counts, each computed on the block's own device by a one-device program, so no collective runs beside
  a background save or another thread's program; and the bytes of those blocks.  Each block counts once
  over all processes: on the process holding the lowest-id device among its replicas; :func:`fingerprint`
  adds the processes' parts."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    if not multihost.is_primary():  # a host value, the same on every process: counted once, on process 0
      return [], 0
    x = jnp.asarray(x)
  owner: dict[tuple, int] = {}
  if not x.is_fully_addressable:
    for device, index in x.sharding.devices_indices_map(x.shape).items():
      key = tuple(sl.indices(n) for sl, n in zip(index, x.shape, strict=True))
      owner[key] = min(owner.get(key, device.id), device.id)
  strides = _row_major_strides(x.shape)
  seen, parts, nbytes = set(), [], 0
  for shard in x.addressable_shards:
    key = tuple(sl.indices(n) for sl, n in zip(shard.index, x.shape, strict=True))
    if key in seen or owner.get(key, shard.device.id) != shard.device.id:  # a replica counted elsewhere
      continue
    seen.add(key)
    offsets = np.asarray([start % (1 << 32) for start, _, _ in key], np.uint32)
    parts.append(_shard_checksum(shard.data, offsets, strides))
    nbytes += shard.data.nbytes
  return parts, nbytes


# How many bytes of its blocks a process sums before :func:`fingerprint` waits for their sums.
_FETCH_BYTES = 64 << 20


def fingerprint(tree: Any) -> dict[str, int]:
  """``{path: uint32 checksum}`` of every array in ``tree``, the same on every process of a multi-process
  run (the processes' parts are added with one gather).

  The blocks' sums are dispatched, then fetched together once every ``_FETCH_BYTES`` of this process's
  blocks: one wait for a small state, one per ``_FETCH_BYTES`` of a process's share of a large one, while
  XLA:CPU, which keeps each block's weighted bits as a temporary (an unsigned sum is not fused with what
  it sums), never holds more than about that much of them.
  """
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  names = [_path_str(p) for p, _ in with_paths]
  fetched, pending, pending_bytes = [], [], 0
  for _, x in with_paths:
    parts, nbytes = _shard_checksums(x)
    pending.append(parts)
    pending_bytes += nbytes
    if pending_bytes >= _FETCH_BYTES:
      fetched += jax.device_get(pending)
      pending, pending_bytes = [], 0
  fetched += jax.device_get(pending)
  parts = np.asarray([sum(int(v) for v in vs) % (1 << 32) for vs in fetched], np.uint64)
  if multihost.multi_process() and len(parts):
    every = multihost.gather(parts.astype(np.int64)).astype(np.uint64)
    parts = every.sum(axis=0) % np.uint64(1 << 32)
  return {name: int(v) for name, v in zip(names, parts, strict=True)}


class Checkpointer:
  """Saves and restores ``(state pytree, metadata dict)`` pairs by step.

  Args:
    directory: where step directories live.
    keep_last: how many of the newest checkpoints to keep.
    keep_every: also keep every step divisible by this (0: none).
    async_save: let saves run in the background (``wait`` before relying on them).
    read_only: open for reading only: nothing is created, saved or deleted (partial saves
      are left alone; they may belong to a live trainer).
  """

  def __init__(
    self, directory: str, *, keep_last: int = 3, keep_every: int = 0, async_save: bool = True, read_only: bool = False
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
      options = ocp.CheckpointManagerOptions(
        max_to_keep=keep_last,
        keep_period=keep_every or None,
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
    """
    error = None
    try:
      restored = self._mgr.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
      )
      meta = schema.upgrade(dict(restored.meta))
    except schema.SchemaError as e:
      error = CheckpointCorrupted(f"checkpoint {step}: {e}")
    except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable
      error = CheckpointCorrupted(f"checkpoint {step} could not be read: {type(e).__name__}: {e}")
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
    meta = self.read_meta(step)
    path = os.path.join(self.directory, str(step), "state")
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
      raise CheckpointCorrupted(f"checkpoint {step} could not be read: {type(e).__name__}: {e}") from e
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
    """
    for step in reversed(self.all_steps()):
      if at_most is not None and step > at_most:
        continue
      try:
        target = abstract_state(self.read_meta(step)) if callable(abstract_state) else abstract_state
        state, meta = self.restore(step, target)
      except Exception as e:  # noqa: BLE001 - any unreadable step is skipped the same way
        why = (
          str(e) if isinstance(e, CheckpointCorrupted) else f"checkpoint {step} is unreadable ({type(e).__name__}: {e})"
        )
        logging.error("%s; falling back to an earlier checkpoint", why)
        print(f"warning: {why}; falling back to an earlier checkpoint", flush=True)
        continue
      return step, state, meta
    return None

  def delete_after(self, step: int) -> None:
    """Deletes every checkpoint newer than ``step`` (used by rollback)."""
    if self.read_only:
      raise PermissionError(f"{self.directory}: opened read-only")
    self.wait()
    for s in self.all_steps():
      if s > step:
        self._mgr.delete(s)

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
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
