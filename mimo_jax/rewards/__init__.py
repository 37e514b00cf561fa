"""Rule-based rewards: answer extraction and verification for math tasks."""

from mimo_jax.rewards.math import (
  AnswerSource,
  answers_match,
  extract_answer,
  extract_answer_with_source,
  math_reward,
  normalize_number,
  sympy_available,
)

__all__ = [
  "AnswerSource",
  "answers_match",
  "extract_answer",
  "extract_answer_with_source",
  "math_reward",
  "normalize_number",
  "sympy_available",
]
