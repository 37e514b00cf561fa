"""Per-token log-probabilities (and entropies) of given completions under a model.

The layout matches the sampler's: prompts left-padded to ``P``, completions
right-padded to ``M``, positions counted over real tokens, so teacher-forced log-probs
equal the ones recorded at sampling time (at the same temperature).

All log-softmax math is float32.  This is the one place the trainer turns logits into
per-token statistics; the fused kernel (``mimo_jax.kernels``) plugs in here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mimo_jax import sharding
from mimo_jax.models.transformer import Transformer, positions_from_mask


def _completion_hidden(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask):
  """Final hidden states ``[B, M, D]`` at the positions that predict the completion tokens."""
  P, M = prompt_tokens.shape[1], completion_tokens.shape[1]
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  hidden, _ = model.hidden(tokens, attention_mask=mask, positions=positions_from_mask(mask))
  # Position P-1+t predicts completion token t.
  return hidden[:, P - 1 : P - 1 + M]


def _completion_logits(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask):
  hidden = _completion_hidden(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask)
  return model.logits_from_hidden(hidden).astype(jnp.float32)


def _scaled_log_softmax(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature):
  """``(log softmax(logits / T) [B, M, V], logp of the completion tokens [B, M])``."""
  logits = _completion_logits(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask)
  temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (logits.shape[0],))
  temp = jnp.where(temp <= 0, 1.0, temp)
  logp_all = jax.nn.log_softmax(logits / temp[:, None, None], axis=-1)
  logp = jnp.take_along_axis(logp_all, completion_tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return logp_all, logp


LOGPROB_IMPLS = ("full", "fused")


def _fused_stats(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature):
  """Like :func:`_scaled_log_softmax` + entropy, without the ``[B, M, V]`` logits.

  The per-row temperature is folded into the hidden states (``(h / T) @ W == (h @ W) / T``), and
  the kernel (:mod:`mimo_jax.kernels.fused_logprobs`) streams over vocabulary blocks in the forward
  and the backward pass. Under a mesh (:func:`mimo_jax.sharding.use_rules`) it runs per device under
  ``shard_map``: rows split like the batch, the vocabulary like the unembedding's ``vocab`` axis, so
  neither the logits nor the unembedding are gathered across the tensor axis.
  """
  from mimo_jax.kernels import fused_logprobs as fused

  hidden = _completion_hidden(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask)
  hidden = hidden.astype(jnp.float32)
  B, M, D = hidden.shape
  temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
  temp = jnp.where(temp <= 0, 1.0, temp)
  dt = jnp.dtype(model.config.dtype)  # the compute dtype, as in ``logits_from_hidden``
  w = model.unembedding().astype(dt)
  scaled = (hidden / temp[:, None, None]).astype(dt).reshape(B * M, D)
  targets = completion_tokens.reshape(-1).astype(jnp.int32)
  layout = sharding.kernel_layout(B * M, w.shape[1])
  if layout is None:
    stats = fused.fused_logprobs(scaled, w, targets)
  else:
    mesh, vocab_axis, batch_axes = layout
    stats = fused.fused_logprobs_sharded(scaled, w, targets, mesh, axis=vocab_axis, batch_axes=batch_axes)
  return stats.logprobs.reshape(B, M), stats.entropy.reshape(B, M)


def completion_stats(
  model: Transformer,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  completion_tokens: jax.Array,
  completion_mask: jax.Array,
  temperature: jax.Array | float = 1.0,
  *,
  impl: str = "full",
) -> tuple[jax.Array, jax.Array]:
  """Log-probs and entropies of the completion tokens under ``softmax(logits / T)``.

  Args:
    model: the policy (or reference) model.
    prompt_tokens: int32 ``[B, P]``, left-padded.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``, right-padded.
    completion_mask: bool ``[B, M]``.
    temperature: scalar or ``[B]``; ``<= 0`` (greedy) is treated as 1.
    impl: ``full`` (materialise ``[B, M, V]`` logits) or ``fused`` (the streaming kernel:
      O(B x M x block) extra memory, gradients computed blockwise).

  Returns:
    ``(logprobs, entropy)``, both float32 ``[B, M]`` and zero where the mask is False.
  """
  if impl == "fused":
    logp, entropy = _fused_stats(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature)
    return jnp.where(completion_mask, logp, 0.0), jnp.where(completion_mask, entropy, 0.0)
  if impl != "full":
    raise ValueError(f"impl must be one of {LOGPROB_IMPLS}, got {impl!r}")
  logp_all, logp = _scaled_log_softmax(
    model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature
  )
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return jnp.where(completion_mask, logp, 0.0), jnp.where(completion_mask, entropy, 0.0)


def completion_logprobs(
  model: Transformer,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  completion_tokens: jax.Array,
  completion_mask: jax.Array,
  temperature: jax.Array | float = 1.0,
) -> jax.Array:
  """``log softmax(logits / T)`` of each completion token (float32 ``[B, M]``, 0 where masked).

  See :func:`completion_stats` for the arguments.
  """
  _, logp = _scaled_log_softmax(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature)
  return jnp.where(completion_mask, logp, 0.0)
