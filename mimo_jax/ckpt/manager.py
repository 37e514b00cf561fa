"""Orbax ``CheckpointManager`` over the train state, with JSON metadata beside it.

On-disk layout (one directory per checkpointed step, committed atomically by Orbax:
a killed save leaves ``<step>.orbax-checkpoint-tmp*`` which is never read)::

    <run_dir>/checkpoints/<step>/state/     # the array pytree (params, opt state, rng key data, ...)
    <run_dir>/checkpoints/<step>/meta/      # JSON: step, phase, data position, config digest, ...

PRNG keys are stored as their ``key_data`` (uint32) so any key implementation restores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores ``(state pytree, metadata dict)`` pairs by step.

  Args:
    directory: where step directories live.
    keep_last: how many of the newest checkpoints to keep.
    async_save: let saves run in the background (``wait`` before relying on them).
  """

  def __init__(self, directory: str, *, keep_last: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep_last, create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True
    )
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
    """Starts saving ``state`` (arrays) and ``meta`` (JSON-able) as ``step``."""
    self._mgr.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))),
      force=True,
    )

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores ``step`` into the shapes/dtypes/shardings of ``abstract_state``."""
    restored = self._mgr.restore(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
    )
    return restored.state, dict(restored.meta)

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()


def abstract_like(tree: Any) -> Any:
  """``ShapeDtypeStruct``s (with shardings) matching a concrete pytree."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
