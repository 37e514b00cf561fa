"""Evaluation: the unbiased pass@k estimator and held-out evaluation of a policy."""

from mimo_jax.eval.metrics import majority_at_k, pass_at_k

__all__ = ["majority_at_k", "pass_at_k"]
