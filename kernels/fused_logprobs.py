"""Fused unembedding + log-softmax statistics, streamed over vocabulary blocks.

For ``hidden [N, H]``, ``w_unembed [H, V]`` and ``targets [N]`` this computes, per token, with logits
``l = hidden @ w_unembed / T``:

- ``logprobs[n] = l[n, t_n] - lse_n`` where ``lse_n = logsumexp_j l[n, j]``;
- ``entropy[n] = lse_n - mu_n`` with ``mu_n = sum_j p[n, j] l[n, j]`` (the entropy of ``softmax(l[n])``);
- optionally ``kl[n]``, the k3 estimator ``exp(r) - r - 1`` of KL(policy || ref) with ``r = ref - logprobs``
  (``r`` clamped to +-20 before ``exp``, the result clamped to +-10).

Memory. The ``[N, V]`` logits are never materialised. The forward pass walks the vocabulary in blocks of
``block_v`` columns, keeping online accumulators per row: the running max ``m``, ``s = sum_j exp(l_j - m)``,
``u = sum_j exp(l_j - m) (l_j - m)`` (kept relative to ``m`` so entropy has no cancellation against a large
logit offset; on a max update ``u <- alpha (u + (m - m') s)``, ``s <- alpha s`` with ``alpha = exp(m - m')``) and
the target logit. Then ``lse = m + log s``, ``mu = m + u / s``, ``entropy = log s - u / s``. Peak extra memory is
``O(N * block_v)`` plus, in the backward pass, an f32 ``[H, V]`` weight-gradient accumulator (cast to the weight
dtype at the end, so 2x a bf16 ``w_unembed``). The Pallas path also pads (copies) ``w_unembed`` when V is not a
multiple of ``block_v``. Measured (CPU, f32, N=4096, H=512, V=32000, forward+backward compiled temp memory):
about 96 MiB blockwise vs 1500 MiB for the reference.

Gradients (``jax.custom_vjp``). Residuals are only ``lse`` and ``mu`` per row (plus the inputs); probabilities
are recomputed block by block as ``p = exp(l - lse)``. With ``g_lp`` and ``g_ent`` the output cotangents:

- ``d logprobs / d l_j = 1[j = t] - p_j``;
- ``d entropy / d l_j = -p_j (l_j - mu)`` (from ``E = lse - sum_k p_k l_k`` and ``dp_k/dl_j = p_k(1[k=j] - p_j)``);
- so ``dL/dl_j = g_lp 1[j = t] - p_j (g_lp + g_ent (l_j - mu))`` and, with ``z = hidden @ w``,
  ``dL/dz = dL/dl / T``, ``dL/dhidden = sum_blocks dz_blk @ w_blk^T``, ``dL/dw_blk = hidden^T @ dz_blk``.
- ``kl`` depends on ``logprobs`` only (``ref_logprobs`` is a constant under ``stop_gradient``); it is computed
  outside the custom VJP, so autodiff chains it through ``logprobs``.

Implementations (``impl``):

- ``"reference"``: plain jnp over the full logits, differentiated by autodiff. The oracle.
- ``"xla"``: a ``fori_loop`` over vocabulary blocks with the custom VJP. The default on CPU. The last block is
  a window shifted back to end at ``V`` with already-seen columns masked, so ``w_unembed`` is never padded/copied.
- ``"pallas"``: a Pallas forward kernel, in two variants. ``vocab_grid`` (default except on GPU): grid
  ``(N / block_n, V / block_v)`` whose output blocks (constant along the vocabulary axis) hold the accumulators;
  this relies on the grid running sequentially (TPU, interpret mode). ``vocab_loop`` (default on GPU, where grid
  programs run in parallel): grid ``(N / block_n,)`` with an in-kernel ``fori_loop`` over vocabulary blocks.
  N and V are padded to block multiples (a block is clamped to the next power of two of a smaller dimension) and
  padded vocabulary columns masked to ``-inf``. The backward pass is the blockwise XLA backward above (there is
  no Pallas backward kernel yet). Only tested with ``interpret=True`` on CPU: GPU (Triton / Mosaic GPU) and TPU
  (Mosaic) lowering is untested. Likely issues there: Triton wants power-of-two tiles, so H must be one;
  ``(block_n, 1)`` accumulator blocks may need a lane-dense relayout on TPU; ``vocab_loop`` maps all of
  ``w_unembed`` as one block.

``fused_logprobs_sharded`` is the vocabulary-parallel version (``w_unembed`` sharded on V over one mesh axis):
each shard computes partial accumulators over its vocabulary slice, combined with ``pmax`` then rescaled
``psum``; its backward pass computes the local ``dw`` shard and ``psum``s ``dhidden``. Nothing ``[N, V]``-sized and
no full unembedding is ever gathered.

Targets must lie in ``[0, V)``; this cannot be checked on traced values. In the blockwise implementations an
out-of-range target matches no column, so its target logit is 0 and ``logprobs = -lse`` (the reference's
``take_along_axis`` behaves differently).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

Impl = Literal["auto", "reference", "xla", "pallas"]
_IMPLS = ("auto", "reference", "xla", "pallas")
PallasVariant = Literal["auto", "vocab_grid", "vocab_loop"]
_PALLAS_VARIANTS = ("auto", "vocab_grid", "vocab_loop")

# Finite stand-in for -inf as the initial running max: keeps ``(m - m') * s`` and ``exp(m - m')`` NaN-free.
_M_INIT = -1e30
_KL_LOG_RATIO_CLAMP = 20.0
_KL_VALUE_CLAMP = 10.0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes; a static (hashable) argument.

  Attributes:
    block_n: rows per Pallas grid step (unused by ``"xla"``, which processes all rows per vocabulary block).
    block_v: vocabulary columns per block (clamped to V when V is smaller).
  """

  block_n: int = 128
  block_v: int = 2048

  def __post_init__(self):
    if self.block_n <= 0 or self.block_v <= 0:
      raise ValueError(f"BlockSizes must be positive, got block_n={self.block_n}, block_v={self.block_v}")


class LogprobStats(NamedTuple):
  """Per-token outputs, all float32 ``[N]``; ``kl`` is None unless ``ref_logprobs`` was given."""

  logprobs: jax.Array
  entropy: jax.Array
  kl: jax.Array | None


# ----------------------------------------------------------------------------------------------------------------
# Shared math
# ----------------------------------------------------------------------------------------------------------------


def k3_kl(ref_logprobs: jax.Array, logprobs: jax.Array) -> jax.Array:
  """k3 estimator of KL(policy || ref) per token; ``ref_logprobs`` gets no gradient.

  Args:
    ref_logprobs: float ``[N]`` reference-policy log-probabilities of the targets.
    logprobs: float32 ``[N]`` policy log-probabilities of the targets.

  Returns:
    float32 ``[N]``: ``exp(r) - r - 1`` with ``r = clip(ref - logp, +-20)``, clipped to +-10.
  """
  r = lax.stop_gradient(ref_logprobs.astype(jnp.float32)) - logprobs
  r = jnp.clip(r, -_KL_LOG_RATIO_CLAMP, _KL_LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(r) - r - 1.0, -_KL_VALUE_CLAMP, _KL_VALUE_CLAMP)


def _init_acc(n: int) -> tuple[jax.Array, ...]:
  """Initial (m, s, u, t) accumulators, each float32 ``[n, 1]``."""
  zeros = jnp.zeros((n, 1), jnp.float32)
  return jnp.full((n, 1), _M_INIT, jnp.float32), zeros, zeros, zeros


def _online_update(
  acc: tuple[jax.Array, ...], logits: jax.Array, valid: jax.Array, cols: jax.Array, targets: jax.Array
) -> tuple[jax.Array, ...]:
  """Folds one logits block into the accumulators (pure jnp: used by the XLA loop and the Pallas kernel).

  Args:
    acc: (m, s, u, t), each float32 ``[n, 1]``.
    logits: float32 ``[n, bv]``.
    valid: bool, broadcastable to ``[n, bv]``; False for padding or already-counted columns.
    cols: int32 global vocabulary ids, broadcastable to ``[n, bv]``.
    targets: int32 ``[n, 1]``.

  Returns:
    The updated (m, s, u, t).
  """
  m, s, u, t = acc
  logits = jnp.where(valid, logits, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  shifted = logits - m_new  # -inf on masked columns
  e = jnp.exp(shifted)
  s_new = alpha * s + jnp.sum(e, axis=1, keepdims=True)
  # u is relative to the running max: sum_j e_j (l_j - m). Masked columns would give 0 * -inf.
  u_new = alpha * (u + (m - m_new) * s) + jnp.sum(jnp.where(valid, e * shifted, 0.0), axis=1, keepdims=True)
  hit = valid & (cols == targets)
  t_new = t + jnp.sum(jnp.where(hit, logits, 0.0), axis=1, keepdims=True)
  return m_new, s_new, u_new, t_new


def _finalize(m: jax.Array, s: jax.Array, u: jax.Array, t: jax.Array) -> tuple[jax.Array, ...]:
  """(logprobs, entropy, lse, mu), each float32 ``[n]``, from ``[n, 1]`` accumulators."""
  m, s, u, t = (x[:, 0] for x in (m, s, u, t))
  log_s = jnp.log(s)
  mean_rel = u / s
  return t - (m + log_s), log_s - mean_rel, m + log_s, m + mean_rel


def _combine_across(acc: tuple[jax.Array, ...], axis: str) -> tuple[jax.Array, ...]:
  """Merges per-shard accumulators over mesh axis ``axis``: max first, then rescaled sums."""
  m, s, u, t = acc
  m_all = lax.pmax(m, axis)
  alpha = jnp.exp(m - m_all)
  s_all = lax.psum(alpha * s, axis)
  u_all = lax.psum(alpha * (u + (m - m_all) * s), axis)
  return m_all, s_all, u_all, lax.psum(t, axis)


# ----------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------


def fused_logprobs_reference(
  hidden: jax.Array,
  w_unembed: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
  ref_logprobs: jax.Array | None = None,
) -> LogprobStats:
  """Plain-jnp oracle over the full ``[N, V]`` logits (differentiable by autodiff); same contract as below."""
  logits = jnp.dot(hidden, w_unembed, preferred_element_type=jnp.float32) / temperature
  log_p = jax.nn.log_softmax(logits, axis=-1)
  logprobs = jnp.take_along_axis(log_p, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
  kl = None if ref_logprobs is None else k3_kl(ref_logprobs, logprobs)
  return LogprobStats(logprobs, entropy, kl)


# ----------------------------------------------------------------------------------------------------------------
# XLA: blockwise loops (forward accumulators and backward)
# ----------------------------------------------------------------------------------------------------------------


def _vocab_window(b: jax.Array, bv: int, v: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Start column of block ``b``, local column ids ``[1, bv]`` and the not-yet-counted mask ``[1, bv]``.

  The last block is shifted back to end at ``v`` (no padding); its overlap with the previous block is masked.
  """
  start = jnp.minimum(b * bv, v - bv)
  cols = start + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
  return start, cols, cols >= b * bv


def _xla_accumulate(
  hidden: jax.Array, w: jax.Array, targets: jax.Array, inv_temp: float, block_v: int, col_offset: jax.Array | int
) -> tuple[jax.Array, ...]:
  """(m, s, u, t) accumulators ``[N, 1]`` over the columns of ``w`` (global ids start at ``col_offset``)."""
  n, v = hidden.shape[0], w.shape[1]
  bv = min(block_v, v)
  tgt = targets.astype(jnp.int32)[:, None]

  def body(b, acc):
    start, cols, valid = _vocab_window(b, bv, v)
    w_blk = lax.dynamic_slice_in_dim(w, start, bv, axis=1)  # [H, bv]
    logits = jnp.dot(hidden, w_blk, preferred_element_type=jnp.float32) * inv_temp  # [N, bv]
    return _online_update(acc, logits, valid, cols + col_offset, tgt)

  return lax.fori_loop(0, pl.cdiv(v, bv), body, _init_acc(n))


def _xla_backward(
  hidden: jax.Array,
  w: jax.Array,
  targets: jax.Array,
  lse: jax.Array,
  mu: jax.Array,
  g_lp: jax.Array,
  g_ent: jax.Array,
  inv_temp: float,
  block_v: int,
  col_offset: jax.Array | int,
) -> tuple[jax.Array, jax.Array]:
  """Blockwise (dhidden [N, H], dw [H, V]) in float32, recomputing probabilities from ``lse``."""
  v = w.shape[1]
  bv = min(block_v, v)
  tgt = targets.astype(jnp.int32)[:, None]
  lse, mu, g_lp, g_ent = (x.astype(jnp.float32)[:, None] for x in (lse, mu, g_lp, g_ent))
  hidden_f32 = hidden.astype(jnp.float32)

  def body(b, carry):
    dh, dw = carry
    start, cols, valid = _vocab_window(b, bv, v)
    w_blk = lax.dynamic_slice_in_dim(w, start, bv, axis=1)  # [H, bv]
    logits = jnp.dot(hidden, w_blk, preferred_element_type=jnp.float32) * inv_temp  # [N, bv]
    p = jnp.where(valid, jnp.exp(logits - lse), 0.0)
    onehot = (valid & (cols + col_offset == tgt)).astype(jnp.float32)
    dz = (onehot * g_lp - p * (g_lp + g_ent * (logits - mu))) * inv_temp  # dL/d(hidden @ w), [N, bv]
    dh = dh + jnp.dot(dz, w_blk.astype(jnp.float32).T)  # [N, H]
    dw_blk = jnp.dot(hidden_f32.T, dz)  # [H, bv]; overlap columns have dz == 0
    dw = lax.dynamic_update_slice_in_dim(dw, lax.dynamic_slice_in_dim(dw, start, bv, axis=1) + dw_blk, start, axis=1)
    return dh, dw

  init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32))
  return lax.fori_loop(0, pl.cdiv(v, bv), body, init)


# ----------------------------------------------------------------------------------------------------------------
# Pallas forward kernel
# ----------------------------------------------------------------------------------------------------------------


def _pallas_grid_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, u_ref, tl_ref, *, inv_temp: float, block_v: int, v: int):
  """``vocab_grid`` step (row block i, vocab block j): the output blocks stay resident across j and hold the
  accumulators. Needs a sequential grid (TPU, interpret mode); GPU grid programs run in parallel."""
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, _M_INIT, jnp.float32)
    s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
    u_ref[...] = jnp.zeros(u_ref.shape, jnp.float32)
    tl_ref[...] = jnp.zeros(tl_ref.shape, jnp.float32)

  logits = jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32) * inv_temp  # [bn, bv]
  cols = j * block_v + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  acc = (m_ref[...], s_ref[...], u_ref[...], tl_ref[...])
  m, s, u, t = _online_update(acc, logits, cols < v, cols, t_ref[...])
  m_ref[...] = m
  s_ref[...] = s
  u_ref[...] = u
  tl_ref[...] = t


def _pallas_loop_kernel(
  h_ref, w_ref, t_ref, m_ref, s_ref, u_ref, tl_ref, *, inv_temp: float, block_v: int, v: int, num_v_blocks: int
):
  """``vocab_loop`` program for one row block: loops over vocabulary blocks in-kernel (GPU-style, no cross-program
  state), with the accumulators in registers."""
  h = h_ref[...]  # [bn, H]
  tgt = t_ref[...]  # [bn, 1]

  def body(j, acc):
    start = pl.multiple_of(j * block_v, block_v)
    w_blk = w_ref[:, pl.ds(start, block_v)]  # [H, bv]
    logits = jnp.dot(h, w_blk, preferred_element_type=jnp.float32) * inv_temp  # [bn, bv]
    cols = start + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return _online_update(acc, logits, cols < v, cols, tgt)

  m, s, u, t = lax.fori_loop(0, num_v_blocks, body, _init_acc(h.shape[0]))
  m_ref[...] = m
  s_ref[...] = s
  u_ref[...] = u
  tl_ref[...] = t


def _pow2_block(block: int, size: int) -> int:
  """``block``, or for a small dimension the next power of two >= ``size`` (Triton needs power-of-two tiles)."""
  return min(block, 1 << max(size - 1, 0).bit_length())


def _pallas_accumulate(
  hidden: jax.Array,
  w: jax.Array,
  targets: jax.Array,
  inv_temp: float,
  block_sizes: BlockSizes,
  variant: str,
  interpret: bool,
) -> tuple[jax.Array, ...]:
  """(m, s, u, t) accumulators ``[N, 1]`` from a Pallas kernel (pads N and V to block multiples internally)."""
  n, h = hidden.shape
  v = w.shape[1]
  if n == 0:
    raise ValueError(f"the Pallas path needs N > 0 rows, got hidden {hidden.shape}")
  bn, bv = _pow2_block(block_sizes.block_n, n), _pow2_block(block_sizes.block_v, v)
  n_pad, v_pad = pl.cdiv(n, bn) * bn, pl.cdiv(v, bv) * bv
  # A grid of size 0 silently returns garbage.
  assert n_pad % bn == 0 and v_pad % bv == 0 and n_pad // bn > 0 and v_pad // bv > 0, (n, v, bn, bv)
  hidden_p = jnp.pad(hidden, ((0, n_pad - n), (0, 0)))
  w_p = jnp.pad(w, ((0, 0), (0, v_pad - v)))  # padded columns are masked to -inf in the kernel
  targets_p = jnp.pad(targets.astype(jnp.int32), (0, n_pad - n))[:, None]
  acc_shape = jax.ShapeDtypeStruct((n_pad, 1), jnp.float32)
  if variant == "vocab_grid":
    kernel = functools.partial(_pallas_grid_kernel, inv_temp=inv_temp, block_v=bv, v=v)
    grid = (n_pad // bn, v_pad // bv)
    in_specs = [
      pl.BlockSpec((bn, h), lambda i, j: (i, 0)),
      pl.BlockSpec((h, bv), lambda i, j: (0, j)),
      pl.BlockSpec((bn, 1), lambda i, j: (i, 0)),
    ]
    acc_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  elif variant == "vocab_loop":
    kernel = functools.partial(_pallas_loop_kernel, inv_temp=inv_temp, block_v=bv, v=v, num_v_blocks=v_pad // bv)
    grid = (n_pad // bn,)
    in_specs = [
      pl.BlockSpec((bn, h), lambda i: (i, 0)),
      pl.BlockSpec((h, v_pad), lambda i: (0, 0)),
      pl.BlockSpec((bn, 1), lambda i: (i, 0)),
    ]
    acc_spec = pl.BlockSpec((bn, 1), lambda i: (i, 0))
  else:
    raise ValueError(f"unknown Pallas variant {variant!r}")
  out = pl.pallas_call(
    kernel,
    out_shape=(acc_shape,) * 4,
    grid=grid,
    in_specs=in_specs,
    out_specs=(acc_spec,) * 4,
    interpret=interpret,
    name=f"fused_logprobs_fwd_{variant}",
  )(hidden_p, w_p, targets_p)
  return tuple(x[:n] for x in out)


# ----------------------------------------------------------------------------------------------------------------
# custom_vjp over (logprobs, entropy)
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _stats(hidden, w, targets, inv_temp: float, impl: str, block_sizes: BlockSizes, interpret: bool):
  return _stats_fwd(hidden, w, targets, inv_temp, impl, block_sizes, interpret)[0]


def _stats_fwd(hidden, w, targets, inv_temp, impl, block_sizes, interpret):
  # impl is "xla", "pallas:vocab_grid" or "pallas:vocab_loop".
  if impl.startswith("pallas:"):
    acc = _pallas_accumulate(hidden, w, targets, inv_temp, block_sizes, impl.split(":")[1], interpret)
  else:
    acc = _xla_accumulate(hidden, w, targets, inv_temp, block_sizes.block_v, 0)
  logprobs, entropy, lse, mu = _finalize(*acc)
  return (logprobs, entropy), (hidden, w, targets, lse, mu)


def _stats_bwd(inv_temp, impl, block_sizes, interpret, res, cts):
  del impl, interpret  # Both implementations share the blockwise XLA backward.
  hidden, w, targets, lse, mu = res
  g_lp, g_ent = cts
  dh, dw = _xla_backward(hidden, w, targets, lse, mu, g_lp, g_ent, inv_temp, block_sizes.block_v, 0)
  return dh.astype(hidden.dtype), dw.astype(w.dtype), None


_stats.defvjp(_stats_fwd, _stats_bwd)


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def _validate(hidden, w_unembed, targets, ref_logprobs, temperature) -> None:
  """Raises ValueError/TypeError naming the offending array and its shape or dtype."""
  if hidden.ndim != 2:
    raise ValueError(f"hidden must be [N, H], got shape {hidden.shape}")
  if w_unembed.ndim != 2:
    raise ValueError(f"w_unembed must be [H, V], got shape {w_unembed.shape}")
  if hidden.shape[1] != w_unembed.shape[0]:
    raise ValueError(
      f"hidden [N, H] and w_unembed [H, V] disagree on H: hidden {hidden.shape}, w_unembed {w_unembed.shape}"
    )
  if targets.shape != (hidden.shape[0],):
    raise ValueError(f"targets must be [N] = ({hidden.shape[0]},) to match hidden {hidden.shape}, got {targets.shape}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"targets must be an integer array, got dtype {targets.dtype}")
  for name, x in (("hidden", hidden), ("w_unembed", w_unembed)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point (bf16 or f32), got dtype {x.dtype}")
  if w_unembed.shape[0] == 0 or w_unembed.shape[1] == 0:
    raise ValueError(f"w_unembed must have H > 0 and V > 0, got shape {w_unembed.shape}")
  if ref_logprobs is not None and ref_logprobs.shape != targets.shape:
    raise ValueError(f"ref_logprobs must have the shape of targets {targets.shape}, got {ref_logprobs.shape}")
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")


def _resolve_impl(impl: str, pallas_variant: str) -> str:
  """Internal impl: "reference", "xla", "pallas:vocab_grid" or "pallas:vocab_loop"."""
  if impl not in _IMPLS:
    raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
  if pallas_variant not in _PALLAS_VARIANTS:
    raise ValueError(f"pallas_variant must be one of {_PALLAS_VARIANTS}, got {pallas_variant!r}")
  backend = jax.default_backend()
  if impl == "auto":
    impl = "pallas" if backend in ("gpu", "tpu") else "xla"
  if impl != "pallas":
    return impl
  if pallas_variant == "auto":
    pallas_variant = "vocab_loop" if backend == "gpu" else "vocab_grid"
  return f"pallas:{pallas_variant}"


@functools.partial(jax.jit, static_argnames=("temperature", "impl", "block_sizes", "interpret", "pallas_variant"))
def fused_logprobs(
  hidden: jax.Array,
  w_unembed: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
  ref_logprobs: jax.Array | None = None,
  impl: Impl = "auto",
  block_sizes: BlockSizes | None = None,
  interpret: bool = False,
  pallas_variant: PallasVariant = "auto",
) -> LogprobStats:
  """Per-token logprobs, entropy and (optionally) k3 KL of ``softmax(hidden @ w_unembed / temperature)``.

  Args:
    hidden: ``[N, H]`` bf16 or f32 final hidden states.
    w_unembed: ``[H, V]`` bf16 or f32 unembedding.
    targets: ``[N]`` integer token ids in ``[0, V)`` (not checked: out-of-range gives ``-lse``).
    temperature: static positive float; logits are divided by it.
    ref_logprobs: optional ``[N]`` reference logprobs (no gradient flows into them); enables ``kl``.
    impl: ``"auto"`` (pallas on GPU/TPU, xla on CPU), ``"reference"``, ``"xla"`` or ``"pallas"``.
    block_sizes: static tile sizes; defaults to ``BlockSizes()``.
    interpret: run the Pallas kernel in interpret mode (needed on CPU).
    pallas_variant: ``"vocab_grid"`` (2-D grid, accumulators in resident output blocks: needs TPU-style
      sequential grid semantics), ``"vocab_loop"`` (grid over row blocks, in-kernel loop over vocabulary blocks:
      GPU-style), or ``"auto"`` (``vocab_loop`` on GPU, else ``vocab_grid``).

  Returns:
    ``LogprobStats`` of float32 ``[N]`` arrays; differentiable w.r.t. ``hidden`` and ``w_unembed``.
  """
  _validate(hidden, w_unembed, targets, ref_logprobs, temperature)
  impl = _resolve_impl(impl, pallas_variant)
  if impl == "reference":
    return fused_logprobs_reference(hidden, w_unembed, targets, temperature=temperature, ref_logprobs=ref_logprobs)
  block_sizes = block_sizes or BlockSizes()
  logprobs, entropy = _stats(hidden, w_unembed, targets, 1.0 / temperature, impl, block_sizes, interpret)
  kl = None if ref_logprobs is None else k3_kl(ref_logprobs, logprobs)
  return LogprobStats(logprobs, entropy, kl)


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary-parallel (shard_map) version
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _sharded_stats(hidden, w, targets, mesh: Mesh, axis: str, inv_temp: float, block_v: int):
  return _sharded_fwd(hidden, w, targets, mesh, axis, inv_temp, block_v)[0]


def _sharded_fwd(hidden, w, targets, mesh, axis, inv_temp, block_v):
  def local(h, w_loc, tgt):
    offset = lax.axis_index(axis) * w_loc.shape[1]
    acc = _xla_accumulate(h, w_loc, tgt, inv_temp, block_v, offset)
    return _finalize(*_combine_across(acc, axis))

  fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, axis), P()), out_specs=(P(),) * 4, check_vma=False)
  logprobs, entropy, lse, mu = fn(hidden, w, targets)
  return (logprobs, entropy), (hidden, w, targets, lse, mu)


def _sharded_bwd(mesh, axis, inv_temp, block_v, res, cts):
  hidden, w, targets, lse, mu = res

  def local(h, w_loc, tgt, lse_, mu_, g_lp, g_ent):
    offset = lax.axis_index(axis) * w_loc.shape[1]
    dh, dw = _xla_backward(h, w_loc, tgt, lse_, mu_, g_lp, g_ent, inv_temp, block_v, offset)
    return lax.psum(dh, axis), dw

  fn = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(P(), P(None, axis), P(), P(), P(), P(), P()),
    out_specs=(P(), P(None, axis)),
    check_vma=False,
  )
  dh, dw = fn(hidden, w, targets, lse, mu, *cts)
  return dh.astype(hidden.dtype), dw.astype(w.dtype), None


_sharded_stats.defvjp(_sharded_fwd, _sharded_bwd)


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "temperature", "block_sizes"))
def fused_logprobs_sharded(
  hidden: jax.Array,
  w_unembed: jax.Array,
  targets: jax.Array,
  mesh: Mesh,
  *,
  axis: str = "tensor",
  temperature: float = 1.0,
  ref_logprobs: jax.Array | None = None,
  block_sizes: BlockSizes | None = None,
) -> LogprobStats:
  """Vocabulary-parallel ``fused_logprobs`` (XLA blockwise per shard) with ``w_unembed`` sharded on V.

  Each shard of ``w_unembed`` (``PartitionSpec(None, axis)``) accumulates (m, s, u, target logit) over its own
  vocabulary slice; shards combine with ``pmax`` then rescaled ``psum``. The backward pass is blockwise too:
  local ``dw`` shards, ``psum`` of ``dhidden``. ``hidden`` and ``targets`` are replicated over ``axis``.

  Args:
    hidden: ``[N, H]`` bf16 or f32.
    w_unembed: ``[H, V]`` bf16 or f32; V must be divisible by ``mesh.shape[axis]``.
    targets: ``[N]`` integer ids in ``[0, V)``.
    mesh: the device mesh (static).
    axis: mesh axis over which V is sharded.
    temperature: static positive float.
    ref_logprobs: optional ``[N]``; enables ``kl``.
    block_sizes: static tile sizes; only ``block_v`` is used.

  Returns:
    ``LogprobStats`` of float32 ``[N]`` arrays (replicated); differentiable w.r.t. ``hidden`` and ``w_unembed``.
  """
  _validate(hidden, w_unembed, targets, ref_logprobs, temperature)
  if axis not in mesh.shape:
    raise ValueError(f"axis {axis!r} is not a mesh axis; mesh axes are {tuple(mesh.shape)}")
  shards = mesh.shape[axis]
  if w_unembed.shape[1] % shards != 0:
    raise ValueError(
      f"w_unembed V={w_unembed.shape[1]} (shape {w_unembed.shape}) must be divisible by mesh axis {axis!r} "
      f"of size {shards}"
    )
  block_sizes = block_sizes or BlockSizes()
  logprobs, entropy = _sharded_stats(hidden, w_unembed, targets, mesh, axis, 1.0 / temperature, block_sizes.block_v)
  kl = None if ref_logprobs is None else k3_kl(ref_logprobs, logprobs)
  return LogprobStats(logprobs, entropy, kl)
