"""Per-token log-probabilities of given completions under a model (teacher forcing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mimo_jax.models.transformer import Transformer, positions_from_mask


def completion_logprobs(
  model: Transformer,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  completion_tokens: jax.Array,
  completion_mask: jax.Array,
  temperature: jax.Array | float = 1.0,
) -> jax.Array:
  """``log softmax(logits / T)`` of each completion token, one full forward pass.

  The layout matches the sampler's: prompts left-padded to ``P``, completions
  right-padded to ``M``, and positions counted over real tokens, so the result equals
  the log-probs recorded at sampling time (at the same temperature).

  Args:
    model: the policy (or reference) model.
    prompt_tokens: int32 ``[B, P]``, left-padded.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``, right-padded.
    completion_mask: bool ``[B, M]``.
    temperature: scalar or ``[B]``; ``<= 0`` (greedy) is treated as 1.

  Returns:
    float32 ``[B, M]``, zero where ``completion_mask`` is False.
  """
  P = prompt_tokens.shape[1]
  M = completion_tokens.shape[1]
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  logits = model(tokens, attention_mask=mask, positions=positions_from_mask(mask))
  # Position P-1+t predicts completion token t.
  logits = logits[:, P - 1 : P - 1 + M].astype(jnp.float32)
  temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (tokens.shape[0],))
  temp = jnp.where(temp <= 0, 1.0, temp)
  logp = jax.nn.log_softmax(logits / temp[:, None, None], axis=-1)
  out = jnp.take_along_axis(logp, completion_tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.where(completion_mask, out, 0.0)
