"""Evaluation: the unbiased pass@k estimator and held-out evaluation of a policy.

``evaluate_policy`` and friends live in :mod:`mimo_jax.eval.evaluator`, which builds on the
trainer (``mimo_jax.train.loop``); the trainer imports this package for ``pass_at_k``, so
they are re-exported lazily to keep that import free of cycles.
"""

from typing import Any

from mimo_jax.eval.metrics import majority_at_k, pass_at_k

_EVALUATOR = (
  "DEFAULT_ANSWER_FNS",
  "AnswerFn",
  "ProblemResult",
  "config_from_dict",
  "default_answer_fn",
  "default_ks",
  "evaluate_checkpoint",
  "evaluate_policy",
  "load_run_config",
  "resolve_checkpoint",
  "samples_per_call",
  "summarize",
)

__all__ = ["majority_at_k", "pass_at_k", *_EVALUATOR]


def __getattr__(name: str) -> Any:
  if name in _EVALUATOR:
    from mimo_jax.eval import evaluator

    return getattr(evaluator, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
