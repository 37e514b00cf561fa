"""Off-policy corrections for samples the learner did not generate itself.

A row of an Experience was drawn by the *behaviour* policy ``mu``: the sampler, with the
weights of some earlier learner step (async rollout lags the learner by up to
``--max_staleness`` updates) and its own numerics and truncation (top-k/top-p).  The learner
rescores every row under its current weights, the *proximal* policy ``pi_prox``; the PPO ratio
and its clip are taken against ``pi_prox``.  What is left is the gap ``pi_prox / mu`` between
the policy the clip trusts and the one that drew the sample.  Each correction turns it into a
non-negative, gradient-free weight per token; the learner multiplies the advantages by it
(for ``w >= 0``, ``w * min(r A, clip(r) A) = min(r (w A), clip(r) (w A))``, so weighting the
advantage weights every policy-loss term, dual clip included):

* ``none``: weight 1 (stale samples are treated as the proximal policy's own).
* ``tis``: token-level truncated IS, ``w_t = min(pi_prox / mu, C)`` (Yao et al. 2025,
  "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").
* ``mis``: sequence-level masked IS: a row whose sequence ratio lies outside ``[1/C, C]``
  is dropped (weight 0), every other row keeps weight 1 (Liu et al. 2025).  The sequence
  ratio is the per-token geometric mean ``exp(mean_t log(pi_prox / mu))``, so one threshold
  serves every completion length.
* ``decoupled``: decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025): the behaviour
  weight ``w_t = pi_prox / mu`` itself, and a token whose weight exceeds ``C`` is masked
  (weight 0) rather than truncated.

Every function is pure and jit-safe; log-ratios are clamped before ``exp`` so a token the
behaviour policy found nearly impossible cannot overflow.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from mimo_jax.rl.advantages import masked_mean
from mimo_jax.rl.kl import kl_estimate

__all__ = ["IS_CORRECTIONS", "behaviour_gap", "importance_weights"]

#: The corrections a run can name (``--is_correction``).
IS_CORRECTIONS = ("none", "tis", "mis", "decoupled")

_LOG_RATIO_CLAMP = 20.0


def importance_weights(
  proximal_logp: ArrayLike,
  behaviour_logp: ArrayLike,
  mask: ArrayLike,
  *,
  mode: str,
  clip: float,
) -> tuple[jax.Array, Mapping[str, jax.Array]]:
  """Per-token weights correcting samples of ``mu`` toward ``pi_prox`` (see the module docstring).

  Args:
    proximal_logp: float ``[B, M]``, the learner's log-probs of the sampled tokens.
    behaviour_logp: float ``[B, M]``, the behaviour policy's (the sampler's) log-probs.
    mask: bool ``[B, M]``, the completion tokens.
    mode: one of :data:`IS_CORRECTIONS` (static).
    clip: the threshold ``C >= 1`` (static).

  Returns:
    ``(weights, metrics)``: float32 ``[B, M]`` weights (0 off the mask, gradient-free), and
    ``is_ratio_mean`` / ``is_ratio_max`` (the raw token ratio ``pi_prox / mu`` over the mask)
    and ``is_clipfrac`` (the share of completion tokens whose weight the correction changed
    from the raw ratio by truncating or masking; 0 for ``none``).

  Raises:
    ValueError: an unknown mode or a threshold below 1.
  """
  if mode not in IS_CORRECTIONS:
    raise ValueError(f"unknown IS correction {mode!r}; allowed: {', '.join(IS_CORRECTIONS)}")
  if not clip >= 1:
    raise ValueError(f"the IS threshold must be >= 1, got {clip}")
  mask = jnp.asarray(mask, bool)
  log_ratio = jnp.asarray(proximal_logp, jnp.float32) - jnp.asarray(behaviour_logp, jnp.float32)
  log_ratio = jax.lax.stop_gradient(jnp.where(mask, jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), 0.0))
  ratio = jnp.exp(log_ratio)
  ones = jnp.where(mask, 1.0, 0.0)
  if mode == "none":
    weights, changed = ones, jnp.zeros_like(mask)
  elif mode == "tis":
    weights = jnp.where(mask, jnp.minimum(ratio, clip), 0.0)
    changed = mask & (ratio > clip)
  elif mode == "mis":
    tokens = jnp.maximum(jnp.sum(mask, axis=-1), 1)
    seq_ratio = jnp.exp(jnp.sum(log_ratio, axis=-1) / tokens)
    keep = (seq_ratio <= clip) & (seq_ratio >= 1.0 / clip)
    weights = jnp.where(keep[:, None], ones, 0.0)
    changed = mask & ~keep[:, None]
  else:  # decoupled
    keep = ratio <= clip
    weights = jnp.where(mask & keep, ratio, 0.0)
    changed = mask & ~keep
  metrics = {
    "is_ratio_mean": masked_mean(ratio, mask),
    "is_ratio_max": jnp.max(jnp.where(mask, ratio, 0.0)),
    "is_clipfrac": masked_mean(changed.astype(jnp.float32), mask),
  }
  return weights, metrics


def behaviour_gap(proximal_logp: ArrayLike, behaviour_logp: ArrayLike, mask: ArrayLike) -> jax.Array:
  """The k3 estimate of ``KL(mu || pi_prox)`` per completion token, from the behaviour policy's samples.

  Logged every step as ``sampler_learner_kl``: on a synchronous run it measures the numerical
  (and top-k/top-p truncation) mismatch between the sampler and the learner alone; with
  async rollout it adds the policy's drift over the sample's staleness.
  """
  mask = jnp.asarray(mask, bool)
  kl = kl_estimate(jnp.asarray(behaviour_logp, jnp.float32), jnp.asarray(proximal_logp, jnp.float32), "k3")
  return masked_mean(jnp.where(mask, kl, 0.0), mask)
