"""Learner step time and memory: full logits vs the fused log-prob kernel, on the local devices.

    python -m mimo_jax.bench.update [--preset 1b] [--layers 4] [--rows 16] [--prompt_len 128]
                                    [--completion_len 1024] [--impls full,fused] [--grad_accum 1] [--repeats 3]

One learner step of a randomly initialised preset, the very program the trainer runs (built by
``mimo_jax.train.learner.build_learner`` from a config: behaviour and reference log-probs, GRPO
advantages, the clipped policy loss with k3 KL and entropy, AdamW, the controllers) on a mesh
over every local device (FSDP), on a random rollout of ``rows`` sequences (groups of 4 samples).
For each ``--logprob_impl``: compile seconds, the compiler's temporary memory, the device's peak
memory after the timed steps (where the backend reports it; the allocator's high-water mark is
per process, so only the first implementation's peak is its own: run one ``--impls`` value per
process for clean peaks), median step seconds over ``--repeats`` steps after a warm-up, and
completion tokens per second. The fused rows report their ratios to the first implementation.
The step's model FLOPs are the compute ledger's count of what the learner runs (its passes, with
prompts shared as they are; the trainer logs the same as ``flops_*``); their rate per device, and on
a known accelerator its share of the bf16 peak (MFU, ``mimo_jax.bench.devices``).
Output: one JSON line per implementation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax.bench.devices import peak
from mimo_jax.main import parse_config
from mimo_jax.models import Transformer, create_sharded
from mimo_jax.optim import TrainState, commit_like_params
from mimo_jax.sharding import build_mesh
from mimo_jax.train.learner import (
  Experience,
  Faults,
  LearnerState,
  build_learner,
  build_ledger,
  init_controller_state,
)

GiB = 2**30
GROUP = 4


def _experience(rows: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0) -> Experience:
  rng = np.random.default_rng(seed)
  lengths = rng.integers(completion_len // 2, completion_len + 1, rows)
  completion_mask = np.arange(completion_len)[None, :] < lengths[:, None]
  f32 = np.float32
  return Experience(
    # A group's rows share their prompt, as the sampler lays them out (the learner runs it once).
    prompt_tokens=jnp.asarray(np.repeat(rng.integers(4, vocab, (rows // GROUP, prompt_len)), GROUP, axis=0), jnp.int32),
    prompt_mask=jnp.ones((rows, prompt_len), bool),
    completion_tokens=jnp.asarray(rng.integers(4, vocab, (rows, completion_len)), jnp.int32),
    completion_mask=jnp.asarray(completion_mask),
    lengths=jnp.asarray(lengths, jnp.int32),
    truncated=jnp.asarray(lengths == completion_len),
    rewards=jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
    reward_components={"correct": jnp.asarray(rng.integers(0, 2, rows), jnp.float32)},
    logprobs=jnp.asarray(-rng.exponential(3.0, (rows, completion_len)).astype(f32)),
    sampler_logprobs=jnp.asarray(-rng.exponential(3.0, (rows, completion_len)).astype(f32)),
    temperature=jnp.ones((rows,), jnp.float32),
    top_k=jnp.zeros((rows,), jnp.int32),
    top_p=jnp.ones((rows,), jnp.float32),
    policy_version=jnp.zeros((rows,), jnp.int32),
    prompt_id=jnp.asarray(np.repeat(np.arange(rows // GROUP), GROUP), jnp.int32),
    batch_id=jnp.zeros((rows,), jnp.int32),
  )


def _peak_gib() -> float | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else round(peak / GiB, 2)


def _config(args: argparse.Namespace, impl: str):
  if args.rows % GROUP:
    raise SystemExit(f"--rows={args.rows}: must be a multiple of {GROUP} (the group size)")
  flags = [
    "prog",
    f"--model_preset={args.preset}",
    f"--logprob_impl={impl}",
    f"--grad_accum={args.grad_accum}",
    f"--prompts_per_step={args.rows // GROUP}",
    f"--num_samples={GROUP}",
    f"--max_new_tokens={args.completion_len}",
    f"--prompt_buckets={args.prompt_len}",
    "--learning_rate=1e-6",
    "--lr_schedule=constant",
    "--kl_coef=0.001",
    "--entropy_coef=0.001",
    "--mesh_data=1",
    "--mesh_fsdp=-1",
    "--mesh_tensor=1",
    f"--run_dir={tempfile.gettempdir()}/mimo_jax_bench_update",
  ]
  cfg = parse_config(flags)
  model_cfg = cfg.model.model_config()
  if args.layers:
    model_cfg = model_cfg.replace(num_layers=args.layers)
  if model_cfg.max_seq_len < args.prompt_len + args.completion_len:
    model_cfg = model_cfg.replace(max_seq_len=args.prompt_len + args.completion_len)
  return cfg, model_cfg


def run(args: argparse.Namespace) -> list[dict]:
  records = []
  for impl in args.impls.split(","):
    cfg, model_cfg = _config(args, impl)
    mesh = build_mesh(cfg.mesh)
    model = create_sharded(lambda m=model_cfg: Transformer(m, rngs=nnx.Rngs(0)), mesh)
    graphdef, params = nnx.split(model)
    learner = build_learner(cfg, mesh, graphdef)
    policy = TrainState.create(model, learner.tx, jax.random.key(0), master_dtype=cfg.optim.master_dtype)
    reference = jax.tree.map(jnp.copy, params)
    state = LearnerState(policy, commit_like_params(init_controller_state(cfg), params), reference)
    del model, params
    exp = _experience(args.rows, args.prompt_len, args.completion_len, model_cfg.vocab_size)
    tokens = int(np.asarray(exp.completion_mask).sum())
    step, faults = jnp.int32(0), Faults.none()
    t0 = time.perf_counter()
    compiled = learner.learn.lower(state, exp, step, faults).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    # Timed through the AOT executable itself: the learner declares the state's layout on its output, so
    # the executable accepts the state it returns (two warm-up calls).
    for _ in range(2):
      state, metrics = compiled(state, exp, step, faults)
      jax.block_until_ready(metrics)
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      state, metrics = compiled(state, exp, step, faults)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    counts = build_ledger(cfg, mesh, model_cfg).step(
      np.asarray(exp.prompt_mask).sum(axis=1), np.asarray(exp.completion_mask).sum(axis=1)
    )
    flops = counts["flops_step"] - counts["flops_generate"]  # the learn program's: score, reference, critic, update
    tflops = flops / step_s / mesh.devices.size / 1e12
    device_peak = peak()
    record = dict(
      preset=model_cfg.name,
      layers=model_cfg.num_layers,
      vocab=model_cfg.vocab_size,
      rows=args.rows,
      prompt_len=args.prompt_len,
      completion_len=args.completion_len,
      grad_accum=args.grad_accum,
      backend=jax.default_backend(),
      devices=jax.device_count(),
      program="learn",
      logprob_impl=impl,
      compile_s=round(compile_s, 1),
      temp_gib=round(temp / GiB, 2),
      # The allocator's high-water mark is per process: only the first implementation's is its own.
      **({"peak_gib": _peak_gib()} if not records else {"peak_gib_process_so_far": _peak_gib()}),
      step_s=round(step_s, 4),
      step_s_spread=[round(min(times), 4), round(max(times), 4)],
      completion_tokens_per_s=round(tokens / step_s),
      model_flops_per_step=float(f"{flops:.6g}"),
      model_tflops_per_device=float(f"{tflops:.4g}"),
      **({"mfu": float(f"{tflops / device_peak['bf16_tflops']:.4g}"), "peak": device_peak} if device_peak else {}),
      loss=float(metrics["train"]["loss"]),
    )
    if records:
      record["step_ratio_vs_first"] = round(step_s / records[0]["step_s"], 3)
      first_temp = records[0]["temp_gib"]
      record["temp_ratio_vs_first"] = round(temp / GiB / first_temp, 3) if first_temp else None
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
