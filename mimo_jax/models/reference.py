"""The frozen reference policy in less memory: a lower-precision copy, int8 weights, or host memory.

The reference is read once per RL step (the score pass's reference log-probs) and never updated, so
it need not be stored like the trained weights:

- ``--reference_dtype=bfloat16``: every floating parameter cast to bf16 (half of f32).
- ``--reference_dtype=int8``: weight-only int8.  Every floating parameter with two or more
  dimensions is stored as ``round(w / s)`` in int8 with ``s = max|w| / 127`` taken over axis -2,
  one scale per index of the other axes.  The parameters are stacked over layers, so this is the
  contraction axis of the MLP and output projections (``[L, F, D]``, ``[L, H, D]`` of
  ``[L, N, H, D]``) and of an untied head, but for q/k/v (``[L, D, N, H]``) it is the head axis (a
  scale per layer, input channel and head dimension, shared by the heads), for the embedding
  (``[V, D]``) the vocabulary axis, and for the stacked norm scales and biases (``[L, D]``,
  ``[L, N, H]``) the layer or head axis.  Only unstacked vectors (the final norm's scale) stay in
  the policy's dtype.  About a quarter of f32 overall (on the tiny preset's one KV head, ``w_k``
  holds more bytes than in f32: its scale has as many entries as the weight).  The score pass
  dequantises to the policy's dtype before its forward pass; the log-prob error this costs is
  measured in the tests.
- ``--reference_offload=host``: the reference lives in host memory (memory kind ``pinned_host``)
  and is copied to the devices inside the learner program, for the score pass only.

:func:`make_reference` builds it from the policy's weights at the SFT -> RL transition;
:func:`dense_reference` gives back ordinary parameters inside the learner program.  Both keep every
array on the policy's mesh layout (scales drop the sharding of their size-1 axis).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["HOST", "Int8Weight", "abstract_reference", "dense_reference", "make_reference", "reference_bytes"]

HOST = "pinned_host"


@flax.struct.dataclass
class Int8Weight:
  """A weight-only int8 tensor: ``w ~= q * scale``, ``scale`` taken over axis -2 (see the module docstring)."""

  q: jax.Array
  scale: jax.Array


def _is_weight(x: Any) -> bool:
  return isinstance(x, Int8Weight)


def _scale_sharding(s: Any, ndim: int) -> Any:
  if not isinstance(s, NamedSharding):
    return s
  spec = list(s.spec) + [None] * (ndim - len(s.spec))
  spec[-2] = None
  return NamedSharding(s.mesh, PartitionSpec(*spec), memory_kind=s.memory_kind)


def _quantize(w: jax.Array) -> Int8Weight:
  w32 = w.astype(jnp.float32)
  scale = jnp.max(jnp.abs(w32), axis=-2, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return Int8Weight(q=q, scale=scale)


def _convert(x: jax.Array, dtype: str) -> Any:
  # A leaf kept as it is is copied (``copy``, not the input itself): the policy's buffers are donated.
  if not jnp.issubdtype(x.dtype, jnp.floating) or not dtype or jnp.dtype(dtype) == x.dtype:
    return jnp.copy(x)
  if dtype == "int8":
    return _quantize(x) if x.ndim >= 2 else jnp.copy(x)
  return x.astype(jnp.dtype(dtype))


def _shardings(params: Any, dtype: str, memory_kind: str | None) -> Any:
  def one(x):
    s = x.sharding
    if isinstance(s, NamedSharding) and memory_kind is not None:
      s = s.with_memory_kind(memory_kind)
    if dtype == "int8" and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2:
      return Int8Weight(q=s, scale=_scale_sharding(s, x.ndim))
    return s

  return jax.tree.map(one, params)


def make_reference(params: Any, *, dtype: str = "", offload: str = "none") -> Any:
  """The frozen reference of ``params`` (a copy: the policy's buffers are donated to later steps).

  Args:
    params: the warm-started policy's parameters (on the mesh).
    dtype: ``""`` (the policy's), ``float32``, ``bfloat16`` or ``int8``.
    offload: ``none`` or ``host``.
  """
  memory_kind = HOST if offload == "host" else None
  shardings = _shardings(params, dtype, memory_kind)
  return jax.jit(lambda p: jax.tree.map(lambda x: _convert(x, dtype), p), out_shardings=shardings)(params)


def abstract_reference(abstract_params: Any, *, dtype: str = "", offload: str = "none") -> Any:
  """``make_reference``'s result as ``ShapeDtypeStruct`` s with shardings (restore targets, dry runs)."""
  memory_kind = HOST if offload == "host" else None
  shardings = _shardings(abstract_params, dtype, memory_kind)
  shapes = jax.eval_shape(lambda p: jax.tree.map(lambda x: _convert(x, dtype), p), abstract_params)
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    shapes,
    shardings,
    is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
  )


def dense_reference(reference: Any, like: Any, *, offload: str = "none") -> Any:
  """Ordinary parameters shaped and typed like ``like`` (the policy's) from a reference (inside ``jit``):
  moved to device memory first when offloaded, dequantised or cast to the policy's dtypes."""

  def one(r, p):
    if offload == "host":
      r = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), r)
    if isinstance(r, Int8Weight):
      return (r.q.astype(jnp.float32) * r.scale).astype(p.dtype)
    return r.astype(p.dtype)

  return jax.tree.map(one, reference, like, is_leaf=_is_weight)


def reference_bytes(reference: Any) -> int:
  """Total bytes of a reference (all shards; for reports)."""
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(reference))
