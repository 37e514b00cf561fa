"""The trainer's reward for a task: its verifier plus optional components, as a :class:`CompositeReward`.

Every task's own verifier is the ``correct`` component (it also defines the logged
accuracy).  Optional components: ``digits`` for arithmetic (a dense partial credit, the
fraction of answer digits in place; weight ``digit_weight``); ``format`` for math tasks (the answer given as ``####``
or ``\\boxed{}``; weight ``format_weight``); for code, ``hacked``, the reward-hacking
probe (a naive checker's verdict where the strict one fails; weight 0: tracked, never
trained on); ``json`` for every task (the completion's JSON against a schema).  In a task
mixture a task-specific component applies to its own task's samples only.  Sources are
module-level functions bound with ``functools.partial`` so they can run in the reward
worker processes.  A judge (:mod:`mimo_jax.rewards.judge`) or a reward model is a batched
source the trainer adds (``extra_sources``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

from mimo_jax.config_base import ConfigError
from mimo_jax.rewards.base import CompositeReward, RewardPool, RewardSample, RewardSource
from mimo_jax.rewards.format import check_schema, json_reward, math_format


def task_correct(sample: RewardSample, *, task: Any) -> float:
  """The task's own verifier on ``sample.row["problem"]``."""
  return float(task.reward(sample.row["problem"], sample.completion))


def arith_digits(sample: RewardSample, *, task: Any) -> float:
  """The arithmetic task's dense partial credit (:meth:`~mimo_jax.tasks.arith.ArithTask.digit_credit`)."""
  return float(task.digit_credit(sample.row["problem"], sample.completion))


def code_hacked(sample: RewardSample, *, task: Any) -> float:
  """1.0 when a naive checker passes the completion but the strict unit-test harness does not."""
  return float(task.reward_components(sample.row["problem"], sample.completion)["hacked"])


def load_json_schema(text: str) -> Any:
  """``--json_schema``: inline JSON (an object, ``true`` or ``false``) or the path of a file holding it.

  Returns:
    The parsed schema, checked against the supported subset (None for an empty flag).

  Raises:
    ConfigError: naming ``--json_schema``: no such file, not JSON, or outside the supported subset.
  """
  if not text:
    return None
  inline = text.lstrip().startswith(("{", "[")) or text.strip() in ("true", "false")
  if not inline:
    if not os.path.isfile(text):
      raise ConfigError(f"--json_schema={text!r}: neither inline JSON nor an existing file")
    with open(text, encoding="utf-8") as f:
      body = f.read()
  else:
    body = text
  try:
    schema = json.loads(body)
    check_schema(schema)
  except ValueError as e:
    raise ConfigError(f"--json_schema={text!r}: {e}") from None
  return schema


def check_reward_flags(data: Any) -> None:
  """The reward flags that name files or hold documents (``--json_schema``, ``--judge_checkpoint``,
  ``--rm_pairs``, ``--reward_model``), checked before any compute.

  Raises:
    ConfigError: naming the flag.
  """
  load_json_schema(data.json_schema)
  if data.rm_pairs and not os.path.isfile(data.rm_pairs):
    raise ConfigError(f"--rm_pairs={data.rm_pairs!r}: no such file")
  if data.judge_checkpoint and not os.path.isfile(os.path.join(data.judge_checkpoint, "config.json")):
    raise ConfigError(
      f"--judge_checkpoint={data.judge_checkpoint!r}: not a Hugging Face checkpoint directory (no config.json)"
    )
  if data.reward_model:
    from mimo_jax.rewards.reward_model import CHECKPOINT_SUBDIR

    if not os.path.isdir(os.path.join(data.reward_model, CHECKPOINT_SUBDIR)):
      raise ConfigError(
        f"--reward_model={data.reward_model!r}: not a reward-model run directory (no {CHECKPOINT_SUBDIR}/ "
        "checkpoints there; --mode=reward_model trains one)"
      )


def build_task_reward(
  task: Any,
  *,
  extra_sources: Sequence[RewardSource] = (),
  workers: int = 0,
  timeout_s: float = 10.0,
  normalize: str = "none",
  format_weight: float = 0.0,
  hacking_probe: bool = False,
  json_weight: float | None = None,
  json_schema: Any = None,
  digit_weight: float = 0.0,
) -> CompositeReward:
  """The composite reward the trainer uses for ``task``.

  Args:
    task: a trainer task (``reward(problem, text)``; ``name``).
    workers: reward worker processes (0: in-process; exceptions are still caught, but a
      hanging verifier cannot be interrupted).
    timeout_s: per-sample time limit in the workers.
    normalize: ``none`` or ``task_running`` (per-task running standardisation before mixing).
    format_weight: weight of the math ``format`` component (0: logged only).
    hacking_probe: add the code reward-hacking probe (``hacked``, weight 0).
    json_weight: add a ``json`` component (:func:`~mimo_jax.rewards.format.json_reward`) with this
      weight (None: none; 0: logged only).
    json_schema: the ``json`` component's schema (None: any JSON value).
    digit_weight: add the arithmetic task's ``digits`` component (a dense partial credit: the
      fraction of answer digits in place) with this weight (0: none).
    extra_sources: more components, e.g. a reward model or a judge (batched sources).
  """
  sources = [RewardSource("correct", functools.partial(task_correct, task=task), timeout_s=timeout_s)]
  # A mixture's components (each problem names its own task); a task-specific source applies to its task only.
  parts = getattr(task, "tasks", {task.name: task})
  if "gsm8k" in parts:
    sources.append(RewardSource("format", math_format, weight=format_weight, tasks=("gsm8k",), timeout_s=timeout_s))
  coding = tuple(name for name, part in parts.items() if hasattr(part, "reward_components"))
  if hacking_probe and coding:
    sources.append(
      RewardSource("hacked", functools.partial(code_hacked, task=task), weight=0.0, tasks=coding, timeout_s=timeout_s)
    )
  if digit_weight > 0 and "arith" in parts:
    sources.append(
      RewardSource(
        "digits",
        functools.partial(arith_digits, task=parts["arith"]),
        weight=digit_weight,
        tasks=("arith",),
        timeout_s=timeout_s,
      )
    )
  if json_weight is not None:
    sources.append(
      RewardSource("json", functools.partial(json_reward, schema=json_schema), weight=json_weight, timeout_s=timeout_s)
    )
  sources.extend(extra_sources)
  pool = RewardPool(num_workers=workers, default_timeout_s=timeout_s)
  return CompositeReward(sources, normalize=normalize, pool=pool)


def reward_samples(
  problems: Sequence[Any],
  texts: Sequence[str],
  group_size: int,
  truncated: Sequence[bool],
  rows: Sequence[int] | None = None,
):
  """``RewardSample`` per completion (row ``i`` answers ``problems[i // group_size]``).

  ``rows``: the batch rows ``texts`` are the completions of (default ``0 .. len(texts) - 1``; a host of a
  multi-process run scores only its own rows); ``truncated`` is indexed by row.
  """
  rows = range(len(texts)) if rows is None else rows
  return [
    RewardSample(
      prompt=problems[i // group_size].prompt,
      completion=text,
      row={"problem": problems[i // group_size], "answer": problems[i // group_size].answer},
      task=problems[i // group_size].task,
      truncated=bool(truncated[i]),
    )
    for i, text in zip(rows, texts, strict=True)
  ]
