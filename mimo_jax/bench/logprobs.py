"""Fused logprobs: compiled temp memory and forward / forward+backward time of each implementation.

    python -m mimo_jax.bench.logprobs [--n 1024] [--h 512] [--vocab 32000,128256,151936] [--dtype float32]
                                      [--impls reference,xla] [--repeats 3] [--block_sizes block_v=2048]
                                      [--check]

For each vocabulary size and implementation: ``jax.jit`` of the forward (logprobs, entropy, k3 KL) and of
``jax.grad`` of ``sum(logprobs) + sum(entropy) + sum(kl)`` w.r.t. ``hidden`` and ``w_unembed``. Memory is the
compiler's ``memory_analysis().temp_size_in_bytes`` of the forward+backward; times are medians of ``--repeats``
runs after a warm-up. The matmul work is counted as ``2 N H V`` FLOPs forward and ``6 N H V`` forward+backward (the
reference's; the blockwise backward recomputes the logits, ``8 N H V`` in all): ``*_tflops`` is that count over the
time (``--matmul_baseline`` times the bare logits matmul alone, the floor). ``--check`` adds the largest absolute difference of each output from the reference's. Every record carries
ratios against the first implementation measured in the same run. ``pallas*`` runs in interpret mode off the
accelerator (very slow on CPU). ``--block_sizes`` sets ``BlockSizes`` fields (``name=value,...``) for every
implementation but ``reference``. Output: one JSON line per (V, implementation).
"""

from __future__ import annotations

import argparse
import dataclasses
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


def parse_block_sizes(text: str) -> fl.BlockSizes:
  """``"block_n=64,block_v=128"`` -> ``BlockSizes(block_n=64, block_v=128)``."""
  if not text:
    return fl.BlockSizes()
  fields = {}
  for item in text.split(","):
    name, _, value = item.partition("=")
    fields[name.strip()] = int(value)
  return fl.BlockSizes(**fields)


def inputs(n: int, h: int, vocab: int, dtype: str, seed: int = 0) -> tuple[jax.Array, ...]:
  """Random (hidden, w_unembed, targets, ref_logprobs) with logits of unit scale."""
  k_h, k_w, k_t, k_r = jax.random.split(jax.random.key(seed), 4)
  return (
    jax.random.normal(k_h, (n, h), dtype),
    (jax.random.normal(k_w, (h, vocab), jnp.float32) / h**0.5).astype(dtype),
    jax.random.randint(k_t, (n,), 0, vocab, jnp.int32),
    -jnp.abs(jax.random.normal(k_r, (n,), jnp.float32)) - 5.0,
  )


def measure(impl: str, args: Sequence[jax.Array], block_sizes: fl.BlockSizes, repeats: int) -> dict:
  """Temp memory and forward / forward+backward median seconds of one implementation, plus its outputs."""
  interpret = impl.startswith("pallas") and jax.default_backend() == "cpu"
  sizes = None if impl == "reference" else block_sizes

  def forward(hidden, w, targets, ref_logprobs):
    return fl.fused_logprobs(
      hidden, w, targets, ref_logprobs=ref_logprobs, impl=impl, block_sizes=sizes, interpret=interpret
    )

  def loss(*a):
    out = forward(*a)
    return jnp.sum(out.logprobs) + jnp.sum(out.entropy) + jnp.sum(out.kl)

  fwd = jax.jit(forward).lower(*args).compile()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  out = jax.block_until_ready(fwd(*args))
  jax.block_until_ready(grad(*args))
  return dict(
    temp_mib=round(grad.memory_analysis().temp_size_in_bytes / 2**20, 1),
    fwd_s=_median_time(lambda: fwd(*args), repeats),
    fwdbwd_s=_median_time(lambda: grad(*args), repeats),
    outputs=out,
  )


def run(
  n: int,
  h: int,
  vocab: int,
  dtype: str,
  impls: Sequence[str],
  block_sizes: fl.BlockSizes,
  repeats: int,
  check: bool = False,
  matmul_baseline: bool = False,
) -> list[dict]:
  """Benchmarks one (N, H, V) configuration; returns one record per implementation (the matmul baseline first)."""
  args = inputs(n, h, vocab, dtype)
  flops = 2.0 * n * h * vocab
  expected = fl.fused_logprobs_reference(*args[:3], ref_logprobs=args[3]) if check else None
  records: list[dict] = []
  baseline: list[dict] = []
  if matmul_baseline:
    # The unavoidable part: the logits matmul alone (XLA / cuBLAS, output in the input dtype).
    mm = jax.jit(lambda hid, w: jnp.dot(hid, w)).lower(*args[:2]).compile()
    jax.block_until_ready(mm(*args[:2]))
    mm_s = _median_time(lambda: mm(*args[:2]), repeats)
    record = dict(n=n, h=h, v=vocab, dtype=dtype, impl="matmul_only", backend=jax.default_backend())
    baseline.append(dict(record, fwd_ms=round(mm_s * 1e3, 3), fwd_tflops=round(flops / mm_s / 1e12, 2)))
  for impl in impls:
    m = measure(impl, args, block_sizes, repeats)
    record = dict(
      n=n,
      h=h,
      v=vocab,
      dtype=dtype,
      impl=impl,
      backend=jax.default_backend(),
      block_sizes=None if impl == "reference" else dataclasses.asdict(fl.effective_block_sizes(impl, block_sizes)),
      temp_mib=m["temp_mib"],
      fwd_ms=round(m["fwd_s"] * 1e3, 3),
      fwdbwd_ms=round(m["fwdbwd_s"] * 1e3, 3),
      fwd_tflops=round(flops / m["fwd_s"] / 1e12, 2),
      fwdbwd_tflops=round(3 * flops / m["fwdbwd_s"] / 1e12, 2),
    )
    if check:
      for name in ("logprobs", "entropy", "kl"):
        diff = jnp.max(jnp.abs(getattr(m["outputs"], name) - getattr(expected, name)))
        record[f"max_abs_err_{name}"] = float(diff)
    if records:
      first = records[0]
      record[f"fwd_speedup_vs_{first['impl']}"] = round(first["fwd_ms"] / record["fwd_ms"], 3)
      record[f"fwdbwd_speedup_vs_{first['impl']}"] = round(first["fwdbwd_ms"] / record["fwdbwd_ms"], 3)
      record[f"temp_ratio_{first['impl']}_over_this"] = round(first["temp_mib"] / max(record["temp_mib"], 1e-9), 2)
    records.append(record)
  return baseline + records


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--n", type=int, default=1024, help="tokens N")
  parser.add_argument("--h", type=int, default=512, help="hidden size H")
  parser.add_argument("--vocab", default="32000,128256,151936", help="comma-separated vocabulary sizes V")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--impls", default="reference,xla", help=f"comma-separated, from {fl.IMPLS}")
  parser.add_argument("--block_sizes", default="", help="BlockSizes fields, e.g. block_n=64,block_v=128")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--check", action="store_true", help="also report max |output - reference|")
  parser.add_argument("--matmul_baseline", action="store_true", help="also time the bare logits matmul")
  args = parser.parse_args(argv)
  impls = args.impls.split(",")
  for impl in impls:
    if impl not in fl.IMPLS:
      parser.error(f"--impls: {impl!r} is not one of {fl.IMPLS}")
  block_sizes = parse_block_sizes(args.block_sizes)
  for vocab in (int(v) for v in args.vocab.split(",")):
    for record in run(
      args.n, args.h, vocab, args.dtype, impls, block_sizes, args.repeats, args.check, args.matmul_baseline
    ):
      print(json.dumps(record), flush=True)


if __name__ == "__main__":
  main()
