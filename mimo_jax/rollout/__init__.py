"""Rollout: jitted KV-cache generation with group sampling and exact log-probs."""

from mimo_jax.rollout.sampler import (
  DEFAULT_PROMPT_BUCKETS,
  FINISH_LENGTH,
  FINISH_STOP,
  RolloutOutput,
  Sampler,
  bucket_for,
  generate,
  left_pad,
)
from mimo_jax.rollout.sampling import SamplingParams, sample_tokens, truncate_logits

__all__ = [
  "DEFAULT_PROMPT_BUCKETS",
  "FINISH_LENGTH",
  "FINISH_STOP",
  "RolloutOutput",
  "Sampler",
  "SamplingParams",
  "bucket_for",
  "generate",
  "left_pad",
  "sample_tokens",
  "truncate_logits",
]
