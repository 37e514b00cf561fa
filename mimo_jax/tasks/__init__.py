"""Built-in tasks: problem generators with rule-based verifiers."""

from mimo_jax.tasks.arith import (
  ALPHABET,
  LEVELS,
  TASK_NAME,
  ArithTask,
  LevelSpec,
  Problem,
  build_tokenizer,
  count_carries,
  make_problem,
  no_carry_sum,
  parse_operands,
  prompt_uid,
)

__all__ = [
  "ALPHABET",
  "LEVELS",
  "TASK_NAME",
  "ArithTask",
  "LevelSpec",
  "Problem",
  "build_tokenizer",
  "count_carries",
  "make_problem",
  "no_carry_sum",
  "parse_operands",
  "prompt_uid",
]
