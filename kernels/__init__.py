"""Pallas kernels and their pure-jnp references (installed as ``mimo_jax.kernels``).

``fused_logprobs`` is the subpackage (``from mimo_jax.kernels import fused_logprobs``, then
``fused_logprobs.fused_logprobs(...)``); its other public names are re-exported here.
"""

from mimo_jax.kernels import fused_logprobs
from mimo_jax.kernels.fused_logprobs import (
  BlockSizes,
  LogprobStats,
  fused_logprobs_reference,
  fused_logprobs_sharded,
  k3_kl,
)

__all__ = [
  "BlockSizes",
  "LogprobStats",
  "fused_logprobs",
  "fused_logprobs_reference",
  "fused_logprobs_sharded",
  "k3_kl",
]
