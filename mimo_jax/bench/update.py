"""Policy-update step time and memory: full logits vs the fused log-prob kernel, on the local devices.

    python -m mimo_jax.bench.update [--preset 1b] [--layers 4] [--rows 16] [--prompt_len 128]
                                    [--completion_len 1024] [--impls full,fused] [--grad_accum 1] [--repeats 3]

One GRPO/PPO update (clipped policy loss, k3 KL, entropy, AdamW) of a randomly initialised preset on a mesh over
every local device (FSDP), on a random batch of ``rows`` sequences. For each ``--logprob_impl``: compile seconds,
the compiler's temporary memory, the device's peak memory after the timed steps (where the backend reports it;
the allocator's high-water mark is per process, so only the first implementation's peak is its own: run one
``--impls`` value per process for clean peaks),
median step seconds over ``--repeats`` steps after a warm-up, and completion tokens per second. The fused rows
report their ratios to the first implementation. Output: one JSON line per implementation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax.config import OptimConfig
from mimo_jax.models import Transformer, create_sharded, get_preset
from mimo_jax.sharding import MeshConfig, build_mesh
from mimo_jax.train.state import TrainState, make_optimizer
from mimo_jax.train.steps import LossCoefs, PolicyBatch, UpdateSettings, make_update_fn

GiB = 2**30


def _batch(rows: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0) -> PolicyBatch:
  rng = np.random.default_rng(seed)
  completion_mask = np.arange(completion_len)[None, :] < rng.integers(
    completion_len // 2, completion_len + 1, (rows, 1)
  )
  return PolicyBatch(
    prompt_tokens=jnp.asarray(rng.integers(4, vocab, (rows, prompt_len)), jnp.int32),
    prompt_mask=jnp.ones((rows, prompt_len), bool),
    completion_tokens=jnp.asarray(rng.integers(4, vocab, (rows, completion_len)), jnp.int32),
    completion_mask=jnp.asarray(completion_mask),
    advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
    old_logprobs=jnp.asarray(-rng.exponential(3.0, (rows, completion_len)), jnp.float32),
    ref_logprobs=jnp.asarray(-rng.exponential(3.0, (rows, completion_len)), jnp.float32),
    temperature=jnp.ones((rows,), jnp.float32),
  )


def _peak_gib() -> float | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else round(peak / GiB, 2)


def run(args: argparse.Namespace) -> list[dict]:
  cfg = get_preset(args.preset)
  if args.layers:
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
  mesh = build_mesh(MeshConfig(1, jax.device_count(), 1))
  batch = _batch(args.rows, args.prompt_len, args.completion_len, cfg.vocab_size)
  coefs = LossCoefs(kl_coef=jnp.float32(0.001), entropy_coef=jnp.float32(0.001))
  tokens = int(np.asarray(batch.completion_mask).sum())
  records = []
  for impl in args.impls.split(","):
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    tx, _ = make_optimizer(OptimConfig(learning_rate=1e-6, lr_schedule="constant"), 10)
    state = TrainState.create(model, tx, jax.random.key(0))
    del model
    settings = UpdateSettings(logprob_impl=impl, grad_accum=args.grad_accum, agg_norm=float(args.completion_len))
    update = make_update_fn(mesh, settings)
    t0 = time.perf_counter()
    compiled = update.lower(state, batch, coefs).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    state, metrics = compiled(state, batch, coefs)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      state, metrics = compiled(state, batch, coefs)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    record = dict(
      preset=cfg.name,
      layers=cfg.num_layers,
      vocab=cfg.vocab_size,
      rows=args.rows,
      prompt_len=args.prompt_len,
      completion_len=args.completion_len,
      grad_accum=args.grad_accum,
      backend=jax.default_backend(),
      devices=jax.device_count(),
      logprob_impl=impl,
      compile_s=round(compile_s, 1),
      temp_gib=round(temp / GiB, 2),
      # The allocator's high-water mark is per process: only the first implementation's is its own.
      **({"peak_gib": _peak_gib()} if not records else {"peak_gib_process_so_far": _peak_gib()}),
      step_s=round(step_s, 4),
      completion_tokens_per_s=round(tokens / step_s),
      loss=float(metrics["loss"]),
    )
    if records:
      record["step_ratio_vs_first"] = round(step_s / records[0]["step_s"], 3)
      record["temp_ratio_vs_first"] = round(temp / GiB / max(records[0]["temp_gib"], 1e-9), 3)
    records.append(record)
    print(json.dumps(record), flush=True)
    del state, compiled
  return records


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="1b")
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--prompt_len", type=int, default=128)
  parser.add_argument("--completion_len", type=int, default=1024)
  parser.add_argument("--impls", default="full,fused", help="comma-separated --logprob_impl values")
  parser.add_argument("--grad_accum", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=3)
  run(parser.parse_args(argv))


if __name__ == "__main__":
  main()
