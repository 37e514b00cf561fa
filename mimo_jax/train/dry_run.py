"""``--dry_run``: build everything abstractly, AOT-compile the programs of a step, report memory.

Nothing is allocated: parameters, master copies, optimizer states, the reference, the
critic, rollout batches and the KV cache are ``jax.ShapeDtypeStruct``s carrying their
``NamedSharding`` on the configured mesh, and the step's programs are lowered and compiled
against them: ``generate`` (the sampler) and ``learn`` (the very program the trainer runs,
from :func:`~mimo_jax.train.learner.build_learner`: scoring, advantages, policy and critic
updates, controllers).  The per-device byte counts come from the shardings (what each device
stores) and from XLA's compiled memory analysis (arguments, outputs, temporaries, generated
code of each program), so a configuration that does not fit is found before any accelerator
time is spent.  The report is printed and written to ``<run_dir>/dry_run.json``.

A task that runs model-written code gets the trainer's sandbox check first (refused without
kernel isolation unless ``--allow_weak_sandbox``), and its report carries the ``sandbox``
record, so a dry run does not pass a configuration the trainer would refuse.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mimo_jax import sharding
from mimo_jax.config import Config
from mimo_jax.config_base import ConfigError
from mimo_jax.models import Transformer, ValueModel, abstract_state
from mimo_jax.models.reference import abstract_reference
from mimo_jax.models.transformer import K_CACHE_LOGICAL_AXES, V_CACHE_LOGICAL_AXES
from mimo_jax.optim import TrainState, abstract_opt_state
from mimo_jax.rollout import Sampler, SamplingParams
from mimo_jax.topology import Topology, parse_topology, topology_devices
from mimo_jax.train.learner import (
  Faults,
  LearnerState,
  abstract_experience,
  build_learner,
  grad_accum_choices,
  init_controller_state,
  minibatch_rows,
  prompt_group,
  prompt_sharing_note,
  uses_kl,
)

GiB = 1024**3


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds for a pytree of sharded arrays or ShapeDtypeStructs."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.shape
    if getattr(x, "sharding", None) is not None:
      shape = x.sharding.shard_shape(x.shape)
    itemsize = 8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.dtype(x.dtype).itemsize
    total += math.prod(shape) * itemsize
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
    "generated_code_gib": m.generated_code_size_in_bytes / GiB,
  }
  # Live at once: inputs, outputs not aliased to donated inputs, and temporaries.
  out["estimate_gib"] = (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  ) / GiB
  peak = getattr(m, "peak_memory_in_bytes", 0)
  if peak:
    out["peak_gib"] = peak / GiB
  return out


def run_vocab(cfg: Config) -> int:
  """The vocabulary size the run would use: ``--vocab_size``, else the tokenizer's (as the trainer does).

  Raises:
    ConfigError: ``--vocab_size`` is below the tokenizer's size (the trainer refuses it too).
  """
  if cfg.model.hf_checkpoint:
    with open(os.path.join(cfg.model.hf_checkpoint, "config.json")) as f:
      return int(json.load(f)["vocab_size"])
  from mimo_jax.tasks.registry import build_task

  return cfg.model.vocab_for(build_task(cfg.data, seed=cfg.run.seed)[1].vocab_size)


def _abstract_train_state(graphdef, abs_params, tx, master_dtype: str, mesh) -> TrainState:
  """A ``TrainState`` of ShapeDtypeStructs: what ``TrainState.create`` would build, nothing allocated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  master = None
  dtype = jnp.dtype(master_dtype)
  if any(jnp.dtype(x.dtype) != dtype for x in jax.tree.leaves(abs_params)):
    master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding), abs_params)
  target = abs_params if master is None else master
  abs_opt = abstract_opt_state(tx, target)
  key = jax.eval_shape(lambda: jax.random.key(0))
  scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=replicated)  # noqa: E731
  return TrainState(
    step=scalar(jnp.int32),
    params=abs_params,
    opt_state=abs_opt,
    rng=jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
    lr_scale=scalar(jnp.float32),
    graphdef=graphdef,
    tx=tx,
    master=master,
  )


def dry_run(cfg: Config, *, vocab_size: int | None = None, write: bool = True) -> dict[str, Any]:
  """AOT-compiles ``generate`` and ``learn`` for ``cfg`` on its mesh; prints, writes and returns the report.

  Args:
    cfg: the run configuration.
    vocab_size: the vocabulary (default: the one the run would use, see :func:`run_vocab`).
    write: write ``dry_run.json`` into the run directory.

  Raises:
    ConfigError: the task runs code and the sandbox has no kernel isolation (without
      ``--allow_weak_sandbox``), or the task cannot be built.
  """
  from mimo_jax.tasks.registry import check_sandbox

  t0 = time.perf_counter()
  # Whether or not the vocabulary needs the task built (run_vocab), as the trainer would.
  sandbox = check_sandbox(cfg.data)
  topo = parse_topology(cfg.run.dry_run_topology) if cfg.run.dry_run_topology else None
  if (
    topo is not None
    and topo.platform == "tpu"
    and (cfg.algo.reference_dtype, cfg.algo.reference_offload)
    == (
      "int8",
      "host",
    )
  ):
    # Seen with libtpu 0.0.42 on the 13B flagfile: "FAILED_PRECONDITION: A cycle is detected" in the
    # learner's copy schedule.  Each option alone compiles.
    raise ConfigError(
      "--reference_offload=host with --reference_dtype=int8: the XLA:TPU compiler fails on the pair (a cycle "
      "in its host-copy schedule); use one of them"
    )
  devices = topology_devices(topo) if topo is not None else None
  mesh, rollout_mesh = sharding.run_meshes(cfg.mesh, cfg.rollout.rollout_devices, devices)
  gen_mesh = rollout_mesh or mesh  # where generation runs and the KV cache lives
  replicated = NamedSharding(mesh, PartitionSpec())
  model_cfg = cfg.model.model_config().replace(vocab_size=vocab_size or run_vocab(cfg))
  use_kl, use_value = uses_kl(cfg), cfg.algo.use_value_model
  graphdef, abs_params = abstract_state(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)), mesh)
  value_graphdef, abs_value_params = (None, None)
  if use_value:
    value_graphdef, abs_value_params = abstract_state(lambda: ValueModel(model_cfg, rngs=nnx.Rngs(0)), mesh)
  learner = build_learner(cfg, mesh, graphdef, value_graphdef)
  master = cfg.optim.master_dtype
  policy = _abstract_train_state(graphdef, abs_params, learner.tx, master, mesh)
  value = _abstract_train_state(value_graphdef, abs_value_params, learner.value_tx, master, mesh) if use_value else None
  controllers = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
    jax.eval_shape(lambda: init_controller_state(cfg)),
  )
  a = cfg.algo
  abs_reference = (
    abstract_reference(abs_params, dtype=a.reference_dtype, offload=a.reference_offload) if use_kl else None
  )
  abs_state = LearnerState(policy=policy, controllers=controllers, reference=abs_reference, value=value)

  # ---- rollout-shaped abstract inputs
  G = cfg.rollout.num_samples
  Np = cfg.data.prompts_per_step
  B, P, M = Np * G, max(cfg.rollout.buckets), cfg.rollout.max_new_tokens

  exp = abstract_experience(mesh, rows=B, prompt_len=P, completion_len=M, reward_names=("correct",))
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  faults = Faults(
    nan_advantages=jax.ShapeDtypeStruct((), bool, sharding=replicated),
    lr_mult=jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
  )

  def nbytes(tree) -> int:
    return per_device_bytes(tree) if tree is not None else 0

  # The sampler's weights: the learner's own on a shared mesh, a copy in the generation layout on a
  # rollout sub-mesh (where they are all the rollout devices hold besides the KV cache).
  gen_params = abs_params
  if rollout_mesh is not None:
    gen_params = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      abs_params,
      sharding.generation_shardings(abs_params, rollout_mesh),
    )
  r = cfg.rollout
  sampler = Sampler(
    nnx.merge(graphdef, gen_params),
    mesh=gen_mesh,
    unrolled_decode=r.unrolled_decode,
    share_prompt_cache=r.share_prompt_cache,
  )
  L, K, H = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.resolved_head_dim
  cache_dtype = jnp.dtype(model_cfg.dtype)

  def cache(rows, slots):
    return (
      _sds((L, rows, K, H, slots), cache_dtype, gen_mesh, K_CACHE_LOGICAL_AXES),
      _sds((L, rows, K, slots, H), cache_dtype, gen_mesh, V_CACHE_LOGICAL_AXES),
    )

  # A prompt's keys and values once for its G rows (a shared prompt), else in every row.
  kv = (*cache(B, M), *cache(Np, P)) if sampler.shares_prompt_cache(Np, G) else cache(B, P + M)
  storage = {
    "params": nbytes(abs_params),
    "master": nbytes(policy.master),
    "optimizer_state": nbytes(policy.opt_state),
    # In device memory; with --reference_offload=host it is in host memory (reference_host_params).
    "reference_params": nbytes(abs_reference) if a.reference_offload != "host" else 0,
    "value_params": nbytes(abs_value_params),
    "value_master": nbytes(value.master) if value is not None else 0,
    "value_optimizer_state": nbytes(value.opt_state) if value is not None else 0,
    "kv_cache": nbytes(kv),
  }
  if rollout_mesh is not None:  # on the rollout devices: the KV cache above and this copy of the weights
    storage["rollout_params"] = nbytes(gen_params)
  if use_kl and a.reference_offload == "host":
    storage["reference_host_params"] = nbytes(abs_reference)
  report: dict[str, Any] = {
    "model": model_cfg.name,
    "params": model_cfg.num_params(),
    "vocab_size": model_cfg.vocab_size,
    "param_dtype": str(model_cfg.param_dtype),
    "compute_dtype": str(model_cfg.dtype),
    "master_dtype": master,
    "platform": topo.platform if topo is not None else jax.default_backend(),
    "topology": None if topo is None else _topology_record(topo, devices),
    "devices": int(mesh.size),
    "mesh": dict(mesh.shape),
    "rollout_mesh": dict(rollout_mesh.shape) if rollout_mesh is not None else None,
    "rollout_batch": [B, P, M],
    # Rows per prompt run once in the learner's passes (1: every row runs its own), and why not when not.
    "learner_prompt_group": prompt_group(cfg, mesh),
    "learner_prompt_sharing": prompt_sharing_note(cfg, mesh),
    "per_device_bytes": storage,
    "per_device_gib": {k: v / GiB for k, v in storage.items()},
  }
  if sandbox is not None:
    report["sandbox"] = sandbox
  if use_kl:
    # What each reference option would store per device (the score pass dequantises transiently).
    report["reference_options_gib"] = {
      **{
        f"reference_dtype={d or 'policy'}": nbytes(abstract_reference(abs_params, dtype=d)) / GiB
        for d in ("", "bfloat16", "int8")
      },
      "reference_offload=host (device memory)": 0.0,
    }

  compiled: dict[str, Any] = {}
  times: dict[str, float] = {}
  refused: dict[str, dict[str, Any]] = {}

  def compile_program(name: str, lower) -> None:
    t = time.perf_counter()
    try:
      compiled[name] = lower().compile()
    except jax.errors.JaxRuntimeError as e:
      # The TPU compiler refuses a program whose temporaries exceed the device's memory: that is the
      # answer a dry run is for, not a crash.
      if topo is None or "RESOURCE_EXHAUSTED" not in str(e):
        raise
      refused[name] = _compiler_refusal(str(e))
    times[name] = time.perf_counter() - t

  compile_program("learn", lambda: learner.learn.lower(abs_state, exp, step, faults))
  gen_replicated = NamedSharding(gen_mesh, PartitionSpec())
  compile_program(
    "generate",
    lambda: sampler.generate_program(B).lower(
      gen_params,
      None,  # no kept per-layer weights: the trainer's sampler copies them inside the call
      _sds((Np, P), jnp.int32, gen_mesh, ("batch", None)),
      _sds((Np, P), bool, gen_mesh, ("batch", None)),
      _sds((B,), jnp.float32, gen_mesh, ("batch",)),
      jax.ShapeDtypeStruct(policy.rng.shape, policy.rng.dtype, sharding=gen_replicated),
      jax.ShapeDtypeStruct((), jnp.int32, sharding=gen_replicated),
      num_samples=G,
      max_len=M,
      sampling=SamplingParams(top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p, stop_ids=(2,)),
    ),
  )
  arguments = {"learn": nbytes(abs_state) + nbytes(exp), "generate": nbytes(gen_params)}
  for name, r in refused.items():
    # Live at once, as far as the refusal tells: the program's arguments and the temporaries it asked for.
    r["argument_gib"] = arguments[name] / GiB
    r["estimate_gib"] = r["argument_gib"] + r.get("temp_gib", math.inf)

  report["compiled"] = {
    name: {**(_memory(compiled[name]) if name in compiled else refused[name]), "compile_s": times[name]}
    for name in ("learn", "generate")
  }
  # Each program's live bytes count its arguments (the whole learner state for learn) and its
  # temporaries (the KV cache for generate): the step's peak is the larger of the two programs.
  # The CPU compiler's peak_memory_in_bytes counts little more than the arguments, so the larger
  # of it and arguments + unaliased outputs + temporaries is reported.  Generation on the learner's
  # devices also has the learner's state beside it, which is not among its arguments (the optimizer's,
  # the reference's, the critic's), and with --async_rollout the learn program itself, running at once.
  if rollout_mesh is None:
    gen = report["compiled"]["generate"]
    if cfg.rollout.async_rollout:
      gen["resident_gib"] = _program_peak(report["compiled"]["learn"])
      gen["resident"] = "the learn program, running at the same time (--async_rollout)"
    else:
      beside = (
        "master",
        "optimizer_state",
        "reference_params",
        "value_params",
        "value_master",
        "value_optimizer_state",
      )
      gen["resident_gib"] = sum(storage[k] for k in beside) / GiB
      gen["resident"] = "the learner's state beside the weights (optimizer, master copy, reference, critic)"
  report["peak_estimate_gib"] = max(_program_peak(m) for m in report["compiled"].values())
  if topo is not None:
    report["fit"] = _fit(cfg, topo, report, mesh)
  report["total_s"] = time.perf_counter() - t0
  _print_report(report)
  if write:
    from mimo_jax.train.loop import resolve_run_dir

    run_dir = resolve_run_dir(cfg)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "dry_run.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(report, f, indent=2, default=_json_default)
    os.replace(tmp, path)
    report["path"] = path
    print(f"dry run report: {path}")
  if topo is not None and not report["fit"]["fits"]:
    raise ConfigError(report["fit"]["message"])
  return report


def _program_peak(m: dict[str, Any]) -> float:
  """A program's live bytes per device (GiB): the larger of the compiler's peak and arguments + unaliased
  outputs + temporaries, plus what stays resident beside it (``resident_gib``)."""
  return max(m.get("peak_gib", 0.0), m.get("estimate_gib", 0.0)) + m.get("resident_gib", 0.0)


def _compiler_refusal(message: str) -> dict[str, Any]:
  """What the compiler's out-of-memory refusal says: the temporaries it needed and the memory there was."""
  out: dict[str, Any] = {"refused_by_compiler": message.splitlines()[0][:500]}
  m = re.search(r"temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", message) or re.search(
    r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT])", message
  )
  if m:
    unit = {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 1024.0}
    out["temp_gib"] = float(m.group(1)) * unit[m.group(2)]
    out["available_gib"] = float(m.group(3)) * unit[m.group(4)]
  return out


def _topology_record(topo: Topology, devices) -> dict[str, Any]:
  return {
    "name": topo.name,
    "platform": topo.platform,
    "compiler": topo.compiler,
    "device_kind": devices[0].device_kind,
    "chips": topo.chips,
    "grid": "x".join(map(str, topo.grid)) or None,
    "devices": topo.devices,
    "device_memory_gib": topo.device_gib,
    "caveat": None
    if topo.platform == "tpu"
    else "compiled by the CPU compiler: per-device storage is exact, temporaries are an approximation of the GPU's",
  }


def _fit(cfg: Config, topo: Topology, report: dict[str, Any], mesh: Mesh | None = None) -> dict[str, Any]:
  """Whether the step fits ``topo``'s devices with ``--dry_run_headroom`` kept free; if not, which flag to
  change and by how much (the larger program decides: the learner step or generation).  A larger
  ``--grad_accum`` that would stop the learner running each prompt once (on ``mesh``) says so."""
  budget = topo.device_gib * (1.0 - cfg.run.dry_run_headroom)
  peaks = {name: _program_peak(m) for name, m in report["compiled"].items()}
  worst = max(peaks, key=peaks.get)
  need = peaks[worst]
  out = {
    "budget_gib": budget,
    "device_memory_gib": topo.device_gib,
    "headroom": cfg.run.dry_run_headroom,
    "peak_gib": need,
    "program": worst,
    "fits": need <= budget,
    "free_gib": budget - need,
  }
  if out["fits"]:
    out["message"] = (
      f"fits {topo.name}: peak {need:.2f} GiB per device ({worst}) of {budget:.2f} GiB usable "
      f"({topo.device_gib:.1f} GiB less {100 * cfg.run.dry_run_headroom:.0f}% headroom)"
    )
    return out
  over = need - budget
  storage = report["per_device_gib"]
  state = sum(v for k, v in storage.items() if k != "kv_cache")
  m = report["compiled"][worst]
  if state > budget:
    advice = (
      f"the model state alone (parameters, optimizer, reference, critic) takes {state:.2f} GiB per device: shard "
      f"it over more devices (a larger --dry_run_topology, or --mesh_fsdp/--mesh_tensor), or use "
      f"--param_dtype=bfloat16"
    )
  elif worst == "learn":
    temp = m.get("temp_gib", 0.0)
    g = cfg.algo.grad_accum
    minibatch = minibatch_rows(cfg)
    shards = report["mesh"]["data"] * report["mesh"]["fsdp"]
    # Activations shrink with the micro-batch: the smallest valid --grad_accum whose share fits.
    need_factor = temp / max(temp - over, 1e-9) if temp > over else math.inf
    valid = [a for a in grad_accum_choices(cfg, shards) if a > g]
    fitting = [a for a in valid if a / g >= need_factor]
    if fitting:
      advice = (
        f"--grad_accum={g}: the learner step's activations take {temp:.2f} GiB per device; raise --grad_accum "
        f"to {fitting[0]} (micro-batches of {minibatch // fitting[0]} rows instead of {minibatch // g})"
      )
      if report["learner_prompt_group"] > 1 and prompt_group(cfg, mesh, grad_accum=fitting[0]) == 1:
        advice += (
          f", though the learner then runs every row's own prompt (its micro-batches no longer split into "
          f"whole groups of --num_samples={cfg.rollout.num_samples} over the {shards} batch shards)"
        )
        keep = next((a for a in fitting if prompt_group(cfg, mesh, grad_accum=a) > 1), None)
        if keep is not None:
          advice += f"; --grad_accum={keep} also fits and runs each prompt once"
    else:
      advice = (
        f"--prompts_per_step={cfg.data.prompts_per_step}: the learner step's activations ({temp:.2f} GiB per "
        f"device) do not fit at any valid --grad_accum; lower --prompts_per_step or --max_new_tokens by about "
        f"{math.ceil(100 * over / max(temp, 1e-9))}%, or raise --num_minibatches"
      )
  else:
    rows = cfg.data.prompts_per_step
    scale = max(0.0, 1.0 - over / max(storage.get("kv_cache", 0.0) + m.get("temp_gib", 0.0), 1e-9))
    fit_rows = int(rows * scale)
    advice = (
      f"--prompts_per_step={rows}: generation's KV cache and temporaries overflow; at most about "
      f"{fit_rows} prompts per step fit (or lower --num_samples / --max_new_tokens)"
    )
  out["message"] = (
    f"--dry_run_topology={topo.name}: does not fit: the {worst} program needs {need:.2f} GiB per device, "
    f"{over:.2f} GiB ({100 * over / budget:.0f}%) over the {budget:.2f} GiB usable ({topo.device_gib:.1f} GiB "
    f"less {100 * cfg.run.dry_run_headroom:.0f}% headroom); change {advice}"
  )
  return out


def _json_default(o: Any) -> Any:
  return float(o) if isinstance(o, np.floating) else str(o)


def _print_report(report: dict[str, Any]) -> None:
  print(f"dry run: {report['model']} ({report['params'] / 1e9:.2f}B params) on mesh {report['mesh']}")
  print(f"rollout batch [rows, prompt, completion] = {report['rollout_batch']}")
  group = report["learner_prompt_group"]
  print(
    f"learner: each prompt run once for its {group} rows" if group > 1 else "learner: every row runs its own prompt"
  )
  if report.get("learner_prompt_sharing"):
    print(f"note: {report['learner_prompt_sharing']}")
  print("per-device storage (GiB):")
  for k, v in report["per_device_gib"].items():
    print(f"  {k:>18}: {v:8.3f}")
  print("compiled steps (GiB per device):")
  for name, m in report["compiled"].items():
    fields = " ".join(f"{k}={v:.3f}" for k, v in m.items() if k != "compile_s" and isinstance(v, float))
    if "refused_by_compiler" in m:
      fields = f"refused by the compiler (out of memory): {fields}"
    print(f"  {name:>10}: {fields} (compiled in {m['compile_s']:.1f}s)")
  print(f"peak estimate: {report['peak_estimate_gib']:.3f} GiB per device")
  if report.get("topology"):
    t = report["topology"]
    print(f"topology: {t['name']} ({t['devices']} x {t['device_kind']}, compiled by {t['compiler']})")
    if t["caveat"]:
      print(f"  caveat: {t['caveat']}")
    print(report["fit"]["message"])
