"""The trainer's reward for a task: its verifier plus optional components, as a :class:`CompositeReward`.

Every task's own verifier is the ``correct`` component (it also defines the logged
accuracy).  Optional components: ``format`` for math tasks (the answer given as ``####``
or ``\\boxed{}``; weight ``format_weight``) and, for code, ``hacked``, the reward-hacking
probe (a naive checker's verdict where the strict one fails; weight 0: tracked, never
trained on).  Sources are module-level functions bound with ``functools.partial`` so they
can run in the reward worker processes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from mimo_jax.rewards.base import CompositeReward, RewardPool, RewardSample, RewardSource
from mimo_jax.rewards.format import math_format


def task_correct(sample: RewardSample, *, task: Any) -> float:
  """The task's own verifier on ``sample.row["problem"]``."""
  return float(task.reward(sample.row["problem"], sample.completion))


def code_hacked(sample: RewardSample, *, task: Any) -> float:
  """1.0 when a naive checker passes the completion but the strict unit-test harness does not."""
  return float(task.reward_components(sample.row["problem"], sample.completion)["hacked"])


def build_task_reward(
  task: Any,
  *,
  extra_sources: Sequence[RewardSource] = (),
  workers: int = 0,
  timeout_s: float = 10.0,
  normalize: str = "none",
  format_weight: float = 0.0,
  hacking_probe: bool = False,
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
    extra_sources: more components, e.g. a reward model (a batched source).
  """
  sources = [RewardSource("correct", functools.partial(task_correct, task=task), timeout_s=timeout_s)]
  if task.name == "gsm8k":
    sources.append(RewardSource("format", math_format, weight=format_weight, timeout_s=timeout_s))
  if hacking_probe and hasattr(task, "reward_components"):
    sources.append(RewardSource("hacked", functools.partial(code_hacked, task=task), weight=0.0, timeout_s=timeout_s))
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
