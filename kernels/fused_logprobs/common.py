"""Math and types shared by every implementation: block sizes, outputs, online accumulators, validation.

The accumulators of one row over a set of vocabulary columns are (all float32):

- ``m``: the running max logit (starts at the finite ``M_INIT`` so no ``inf - inf`` appears);
- ``s = sum_j exp(l_j - m)``;
- ``u = sum_j exp(l_j - m) (l_j - m)``, kept relative to ``m`` so the entropy has no cancellation against a large
  logit offset (on a max update ``u <- alpha (u + (m - m') s)``, ``s <- alpha s`` with ``alpha = exp(m - m')``);
- ``t``: the target's logit (0 while the target has not been seen, and forever when it lies outside the columns).

Then ``lse = m + log s``, ``mu = sum_j p_j l_j = m + u / s`` and ``entropy = lse - mu = log s - u / s``. Partial
accumulators over disjoint column sets (vocabulary splits of one kernel, or vocabulary shards of a mesh) merge with
a max, then rescaled sums (:func:`combine_partials`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Finite stand-in for -inf as the initial running max: keeps ``(m - m') * s`` and ``exp(m - m')`` NaN-free.
M_INIT = -1e30
KL_LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0

Acc = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters; a static (hashable) argument. ``None`` takes the implementation's default.

  Attributes:
    block_n: rows per Pallas program (unused by ``xla``, which takes every row per vocabulary block).
    block_v: vocabulary columns per block.
    block_h: hidden (contraction) columns per matmul step of the Pallas kernels.
    num_v_splits: ``pallas_gpu``: vocabulary splits per row block, run as separate programs and merged
      afterwards (more programs for small N); ``None`` picks enough to fill the GPU.
    num_warps: ``pallas_gpu``: warps per program.
    num_stages: ``pallas_gpu``: software-pipelining stages of the contraction loop.
    bwd_block_v: vocabulary columns per block of the blockwise (XLA) backward pass, shared by every
      implementation; ``None``: ``block_v`` for ``xla``, else the ``xla`` default.
  """

  block_n: int | None = None
  block_v: int | None = None
  block_h: int | None = None
  num_v_splits: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  bwd_block_v: int | None = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"BlockSizes.{f.name} must be a positive int or None, got {value!r}")

  def with_defaults(self, defaults: BlockSizes) -> BlockSizes:
    """These sizes, with every ``None`` taken from ``defaults``."""
    return dataclasses.replace(
      defaults, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
    )


class LogprobStats(NamedTuple):
  """Per-token outputs, all float32 ``[N]``; ``kl`` is None unless ``ref_logprobs`` was given."""

  logprobs: jax.Array
  entropy: jax.Array
  kl: jax.Array | None


def k3_kl(ref_logprobs: jax.Array, logprobs: jax.Array) -> jax.Array:
  """k3 estimator of KL(policy || ref) per token; ``ref_logprobs`` gets no gradient.

  Args:
    ref_logprobs: float ``[N]`` reference-policy log-probabilities of the targets.
    logprobs: float32 ``[N]`` policy log-probabilities of the targets.

  Returns:
    float32 ``[N]``: ``exp(r) - r - 1`` with ``r = clip(ref - logp, +-20)``, clipped to +-10.
  """
  r = lax.stop_gradient(ref_logprobs.astype(jnp.float32)) - logprobs
  r = jnp.clip(r, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(r) - r - 1.0, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def init_acc(shape: tuple[int, ...]) -> Acc:
  """Initial (m, s, u, t) accumulators of ``shape`` (``[n]``, or ``[n, 1]`` for the keep-dims layout)."""
  zeros = jnp.zeros(shape, jnp.float32)
  return jnp.full(shape, M_INIT, jnp.float32), zeros, zeros, zeros


def online_update(
  acc: Acc, logits: jax.Array, valid: jax.Array, cols: jax.Array, targets: jax.Array, *, keepdims: bool = False
) -> Acc:
  """Folds one logits block into the accumulators (pure jnp: used by the XLA loop and both Pallas kernels).

  Args:
    acc: (m, s, u, t), each float32 ``[n]`` (or ``[n, 1]`` with ``keepdims``).
    logits: float32 ``[n, bv]``.
    valid: bool, broadcastable to ``[n, bv]``; False for padding or already-counted columns.
    cols: int32 vocabulary ids, broadcastable to ``[n, bv]``.
    targets: int32 ``[n]`` (or ``[n, 1]`` with ``keepdims``).
    keepdims: the accumulators and targets carry a trailing unit dimension (the TPU kernel's 2-D layout).

  Returns:
    The updated (m, s, u, t), in the layout of ``acc``.
  """

  def col(x):  # per-row value -> [n, 1] for broadcasting against the block
    return x if keepdims else x[:, None]

  def row_sum(x):
    return jnp.sum(x, axis=1, keepdims=keepdims)

  m, s, u, t = acc
  logits = jnp.where(valid, logits, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=keepdims))
  alpha = jnp.exp(m - m_new)
  shifted = logits - col(m_new)  # -inf on masked columns
  e = jnp.exp(shifted)
  s_new = alpha * s + row_sum(e)
  # Masked columns would give 0 * -inf.
  u_new = alpha * (u + (m - m_new) * s) + row_sum(jnp.where(valid, e * shifted, 0.0))
  hit = valid & (cols == col(targets))
  t_new = t + row_sum(jnp.where(hit, logits, 0.0))
  return m_new, s_new, u_new, t_new


def finalize(m: jax.Array, s: jax.Array, u: jax.Array, t: jax.Array) -> tuple[jax.Array, ...]:
  """(logprobs, entropy, lse, mu), each float32 ``[n]``, from ``[n]`` accumulators."""
  log_s = jnp.log(s)
  mean_rel = u / s
  return t - (m + log_s), log_s - mean_rel, m + log_s, m + mean_rel


def combine_partials(
  acc: Acc, max_fn: Callable[[jax.Array], jax.Array], sum_fn: Callable[[jax.Array], jax.Array]
) -> Acc:
  """Merges accumulators over disjoint column sets: ``max_fn`` then rescaled ``sum_fn``.

  With ``max_fn = lambda x: lax.pmax(x, axis)`` it merges mesh shards; with ``lambda x: x.max(0)`` the leading
  axis of stacked partials. A part that saw no column (``m = M_INIT``, ``s = u = 0``) contributes nothing.
  """
  m, s, u, t = acc
  m_all = max_fn(m)
  alpha = jnp.exp(m - m_all)
  return m_all, sum_fn(alpha * s), sum_fn(alpha * (u + (m - m_all) * s)), sum_fn(t)


def pow2_block(block: int, size: int, minimum: int = 1) -> int:
  """``block``, or for a smaller dimension the next power of two >= ``size`` (at least ``minimum``)."""
  return max(minimum, min(block, 1 << max(size - 1, 0).bit_length()))


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero-pads ``x`` along ``axis`` to ``size`` (no copy when it already has that size)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def validate(hidden, w_unembed, targets, ref_logprobs, temperature, row_temperature=None) -> None:
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
  if row_temperature is not None:
    if row_temperature.shape != targets.shape:
      raise ValueError(f"row_temperature must have the shape of targets {targets.shape}, got {row_temperature.shape}")
    if not jnp.issubdtype(row_temperature.dtype, jnp.floating):
      raise TypeError(f"row_temperature must be floating point, got dtype {row_temperature.dtype}")


def row_inv_temperature(n: int, temperature: float, row_temperature: jax.Array | None) -> jax.Array:
  """Float32 ``[N]``, each row's ``1 / (temperature * row_temperature)``: the factor applied to the float32
  logits after the matmul (folding it into the hidden states would round them again in a bf16 model)."""
  inv = jnp.full((n,), 1.0 / temperature, jnp.float32)
  return inv if row_temperature is None else inv / row_temperature.astype(jnp.float32)
