"""Evaluation: the unbiased pass@k estimator and held-out evaluation of a policy.

:mod:`mimo_jax.eval.metrics` holds the estimators; :mod:`mimo_jax.eval.evaluator` builds on
the trainer (it reuses its run construction and prompt encoding) and is what the trainer's
periodic evaluation and ``python -m mimo_jax.eval`` call.
"""

from mimo_jax.eval.evaluator import (
  DEFAULT_ANSWER_FNS,
  AnswerFn,
  ProblemResult,
  config_from_dict,
  default_answer_fn,
  default_ks,
  evaluate_checkpoint,
  evaluate_policy,
  load_run_config,
  resolve_checkpoint,
  samples_per_call,
  summarize,
)
from mimo_jax.eval.metrics import majority_at_k, pass_at_k

__all__ = [
  "DEFAULT_ANSWER_FNS",
  "AnswerFn",
  "ProblemResult",
  "config_from_dict",
  "default_answer_fn",
  "default_ks",
  "evaluate_checkpoint",
  "evaluate_policy",
  "load_run_config",
  "majority_at_k",
  "pass_at_k",
  "resolve_checkpoint",
  "samples_per_call",
  "summarize",
]
