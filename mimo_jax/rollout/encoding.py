"""Text <-> token batches for the sampler: prompts left-padded to a bucket, targets right-padded, completions
decoded; and the sampling parameters of a run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mimo_jax import multihost
from mimo_jax.config import RolloutConfig
from mimo_jax.rollout.sampler import RolloutOutput, bucket_for, left_pad
from mimo_jax.rollout.sampling import SamplingParams
from mimo_jax.tokenization import Tokenizer, keep_last_tokens


def sampling_params(cfg: RolloutConfig, tokenizer: Tokenizer) -> SamplingParams:
  """The run's static sampling parameters: its top-k/top-p, the tokenizer's stop ids (EOS, and a chat
  model's end of turn)."""
  return SamplingParams(
    top_k=cfg.top_k,
    top_p=cfg.top_p,
    stop_ids=tokenizer.stop_ids,
    pad_id=tokenizer.pad_id,
    vocab_limit=tokenizer.vocab_size,  # a padded model vocabulary never samples ids the tokenizer lacks
  )


def encode_prompts(
  tokenizer: Tokenizer, prompts: Sequence[str], buckets: Sequence[int], num_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
  """Tokenizes (:meth:`Tokenizer.encode_prompt`: after BOS, or through the model's chat template), left-pads
  to a bucket, and pads the row count with 1-token fillers.

  A prompt longer than the largest bucket keeps its BOS and its last tokens (where the
  question ends and the answer cue sits), so shapes stay static.

  Returns:
    ``(tokens [rows, P], mask [rows, P], number of prompts that were cut)``.
  """
  limit = max(buckets)
  full = [tokenizer.encode_prompt(p) for p in prompts]
  truncated = sum(len(i) > limit for i in full)
  ids = [keep_last_tokens(i, limit, tokenizer.bos_id) for i in full]
  rows = num_rows or len(ids)
  ids += [[tokenizer.pad_id]] * (rows - len(ids))
  tokens, mask = left_pad(ids, bucket_for(max(len(i) for i in ids), buckets), tokenizer.pad_id)
  return tokens, mask, truncated


def encode_targets(tokenizer: Tokenizer, completions: Sequence[str], length: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Right-pads completion tokens (+ EOS) to ``length``; over-long targets keep their first ``length``
  tokens (their end, and the EOS, cut).

  Returns:
    ``(tokens [rows, length], mask [rows, length], number of targets that were cut)``.
  """
  tokens = np.full((len(completions), length), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(completions), length), bool)
  truncated = 0
  for i, c in enumerate(completions):
    ids = tokenizer.encode(c, add_eos=True)
    truncated += len(ids) > length
    ids = ids[:length]
    tokens[i, : len(ids)] = ids
    mask[i, : len(ids)] = True
  return tokens, mask, truncated


def decode_completions(tokenizer: Tokenizer, rollout: RolloutOutput, rows: np.ndarray | None = None) -> list[str]:
  """The completions' texts: of every row (gathered from all processes in a multi-process run), or of
  ``rows`` only, which must be this process's own (:func:`mimo_jax.multihost.local_rows`)."""
  if rows is None:
    tokens, lengths = multihost.to_host((rollout.completion_tokens, rollout.lengths))
  else:
    tokens = multihost.local_data(rollout.completion_tokens, rows)
    lengths = multihost.local_data(rollout.lengths, rows)
  return [tokenizer.decode(tokens[i, : lengths[i]].tolist()) for i in range(tokens.shape[0])]
