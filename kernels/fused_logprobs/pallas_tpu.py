"""``pallas_tpu``: the forward kernel for TPU (Mosaic), a tiled matmul with an online-softmax epilogue.

Grid ``(N / block_n, V / block_v, H / block_h)``, row blocks parallel, the other two sequential ("arbitrary"):

- the contraction axis (last, fastest) accumulates ``hidden[i, k] @ w[k, j]`` into a float32 VMEM scratch tile
  ``[block_n, block_v]``;
- at the last contraction step the tile is one block of logits; it is folded into the row block's accumulators,
  which live in the output blocks (their index map is constant along ``j`` and ``k``, so they stay resident in
  VMEM across the whole vocabulary sweep and are written back once per row block).

This relies on TPU grid semantics (sequential iteration in row-major order), which interpret mode shares; GPU
programs run concurrently, hence the separate ``pallas_gpu`` kernel. Accumulators use the 2-D ``[block_n, 1]``
layout. A block is clamped to the next power of two of a smaller dimension. N and V are not padded (that would
copy ``w_unembed``): the grid is rounded up, the last row / vocabulary block is a partial edge block, its
out-of-range vocabulary columns are masked to ``-inf`` and its out-of-range rows are never written back. H is
zero-padded to a block multiple (padded H columns contribute zeros).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mimo_jax.kernels.fused_logprobs.common import (
  M_INIT,
  Acc,
  BlockSizes,
  online_update,
  pad_to,
  pow2_block,
  round_up,
)

DEFAULT_BLOCK_SIZES = BlockSizes(block_n=256, block_v=512, block_h=512)


def _kernel(h_ref, w_ref, t_ref, it_ref, m_ref, s_ref, u_ref, tl_ref, logits_ref, *, block_v, v, num_h_blocks):
  j, k = pl.program_id(1), pl.program_id(2)

  @pl.when((j == 0) & (k == 0))
  def _init_acc():
    m_ref[...] = jnp.full(m_ref.shape, M_INIT, jnp.float32)
    s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
    u_ref[...] = jnp.zeros(u_ref.shape, jnp.float32)
    tl_ref[...] = jnp.zeros(tl_ref.shape, jnp.float32)

  @pl.when(k == 0)
  def _init_logits():
    logits_ref[...] = jnp.zeros(logits_ref.shape, jnp.float32)

  logits_ref[...] += jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32)

  @pl.when(k == num_h_blocks - 1)
  def _fold():
    logits = logits_ref[...] * it_ref[...]  # [bn, bv] times each row's 1 / T
    cols = j * block_v + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    acc = (m_ref[...], s_ref[...], u_ref[...], tl_ref[...])
    m, s, u, t = online_update(acc, logits, cols < v, cols, t_ref[...], keepdims=True)
    m_ref[...] = m
    s_ref[...] = s
    u_ref[...] = u
    tl_ref[...] = t


def accumulate(
  hidden: jax.Array, w: jax.Array, targets: jax.Array, inv_temp: jax.Array, block_sizes: BlockSizes, interpret: bool
) -> Acc:
  """(m, s, u, t) accumulators, float32 ``[N]`` (N > 0); targets outside ``[0, V)`` match no column."""
  n, h = hidden.shape
  v = w.shape[1]
  bn = pow2_block(block_sizes.block_n, n, 8)
  bv = pow2_block(block_sizes.block_v, v, 128)
  bh = pow2_block(block_sizes.block_h, h, 128) if h > 128 else h  # a block spanning all of H is always legal
  # N and V are not padded: the last row/vocabulary block is a partial (edge) block, whose out-of-range part holds
  # unspecified values; columns >= v are masked in the epilogue and rows >= n are never written back. Padding V
  # would copy all of w_unembed (1 GiB for [4096, 128256] bf16) on every call. H must be zero-padded (garbage there
  # would enter every logit); this copies w only when bh does not divide H.
  h_pad = round_up(h, bh)
  grid = (pl.cdiv(n, bn), pl.cdiv(v, bv), h_pad // bh)
  assert min(grid) > 0, (n, v, h, bn, bv, bh)  # A grid of size 0 silently returns garbage.
  hidden_p = pad_to(hidden, 1, h_pad)
  w_p = pad_to(w, 0, h_pad)
  targets_p = targets.astype(jnp.int32)[:, None]
  acc_spec = pl.BlockSpec((bn, 1), lambda i, j, k: (i, 0))
  rows, cols = grid[0] * bn, grid[1] * bv
  cost = pl.CostEstimate(
    flops=2 * rows * cols * h_pad,
    transcendentals=rows * cols,
    bytes_accessed=grid[1] * rows * h_pad * hidden.dtype.itemsize + grid[0] * h_pad * cols * w.dtype.itemsize,
  )
  out = pl.pallas_call(
    functools.partial(_kernel, block_v=bv, v=v, num_h_blocks=grid[2]),
    out_shape=(jax.ShapeDtypeStruct((n, 1), jnp.float32),) * 4,
    grid=grid,
    in_specs=[
      pl.BlockSpec((bn, bh), lambda i, j, k: (i, k)),
      pl.BlockSpec((bh, bv), lambda i, j, k: (k, j)),
      pl.BlockSpec((bn, 1), lambda i, j, k: (i, 0)),
      pl.BlockSpec((bn, 1), lambda i, j, k: (i, 0)),
    ],
    out_specs=(acc_spec,) * 4,
    scratch_shapes=[pltpu.VMEM((bn, bv), jnp.float32)],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
    cost_estimate=cost,
    interpret=interpret,
    name="fused_logprobs_fwd_tpu",
  )(hidden_p, w_p, targets_p, inv_temp.astype(jnp.float32)[:, None])
  return tuple(x[:, 0] for x in out)
