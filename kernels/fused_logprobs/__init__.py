"""Fused unembedding + log-softmax statistics, streamed over vocabulary blocks.

For ``hidden [N, H]``, ``w_unembed [H, V]`` and ``targets [N]`` this computes, per token, with logits
``l = hidden @ w_unembed / T`` (``T``: ``temperature`` times the row's ``row_temperature``, applied to the
float32 logits after the matmul, never folded into a bf16 ``hidden``):

- ``logprobs[n] = l[n, t_n] - lse_n`` where ``lse_n = logsumexp_j l[n, j]``;
- ``entropy[n] = lse_n - mu_n`` with ``mu_n = sum_j p[n, j] l[n, j]`` (the entropy of ``softmax(l[n])``);
- optionally ``kl[n]``, the k3 estimator ``exp(r) - r - 1`` of KL(policy || ref) with ``r = ref - logprobs``
  (``r`` clamped to +-20 before ``exp``, the result clamped to +-10).

Memory. The ``[N, V]`` logits are never materialised: the forward pass keeps online accumulators per row (running
max, sum of exponentials, their logit-weighted sum, target logit; see ``common``) over vocabulary blocks, so peak
extra memory is ``O(N * block_v)``; the backward pass writes each column of the ``[H, V]`` weight gradient once, in
the weight's dtype.

Gradients (``jax.custom_vjp``). Residuals are only ``lse`` and ``mu`` per row (plus the inputs); probabilities are
recomputed block by block as ``p = exp(l - lse)``. With ``g_lp`` and ``g_ent`` the output cotangents:

- ``d logprobs / d l_j = 1[j = t] - p_j``;
- ``d entropy / d l_j = -p_j (l_j - mu)`` (from ``E = lse - sum_k p_k l_k`` and ``dp_k/dl_j = p_k(1[k=j] - p_j)``);
- so ``dL/dl_j = g_lp 1[j = t] - p_j (g_lp + g_ent (l_j - mu))`` and, with ``z = hidden @ w``,
  ``dL/dz = dL/dl / T``, ``dL/dhidden = sum_blocks dz_blk @ w_blk^T``, ``dL/dw_blk = hidden^T @ dz_blk``.
- ``kl`` depends on ``logprobs`` only (``ref_logprobs`` is a constant under ``stop_gradient``); it is computed
  outside the custom VJP, so autodiff chains it through ``logprobs``.

Implementations (one module each; ``api.fused_logprobs`` is the dispatch point):

- ``reference``: plain jnp over the full logits, differentiated by autodiff. The oracle.
- ``xla``: a ``fori_loop`` over vocabulary blocks; the default on CPU. Its blockwise backward serves every
  implementation.
- ``pallas_tpu``: Mosaic kernel, a tiled matmul whose epilogue folds each logits tile into accumulators resident
  in the output blocks (sequential grid).
- ``pallas_gpu``: Triton kernel, programs over (row block, vocabulary range) with an in-kernel loop over
  vocabulary blocks and contraction steps; partial accumulators merged in XLA.
- ``sharded``: ``fused_logprobs_sharded``, any blockwise implementation per device under ``shard_map`` with the
  vocabulary split over a mesh axis (``pmax`` then rescaled ``psum``) and the rows over the batch axes.

``interpret=True`` runs a Pallas kernel in interpret mode (how CPU tests run both).

Targets must lie in ``[0, V)``; this cannot be checked on traced values. In the blockwise implementations an
out-of-range target matches no column, so its target logit is 0 and ``logprobs = -lse`` (the reference's
``take_along_axis`` behaves differently).
"""

from mimo_jax.kernels.fused_logprobs.api import IMPLS, effective_block_sizes, fused_logprobs, resolve_impl
from mimo_jax.kernels.fused_logprobs.common import BlockSizes, LogprobStats, k3_kl
from mimo_jax.kernels.fused_logprobs.reference import fused_logprobs_reference
from mimo_jax.kernels.fused_logprobs.sharded import fused_logprobs_sharded

__all__ = [
  "IMPLS",
  "BlockSizes",
  "LogprobStats",
  "effective_block_sizes",
  "fused_logprobs",
  "fused_logprobs_reference",
  "fused_logprobs_sharded",
  "k3_kl",
  "resolve_impl",
]
