"""RL math for LLM training: advantage estimators, KL estimators, policy/value losses.

Everything here is a pure, jit-compatible function of arrays; variants are chosen by
static names from the registries re-exported below, so config validation can list them.
"""

from mimo_jax.rl import advantages, importance, kl, losses
from mimo_jax.rl.advantages import (
  ADVANTAGE_ESTIMATORS,
  ADVANTAGES,
  gae,
  group_advantages,
  group_all_equal,
  group_stats,
  masked_mean,
  masked_var,
  masked_whiten,
)
from mimo_jax.rl.importance import IS_CORRECTIONS, behaviour_gap, importance_weights
from mimo_jax.rl.kl import KL_ESTIMATORS, kl_estimate
from mimo_jax.rl.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, entropy_from_logits, policy_loss, value_loss

__all__ = [
  "ADVANTAGES",
  "ADVANTAGE_ESTIMATORS",
  "AGGREGATIONS",
  "IS_CORRECTIONS",
  "KL_ESTIMATORS",
  "POLICY_LOSSES",
  "advantages",
  "aggregate",
  "behaviour_gap",
  "entropy_from_logits",
  "gae",
  "group_advantages",
  "group_all_equal",
  "group_stats",
  "importance",
  "importance_weights",
  "kl",
  "kl_estimate",
  "losses",
  "masked_mean",
  "masked_var",
  "masked_whiten",
  "policy_loss",
  "value_loss",
]
