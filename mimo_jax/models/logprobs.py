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


def shares_prompts(rows: int, completion_len: int, prompt_group: int, *, mesh=None, rules=None) -> bool:
  """Whether a ``rows``-row batch is run with each group's prompt once (see :func:`completion_stats`):
  the groups divide the rows, there is more than one completion position, and the groups split over
  the batch shards as the rows do (the active rules', or ``mesh``'s under ``rules``), so that a group
  stays on one shard."""
  if prompt_group <= 1 or rows % prompt_group or completion_len < 2:
    return False
  return sharding.splits_alike("batch", rows, rows // prompt_group, mesh=mesh, rules=rules)


def completion_hidden(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, prompt_group: int = 1):
  """Final hidden states ``[B, M, D]`` at the positions that predict the completion tokens.

  ``prompt_group`` > 1: every run of that many contiguous rows shares one prompt (a GRPO
  group), and the stack runs each prompt once (:meth:`Decoder.with_prompt`): the last prompt
  position (which predicts completion token 0) comes from the prompt's pass, the rest from
  the completions' pass over their first ``M - 1`` tokens (the last one predicts nothing).
  """
  B, P = prompt_tokens.shape
  M = completion_tokens.shape[1]
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  positions = positions_from_mask(mask)
  if shares_prompts(B, M, prompt_group):
    R = prompt_group

    def first_of_group(x):  # [B, ...] -> [B / R, ...]; the row split keeps a group on one batch shard
      return x.reshape((B // R, R) + x.shape[1:])[:, 0]

    hidden_p, hidden_c = model.decoder.with_prompt(
      first_of_group(prompt_tokens),
      first_of_group(positions[:, :P]),
      first_of_group(prompt_mask),
      completion_tokens[:, : M - 1],
      positions[:, P : P + M - 1],
      completion_mask[:, : M - 1],
    )
    return jnp.concatenate([jnp.repeat(hidden_p[:, -1:], R, axis=0), hidden_c], axis=1)
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  hidden, _ = model.hidden(tokens, attention_mask=mask, positions=positions)
  # Position P-1+t predicts completion token t.
  return hidden[:, P - 1 : P - 1 + M]


def _completion_logits(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, prompt_group=1):
  hidden = completion_hidden(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, prompt_group)
  return model.logits_from_hidden(hidden).astype(jnp.float32)


def _scaled_log_softmax(
  model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature, prompt_group=1
):
  """``(log softmax(logits / T) [B, M, V], logp of the completion tokens [B, M])``."""
  logits = _completion_logits(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, prompt_group)
  temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (logits.shape[0],))
  temp = jnp.where(temp <= 0, 1.0, temp)
  logp_all = jax.nn.log_softmax(logits / temp[:, None, None], axis=-1)
  logp = jnp.take_along_axis(logp_all, completion_tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return logp_all, logp


LOGPROB_IMPLS = ("full", "fused")


def _fused_stats(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature, prompt_group=1):
  """Like :func:`_scaled_log_softmax` + entropy, without the ``[B, M, V]`` logits.

  The kernel divides each row's float32 logits by its temperature after the matmul, as the full path
  does (folding ``1 / T`` into the hidden states would round them to the compute dtype a second time: in
  a bf16 model, log-probs ~1e-3 off the full path's and the sampler's at T = 0.7), and it (:mod:`mimo_jax.kernels.fused_logprobs`) streams over vocabulary blocks in the forward
  and the backward pass. Under a mesh (:func:`mimo_jax.sharding.use_rules`) it runs per device under
  ``shard_map``: rows split like the batch, the vocabulary like the unembedding's ``vocab`` axis, so
  neither the logits nor the unembedding are gathered across the tensor axis.
  """
  from mimo_jax.kernels import fused_logprobs as fused

  hidden = completion_hidden(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, prompt_group)
  B, M, D = hidden.shape
  temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
  temp = jnp.where(temp <= 0, 1.0, temp)
  dt = jnp.dtype(model.config.dtype)  # the compute dtype, as in ``logits_from_hidden``
  w = model.unembedding().astype(dt)
  rows = hidden.astype(dt).reshape(B * M, D)
  row_temp = jnp.repeat(temp, M)
  targets = completion_tokens.reshape(-1).astype(jnp.int32)
  layout = sharding.kernel_layout(B * M, w.shape[1])
  if layout is None:
    stats = fused.fused_logprobs(rows, w, targets, row_temperature=row_temp)
  else:
    mesh, vocab_axis, batch_axes = layout
    stats = fused.fused_logprobs_sharded(
      rows, w, targets, mesh, axis=vocab_axis, batch_axes=batch_axes, row_temperature=row_temp
    )
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
  prompt_group: int = 1,
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
    prompt_group: when > 1 (and it divides ``B``), each run of that many contiguous rows has
      one prompt (their ``prompt_tokens`` and ``prompt_mask`` rows are equal, as in a GRPO
      group), and the model runs each prompt once: the same values up to the order of float
      sums, with ``(R - 1) / R`` of the prompt positions' work removed.  Rows that break the
      premise get their group's first prompt.

  Returns:
    ``(logprobs, entropy)``, both float32 ``[B, M]`` and zero where the mask is False.
  """
  if impl == "fused":
    logp, entropy = _fused_stats(
      model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature, prompt_group
    )
    return jnp.where(completion_mask, logp, 0.0), jnp.where(completion_mask, entropy, 0.0)
  if impl != "full":
    raise ValueError(f"impl must be one of {LOGPROB_IMPLS}, got {impl!r}")
  logp_all, logp = _scaled_log_softmax(
    model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature, prompt_group
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
  *,
  prompt_group: int = 1,
) -> jax.Array:
  """``log softmax(logits / T)`` of each completion token (float32 ``[B, M]``, 0 where masked).

  See :func:`completion_stats` for the arguments.
  """
  _, logp = _scaled_log_softmax(
    model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature, prompt_group
  )
  return jnp.where(completion_mask, logp, 0.0)
