"""Fused logprobs: compiled temp memory and forward+backward time, reference vs blockwise XLA (vs Pallas).

    python -m mimo_jax.bench.logprobs [--n 1024] [--h 512] [--vocab 32000,128256,151936] [--repeats 3]
                                      [--block_v 2048] [--dtype float32] [--pallas]

For each vocabulary size, both implementations are ``jax.jit(jax.grad(loss))`` of
``sum(logprobs) + sum(entropy) + sum(kl)`` w.r.t. ``hidden`` and ``w_unembed``. Memory is the compiler's
``memory_analysis().temp_size_in_bytes``; time is the median of ``--repeats`` runs after a warm-up.
``--pallas`` adds the Pallas kernel (interpret mode off the accelerator: very slow on CPU).
Output: one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mimo_jax.kernels import fused_logprobs as fl


def _median_time(fn: Callable[[], object], repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _measure(impl: str, args: Sequence[jax.Array], block_sizes: fl.BlockSizes, repeats: int) -> dict:
  """Compiled temp bytes and median forward+backward seconds of one implementation."""
  interpret = impl == "pallas" and jax.default_backend() == "cpu"

  def loss(hidden, w, targets, ref_logprobs):
    out = fl.fused_logprobs(
      hidden, w, targets, ref_logprobs=ref_logprobs, impl=impl, block_sizes=block_sizes, interpret=interpret
    )
    return jnp.sum(out.logprobs) + jnp.sum(out.entropy) + jnp.sum(out.kl)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  temp_bytes = compiled.memory_analysis().temp_size_in_bytes
  jax.block_until_ready(compiled(*args))  # warm-up
  return dict(temp_mib=round(temp_bytes / 2**20, 1), time_s=round(_median_time(lambda: compiled(*args), repeats), 4))


def run(n: int, h: int, vocab: int, dtype: str, block_v: int, repeats: int, pallas: bool) -> dict:
  """Benchmarks one (N, H, V) configuration and returns its JSON record."""
  k_h, k_w, k_t, k_r = jax.random.split(jax.random.key(0), 4)
  args = (
    jax.random.normal(k_h, (n, h), dtype),
    (jax.random.normal(k_w, (h, vocab), jnp.float32) / h**0.5).astype(dtype),
    jax.random.randint(k_t, (n,), 0, vocab, jnp.int32),
    -jnp.abs(jax.random.normal(k_r, (n,), jnp.float32)) - 5.0,
  )
  block_sizes = fl.BlockSizes(block_v=block_v)
  record = dict(n=n, h=h, v=vocab, dtype=dtype, block_v=block_v, backend=jax.default_backend())
  impls = ("reference", "xla") + (("pallas",) if pallas else ())
  for impl in impls:
    for key, value in _measure(impl, args, block_sizes, repeats).items():
      record[f"{impl}_{key}"] = value
  record["temp_ratio_ref_over_xla"] = round(record["reference_temp_mib"] / max(record["xla_temp_mib"], 1e-9), 2)
  record["time_ratio_ref_over_xla"] = round(record["reference_time_s"] / record["xla_time_s"], 2)
  return record


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--n", type=int, default=1024, help="tokens N")
  parser.add_argument("--h", type=int, default=512, help="hidden size H")
  parser.add_argument("--vocab", default="32000,128256,151936", help="comma-separated vocabulary sizes V")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--block_v", type=int, default=fl.BlockSizes().block_v)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--pallas", action="store_true", help="also time the Pallas kernel (interpret mode on CPU)")
  args = parser.parse_args(argv)
  for vocab in (int(v) for v in args.vocab.split(",")):
    record = run(args.n, args.h, vocab, args.dtype, args.block_v, args.repeats, args.pallas)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
  main()
