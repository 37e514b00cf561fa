"""Policy-gradient and value losses, with the loss aggregations used by PPO-style RL for LLMs.

Losses are computed per token and then reduced by :func:`aggregate`.  The variant of
each is a static string looked up in a registry (:data:`POLICY_LOSSES`,
:data:`AGGREGATIONS`), so configs can list and validate names before any compute.

Gradient accumulation: pass the *global* ``num_tokens`` / ``num_seqs`` of the whole
batch to every micro-batch call.  Each micro-batch then contributes its share of the
full-batch mean, and the sum of micro-batch losses (and of their gradients) equals the
full-batch loss (and gradient).  Without them, each micro-batch is normalised by its
own counts, and averaging micro-batches over-weights short ones.

Every function is a pure function of arrays and static Python scalars/strings, safe
under ``jax.jit``; all math is float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from mimo_jax.rl.advantages import masked_mean

__all__ = [
  "AGGREGATIONS",
  "POLICY_LOSSES",
  "aggregate",
  "entropy_from_logits",
  "policy_loss",
  "value_loss",
]

Scalar = float | int | jax.Array

# Log-ratios beyond +-20 (ratio ~5e8) only arise from stale or broken log-probs; clamping
# before exp keeps the loss finite.  The clamp zeroes the gradient of such tokens, which
# every variant would clip away anyway.
_LOG_RATIO_CLAMP = 20.0


def _lookup(registry: Mapping[str, Callable], name: str, what: str) -> Callable:
  if name not in registry:
    raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(sorted(registry))}")
  return registry[name]


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
  """num / den where den > 0, else 0; the inner where keeps gradients finite too."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


# ---------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------


def _seq_count(m: jax.Array, num_seqs: Scalar | None) -> jax.Array:
  """Sequences with at least one valid token: padding rows must not dilute the mean."""
  if num_seqs is not None:
    return jnp.asarray(num_seqs, jnp.float32)
  return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))


def _token_mean(x, m, norm, num_tokens, num_seqs):
  del norm, num_seqs
  den = jnp.sum(m) if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
  return _safe_div(jnp.sum(x * m), den)


def _seq_mean_token_mean(x, m, norm, num_tokens, num_seqs):
  del norm, num_tokens
  # The per-sequence mean uses that sequence's own length, which a micro-batch always
  # holds in full, so only the sequence count needs to be global.
  per_seq = _safe_div(jnp.sum(x * m, axis=-1), jnp.sum(m, axis=-1))
  return _safe_div(jnp.sum(per_seq), _seq_count(m, num_seqs))


def _seq_mean_token_sum(x, m, norm, num_tokens, num_seqs):
  del norm, num_tokens
  return _safe_div(jnp.sum(x * m), _seq_count(m, num_seqs))


def _seq_mean_token_sum_norm(x, m, norm, num_tokens, num_seqs):
  del num_tokens
  if norm is None:
    raise ValueError("agg='seq-mean-token-sum-norm' needs norm (e.g. the maximum completion length)")
  return _safe_div(jnp.sum(x * m) / jnp.asarray(norm, jnp.float32), _seq_count(m, num_seqs))


Aggregation = Callable[[jax.Array, jax.Array, Scalar | None, Scalar | None, Scalar | None], jax.Array]

#: name -> ``fn(x [B, T], mask float [B, T], norm, num_tokens, num_seqs) -> scalar``.
AGGREGATIONS: Mapping[str, Aggregation] = {
  "token-mean": _token_mean,
  "seq-mean-token-mean": _seq_mean_token_mean,
  "seq-mean-token-sum": _seq_mean_token_sum,
  "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
  x: ArrayLike,
  mask: ArrayLike,
  mode: str,
  *,
  norm: Scalar | None = None,
  num_tokens: Scalar | None = None,
  num_seqs: Scalar | None = None,
) -> jax.Array:
  """Reduces a per-token quantity to a scalar loss.

  Modes:

  * ``token-mean``: ``sum(x * mask) / num_tokens``; every token weighs the same, so long
    sequences are not down-weighted (DAPO, Yu et al. 2025, "token-level policy gradient loss").
  * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (GRPO,
    Shao et al. 2024, Eq. 3).
  * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
  * ``seq-mean-token-sum-norm``: mean over sequences of ``token sum / norm`` with a
    constant ``norm`` (Dr. GRPO, Liu et al. 2025: removes the length bias of the per-sequence mean).

  In the ``seq-mean-*`` modes, sequences without a valid token contribute 0 and are not
  counted.

  Gradient accumulation: ``num_tokens`` (token-mean) and ``num_seqs`` (seq-mean-*) are
  the counts of the *whole* batch (scalars; traced arrays are fine).  When given, they
  replace the local denominators, so summing ``aggregate`` over the micro-batches of a
  batch equals ``aggregate`` on the whole batch.  ``num_seqs`` must then count only the
  sequences with at least one valid token.  Counts a mode does not use are ignored.

  Args:
    x: float ``[B, T]`` per-token values.
    mask: bool or 0/1 ``[B, T]`` of valid tokens.
    mode: aggregation name (static), one of :data:`AGGREGATIONS`.
    norm: the constant divisor of ``seq-mean-token-sum-norm`` (required there, ignored elsewhere).
    num_tokens: global number of valid tokens, or ``None`` for the local count.
    num_seqs: global number of non-empty sequences, or ``None`` for the local count.

  Returns:
    float32 scalar (0 when there is nothing to average).

  Raises:
    ValueError: unknown mode, or ``seq-mean-token-sum-norm`` without ``norm``.
  """
  fn = _lookup(AGGREGATIONS, mode, "aggregation")
  x = jnp.asarray(x, jnp.float32)
  chex.assert_rank(x, 2)
  m = jnp.broadcast_to(jnp.asarray(mask).astype(jnp.float32), x.shape)
  # Padding may hold inf/NaN (e.g. log-probs of pad tokens); 0 * inf would poison the sum.
  x = jnp.where(m > 0, x, 0.0)
  return fn(x, m, norm, num_tokens, num_seqs)


# ---------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------

# Each variant maps (logp, old_logp, advantages, mask, clip_low, clip_high, clip_c), all
# float32 [B, T] except the bool mask and the scalars, to:
#   per-token loss [B, T], the ratio the clip acts on [B, T], dual-clip active (bool [B, T]).
PolicyLossFn = Callable[
  [jax.Array, jax.Array, jax.Array, jax.Array, Scalar, Scalar, Scalar | None],
  tuple[jax.Array, jax.Array, jax.Array],
]


def _token_ratio(logp: jax.Array, old_logp: jax.Array) -> jax.Array:
  return jnp.exp(jnp.clip(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _clipped_objective(ratio: jax.Array, adv: jax.Array, clip_low: Scalar, clip_high: Scalar) -> jax.Array:
  """PPO's pessimistic surrogate min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
  return jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)


def _ppo(logp, old_logp, adv, mask, clip_low, clip_high, clip_c):
  """PPO clipped surrogate (Schulman et al. 2017, Eq. 7), asymmetric clip-higher (DAPO,
  Yu et al. 2025, Eq. 10), optional dual clip (Ye et al. 2020, Eq. 5)."""
  del mask
  ratio = _token_ratio(logp, old_logp)
  obj = _clipped_objective(ratio, adv, clip_low, clip_high)
  if clip_c is None:
    return -obj, ratio, jnp.zeros(obj.shape, bool)
  # With A < 0 the min() above is unbounded below as the ratio grows; the dual clip
  # floors the objective at c * A so one very off-policy token cannot dominate.
  dual = clip_c * adv
  dual_active = (adv < 0) & (dual > obj)
  obj = jnp.where(adv < 0, jnp.maximum(obj, dual), obj)
  return -obj, ratio, dual_active


def _gspo(logp, old_logp, adv, mask, clip_low, clip_high, clip_c):
  """GSPO (Zheng et al. 2025), GSPO-token form (Eq. 13-14).

  s_i = exp(mean_t log(pi / pi_old)) is the length-normalised sequence ratio.  The token
  ratio sg[s_i] * pi / sg[pi] has value s_i but the gradient of s_i * log pi per token,
  so per-token advantages remain possible; with sequence-level advantages and
  ``seq-mean-token-mean`` aggregation it equals sequence-level GSPO exactly.
  """
  del clip_c
  seq_log_ratio = masked_mean(logp - old_logp, mask, axis=-1)
  seq_ratio = jnp.exp(jnp.clip(seq_log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
  ratio = jax.lax.stop_gradient(seq_ratio)[:, None] * jnp.exp(logp - jax.lax.stop_gradient(logp))
  obj = _clipped_objective(ratio, adv, clip_low, clip_high)
  return -obj, ratio, jnp.zeros(obj.shape, bool)


def _cispo(logp, old_logp, adv, mask, clip_low, clip_high, clip_c):
  """CISPO (MiniMax-M1, 2025, Eq. 4-5): REINFORCE on log pi weighted by the clipped,
  stop-gradient IS ratio.  Unlike PPO no token's gradient is dropped; clipping only
  bounds its weight."""
  del mask, clip_c
  ratio = _token_ratio(logp, old_logp)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
  return -weight * adv * logp, ratio, jnp.zeros(logp.shape, bool)


#: name -> per-token policy loss variant (see ``PolicyLossFn``).
POLICY_LOSSES: Mapping[str, PolicyLossFn] = {
  "ppo": _ppo,
  "gspo": _gspo,
  "cispo": _cispo,
}


def policy_loss(
  logp: ArrayLike,
  old_logp: ArrayLike,
  advantages: ArrayLike,
  mask: ArrayLike,
  *,
  mode: str,
  clip_low: Scalar,
  clip_high: Scalar,
  clip_c: Scalar | None = None,
  agg: str = "token-mean",
  norm: Scalar | None = None,
  num_tokens: Scalar | None = None,
  num_seqs: Scalar | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped policy-gradient loss for one (micro-)batch.

  With ``r = exp(logp - old_logp)`` and advantage ``A``:

  * ``ppo``: ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` (PPO, Schulman et al.
    2017, Eq. 7; asymmetric "clip-higher" bounds from DAPO, Yu et al. 2025, Eq. 10).  With
    ``clip_c``, dual clip for ``A < 0`` (Ye et al. 2020, Eq. 5): the objective is
    ``max(min(...), clip_c A)``, i.e. the loss is at most ``-clip_c A``.
  * ``gspo``: same surrogate with the sequence ratio ``s_i = exp(mean_t log r)`` in
    GSPO-token form, value ``s_i`` and gradient ``s_i * grad logp`` per token (Zheng et al.
    2025, Eq. 13-14).  No dual clip.
  * ``cispo``: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp`` (MiniMax-M1 2025, Eq. 4).
    The paper clips only from above; pass a large ``clip_low`` (e.g. 1.0) to match.

  The per-token loss is reduced with :func:`aggregate` (``agg``, ``norm``, ``num_tokens``,
  ``num_seqs``; see there for gradient accumulation).  ``old_logp`` and ``advantages``
  are treated as constants (no gradient).  Positions outside ``mask`` are ignored, even
  if they hold inf/NaN.

  Args:
    logp: float ``[B, T]`` log-probs of the sampled tokens under the current policy.
    old_logp: float ``[B, T]`` log-probs under the behaviour policy that sampled them.
    advantages: float ``[B]`` (per sequence, broadcast over tokens) or ``[B, T]`` (per token, e.g. GAE).
    mask: bool or 0/1 ``[B, T]`` of valid (completion) tokens.
    mode: policy loss name (static), one of :data:`POLICY_LOSSES`.
    clip_low: lower clip epsilon (ratio floor ``1 - clip_low``).
    clip_high: upper clip epsilon (ratio ceiling ``1 + clip_high``).
    clip_c: dual-clip constant (> 1), ``ppo`` only; ``None`` disables it.
    agg: aggregation name (static), one of :data:`AGGREGATIONS`.
    norm: divisor for ``seq-mean-token-sum-norm``.
    num_tokens: global valid-token count for gradient accumulation.
    num_seqs: global non-empty sequence count for gradient accumulation.

  Returns:
    ``(loss, metrics)``: float32 scalar loss, and float32 scalar metrics (token-masked
    means over this micro-batch, gradient-stopped):

    * ``clipfrac_high``: fraction of tokens with ``A > 0`` and ``r > 1 + clip_high``.
    * ``clipfrac_low``: fraction with ``A < 0`` and ``r < 1 - clip_low``.
    * ``clipfrac``: their sum.
    * ``dual_clip_frac``: fraction where the dual clip is active (0 unless ``ppo`` with ``clip_c``).
    * ``approx_kl``: mean of ``0.5 (logp - old_logp)^2`` (k2 estimator vs the old policy).
    * ``ratio_mean`` / ``ratio_max``: of ``r`` (of ``s_i`` for ``gspo``).

  Raises:
    ValueError: unknown ``mode``/``agg``, bad shapes, or ``clip_c`` with a mode other than ``ppo``
      or not > 1.
  """
  loss_fn = _lookup(POLICY_LOSSES, mode, "policy loss")
  _lookup(AGGREGATIONS, agg, "aggregation")  # fail on a bad name before tracing any math
  if clip_c is not None:
    if mode != "ppo":
      raise ValueError(f"clip_c (dual clip) is only defined for mode='ppo', got mode={mode!r}")
    if isinstance(clip_c, int | float) and clip_c <= 1:
      raise ValueError(f"clip_c must be > 1, got {clip_c}")

  logp = jnp.asarray(logp, jnp.float32)
  old_logp = jnp.asarray(old_logp, jnp.float32)
  advantages = jnp.asarray(advantages, jnp.float32)
  mask = jnp.asarray(mask).astype(bool)
  chex.assert_rank([logp, old_logp, mask], 2)
  chex.assert_equal_shape([logp, old_logp, mask])
  if advantages.ndim == 1:
    chex.assert_shape(advantages, logp.shape[:1])
    advantages = advantages[:, None]
  elif advantages.ndim == 2:
    chex.assert_equal_shape([advantages, logp])
  else:
    raise ValueError(f"advantages must be [B] or [B, T], got shape {advantages.shape}")
  advantages = jnp.broadcast_to(jax.lax.stop_gradient(advantages), logp.shape)
  advantages = jnp.where(mask, advantages, 0.0)

  # Pad positions may hold -inf or garbage; zero them so exp() and the GSPO sequence mean
  # stay finite.  where() also routes no gradient to them.
  logp = jnp.where(mask, logp, 0.0)
  old_logp = jax.lax.stop_gradient(jnp.where(mask, old_logp, 0.0))

  token_loss, ratio, dual_active = loss_fn(logp, old_logp, advantages, mask, clip_low, clip_high, clip_c)
  loss = aggregate(token_loss, mask, agg, norm=norm, num_tokens=num_tokens, num_seqs=num_seqs)

  r = jax.lax.stop_gradient(ratio)
  high = masked_mean((advantages > 0) & (r > 1.0 + clip_high), mask)
  low = masked_mean((advantages < 0) & (r < 1.0 - clip_low), mask)
  metrics = {
    "clipfrac_high": high,
    "clipfrac_low": low,
    "clipfrac": high + low,
    "dual_clip_frac": masked_mean(dual_active, mask),
    "approx_kl": masked_mean(0.5 * jnp.square(jax.lax.stop_gradient(logp) - old_logp), mask),
    "ratio_mean": masked_mean(r, mask),
    # Ratios are positive, so 0 at padding never wins the max (and an empty batch gives 0).
    "ratio_max": jnp.max(jnp.where(mask, r, 0.0)),
  }
  return loss, metrics


# ---------------------------------------------------------------------------
# Value loss and entropy
# ---------------------------------------------------------------------------


def value_loss(
  values: ArrayLike,
  old_values: ArrayLike,
  returns: ArrayLike,
  mask: ArrayLike,
  *,
  clip: Scalar,
  agg: str = "token-mean",
  norm: Scalar | None = None,
  num_tokens: Scalar | None = None,
  num_seqs: Scalar | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss, as in the PPO reference implementation (Schulman et al. 2017, openai/baselines).

  ``0.5 * max((v - R)^2, (v_old + clip(v - v_old, -clip, clip) - R)^2)``: the pessimistic
  choice keeps the critic from moving further than ``clip`` from its rollout-time
  prediction in the direction that helps the loss.

  Args:
    values: float ``[B, T]`` current value predictions.
    old_values: float ``[B, T]`` predictions at rollout time.
    returns: float ``[B, T]`` targets (e.g. from :func:`mimo_jax.rl.advantages.gae`).
    mask: bool or 0/1 ``[B, T]`` of valid tokens.
    clip: value clip range.
    agg: aggregation name (static), one of :data:`AGGREGATIONS`.
    norm: divisor for ``seq-mean-token-sum-norm``.
    num_tokens: global valid-token count for gradient accumulation.
    num_seqs: global non-empty sequence count for gradient accumulation.

  Returns:
    ``(loss, metrics)``: float32 scalar loss; metrics (float32 scalars, token-masked
    means, gradient-stopped) ``vf_clipfrac`` (fraction where the clipped term is strictly
    larger) and ``value_mean``.
  """
  values = jnp.asarray(values, jnp.float32)
  old_values = jnp.asarray(old_values, jnp.float32)
  returns = jnp.asarray(returns, jnp.float32)
  mask = jnp.asarray(mask).astype(bool)
  chex.assert_rank([values, old_values, returns, mask], 2)
  chex.assert_equal_shape([values, old_values, returns, mask])
  values = jnp.where(mask, values, 0.0)
  old_values = jax.lax.stop_gradient(jnp.where(mask, old_values, 0.0))
  returns = jax.lax.stop_gradient(jnp.where(mask, returns, 0.0))

  v_clipped = old_values + jnp.clip(values - old_values, -clip, clip)
  unclipped = jnp.square(values - returns)
  clipped = jnp.square(v_clipped - returns)
  loss = aggregate(
    0.5 * jnp.maximum(unclipped, clipped), mask, agg, norm=norm, num_tokens=num_tokens, num_seqs=num_seqs
  )
  metrics = {
    "vf_clipfrac": masked_mean(jax.lax.stop_gradient(clipped > unclipped), mask),
    "value_mean": masked_mean(jax.lax.stop_gradient(values), mask),
  }
  return loss, metrics


def entropy_from_logits(logits: ArrayLike) -> jax.Array:
  """Entropy of the categorical distribution at each position.

  ``H = logsumexp(z) - sum softmax(z) * z``, computed in float32 after subtracting the
  per-position max (entropy is shift-invariant, and the shift avoids cancellation
  between two large terms).  ``-inf`` logits (masked vocabulary) are handled.

  Args:
    logits: float ``[B, T, V]`` (any leading shape works; the last axis is the vocabulary).

  Returns:
    float32 ``[B, T]``.
  """
  z = jnp.asarray(logits, jnp.float32)
  z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
  p = jnp.exp(z - lse)
  # 0 * -inf is NaN; a zero-probability entry contributes nothing to the entropy.
  pz = p * jnp.where(p > 0, z, 0.0)
  return lse[..., 0] - jnp.sum(pz, axis=-1)
