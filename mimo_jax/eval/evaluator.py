"""Held-out evaluation of a policy: greedy accuracy, unbiased pass@k and majority-vote maj@k.

Two levels: :func:`evaluate_policy` evaluates parameters already on a sampler, and
:func:`evaluate_checkpoint` rebuilds a run from its directory (``config.json``), restores
one checkpoint's policy onto the run's mesh and evaluates it on the held-out prompts (the
``python -m mimo_jax.eval`` command line).

:func:`evaluate_policy` generates, for every problem, one greedy completion and
``num_samples`` sampled ones, scores each with the task's verifier and reduces them to
per-problem verdicts (:class:`ProblemResult`), which :func:`summarize` turns into the
reported metrics.  Every generation call has a static shape: prompts are padded to
``rows`` per call (filler rows are generated and discarded), and the samples of one chunk
of prompts are drawn ``samples_per_call`` at a time (a divisor of ``num_samples``), so a
large ``num_samples`` (pass@64) never needs a batch larger than ``max_batch_rows``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from flax import nnx

from mimo_jax import sharding
from mimo_jax.ckpt.manager import CheckpointCorrupted, Checkpointer
from mimo_jax.config import ADDED_FROM, ADDED_SETTINGS, CONCERN_CLASSES, RUN_RECORD_KEYS, Config, default_ks
from mimo_jax.config_base import ConfigError, coerce_value
from mimo_jax.eval.metrics import majority_at_k, pass_at_k
from mimo_jax.files import read_jsonl, write_atomic
from mimo_jax.models import ModelConfig, Transformer, abstract_state
from mimo_jax.rewards.math import extract_answer, normalize_number
from mimo_jax.rollout import Sampler, SamplingParams
from mimo_jax.rollout.encoding import decode_completions, encode_prompts, sampling_params
from mimo_jax.tasks.registry import build_arith_task, build_task, check_sandbox
from mimo_jax.tokenization import Tokenizer

__all__ = [
  "DEFAULT_ANSWER_FNS",
  "AnswerFn",
  "ProblemResult",
  "config_from_dict",
  "default_answer_fn",
  "default_ks",
  "evaluate_checkpoint",
  "evaluate_policy",
  "eval_rows",
  "load_run_config",
  "resolve_checkpoint",
  "samples_per_call",
  "summarize",
]

# answer_fn(problem, completion_text) -> the final answer to vote on, or None when there is none.
AnswerFn = Callable[[Any, str], str | None]


def _arith_answer(problem: Any, text: str) -> str | None:
  """The arithmetic verifier compares the stripped completion: that is the answer."""
  del problem
  return text.strip() or None


def _gsm8k_answer(problem: Any, text: str) -> str | None:
  """The extracted final answer, canonicalised when it is a number (``"1,200"`` and ``"1200"`` vote together)."""
  del problem
  raw = extract_answer(text)
  if raw is None:
    return None
  value = normalize_number(raw)
  return raw if value is None else str(value)


# Answer extractors per task name; tasks without a notion of a final answer (humaneval) have none.
DEFAULT_ANSWER_FNS: Mapping[str, AnswerFn] = MappingProxyType({"arith": _arith_answer, "gsm8k": _gsm8k_answer})


def default_answer_fn(task_name: str) -> AnswerFn | None:
  """The answer extractor used for maj@k on ``task_name``, or None when the task has none."""
  return DEFAULT_ANSWER_FNS.get(task_name)


@dataclasses.dataclass(frozen=True)
class ProblemResult:
  """The verdicts on one problem.

  Attributes:
    task: the problem's task name.
    greedy_correct: whether the greedy completion is correct.
    correct: whether each sampled completion is correct, in sample order.
    answers: the extracted answer of each sampled completion, or None when the task has no
      answer extractor (then no maj@k is computed for the problem).
    level: the problem's difficulty level (tasks without levels have one, 0).
  """

  task: str
  greedy_correct: bool
  correct: tuple[bool, ...]
  answers: tuple[str | None, ...] | None
  level: int = 0


def _check_ks(ks: Sequence[int], num_samples: int) -> tuple[int, ...]:
  ks = tuple(sorted({int(k) for k in ks}))
  if not ks:
    raise ValueError("ks must name at least one k")
  bad = [k for k in ks if not 1 <= k <= num_samples]
  if bad:
    raise ValueError(f"ks {bad} are outside 1..num_samples={num_samples}")
  return ks


def _metrics(results: Sequence[ProblemResult], ks: Sequence[int]) -> dict[str, float]:
  if not results:
    return {"greedy_accuracy": float("nan"), **{f"pass@{k}": float("nan") for k in ks}}
  n = len(results[0].correct)
  out = {"greedy_accuracy": float(np.mean([r.greedy_correct for r in results]))}
  for k in ks:
    out[f"pass@{k}"] = float(np.mean([pass_at_k(n, sum(r.correct), k) for r in results]))
  if all(r.answers is not None for r in results):
    for k in ks:
      out[f"maj@{k}"] = float(np.mean([majority_at_k(r.answers[:k], r.correct[:k]) for r in results]))
  return out


def summarize(results: Sequence[ProblemResult], ks: Sequence[int]) -> dict[str, float]:
  """Reduces per-problem verdicts to the reported metrics.

  Args:
    results: one entry per problem, all with the same number of samples ``n``.
    ks: the k of pass@k and maj@k (each ``<= n``).

  Returns:
    ``greedy_accuracy``; ``pass@k`` (the unbiased estimator, averaged over problems) for
    each k; ``maj@k`` (majority vote over the first k samples' answers) for each k when
    every problem has extracted answers; the same keys prefixed ``<task>/`` per task when
    the problems come from more than one task (a task's ``maj@k`` only when it has an
    extractor); the same keys prefixed ``level<l>/`` (``<task>/level<l>/`` with several tasks) per
    difficulty level when a task's problems come from more than one (how a mixed-difficulty run
    moves each level); and ``num_problems``.
  """
  lengths = {len(r.correct) for r in results}
  if len(lengths) > 1:
    raise ValueError(f"every problem needs the same number of samples, got {sorted(lengths)}")
  if results:
    ks = _check_ks(ks, lengths.pop())
  out = _metrics(results, ks)
  tasks = sorted({r.task for r in results})
  for name in tasks:
    group = [r for r in results if r.task == name]
    prefix = f"{name}/" if len(tasks) > 1 else ""
    if prefix:
      out.update({f"{prefix}{k}": v for k, v in _metrics(group, ks).items()})
      out[f"{prefix}num_problems"] = float(len(group))
    levels = sorted({r.level for r in group})
    if len(levels) > 1:
      for level in levels:
        part = [r for r in group if r.level == level]
        out.update({f"{prefix}level{level}/{k}": v for k, v in _metrics(part, ks).items()})
        out[f"{prefix}level{level}/num_problems"] = float(len(part))
  out["num_problems"] = float(len(results))
  return out


def samples_per_call(num_samples: int, rows: int, max_batch_rows: int | None) -> int:
  """The samples per prompt drawn by one generation call.

  The largest divisor ``g`` of ``num_samples`` with ``rows * g <= max_batch_rows`` (at
  least 1), so every call of an evaluation has the same static shape.

  Args:
    num_samples: samples per prompt in all.
    rows: prompt rows per call.
    max_batch_rows: the most completion rows one call may generate (None: no limit).

  Returns:
    ``g``, a divisor of ``num_samples``.
  """
  if max_batch_rows is None:
    return num_samples
  fits = [g for g in range(1, num_samples + 1) if num_samples % g == 0 and rows * g <= max_batch_rows]
  return max(fits, default=1)


def _task_name(problem: Any, task: Any) -> str:
  return str(getattr(problem, "task", None) or getattr(task, "name", None) or "task")


def evaluate_policy(
  sampler: Any,
  params: Any,
  task: Any,
  tokenizer: Tokenizer,
  problems: Sequence[Any],
  *,
  buckets: Sequence[int],
  rows: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  num_samples: int,
  ks: Sequence[int],
  temperature: float,
  key: jax.Array,
  answer_fn: AnswerFn | None = None,
  max_batch_rows: int | None = None,
) -> dict[str, float]:
  """Greedy accuracy, pass@k and maj@k of a policy on ``problems``.

  Args:
    sampler: the rollout (``generate`` / ``update_params`` / ``batch_shards``), e.g. a
      :class:`~mimo_jax.rollout.Sampler` or :class:`~mimo_jax.testing.FakeRollout`.
    params: the policy parameters to evaluate (handed to ``sampler.update_params``); None
      keeps the sampler's current parameters.
    task: the verifier: ``task.reward(problem, text) > 0`` means correct.
    tokenizer: encodes prompts and decodes completions.
    problems: the problems (with ``prompt``, and ``task`` naming their task).
    buckets: prompt bucket lengths.
    rows: prompts per generation call; the last chunk is padded to it.  A multiple of
      the sampler's batch shards.
    max_new_tokens: the completion length.
    sampling: static sampling parameters (top-k/top-p, stop ids, pad id).
    num_samples: sampled completions per problem.
    ks: the k of pass@k and maj@k, each in ``1..num_samples``.
    temperature: the sampling temperature (the greedy completion uses 0).
    key: the PRNG key; split once per generation call.
    answer_fn: ``(problem, text) -> answer or None`` for maj@k; default per task name
      (:data:`DEFAULT_ANSWER_FNS`); tasks without one report no maj@k.
    max_batch_rows: the most completion rows one sampling call may generate; the samples
      are then drawn in equal parts (see :func:`samples_per_call`).  None: all at once.

  Returns:
    The metrics of :func:`summarize`, plus ``prompt_truncated`` (prompts that were cut to
    the largest bucket).

  Raises:
    ValueError: ``rows`` is not a positive multiple of the batch shards, or a k is out of range.
  """
  shards = int(getattr(sampler, "batch_shards", 1))
  if rows < 1 or rows % shards:
    raise ValueError(f"rows={rows} must be a positive multiple of the sampler's batch shards ({shards})")
  if num_samples < 1:
    raise ValueError(f"num_samples={num_samples} must be >= 1")
  ks = _check_ks(ks, num_samples)
  if params is not None:
    sampler.update_params(params)
  per_call = samples_per_call(num_samples, rows, max_batch_rows)
  calls = num_samples // per_call

  def generate(tokens, mask, G: int, temp: float, call_key: jax.Array) -> list[str]:
    out = sampler.generate(
      tokens,
      mask,
      num_samples=G,
      max_len=max_new_tokens,
      sampling=sampling,
      temperature=temp,
      key=call_key,
    )
    return decode_completions(tokenizer, out)

  results: list[ProblemResult] = []
  truncated = 0
  for start in range(0, len(problems), rows):
    chunk = problems[start : start + rows]
    tokens, mask, cut = encode_prompts(tokenizer, [p.prompt for p in chunk], buckets, rows)
    truncated += cut
    key, greedy_key, *sample_keys = jax.random.split(key, 2 + calls)
    greedy = generate(tokens, mask, 1, 0.0, greedy_key)
    samples: list[list[str]] = [[] for _ in chunk]
    for call_key in sample_keys:
      texts = generate(tokens, mask, per_call, temperature, call_key)
      for j in range(len(chunk)):
        samples[j].extend(texts[j * per_call : (j + 1) * per_call])
    for j, problem in enumerate(chunk):
      name = _task_name(problem, task)
      extract = answer_fn or default_answer_fn(name)
      results.append(
        ProblemResult(
          task=name,
          greedy_correct=task.reward(problem, greedy[j]) > 0,
          correct=tuple(task.reward(problem, t) > 0 for t in samples[j]),
          answers=None if extract is None else tuple(extract(problem, t) for t in samples[j]),
          level=int(getattr(problem, "level", 0) or 0),
        )
      )
  out = summarize(results, ks)
  out["prompt_truncated"] = float(truncated)
  return out


# ----------------------------------------------------------------------------
# Evaluating a checkpoint of a run directory
# ----------------------------------------------------------------------------


def config_from_dict(d: Mapping[str, Any]) -> Config:
  """Rebuilds a :class:`Config` from its ``Config.to_dict()`` layout (a run's ``config.json``).

  Every concern and every field must be present and known, so a configuration written by a
  different version of the trainer is refused rather than silently completed with defaults.
  The run records a ``config.json`` also holds (``RUN_RECORD_KEYS``: the sandbox isolation of
  the machine, the code's provenance) are not settings and are skipped.  Settings added later
  (``ADDED_SETTINGS``, each defaulting to the older behaviour, or to another field's value where
  ``ADDED_FROM`` names one) may be absent.

  Args:
    d: ``{concern: {field: value}}``, plus optional run records.

  Returns:
    The validated config (each concern's own checks run).

  Raises:
    ConfigError: unknown or missing concerns or fields (all of them named), a value of the
      wrong type, or a value the concern's checks refuse.
  """
  if not isinstance(d, Mapping):
    raise ConfigError(f"a config must be a JSON object of concerns, got {type(d).__name__}")
  unknown = sorted(set(d) - set(CONCERN_CLASSES) - set(RUN_RECORD_KEYS))
  missing = sorted(set(CONCERN_CLASSES) - set(d))
  wrong_type: list[str] = []
  parts: dict[str, Any] = {}
  for concern, cls in CONCERN_CLASSES.items():
    values = d.get(concern)
    if values is None:
      continue
    if not isinstance(values, Mapping):
      wrong_type.append(f"{concern} (expected an object, got {type(values).__name__})")
      continue
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown += [f"{concern}.{name}" for name in sorted(set(values) - set(fields))]
    added = set(ADDED_SETTINGS.get(concern, ()))  # newer settings: absent means their default
    missing += [f"{concern}.{name}" for name in sorted(set(fields) - set(values) - added)]
    kwargs = {}
    for name, f in fields.items():
      if name not in values:
        continue
      value, expected = coerce_value(f, values[name]), type(f.default)
      if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        wrong_type.append(f"{concern}.{name}={value!r} (expected {expected.__name__})")
        continue
      kwargs[name] = value
    for name, source in ADDED_FROM.get(concern, {}).items():
      if name not in values and source in kwargs:
        kwargs[name] = kwargs[source]
    parts[concern] = (cls, kwargs)
  problems = []
  if unknown:
    problems.append(f"unknown fields: {', '.join(unknown)}")
  if missing:
    problems.append(f"missing fields: {', '.join(missing)}")
  if wrong_type:
    problems.append(f"values of the wrong type: {', '.join(wrong_type)}")
  if problems:
    raise ConfigError("the config does not match this version's Config: " + "; ".join(problems))
  return Config(**{concern: cls(**kwargs) for concern, (cls, kwargs) in parts.items()})


def load_run_config(run_dir: str) -> Config:
  """The config of a run directory (``<run_dir>/config.json``); raises ConfigError naming the file."""
  path = os.path.join(run_dir, "config.json")
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: no such file (not a run directory?)") from None
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: not valid JSON ({e})") from None
  try:
    return config_from_dict(data)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None


def _step_dirs(checkpoints: str) -> list[int]:
  if not os.path.isdir(checkpoints):
    return []
  return sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit() and os.path.isdir(os.path.join(checkpoints, n)))


def resolve_checkpoint(path: str) -> tuple[str, int | None]:
  """Splits a ``--checkpoint`` path into ``(run_dir, step)``.

  Args:
    path: a run directory (one with ``config.json``: its latest intact checkpoint, step
      None) or one checkpoint directory ``<run_dir>/checkpoints/<step>``.

  Returns:
    The run directory and the checkpoint step (None: the latest).

  Raises:
    FileNotFoundError: the path does not exist, is neither form, or holds no checkpoint;
      the message lists the checkpoints that do exist.
  """
  path = os.path.abspath(path)
  name, parent = os.path.basename(path), os.path.dirname(path)
  # <run_dir>/checkpoints/<step>, or the best checkpoint kept by --keep_best: <run_dir>/best/<step>.
  is_step_dir = name.isdigit() and os.path.basename(parent) in ("checkpoints", "best")
  if is_step_dir:
    run_dir = os.path.dirname(parent)
    if not os.path.isdir(path):
      available = _step_dirs(parent)
      raise FileNotFoundError(f"{path}: no such checkpoint directory (checkpoints in {parent}: {available or 'none'})")
    if not os.path.isfile(os.path.join(run_dir, "config.json")):
      raise FileNotFoundError(f"{path}: its run directory {run_dir} has no config.json")
    return run_dir, int(name)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no such directory")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(
      f"{path}: neither a run directory (no config.json) nor a checkpoint directory <run_dir>/checkpoints/<step>"
    )
  if not _step_dirs(os.path.join(path, "checkpoints")):
    raise FileNotFoundError(f"{path}: the run has no checkpoints ({os.path.join(path, 'checkpoints')} is empty)")
  return path, None


def eval_rows(num_prompts: int, batch_shards: int) -> int:
  """Prompts per evaluation call: the held-out prompts rounded up to the sampler's batch shards, at most
  the largest multiple of them up to 64 (at least one per shard); one static shape for every call (the
  trainer and :func:`evaluate_checkpoint` use the same)."""
  cap = max(batch_shards, 64 // batch_shards * batch_shards)
  return min(cap, max(batch_shards, -(-num_prompts // batch_shards) * batch_shards))


def _restore_policy(ckpt: Checkpointer, run_dir: str, step: int | None, mesh) -> tuple[Any, dict[str, Any], int]:
  """The policy parameters of checkpoint ``step`` (None: the newest intact one) on ``mesh``, its metadata
  (with the resolved ``ModelConfig`` under ``"_model"``) and the step."""

  def restore(s: int) -> tuple[Any, dict[str, Any]]:
    try:
      meta = ckpt.read_meta(s)
    except Exception as e:  # noqa: BLE001 - unreadable metadata means an unusable checkpoint
      raise CheckpointCorrupted(f"checkpoint {s}: metadata unreadable ({type(e).__name__}: {e})") from e
    phase = meta.get("phase")
    if phase not in ("sft", "rl"):
      raise CheckpointCorrupted(f"checkpoint metadata names no phase (got {phase!r})")
    try:
      model_cfg = ModelConfig.from_dict(meta.get("model_config"))
    except (TypeError, ValueError) as e:  # ConfigError included: a value out of range
      raise CheckpointCorrupted(f"checkpoint {s}: its model_config is unusable ({e})") from None
    _, abs_params = abstract_state(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)), mesh)
    tree, meta = ckpt.restore_part(s, {"params": abs_params})
    return tree["params"], {**meta, "_model": model_cfg}

  available = ckpt.all_steps()
  if step is not None:
    if step not in available:
      raise FileNotFoundError(
        f"{run_dir}/checkpoints/{step}: not a committed checkpoint (committed steps: {available or 'none'})"
      )
    return (*restore(step), step)
  for s in reversed(available):
    try:
      return (*restore(s), s)
    except CheckpointCorrupted as e:
      print(f"warning: {e}; falling back to an earlier checkpoint", flush=True)
  raise CheckpointCorrupted(f"{run_dir}: no intact checkpoint (steps on disk: {available})")


def evaluate_checkpoint(
  path: str,
  *,
  eval_prompts: int | None = None,
  num_samples: int | None = None,
  ks: Sequence[int] | None = None,
  temperature: float | None = None,
  max_batch_rows: int | None = None,
  seed: int = 0,
  allow_weak_sandbox: bool = False,
  rollout_factory: Callable[..., Any] | None = None,
) -> dict[str, Any]:
  """Evaluates one checkpoint of a run on the run's held-out prompts.

  The run is rebuilt from ``<run_dir>/config.json`` (task, held-out split, tokenizer and
  mesh are deterministic functions of the config), the checkpoint's policy parameters are
  restored onto the mesh (fingerprints verified), and :func:`evaluate_policy` runs with the
  run's prompt rows per call, so greedy decoding reproduces the run's own evaluation.

  Args:
    path: a run directory (its latest intact checkpoint) or ``<run_dir>/checkpoints/<step>``.
    eval_prompts: held-out prompts to evaluate (None: the run's ``eval_prompts``).  For the
      arithmetic task a larger number draws a larger held-out split, whose extra prompts
      the run may have trained on.
    num_samples: sampled completions per prompt (None: the run's ``eval_samples``).
    ks: the k of pass@k / maj@k (None: :func:`default_ks`).
    temperature: the sampling temperature (None: the run's ``eval_temperature``).
    max_batch_rows: the most completion rows per generation call (None: the larger of one
      evaluation chunk and one training rollout batch).
    seed: seed of the sampling key.
    allow_weak_sandbox: for tasks that run model-written code, go on where the sandbox has
      no kernel isolation (Python-level guards only).  This replaces the run's own setting:
      accepting weak isolation is a decision about the machine evaluating, made each time.
    rollout_factory: ``(model, mesh) -> rollout`` replaces the sampler (tests).

  Returns:
    ``run_dir``, ``checkpoint_step`` (the global checkpoint step), ``phase``, ``step`` (the
    step within the phase), the evaluation settings, the metrics of :func:`evaluate_policy`,
    and for tasks that run code ``sandbox``, the isolation they ran under.

  Raises:
    FileNotFoundError: no such run directory or checkpoint.
    CheckpointCorrupted: the checkpoint cannot be read back intact.
    ConfigError: the run's config is unusable, a setting is out of range, or the task runs
      code and the sandbox has no kernel isolation (without ``allow_weak_sandbox``).
  """
  run_dir, step = resolve_checkpoint(path)
  run_cfg = load_run_config(run_dir)
  cfg, num_samples, ks, temperature = _eval_settings(
    run_cfg, eval_prompts, num_samples, ks, temperature, allow_weak_sandbox
  )
  if max_batch_rows is not None and max_batch_rows < 1:
    raise ConfigError(f"--max_batch_rows={max_batch_rows}: must be >= 1")
  # A code task without kernel isolation is refused first, outside the rebuild below: the refusal is
  # about this machine, not about the run's config.
  sandbox = check_sandbox(cfg.data)
  # Only what evaluation needs: the task and its held-out split, the policy's parameters (restored
  # alone, onto the run's mesh) and a sampler.
  try:
    mesh = sharding.build_mesh(_local_mesh_config(cfg.mesh))
    task, tokenizer = build_task(cfg.data, seed=cfg.run.seed, hf_checkpoint=cfg.model.hf_checkpoint)
    heldout = task.heldout()[: cfg.data.eval_prompts]
  except ValueError as e:  # ConfigError included; also a held-out split the task cannot draw
    raise ConfigError(f"cannot rebuild the run from {run_dir}/config.json: {e}") from None
  if not heldout:
    raise ConfigError(f"the run's task has no held-out prompts (eval_prompts={cfg.data.eval_prompts})")
  unseen = _outside_the_runs_heldout(run_cfg, heldout)
  if unseen:
    print(
      f"warning: {unseen} of the {len(heldout)} prompts evaluated are outside the run's own held-out split "
      f"(--eval_prompts={run_cfg.data.eval_prompts} drew it): the run may have trained on them",
      flush=True,
    )
  folder = os.path.dirname(os.path.abspath(path)) if step is not None else os.path.join(run_dir, "checkpoints")
  ckpt = Checkpointer(folder, async_save=False, read_only=True)
  try:
    params, meta, step = _restore_policy(ckpt, run_dir, step, mesh)
  finally:
    ckpt.close()
  graphdef, _ = abstract_state(lambda: Transformer(meta["_model"], rngs=nnx.Rngs(0)))
  model = nnx.merge(graphdef, params)
  # Fixed weights, many calls: the per-layer copy (of the unrolled decode) is made once.
  unrolled, shared = cfg.rollout.unrolled_decode, cfg.rollout.share_prompt_cache
  factory = rollout_factory or (
    lambda m, mesh: Sampler(m, mesh=mesh, unrolled_decode=unrolled, keep_layer_copy=unrolled, share_prompt_cache=shared)
  )
  sampler = factory(model, mesh)
  rows = eval_rows(len(heldout), sampler.batch_shards)
  if max_batch_rows is None:
    max_batch_rows = max(rows, cfg.data.prompts_per_step * cfg.rollout.num_samples)
  metrics = evaluate_policy(
    sampler,
    params,
    task,
    tokenizer,
    heldout,
    buckets=cfg.rollout.buckets,
    rows=rows,
    max_new_tokens=cfg.rollout.max_new_tokens,
    sampling=sampling_params(cfg.rollout, tokenizer),
    num_samples=num_samples,
    ks=ks,
    temperature=temperature,
    key=jax.random.key(seed),
    max_batch_rows=max_batch_rows,
  )
  return {
    "run_dir": run_dir,
    "checkpoint_step": int(step),
    "phase": meta["phase"],
    "step": int(meta["step"]),
    "task": cfg.data.task,
    "eval_prompts": len(heldout),
    # Prompts the run did not hold out (a larger arithmetic split than the run's): it may have trained on them.
    **({"eval_prompts_not_held_out": unseen} if unseen else {}),
    "eval_samples": num_samples,
    "eval_temperature": float(temperature),
    "ks": list(ks),
    **metrics,
    **({"sandbox": sandbox} if sandbox is not None else {}),
  }


def _local_mesh_config(mesh: sharding.MeshConfig) -> sharding.MeshConfig:
  """The run's mesh where it fits this machine's devices (greedy decoding then reproduces the run's own
  evaluation), else every device on the fsdp axis: checkpoints restore onto any layout, and the numbers
  may differ from the run's by float rounding (another split of the same sums)."""
  devices = jax.device_count()
  try:
    mesh.resolve(devices)
    return mesh
  except ValueError as e:
    local = dataclasses.replace(mesh, mesh_data=1, mesh_fsdp=-1, mesh_tensor=1)
    print(f"note: {e}; evaluating on data=1, fsdp={devices}, tensor=1 instead", flush=True)
    return local


def _outside_the_runs_heldout(run_cfg: Config, heldout: Sequence[Any]) -> int:
  """How many of ``heldout`` the run itself did not hold out.  Only the arithmetic task's held-out split
  depends on ``--eval_prompts`` (a file task's is its whole evaluation file), so a larger count evaluates
  arithmetic problems the run's training stream was free to draw."""
  if "arith" not in dict(run_cfg.data.task_mix):
    return 0
  arith = build_arith_task(run_cfg.data)
  return sum(getattr(p, "task", "arith") == "arith" and not arith.is_heldout(p) for p in heldout)


def _eval_settings(
  cfg: Config,
  eval_prompts: int | None,
  num_samples: int | None,
  ks: Sequence[int] | None,
  temperature: float | None,
  allow_weak_sandbox: bool = False,
) -> tuple[Config, int, tuple[int, ...], float]:
  """The run's config with the evaluation's prompt count and sandbox decision, and the samples, ks and
  temperature in effect (each the flag's, else the run's); ConfigError naming a bad flag."""
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, allow_weak_sandbox=bool(allow_weak_sandbox)))
  if eval_prompts is not None:
    if eval_prompts < 1:
      raise ConfigError(f"--eval_prompts={eval_prompts}: must be >= 1")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_prompts=eval_prompts))
  num_samples = cfg.run.eval_samples if num_samples is None else num_samples
  if num_samples < 1:
    raise ConfigError(f"--eval_samples={num_samples}: must be >= 1")
  ks = default_ks(num_samples) if ks is None else tuple(sorted(set(ks)))
  bad = [k for k in ks if not 1 <= k <= num_samples]
  if bad or not ks:
    raise ConfigError(f"--ks={','.join(map(str, ks))}: every k must be in 1..eval_samples={num_samples}")
  temperature = cfg.run.eval_temperature if temperature is None else temperature
  if not math.isfinite(temperature) or temperature <= 0:
    raise ConfigError(f"--eval_temperature={temperature}: must be > 0 (the greedy completion is always evaluated)")
  return cfg, num_samples, tuple(ks), float(temperature)


EVAL_CURVE = "eval_curve.jsonl"
_SETTINGS = ("eval_prompts", "eval_samples", "eval_temperature", "ks", "eval_seed")


def _curve_settings(run_dir: str, seed: int, kwargs: Mapping[str, Any]) -> tuple | None:
  """The ``_SETTINGS`` values :func:`evaluate_checkpoint` will give every row of ``run_dir`` with these
  settings (None where they cannot be worked out: the first evaluation then says why)."""
  try:
    cfg, num_samples, ks, temperature = _eval_settings(
      load_run_config(run_dir),
      kwargs.get("eval_prompts"),
      kwargs.get("num_samples"),
      kwargs.get("ks"),
      kwargs.get("temperature"),
    )
    task, _ = build_task(cfg.data, seed=cfg.run.seed, hf_checkpoint=cfg.model.hf_checkpoint)
    prompts = len(task.heldout()[: cfg.data.eval_prompts])
  except Exception:  # noqa: BLE001 - whatever it is, the first evaluation raises it with its own message
    return None
  return (prompts, num_samples, temperature, list(ks), seed)


def evaluate_all(run_dir: str, *, seed: int = 0, on_result: Callable[[dict], None] | None = None, **kwargs):
  """Evaluates every kept checkpoint of a run, oldest first, into ``<run_dir>/eval_curve.jsonl``
  (``best/``'s checkpoint too, where ``--keep_best`` kept one that ``--keep_last`` has dropped).

  One JSON row per checkpoint (:func:`evaluate_checkpoint`'s result plus ``eval_seed``), the file
  rewritten atomically after each one, so a killed evaluation keeps what it finished; rerun with the
  same settings it skips the checkpoints already evaluated (rows of other settings are replaced).

  Args:
    run_dir: the run directory.
    seed: seed of the sampling key (the same for every checkpoint: the curve compares policies).
    on_result: called with each new row (progress output).
    **kwargs: the other settings of :func:`evaluate_checkpoint`.

  Returns:
    The rows, in checkpoint order.
  """
  run_dir, _ = resolve_checkpoint(run_dir)
  if os.path.basename(os.path.dirname(run_dir)) == "checkpoints":
    raise FileNotFoundError(f"{run_dir}: --all takes the run directory, not one checkpoint")
  path = os.path.join(run_dir, EVAL_CURVE)
  done: dict[int, dict] = {}
  for row in read_jsonl(path):  # rows of another shape (edited by hand) are not results
    step = row.get("checkpoint_step") if isinstance(row, dict) else None
    if isinstance(step, int) and not isinstance(step, bool):
      done[step] = row
  # The kept checkpoints, and the best one (--keep_best) where it is no longer among them.
  folders = {step: "best" for step in _step_dirs(os.path.join(run_dir, "best"))}
  folders.update({step: "checkpoints" for step in _step_dirs(os.path.join(run_dir, "checkpoints"))})
  steps = sorted(folders)
  rows: list[dict] = []
  # The settings every row of this call will have (each is the run's, or the flag's): rows already
  # written under them are kept, from the first checkpoint on.
  settings: tuple | None = _curve_settings(run_dir, seed, kwargs)
  for step in steps:
    previous = done.get(step)
    if previous is not None and settings is not None and tuple(previous.get(k) for k in _SETTINGS) == settings:
      rows.append(previous)
      continue
    row = evaluate_checkpoint(os.path.join(run_dir, folders[step], str(step)), seed=seed, **kwargs)
    row["eval_seed"] = seed
    settings = tuple(row.get(k) for k in _SETTINGS)
    rows.append(row)
    # Rows of the earlier checkpoints evaluated under other settings are dropped by the rewrite.
    rows = [r for r in rows if tuple(r.get(k) for k in _SETTINGS) == settings]
    kept = rows + [r for s2, r in sorted(done.items()) if s2 > step and tuple(r.get(k) for k in _SETTINGS) == settings]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    if on_result is not None:
      on_result(row)
  return rows
