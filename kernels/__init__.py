"""Kernels and their pure-jnp references (installed as ``mimo_jax.kernels``).

``fused_logprobs`` (Pallas, with XLA and jnp forms) is a subpackage (``from mimo_jax.kernels import
fused_logprobs``, then ``fused_logprobs.fused_logprobs(...)``); its other public names are re-exported
here.  ``cpu_rows`` is the CPU decode step's matrix products on all cores, an XLA FFI custom call
compiled on first use (``from mimo_jax.kernels import cpu_rows``).
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
