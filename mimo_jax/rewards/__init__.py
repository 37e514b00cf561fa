"""Rewards: one interface for every source, mixed per task, run in worker processes with timeouts.

* :mod:`~mimo_jax.rewards.base`: ``RewardSample`` in, one float plus named components out;
  ``CompositeReward`` (weighted sources, per-task normalisation, failures recorded) and
  ``RewardPool`` (worker processes, per-sample timeouts).
* Rule rewards: :mod:`~mimo_jax.rewards.math` (answer extraction and matching),
  :mod:`~mimo_jax.rewards.format` (JSON schema, sections, math format),
  :mod:`~mimo_jax.rewards.code` (unit tests in :mod:`~mimo_jax.rewards.sandbox`, hacking probe).
* Learned rewards: :mod:`~mimo_jax.rewards.reward_model` (Bradley-Terry) and
  :mod:`~mimo_jax.rewards.judge` (model as judge); import them directly (they build JAX models).
* :mod:`~mimo_jax.rewards.task_rewards`: the trainer's composite reward for a task.
"""

from mimo_jax.rewards.base import CompositeReward, Outcome, RewardBatch, RewardPool, RewardSample, RewardSource
from mimo_jax.rewards.code import extract_code, probe_components, unit_test_result, unit_test_reward, weak_test_reward
from mimo_jax.rewards.format import json_reward, math_correct, math_format, sections_reward
from mimo_jax.rewards.math import (
  AnswerSource,
  answers_match,
  extract_answer,
  extract_answer_with_source,
  math_reward,
  normalize_number,
  sympy_available,
)
from mimo_jax.rewards.sandbox import SandboxResult, run_python

__all__ = [
  "AnswerSource",
  "CompositeReward",
  "Outcome",
  "RewardBatch",
  "RewardPool",
  "RewardSample",
  "RewardSource",
  "SandboxResult",
  "answers_match",
  "extract_answer",
  "extract_answer_with_source",
  "extract_code",
  "json_reward",
  "math_correct",
  "math_format",
  "math_reward",
  "normalize_number",
  "probe_components",
  "run_python",
  "sections_reward",
  "sympy_available",
  "unit_test_reward",
  "unit_test_result",
  "weak_test_reward",
]
