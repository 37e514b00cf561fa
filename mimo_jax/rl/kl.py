"""Per-token KL-divergence estimators between the policy and a reference policy.

The estimators follow J. Schulman, "Approximating KL divergence" (2020 blog post), with
samples drawn from the current policy ``pi`` and ``r = ref(x) / pi(x)``:

* ``k1 = -log r``: unbiased for KL(pi || ref), high variance, can be negative.
* ``k2 = 0.5 (log r)^2``: biased but low variance; its gradient matches the KL's to first order.
* ``k3 = (r - 1) - log r``: unbiased and always >= 0 (used by GRPO, Shao et al. 2024, Eq. 4).
* ``abs = |log r|``: a non-negative magnitude, for logging or a penalty.

Which one runs is a static string looked up in :data:`KL_ESTIMATORS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["KL_ESTIMATORS", "kl_estimate"]

# exp(20) ~ 5e8 is far beyond any ratio that matters; clamping before exp keeps k3
# finite when a token is near-impossible under one of the two policies.
_LOG_RATIO_CLAMP = 20.0
# A single outlier token should not dominate the penalty; bound its k3 contribution.
_K3_CLAMP = 10.0


def _k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  return logp - ref_logp


def _k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  return 0.5 * jnp.square(logp - ref_logp)


def _k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  log_r = jnp.clip(ref_logp - logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(log_r) - log_r - 1.0, -_K3_CLAMP, _K3_CLAMP)


def _abs(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  return jnp.abs(logp - ref_logp)


KLEstimator = Callable[[jax.Array, jax.Array], jax.Array]

#: name -> ``fn(logp, ref_logp) -> per-token estimate``, all float32 of the same shape.
KL_ESTIMATORS: Mapping[str, KLEstimator] = {
  "k1": _k1,
  "k2": _k2,
  "k3": _k3,
  "abs": _abs,
}


def kl_estimate(logp: ArrayLike, ref_logp: ArrayLike, kind: str) -> jax.Array:
  """Elementwise estimate of KL(pi || ref) from sampled-token log-probs.

  Estimators from Schulman (2020), "Approximating KL divergence":

  * ``k1 = logp - ref_logp``
  * ``k2 = 0.5 * (logp - ref_logp)^2``
  * ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1``, with the log-ratio clamped to
    [-20, 20] before ``exp`` and the result clamped to [-10, 10].
  * ``abs = |logp - ref_logp|``

  Args:
    logp: float ``[...]`` log-probs of the sampled tokens under the policy.
    ref_logp: float, same shape, under the reference policy.
    kind: estimator name (static), one of :data:`KL_ESTIMATORS`.

  Returns:
    float32 array of the input shape.  No masking is applied; the caller aggregates.

  Raises:
    ValueError: unknown ``kind``.
  """
  if kind not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(sorted(KL_ESTIMATORS))}")
  logp = jnp.asarray(logp, jnp.float32)
  ref_logp = jnp.asarray(ref_logp, jnp.float32)
  return KL_ESTIMATORS[kind](logp, ref_logp)
