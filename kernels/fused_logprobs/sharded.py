"""Vocabulary-parallel (and row-parallel) ``fused_logprobs`` under ``shard_map``.

``w_unembed`` is split on V over the mesh axis ``axis`` (``PartitionSpec(None, axis)``) and the rows over
``batch_axes``. Each device runs a blockwise implementation (``xla`` or a Pallas kernel) over its rows and its
vocabulary slice, with targets shifted by the slice's first column (a target outside the slice matches nothing).
The partial accumulators merge across ``axis`` with ``pmax`` then rescaled ``psum`` (``combine_partials``).
Backward, each device computes its ``dhidden`` contribution (``psum`` over ``axis``) and its ``dw`` slice from its
rows (``psum`` over ``batch_axes``). Nothing ``[N, V]``-sized is formed and the unembedding is never gathered
across ``axis``; an unembedding also sharded on H (FSDP) is gathered over that axis on entry, as any matmul with
it would be.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mimo_jax.kernels.fused_logprobs import xla
from mimo_jax.kernels.fused_logprobs.api import Impl, accumulate, backward_sizes, resolve_block_sizes, resolve_impl
from mimo_jax.kernels.fused_logprobs.common import (
  BlockSizes,
  LogprobStats,
  combine_partials,
  finalize,
  k3_kl,
  row_inv_temperature,
  validate,
)


def _specs(axis: str | None, batch_axes: tuple[str, ...]) -> tuple[P, P, P]:
  """(hidden, w, per-row) PartitionSpecs."""
  rows = batch_axes if batch_axes else None
  return P(rows, None), P(None, axis), P(rows)


def _col_offset(axis: str | None, local_v: int):
  return 0 if axis is None else lax.axis_index(axis) * local_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _sharded_stats(hidden, w, targets, inv_temp, mesh, axis, batch_axes, impl, sizes, interpret):
  return _sharded_fwd(hidden, w, targets, inv_temp, mesh, axis, batch_axes, impl, sizes, interpret)[0]


def _sharded_fwd(hidden, w, targets, inv_temp, mesh, axis, batch_axes, impl, sizes, interpret):
  def local(h, w_loc, tgt, inv):
    acc = accumulate(impl, h, w_loc, tgt - _col_offset(axis, w_loc.shape[1]), inv, sizes, interpret)
    if axis is not None:
      acc = combine_partials(acc, lambda x: lax.pmax(x, axis), lambda x: lax.psum(x, axis))
    return finalize(*acc)

  h_spec, w_spec, row_spec = _specs(axis, batch_axes)
  fn = jax.shard_map(
    local, mesh=mesh, in_specs=(h_spec, w_spec, row_spec, row_spec), out_specs=(row_spec,) * 4, check_vma=False
  )
  logprobs, entropy, lse, mu = fn(hidden, w, targets, inv_temp)
  return (logprobs, entropy), (hidden, w, targets, inv_temp, lse, mu)


def _sharded_bwd(mesh, axis, batch_axes, impl, sizes, interpret, res, cts):
  del impl, interpret
  hidden, w, targets, inv_temp, lse, mu = res

  def local(h, w_loc, tgt, inv, lse_, mu_, g_lp, g_ent):
    tgt = tgt - _col_offset(axis, w_loc.shape[1])
    dh, dw = xla.backward(h, w_loc, tgt, lse_, mu_, g_lp, g_ent, inv, backward_sizes(sizes))
    if axis is not None:
      dh = lax.psum(dh, axis)
    if batch_axes:
      dw = lax.psum(dw, batch_axes)
    return dh, dw

  h_spec, w_spec, row_spec = _specs(axis, batch_axes)
  fn = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(h_spec, w_spec, row_spec, row_spec, row_spec, row_spec, row_spec, row_spec),
    out_specs=(h_spec, w_spec),
    check_vma=False,
  )
  dh, dw = fn(hidden, w, targets, inv_temp, lse, mu, *cts)
  return dh.astype(hidden.dtype), dw.astype(w.dtype), None, None


_sharded_stats.defvjp(_sharded_fwd, _sharded_bwd)


def _validate_mesh(mesh: Mesh, axis: str | None, batch_axes: tuple[str, ...], n: int, v: int, w_shape) -> None:
  for name in ((axis,) if axis else ()) + batch_axes:
    if name not in mesh.shape:
      raise ValueError(f"axis {name!r} is not a mesh axis; mesh axes are {tuple(mesh.shape)}")
  if axis is not None and axis in batch_axes:
    raise ValueError(f"axis {axis!r} cannot shard both the vocabulary and the rows (batch_axes={batch_axes})")
  if axis is not None and v % mesh.shape[axis]:
    raise ValueError(
      f"w_unembed V={v} (shape {w_shape}) must be divisible by mesh axis {axis!r} of size {mesh.shape[axis]}"
    )
  rows = math.prod(mesh.shape[a] for a in batch_axes)
  if n % rows:
    raise ValueError(f"N={n} rows must be divisible by the batch axes {batch_axes} (size {rows})")


@functools.partial(
  jax.jit, static_argnames=("mesh", "axis", "batch_axes", "temperature", "impl", "block_sizes", "interpret")
)
def fused_logprobs_sharded(
  hidden: jax.Array,
  w_unembed: jax.Array,
  targets: jax.Array,
  mesh: Mesh,
  *,
  axis: str | None = "tensor",
  batch_axes: tuple[str, ...] = (),
  temperature: float = 1.0,
  ref_logprobs: jax.Array | None = None,
  row_temperature: jax.Array | None = None,
  impl: Impl = "auto",
  block_sizes: BlockSizes | None = None,
  interpret: bool = False,
) -> LogprobStats:
  """``fused_logprobs`` with the vocabulary split over ``axis`` and the rows over ``batch_axes``.

  Args:
    hidden: ``[N, H]`` bf16 or f32; N divisible by the product of the ``batch_axes`` sizes.
    w_unembed: ``[H, V]`` bf16 or f32; V divisible by ``mesh.shape[axis]``.
    targets: ``[N]`` integer ids in ``[0, V)``.
    mesh: the device mesh (static).
    axis: mesh axis over which V is split, or None (each device holds all of V).
    batch_axes: mesh axes over which the rows are split (hidden, targets and outputs); ``()`` replicates them.
    temperature: static positive float.
    ref_logprobs: optional ``[N]``; enables ``kl``.
    row_temperature: optional ``[N]`` per-row temperatures (as in ``fused_logprobs``), sharded like the rows.
    impl: the per-device implementation (as in ``fused_logprobs``; ``reference`` is not blockwise and is refused).
    block_sizes: static tile sizes; ``None`` fields take the implementation's defaults.
    interpret: run a Pallas kernel in interpret mode (needed on CPU).

  Returns:
    ``LogprobStats`` of float32 ``[N]`` arrays sharded like the rows; differentiable w.r.t. ``hidden`` and
    ``w_unembed``.
  """
  validate(hidden, w_unembed, targets, ref_logprobs, temperature, row_temperature)
  batch_axes = tuple(batch_axes)
  _validate_mesh(mesh, axis, batch_axes, hidden.shape[0], w_unembed.shape[1], w_unembed.shape)
  impl = resolve_impl(impl)
  if impl == "reference":
    raise ValueError("fused_logprobs_sharded needs a blockwise impl ('auto', 'xla', 'pallas*'), got 'reference'")
  sizes = resolve_block_sizes(impl, block_sizes)
  inv_temp = row_inv_temperature(hidden.shape[0], temperature, row_temperature)
  logprobs, entropy = _sharded_stats(
    hidden, w_unembed, targets, inv_temp, mesh, axis, batch_axes, impl, sizes, interpret
  )
  kl = None if ref_logprobs is None else k3_kl(ref_logprobs, logprobs)
  return LogprobStats(logprobs, entropy, kl)
