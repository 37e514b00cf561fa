"""``--dry_run``: build everything abstractly, AOT-compile the jitted steps, report memory.

Nothing is allocated: parameters, optimizer state, rollout batches and the KV cache
are ``jax.ShapeDtypeStruct``s carrying their ``NamedSharding`` on the configured mesh,
and each step is lowered and compiled against them.  The per-device byte counts come
from the shardings (what each device stores) and from XLA's compiled memory analysis
(arguments, outputs, temporaries of each step), so a configuration that does not fit is
found before any accelerator time is spent.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from mimo_jax import sharding
from mimo_jax.config import Config
from mimo_jax.models import Transformer, abstract_state
from mimo_jax.models.transformer import KV_CACHE_LOGICAL_AXES
from mimo_jax.rollout import Sampler, SamplingParams
from mimo_jax.train.state import TrainState, make_optimizer, opt_state_shardings
from mimo_jax.train.steps import LossCoefs, PolicyBatch, SequenceBatch, UpdateSettings, make_score_fn, make_update_fn

GiB = 1024**3


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds for a pytree of sharded arrays or ShapeDtypeStructs."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.shape
    if getattr(x, "sharding", None) is not None:
      shape = x.sharding.shard_shape(x.shape)
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def _sds(shape, dtype, mesh, logical):
  return jax.ShapeDtypeStruct(
    shape, dtype, sharding=sharding.named_sharding(mesh, logical, sharding.TRAIN_RULES, shape)
  )


def _memory(compiled) -> dict[str, float]:
  m = compiled.memory_analysis()
  if m is None:  # pragma: no cover - some backends do not report
    return {}
  out = {
    "argument_gib": m.argument_size_in_bytes / GiB,
    "output_gib": m.output_size_in_bytes / GiB,
    "temp_gib": m.temp_size_in_bytes / GiB,
    "alias_gib": m.alias_size_in_bytes / GiB,
  }
  # Live at once: inputs, outputs not aliased to donated inputs, and temporaries.
  out["estimate_gib"] = (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  ) / GiB
  peak = getattr(m, "peak_memory_in_bytes", 0)
  if peak:
    out["peak_gib"] = peak / GiB
  return out


def dry_run(cfg: Config, *, vocab_size: int | None = None) -> dict[str, Any]:
  """AOT-compiles generate, score and update for ``cfg`` on its mesh; prints and returns the report."""
  t0 = time.perf_counter()
  mesh = sharding.build_mesh(cfg.mesh)
  model_cfg = cfg.model.model_config()
  if vocab_size is None and cfg.data.task == "arith" and not cfg.model.vocab_size:
    from mimo_jax.tasks.registry import build_task

    vocab_size = build_task(cfg.data, seed=cfg.run.seed)[1].vocab_size
  if vocab_size:
    model_cfg = model_cfg.replace(vocab_size=vocab_size)
  graphdef, abs_params = abstract_state(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)), mesh)

  # ---- optimizer state: shardings follow the parameters (found by compiling init)
  tx, _ = make_optimizer(cfg.optim, max(cfg.run.max_steps, 1))
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  abs_opt = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    jax.eval_shape(tx.init, abs_params),
    opt_state_shardings(tx, abs_params),
  )
  abs_key = jax.eval_shape(lambda: jax.random.key(0))
  abs_key = jax.ShapeDtypeStruct(abs_key.shape, abs_key.dtype, sharding=replicated)
  scalar_i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  abs_state = TrainState(
    step=scalar_i32,
    params=abs_params,
    opt_state=abs_opt,
    rng=abs_key,
    skipped=scalar_i32,
    lr_scale=jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
    graphdef=graphdef,
    tx=tx,
  )

  # ---- rollout-shaped abstract batches
  G = cfg.rollout.num_samples
  Np = cfg.data.prompts_per_step
  B, P, M = Np * G, max(cfg.rollout.buckets), cfg.rollout.max_new_tokens

  def rows(shape, dtype):
    return _sds(shape, dtype, mesh, ("batch",) + (None,) * (len(shape) - 1))

  seqs = SequenceBatch(rows((B, P), jnp.int32), rows((B, P), bool), rows((B, M), jnp.int32), rows((B, M), bool))
  batch = PolicyBatch(
    prompt_tokens=seqs.prompt_tokens,
    prompt_mask=seqs.prompt_mask,
    completion_tokens=seqs.completion_tokens,
    completion_mask=seqs.completion_mask,
    advantages=rows((B,), jnp.float32),
    old_logprobs=rows((B, M), jnp.float32),
    ref_logprobs=rows((B, M), jnp.float32),
    temperature=rows((B,), jnp.float32),
  )
  use_kl = cfg.algo.kl_coef > 0
  settings = UpdateSettings(
    policy_loss=cfg.algo.policy_loss,
    clip_low=cfg.algo.clip_low,
    clip_high=cfg.algo.clip_high,
    clip_c=cfg.algo.clip_c if cfg.algo.policy_loss == "ppo" else None,
    loss_agg=cfg.algo.loss_agg,
    agg_norm=float(M),
    kl_estimator=cfg.algo.kl_estimator,
    use_kl=use_kl,
    epochs=cfg.algo.ppo_epochs,
    num_minibatches=cfg.algo.num_minibatches,
    grad_accum=cfg.algo.grad_accum,
    logprob_impl=cfg.algo.logprob_impl,
  )
  coefs = LossCoefs(kl_coef=jnp.float32(0), entropy_coef=jnp.float32(0))
  report: dict[str, Any] = {
    "model": model_cfg.name,
    "params": model_cfg.num_params(),
    "mesh": dict(mesh.shape),
    "rollout_batch": [B, P, M],
    "per_device_gib": {
      "params": per_device_bytes(abs_params) / GiB,
      "reference_params": per_device_bytes(abs_params) / GiB if use_kl else 0.0,
      "optimizer_state": per_device_bytes(abs_opt) / GiB,
    },
  }
  kv_shape = (model_cfg.num_layers, B, P + M, model_cfg.num_kv_heads, model_cfg.resolved_head_dim)
  kv = _sds(kv_shape, jnp.dtype(model_cfg.dtype), mesh, KV_CACHE_LOGICAL_AXES)
  report["per_device_gib"]["kv_cache"] = 2 * per_device_bytes(kv) / GiB

  compiled: dict[str, Any] = {}
  t = time.perf_counter()
  update_fn = make_update_fn(mesh, settings)
  compiled["update"] = update_fn.lower(abs_state, batch, coefs).compile()
  times = {"update": time.perf_counter() - t}

  t = time.perf_counter()
  score_fn = make_score_fn(
    graphdef,
    mesh,
    use_reference=use_kl,
    logprob_impl=cfg.algo.logprob_impl,
    micro_batches=cfg.algo.num_minibatches * cfg.algo.grad_accum,
  )
  compiled["score"] = score_fn.lower(abs_params, abs_params if use_kl else None, seqs, batch.temperature).compile()
  times["score"] = time.perf_counter() - t

  t = time.perf_counter()
  sampler = Sampler(nnx.merge(graphdef, abs_params), mesh=mesh)
  prompt_rows = _sds((Np, P), jnp.int32, mesh, ("batch", None))
  compiled["generate"] = sampler._generate.lower(
    abs_params,
    prompt_rows,
    _sds((Np, P), bool, mesh, ("batch", None)),
    rows((B,), jnp.float32),
    abs_key,
    scalar_i32,
    num_samples=G,
    max_len=M,
    sampling=SamplingParams(top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p, stop_ids=(2,)),
  ).compile()
  times["generate"] = time.perf_counter() - t

  report["compiled"] = {name: {**_memory(c), "compile_s": times[name]} for name, c in compiled.items()}
  report["total_s"] = time.perf_counter() - t0
  _print_report(report)
  return report


def _print_report(report: dict[str, Any]) -> None:
  print(f"dry run: {report['model']} ({report['params'] / 1e9:.2f}B params) on mesh {report['mesh']}")
  print(f"rollout batch [rows, prompt, completion] = {report['rollout_batch']}")
  print("per-device storage (GiB):")
  for k, v in report["per_device_gib"].items():
    print(f"  {k:>18}: {v:8.3f}")
  print("compiled steps (GiB per device):")
  for name, m in report["compiled"].items():
    fields = " ".join(f"{k}={v:.3f}" for k, v in m.items() if k != "compile_s")
    print(f"  {name:>10}: {fields} (compiled in {m['compile_s']:.1f}s)")
  print(json.dumps(report, default=lambda o: float(o) if isinstance(o, np.floating) else str(o)))
