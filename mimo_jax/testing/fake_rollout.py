"""A scripted rollout with the :class:`~mimo_jax.rollout.Sampler` interface, for tests.

Completions come from a callback instead of the model, so reward, advantage and
logging code can be tested against known answers.  Log-probs are zeros (the trainer
recomputes behaviour log-probs with the policy anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax.rollout import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams

# respond(prompt_token_ids, sample_index) -> completion token ids (without padding)
Responder = Callable[[Sequence[int], int], Sequence[int]]


class FakeRollout:
  """Implements ``generate`` / ``per_token_logps`` / ``update_params`` / ``batch_shards``."""

  def __init__(self, respond: Responder, *, batch_shards: int = 1):
    self.respond = respond
    self.batch_shards = batch_shards
    self.params_version = 0

  def update_params(self, params) -> None:
    del params
    self.params_version += 1

  def generate(
    self,
    prompt_tokens,
    prompt_mask,
    *,
    num_samples: int,
    max_len: int,
    sampling: SamplingParams,
    temperature,
    key: jax.Array,
    max_new_tokens: int | None = None,
  ) -> RolloutOutput:
    del key
    tokens_np, mask_np = np.asarray(prompt_tokens), np.asarray(prompt_mask)
    B = tokens_np.shape[0] * num_samples
    limit = max_len if max_new_tokens is None else min(max_new_tokens, max_len)
    completion = np.full((B, max_len), sampling.pad_id, np.int32)
    comp_mask = np.zeros((B, max_len), bool)
    lengths = np.zeros((B,), np.int32)
    finish = np.full((B,), FINISH_LENGTH, np.int32)
    for i in range(tokens_np.shape[0]):
      prompt = tokens_np[i][mask_np[i]].tolist()
      for g in range(num_samples):
        row = i * num_samples + g
        ids = list(self.respond(prompt, g))[:limit]
        for t, tok in enumerate(ids):
          completion[row, t] = tok
          if tok in sampling.stop_ids:
            ids = ids[: t + 1]
            finish[row] = FINISH_STOP
            break
        comp_mask[row, : len(ids)] = True
        lengths[row] = len(ids)
    zeros = jnp.zeros((B, max_len), jnp.float32)
    return RolloutOutput(
      prompt_tokens=jnp.asarray(np.repeat(tokens_np, num_samples, axis=0)),
      prompt_mask=jnp.asarray(np.repeat(mask_np, num_samples, axis=0)),
      completion_tokens=jnp.asarray(completion),
      completion_mask=jnp.asarray(comp_mask),
      lengths=jnp.asarray(lengths),
      finish_reason=jnp.asarray(finish),
      logprobs=zeros,
      sampler_logprobs=zeros,
      temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)),
      prompt_index=jnp.asarray(np.repeat(np.arange(tokens_np.shape[0], dtype=np.int32), num_samples)),
      top_k=sampling.top_k,
      top_p=sampling.top_p,
    )

  def per_token_logps(self, out: RolloutOutput, temperature=None) -> jax.Array:
    del temperature
    return jnp.zeros_like(out.logprobs)
