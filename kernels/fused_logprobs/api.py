"""The dispatch point: implementation choice, the ``custom_vjp`` and the public jitted wrapper."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax

from mimo_jax.kernels.fused_logprobs import pallas_gpu, pallas_tpu, xla
from mimo_jax.kernels.fused_logprobs.common import (
  Acc,
  BlockSizes,
  LogprobStats,
  finalize,
  k3_kl,
  row_inv_temperature,
  validate,
)
from mimo_jax.kernels.fused_logprobs.reference import fused_logprobs_reference

Impl = Literal["auto", "reference", "xla", "pallas", "pallas_tpu", "pallas_gpu"]
IMPLS = ("auto", "reference", "xla", "pallas", "pallas_tpu", "pallas_gpu")
_DEFAULTS = {
  "xla": xla.DEFAULT_BLOCK_SIZES,
  "pallas_tpu": pallas_tpu.DEFAULT_BLOCK_SIZES,
  "pallas_gpu": pallas_gpu.DEFAULT_BLOCK_SIZES,
}


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """The concrete implementation: ``reference``, ``xla``, ``pallas_tpu`` or ``pallas_gpu``.

  ``auto`` is ``pallas_gpu`` on GPU, ``pallas_tpu`` on TPU and ``xla`` elsewhere; ``pallas`` is the backend's
  Pallas kernel (``pallas_tpu`` off GPU, e.g. in interpret mode on CPU).
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  backend = backend or jax.default_backend()
  if impl == "auto":
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")
  if impl == "pallas":
    return "pallas_gpu" if backend == "gpu" else "pallas_tpu"
  return impl


def resolve_block_sizes(impl: str, block_sizes: BlockSizes | None) -> BlockSizes:
  """``block_sizes`` with the implementation's defaults filled in (``impl`` already resolved)."""
  sizes = (block_sizes or BlockSizes()).with_defaults(_DEFAULTS[impl])
  if sizes.bwd_block_v is None:
    bwd = sizes.block_v if impl == "xla" else xla.DEFAULT_BLOCK_SIZES.block_v
    sizes = dataclasses.replace(sizes, bwd_block_v=bwd)
  return sizes


def accumulate(
  impl: str,
  hidden: jax.Array,
  w: jax.Array,
  targets: jax.Array,
  inv_temp: jax.Array,
  sizes: BlockSizes,
  interpret: bool,
) -> Acc:
  """(m, s, u, t) accumulators ``[N]`` over the columns of ``w`` from the chosen forward implementation
  (each row's float32 logits times its ``inv_temp``)."""
  if impl == "xla":
    return xla.accumulate(hidden, w, targets, inv_temp, sizes)
  if hidden.shape[0] == 0:
    raise ValueError(f"the Pallas kernels need N > 0 rows, got hidden {hidden.shape}")
  if impl == "pallas_tpu":
    return pallas_tpu.accumulate(hidden, w, targets, inv_temp, sizes, interpret)
  if impl == "pallas_gpu":
    return pallas_gpu.accumulate(hidden, w, targets, inv_temp, sizes, interpret)
  raise ValueError(f"no blockwise implementation {impl!r}")


def backward_sizes(sizes: BlockSizes) -> BlockSizes:
  return BlockSizes(block_v=sizes.bwd_block_v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _stats(hidden, w, targets, inv_temp, impl: str, sizes: BlockSizes, interpret: bool):
  return _stats_fwd(hidden, w, targets, inv_temp, impl, sizes, interpret)[0]


def _stats_fwd(hidden, w, targets, inv_temp, impl, sizes, interpret):
  logprobs, entropy, lse, mu = finalize(*accumulate(impl, hidden, w, targets, inv_temp, sizes, interpret))
  return (logprobs, entropy), (hidden, w, targets, inv_temp, lse, mu)


def _stats_bwd(impl, sizes, interpret, res, cts):
  del impl, interpret  # Every implementation shares the blockwise XLA backward.
  hidden, w, targets, inv_temp, lse, mu = res
  dh, dw = xla.backward(hidden, w, targets, lse, mu, *cts, inv_temp, backward_sizes(sizes))
  return dh.astype(hidden.dtype), dw.astype(w.dtype), None, None  # the temperatures are constants


_stats.defvjp(_stats_fwd, _stats_bwd)


@functools.partial(jax.jit, static_argnames=("temperature", "impl", "block_sizes", "interpret"))
def fused_logprobs(
  hidden: jax.Array,
  w_unembed: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
  ref_logprobs: jax.Array | None = None,
  row_temperature: jax.Array | None = None,
  impl: Impl = "auto",
  block_sizes: BlockSizes | None = None,
  interpret: bool = False,
) -> LogprobStats:
  """Per-token logprobs, entropy and (optionally) k3 KL of ``softmax(hidden @ w_unembed / temperature)``.

  Args:
    hidden: ``[N, H]`` bf16 or f32 final hidden states.
    w_unembed: ``[H, V]`` bf16 or f32 unembedding.
    targets: ``[N]`` integer token ids in ``[0, V)`` (not checked: out-of-range gives ``-lse``).
    temperature: static positive float; logits are divided by it.
    ref_logprobs: optional ``[N]`` reference logprobs (no gradient flows into them); enables ``kl``.
    row_temperature: optional ``[N]`` positive per-row temperatures (traced; no gradient), dividing each row's
      logits besides ``temperature``.  Like ``temperature`` it divides the float32 logits after the matmul,
      so a bf16 model's rows see exactly the logits of ``(hidden @ w_unembed) / T``.
    impl: ``auto`` (``pallas_gpu`` on GPU, ``pallas_tpu`` on TPU, ``xla`` elsewhere), ``reference``, ``xla``,
      ``pallas`` (the backend's Pallas kernel), ``pallas_tpu`` or ``pallas_gpu``.
    block_sizes: static tile sizes; ``None`` fields take the implementation's defaults.
    interpret: run a Pallas kernel in interpret mode (needed on CPU).

  Returns:
    ``LogprobStats`` of float32 ``[N]`` arrays; differentiable w.r.t. ``hidden`` and ``w_unembed``.
  """
  validate(hidden, w_unembed, targets, ref_logprobs, temperature, row_temperature)
  impl = resolve_impl(impl)
  if impl == "reference":
    return fused_logprobs_reference(
      hidden, w_unembed, targets, temperature=temperature, ref_logprobs=ref_logprobs, row_temperature=row_temperature
    )
  sizes = resolve_block_sizes(impl, block_sizes)
  inv_temp = row_inv_temperature(hidden.shape[0], temperature, row_temperature)
  logprobs, entropy = _stats(hidden, w_unembed, targets, inv_temp, impl, sizes, interpret)
  kl = None if ref_logprobs is None else k3_kl(ref_logprobs, logprobs)
  return LogprobStats(logprobs, entropy, kl)


def effective_block_sizes(impl: str, block_sizes: BlockSizes | None = None) -> BlockSizes:
  """The block sizes ``fused_logprobs(..., impl=impl, block_sizes=block_sizes)`` runs with on this backend."""
  return resolve_block_sizes(resolve_impl(impl), block_sizes)
