"""Advantage estimators: group-relative baselines (GRPO family) and GAE, plus masked statistics.

Group estimators take a flat score vector whose samples of one prompt are contiguous
(``[p0s0, p0s1, ..., p1s0, ...]``) and return one advantage per sample.  Which estimator
runs is a static string looked up in :data:`ADVANTAGE_ESTIMATORS`, so a config can list and
validate the names before any compute.

Every function is a pure function of arrays and static Python scalars/strings, safe
under ``jax.jit``; all math is float32.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = [
  "ADVANTAGES",
  "ADVANTAGE_ESTIMATORS",
  "gae",
  "group_advantages",
  "group_all_equal",
  "group_stats",
  "masked_mean",
  "masked_var",
  "masked_whiten",
]


# ---------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
  """num / den where den > 0, else 0; the inner where keeps gradients finite too."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def masked_mean(x: ArrayLike, mask: ArrayLike, axis: int | tuple[int, ...] | None = None) -> jax.Array:
  """Mean of ``x`` over the positions where ``mask`` is set.

  Args:
    x: float array, any shape.
    mask: bool or 0/1 array broadcastable to ``x.shape``.
    axis: axes to reduce (``None``: all).

  Returns:
    float32 array of ``x``'s shape with ``axis`` removed (a scalar for ``axis=None``).
    An empty selection gives 0 rather than NaN, so a fully padded row is harmless.
  """
  x = jnp.asarray(x, jnp.float32)
  m = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), x.shape)
  return _safe_div(jnp.sum(x * m, axis=axis), jnp.sum(m, axis=axis))


def masked_var(x: ArrayLike, mask: ArrayLike, unbiased: bool = True) -> jax.Array:
  """Variance of ``x`` over all positions where ``mask`` is set.

  Args:
    x: float array, any shape.
    mask: bool or 0/1 array broadcastable to ``x.shape``.
    unbiased: divide by ``n - 1`` (Bessel) instead of ``n``.  With ``n <= 1`` valid
      entries the Bessel factor is undefined; the biased value (0 or 0/0 -> 0) is
      returned instead so that jitted code never produces NaN.

  Returns:
    float32 scalar.
  """
  x = jnp.asarray(x, jnp.float32)
  m = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), x.shape)
  mean = masked_mean(x, m)
  var = masked_mean(jnp.square(x - mean), m)
  if unbiased:
    n = jnp.sum(m)
    var = jnp.where(n > 1, var * n / jnp.where(n > 1, n - 1.0, 1.0), var)
  return var


def masked_whiten(x: ArrayLike, mask: ArrayLike, *, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
  """Normalises ``x`` to unit (unbiased) standard deviation over the masked positions.

  Computes ``(x - mean) / (std + eps)`` with the mean and unbiased std taken over the
  valid positions.  ``eps`` is added to the std (not the variance) so a constant input
  maps to exactly 0 instead of blowing up.

  Args:
    x: float array, any shape.
    mask: bool or 0/1 array broadcastable to ``x.shape``.
    shift_mean: if False, the original mean is added back (only the scale changes).
    eps: added to the standard deviation.

  Returns:
    float32 array of ``x``'s shape; positions outside ``mask`` are 0.
  """
  x = jnp.asarray(x, jnp.float32)
  m = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
  mean = masked_mean(x, m)
  std = jnp.sqrt(masked_var(x, m, unbiased=True))
  out = (x - mean) / (std + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(m, out, 0.0)


# ---------------------------------------------------------------------------
# Group-relative advantages
# ---------------------------------------------------------------------------


def _as_groups(scores: ArrayLike, group_size: int) -> jax.Array:
  """[P * G] -> [P, G] float32; shapes are static so the checks run at trace time."""
  scores = jnp.asarray(scores, jnp.float32)
  if scores.ndim != 1:
    raise ValueError(f"scores must be rank 1 [num_prompts * group_size], got shape {scores.shape}")
  try:
    group_size = operator.index(group_size)  # static: numpy ints are fine, traced values are not
  except TypeError:
    raise ValueError(f"group_size must be a static positive int, got {group_size!r}") from None
  if group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size}")
  if scores.shape[0] % group_size:
    raise ValueError(f"group_size={group_size} does not divide the number of scores {scores.shape[0]}")
  return scores.reshape(-1, group_size)


def group_stats(scores: ArrayLike, group_size: int) -> tuple[jax.Array, jax.Array]:
  """Per-group mean and unbiased standard deviation.

  Args:
    scores: float ``[P * G]``, samples of one prompt contiguous.
    group_size: ``G`` (static).

  Returns:
    ``(mean, std)``, both float32 ``[P]``.  ``std`` uses ``G - 1``; with ``G == 1`` it
    is undefined and reported as 0.
  """
  groups = _as_groups(scores, group_size)
  mean = jnp.mean(groups, axis=-1)
  if group_size == 1:
    return mean, jnp.zeros_like(mean)
  return mean, jnp.std(groups, axis=-1, ddof=1)


def group_all_equal(scores: ArrayLike, group_size: int) -> jax.Array:
  """Whether every sample of a group got the same score (no learning signal).

  Args:
    scores: float ``[P * G]``, samples of one prompt contiguous.
    group_size: ``G`` (static).

  Returns:
    bool ``[P]``.  Compares max and min exactly, so it does not depend on the rounding
    of a computed mean or std.
  """
  groups = _as_groups(scores, group_size)
  return jnp.max(groups, axis=-1) == jnp.min(groups, axis=-1)


def _centered(groups: jax.Array) -> jax.Array:
  """s - group mean, forced to exactly 0 in all-equal groups.

  Summing G copies of a float and dividing by G need not round back to the same
  float, so a constant group could otherwise leak tiny non-zero advantages.
  """
  equal = jnp.max(groups, axis=-1, keepdims=True) == jnp.min(groups, axis=-1, keepdims=True)
  return jnp.where(equal, 0.0, groups - jnp.mean(groups, axis=-1, keepdims=True))


def _grpo(groups: jax.Array, eps: float) -> jax.Array:
  """GRPO outcome supervision, Shao et al. 2024 (DeepSeekMath) Sec. 4.1.2: (s - mean) / (std + eps)."""
  g = groups.shape[-1]
  if g < 2:
    raise ValueError("mode='grpo' needs group_size >= 2: the unbiased std of a single sample is undefined")
  std = jnp.std(groups, axis=-1, ddof=1, keepdims=True)
  return _centered(groups) / (std + eps)


def _drgrpo(groups: jax.Array, eps: float) -> jax.Array:
  """Dr. GRPO, Liu et al. 2025: s - mean, dropping the std division that re-weights easy/hard prompts."""
  del eps  # no division, nothing to guard
  return _centered(groups)


def _rloo(groups: jax.Array, eps: float) -> jax.Array:
  """RLOO, Ahmadian et al. 2024: s - mean of the other G-1 samples = G / (G-1) * (s - mean)."""
  del eps
  g = groups.shape[-1]
  if g < 2:
    raise ValueError("mode='rloo' needs group_size >= 2: a single sample has no other samples to form a baseline")
  return _centered(groups) * (g / (g - 1.0))


def _reinforce_baseline(groups: jax.Array, eps: float) -> jax.Array:
  """REINFORCE with a group-mean baseline, then whitened over the whole batch (unbiased std).

  The batch-level whitening keeps the advantage scale fixed across steps without the
  per-group std division of GRPO.  All-equal groups are re-zeroed after whitening:
  they carry no signal, and the batch mean shift must not give them one.
  """
  centered = _centered(groups)
  equal = jnp.max(groups, axis=-1, keepdims=True) == jnp.min(groups, axis=-1, keepdims=True)
  whitened = masked_whiten(centered, jnp.ones_like(centered, dtype=bool), eps=eps)
  return jnp.where(equal, 0.0, whitened)


GroupEstimator = Callable[[jax.Array, float], jax.Array]

#: name -> ``fn(groups [P, G] float32, eps) -> advantages [P, G]``.
ADVANTAGE_ESTIMATORS: Mapping[str, GroupEstimator] = {
  "grpo": _grpo,
  "drgrpo": _drgrpo,
  "rloo": _rloo,
  "reinforce_baseline": _reinforce_baseline,
}
#: Every advantage estimator a run can name: the group-relative ones (which need at least
#: two samples per prompt; one sample is its own baseline, so its advantage is 0) and GAE
#: (:func:`gae`, which needs a value model).
ADVANTAGES: tuple[str, ...] = (*ADVANTAGE_ESTIMATORS, "gae")


def _lookup(registry: Mapping[str, Callable], name: str, what: str) -> Callable:
  if name not in registry:
    raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(sorted(registry))}")
  return registry[name]


def group_advantages(scores: ArrayLike, group_size: int, *, mode: str, eps: float = 1e-6) -> jax.Array:
  """Per-sample advantages from a group-relative baseline.

  Modes (see :data:`ADVANTAGE_ESTIMATORS`):

  * ``grpo``: ``(s - mean) / (std + eps)``, unbiased std (Shao et al. 2024).
  * ``drgrpo``: ``s - mean`` (Liu et al. 2025).
  * ``rloo``: ``s - mean(others) = G / (G-1) * (s - mean)`` (Ahmadian et al. 2024).
  * ``reinforce_baseline``: ``s - mean``, then ``(x - mean) / (std + eps)`` over the
    whole batch with the unbiased std.

  A group whose scores are all equal gets exactly 0 in every mode.

  Args:
    scores: float ``[P * G]``; the ``G`` samples of one prompt are contiguous.
    group_size: ``G`` (static); must divide ``len(scores)``; ``>= 2`` for grpo/rloo.
    mode: estimator name (static).
    eps: added to the standard deviation before dividing.

  Returns:
    float32 ``[P * G]``.

  Raises:
    ValueError: unknown mode, bad shape, or a group size the mode cannot use.
  """
  fn = _lookup(ADVANTAGE_ESTIMATORS, mode, "advantage estimator")
  groups = _as_groups(scores, group_size)
  return fn(groups, eps).reshape(-1)


# ---------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------


def _gae_single(
  rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float | jax.Array, lam: float | jax.Array
) -> jax.Array:
  """GAE advantages for one sequence: rewards/values float32 [T], mask bool [T] -> [T]."""
  chex.assert_rank([rewards, values, mask], 1)

  def step(carry, xs):
    next_value, next_adv = carry
    r, v, m = xs
    delta = r + gamma * next_value - v
    adv = delta + gamma * lam * next_adv
    # Invalid positions are transparent: the carry passes through unchanged, so a hole
    # inside a sequence links the valid tokens on either side.
    new_carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
    return new_carry, jnp.where(m, adv, 0.0)

  zero = jnp.zeros((), jnp.float32)
  _, adv = jax.lax.scan(step, (zero, zero), (rewards, values, mask), reverse=True)
  return adv


def gae(
  rewards: ArrayLike,
  values: ArrayLike,
  mask: ArrayLike,
  *,
  gamma: float | jax.Array,
  lam: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Generalised Advantage Estimation, Schulman et al. 2016 (arXiv:1506.02438), Eq. 16.

  ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
  computed backwards with ``jax.lax.scan`` over the valid tokens only: ``t + 1`` is the
  next *valid* token, and the last valid token bootstraps from 0 (the episode ends).

  Args:
    rewards: float ``[B, T]`` per-token rewards (typically non-zero only at the last valid token).
      Rewards at invalid positions are ignored.
    values: float ``[B, T]`` value predictions.
    mask: bool or 0/1 ``[B, T]``, set on valid (completion) tokens; right padding or holes.
    gamma: discount.
    lam: GAE lambda.

  Returns:
    ``(advantages, returns)``, both float32 ``[B, T]``; ``returns = advantages + values``.
    Both are 0 at invalid positions.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  mask = jnp.asarray(mask).astype(bool)
  chex.assert_rank([rewards, values, mask], 2)
  chex.assert_equal_shape([rewards, values, mask])
  gamma = jnp.asarray(gamma, jnp.float32)
  lam = jnp.asarray(lam, jnp.float32)
  adv = jax.vmap(_gae_single, in_axes=(0, 0, 0, None, None))(rewards, values, mask, gamma, lam)
  returns = jnp.where(mask, adv + values, 0.0)
  return adv, returns
