"""``pallas_gpu``: the forward kernel for GPU (Triton lowering), split over rows and vocabulary ranges.

GPU programs run concurrently, so no state may carry across grid steps. The grid is
``(N / block_n, num_v_splits)``: program ``(i, s)`` owns row block ``i`` and a contiguous range of
``blocks_per_split`` vocabulary blocks. It loops over its vocabulary blocks; for each it accumulates the
``[block_n, block_v]`` logits tile over ``block_h``-wide contraction steps (the loop Triton software-pipelines,
``num_stages`` deep) and folds the tile into per-row accumulators held in registers. Each program writes its
partial (m, s, u, t); the splits are merged afterwards in XLA with the max-then-rescaled-sum rule (``[splits, N]``
floats, negligible next to the matmul).

Splits exist because one program per row block under-fills the GPU when N is small (N = 4096 rows in blocks of
64 is 64 programs for 132 SMs). Row blocks vary fastest in launch order, so the programs running at one time
share a vocabulary range and read the same ``w`` tiles from L2.

Shapes: Triton tiles are powers of two, at least 16 wide for ``dot``. N is zero-padded to ``block_n`` and H to
``block_h`` (a copy of ``w`` only when H is not a multiple, rare for real models); V is not padded unless it is
smaller than ``block_v``: the last vocabulary block is a window shifted back to end at V, its already-counted
columns masked (as in ``xla``). Splits past the last block are masked whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mimo_jax.kernels.fused_logprobs.common import (
  Acc,
  BlockSizes,
  combine_partials,
  init_acc,
  online_update,
  pad_to,
  pow2_block,
  round_up,
)

# Tuned on an H200 (bf16, H = 4096, V = 128256, N = 1024 and 4096; BUILD_NOTES.md has the sweep).
DEFAULT_BLOCK_SIZES = BlockSizes(block_n=128, block_v=256, block_h=64, num_warps=8, num_stages=3)
# Programs to aim for when choosing the number of vocabulary splits: about two waves over an H100/H200's 132 SMs
# (one program per SM at these tile sizes); 4x more programs was measured 14% slower, 2x fewer 4% slower.
_TARGET_PROGRAMS = 256


def _kernel(
  h_ref, w_ref, t_ref, it_ref, m_ref, s_ref, u_ref, tl_ref, *, block_v, block_h, v, num_v_blocks, per_split, precision
):
  split = pl.program_id(1)
  tgt = t_ref[...]  # [bn]
  scale = it_ref[...][:, None]  # [bn, 1]: each row's 1 / T
  bn = tgt.shape[0]
  num_h_blocks = h_ref.shape[1] // block_h

  def vocab_block(jj, acc):
    b = split * per_split + jj  # global vocabulary block; >= num_v_blocks past the end of the last split
    start = jnp.minimum(b, num_v_blocks - 1) * block_v
    start = jnp.minimum(start, w_ref.shape[1] - block_v)  # the last block: shifted back to end at V

    def contract(k, logits):
      h0 = pl.multiple_of(k * block_h, block_h)
      h_blk = h_ref[:, pl.ds(h0, block_h)]  # [bn, bh]
      w_blk = w_ref[pl.ds(h0, block_h), pl.ds(start, block_v)]  # [bh, bv]
      return logits + jnp.dot(h_blk, w_blk, precision=precision, preferred_element_type=jnp.float32)

    logits = lax.fori_loop(0, num_h_blocks, contract, jnp.zeros((bn, block_v), jnp.float32)) * scale
    cols = start + jnp.arange(block_v, dtype=jnp.int32)
    valid = (cols >= b * block_v) & (cols < v) & (b < num_v_blocks)
    return online_update(acc, logits, valid[None, :], cols[None, :], tgt)

  m, s, u, t = lax.fori_loop(0, per_split, vocab_block, init_acc((bn,)))
  m_ref[...] = m
  s_ref[...] = s
  u_ref[...] = u
  tl_ref[...] = t


def _dot_precision(dtype) -> lax.Precision | None:
  """Triton runs a float32 ``dot`` without a precision in TF32; follow ``jax_default_matmul_precision`` instead,
  as XLA's own matmuls do (``highest``: IEEE float32)."""
  if dtype != jnp.float32:
    return None
  setting = jax.config.jax_default_matmul_precision
  if setting in ("highest", "float32"):
    return lax.Precision.HIGHEST
  return None


def _num_splits(block_sizes: BlockSizes, num_row_blocks: int, num_v_blocks: int) -> int:
  if block_sizes.num_v_splits is not None:
    return min(block_sizes.num_v_splits, num_v_blocks)
  return max(1, min(num_v_blocks, -(-_TARGET_PROGRAMS // num_row_blocks)))


def accumulate(
  hidden: jax.Array, w: jax.Array, targets: jax.Array, inv_temp: jax.Array, block_sizes: BlockSizes, interpret: bool
) -> Acc:
  """(m, s, u, t) accumulators, float32 ``[N]`` (N > 0); targets outside ``[0, V)`` match no column."""
  n, h = hidden.shape
  v = w.shape[1]
  bn = pow2_block(block_sizes.block_n, n, 16)
  bv = pow2_block(block_sizes.block_v, v, 16)
  bh = pow2_block(block_sizes.block_h, h, 16)
  n_pad, h_pad = round_up(n, bn), round_up(h, bh)
  v_pad = max(v, bv)  # only a vocabulary smaller than one block is padded
  num_row_blocks, num_v_blocks = n_pad // bn, -(-v // bv)
  splits = _num_splits(block_sizes, num_row_blocks, num_v_blocks)
  per_split = -(-num_v_blocks // splits)
  splits = -(-num_v_blocks // per_split)  # drop splits that would own no block
  dtype = jnp.promote_types(hidden.dtype, w.dtype)  # Triton's dot takes one operand type
  hidden, w = hidden.astype(dtype), w.astype(dtype)
  hidden_p = pad_to(pad_to(hidden, 0, n_pad), 1, h_pad)
  w_p = pad_to(pad_to(w, 0, h_pad), 1, v_pad)
  targets_p = pad_to(targets.astype(jnp.int32), 0, n_pad)
  inv_temp_p = pad_to(inv_temp.astype(jnp.float32), 0, n_pad)  # padded rows are dropped: their 0 is harmless
  kernel = functools.partial(
    _kernel,
    block_v=bv,
    block_h=bh,
    v=v,
    num_v_blocks=num_v_blocks,
    per_split=per_split,
    precision=_dot_precision(dtype),
  )
  acc_spec = pl.BlockSpec((None, bn), lambda i, s: (s, i))
  partial = pl.pallas_call(
    kernel,
    out_shape=(jax.ShapeDtypeStruct((splits, n_pad), jnp.float32),) * 4,
    grid=(num_row_blocks, splits),
    in_specs=[
      pl.BlockSpec((bn, h_pad), lambda i, s: (i, 0)),
      pl.BlockSpec((h_pad, v_pad), lambda i, s: (0, 0)),  # whole w: the kernel slices its own tiles
      pl.BlockSpec((bn,), lambda i, s: (i,)),
      pl.BlockSpec((bn,), lambda i, s: (i,)),
    ],
    out_specs=(acc_spec,) * 4,
    compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
    interpret=interpret,
    name="fused_logprobs_fwd_gpu",
  )(hidden_p, w_p, targets_p, inv_temp_p)
  merged = combine_partials(partial, lambda x: x.max(axis=0), lambda x: x.sum(axis=0))
  return tuple(x[:n] for x in merged)
