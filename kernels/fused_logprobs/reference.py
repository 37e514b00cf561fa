"""``reference``: plain jnp over the full ``[N, V]`` logits, differentiated by autodiff. The oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mimo_jax.kernels.fused_logprobs.common import LogprobStats, k3_kl


def fused_logprobs_reference(
  hidden: jax.Array,
  w_unembed: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
  ref_logprobs: jax.Array | None = None,
  row_temperature: jax.Array | None = None,
) -> LogprobStats:
  """Per-token logprobs, entropy and k3 KL from materialised logits; same contract as ``fused_logprobs``."""
  logits = jnp.dot(hidden, w_unembed, preferred_element_type=jnp.float32) / temperature
  if row_temperature is not None:
    logits = logits / row_temperature.astype(jnp.float32)[:, None]
  log_p = jax.nn.log_softmax(logits, axis=-1)
  logprobs = jnp.take_along_axis(log_p, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
  kl = None if ref_logprobs is None else k3_kl(ref_logprobs, logprobs)
  return LogprobStats(logprobs, entropy, kl)
