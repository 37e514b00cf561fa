"""``xla``: blockwise ``fori_loop`` over vocabulary blocks; the forward accumulators and the backward pass.

The backward pass here is shared by every implementation (the Pallas kernels are forward-only): per vocabulary
block it recomputes the logits, the probabilities ``p = exp(l - lse)`` and ``dL/dz`` (see the package docstring),
then ``dhidden += dz @ w_blk^T`` (a float32 ``[N, H]`` accumulator) and ``dw_blk = hidden^T @ dz``, written once
into ``dw`` in the weight's dtype (a column's gradient is complete after its block, so there is no float32
``[H, V]`` accumulator: at H = 4096, V = 128256 that would be 2 GiB). The matmuls run in the inputs' dtype with float32
accumulation (bf16 tensor-core matmuls for bf16 weights, like autodiff of a bf16 matmul; float32 on CPU, whose
runtime has no bf16 x bf16 -> f32 dot for some loop shapes); ``dz`` itself is float32.

The last block is a window shifted back to end at ``V`` with its already-counted columns masked, so
``w_unembed`` is never padded or copied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mimo_jax.kernels.fused_logprobs.common import Acc, BlockSizes, init_acc, online_update

DEFAULT_BLOCK_SIZES = BlockSizes(block_v=2048)


def _vocab_window(b: jax.Array, bv: int, v: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Start column of block ``b``, its column ids ``[1, bv]`` and the not-yet-counted mask ``[1, bv]``."""
  start = jnp.minimum(b * bv, v - bv)
  cols = start + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
  return start, cols, cols >= b * bv


def accumulate(
  hidden: jax.Array, w: jax.Array, targets: jax.Array, inv_temp: jax.Array, block_sizes: BlockSizes
) -> Acc:
  """(m, s, u, t) accumulators, float32 ``[N]``, over the columns of ``w`` (logits times ``inv_temp [N]``).

  Targets outside ``[0, V)`` match no column (their ``t`` stays 0): a vocabulary shard passes global targets
  minus its column offset.
  """
  n, v = hidden.shape[0], w.shape[1]
  bv = min(block_sizes.block_v, v)
  tgt = targets.astype(jnp.int32)
  scale = inv_temp.astype(jnp.float32)[:, None]

  def body(b, acc):
    start, cols, valid = _vocab_window(b, bv, v)
    w_blk = lax.dynamic_slice_in_dim(w, start, bv, axis=1)  # [H, bv]
    logits = jnp.dot(hidden, w_blk, preferred_element_type=jnp.float32) * scale  # [N, bv]
    return online_update(acc, logits, valid, cols, tgt)

  return lax.fori_loop(0, -(-v // bv), body, init_acc((n,)))


def backward(
  hidden: jax.Array,
  w: jax.Array,
  targets: jax.Array,
  lse: jax.Array,
  mu: jax.Array,
  g_lp: jax.Array,
  g_ent: jax.Array,
  inv_temp: jax.Array,
  block_sizes: BlockSizes,
) -> tuple[jax.Array, jax.Array]:
  """Blockwise (dhidden ``[N, H]`` float32, dw ``[H, V]`` in ``w``'s dtype), recomputing probabilities from ``lse``."""
  v = w.shape[1]
  bv = min(block_sizes.block_v, v)
  mm_dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.promote_types(hidden.dtype, w.dtype)
  tgt = targets.astype(jnp.int32)[:, None]
  lse, mu, g_lp, g_ent, scale = (x.astype(jnp.float32)[:, None] for x in (lse, mu, g_lp, g_ent, inv_temp))
  hidden_t = hidden.astype(mm_dtype).T

  def body(b, carry):
    dh, dw = carry
    start, cols, valid = _vocab_window(b, bv, v)
    w_blk = lax.dynamic_slice_in_dim(w, start, bv, axis=1)  # [H, bv]
    logits = jnp.dot(hidden, w_blk, preferred_element_type=jnp.float32) * scale  # [N, bv]
    p = jnp.where(valid, jnp.exp(logits - lse), 0.0)
    onehot = (valid & (cols == tgt)).astype(jnp.float32)
    dz = ((onehot * g_lp - p * (g_lp + g_ent * (logits - mu))) * scale).astype(mm_dtype)  # dL/d(h @ w)
    dh = dh + jnp.dot(dz, w_blk.astype(mm_dtype).T, preferred_element_type=jnp.float32)  # [N, H]
    dw_blk = jnp.dot(hidden_t, dz, preferred_element_type=jnp.float32).astype(dw.dtype)  # [H, bv]
    # Every column is complete after its one block: write it once (the shifted tail keeps the columns it overlaps).
    dw_blk = jnp.where(valid, dw_blk, lax.dynamic_slice_in_dim(dw, start, bv, axis=1))
    return dh, lax.dynamic_update_slice_in_dim(dw, dw_blk, start, axis=1)

  init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
  return lax.fori_loop(0, -(-v // bv), body, init)
