"""Several trainer tasks as one (``--task=arith:0.5,gsm8k:0.5``).

A :class:`MixtureTask` has the interface of a single task (``heldout``, ``sample``,
``sft_examples``, ``tokenizer_corpus``, ``reward``), so the trainer, the evaluator and the
reward path need nothing of their own for it.  Every problem keeps its own task's name in
``problem.task``; that is what the reward path keys on (per-task standardisation before the
components are mixed, :class:`~mimo_jax.rewards.base.CompositeReward`), what the evaluator
reports per task, and what :meth:`MixtureTask.reward` dispatches on.

Proportions:

* training prompts: :meth:`strata` gives each ``(task, level)`` its share (a task's weight
  split evenly over its difficulty levels), for the stratified
  :class:`~mimo_jax.data.curriculum.PromptSampler` the rollout worker draws from, so every
  batch holds each task and level in proportion (within one prompt, carried over between
  steps) rather than a multinomial draw's;
* held-out prompts: the evaluation budget is split by weight (largest remainders, at least
  one prompt per task), each task contributing the first prompts of its own held-out list (a
  task with too few passes its shortfall to the others, by weight);
* supervised warm-start demonstrations: a multinomial draw of the counts by weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["MixtureTask", "apportion"]


def apportion(total: int, weights: Sequence[float], *, at_least_one: bool = False) -> list[int]:
  """Integer counts summing to ``total`` in proportion to ``weights`` (largest remainders, ties by order).

  Args:
    total: the count to split (>= 0).
    weights: positive weights.
    at_least_one: give every entry at least one (when ``total`` allows it).
  """
  w = np.asarray(weights, np.float64)
  if total < 0 or w.size == 0 or not np.all(w > 0):
    raise ValueError(f"apportion needs total >= 0 and positive weights, got {total}, {list(weights)}")
  floor_min = 1 if at_least_one and total >= w.size else 0
  quota = w / w.sum() * total
  counts = np.maximum(np.floor(quota).astype(np.int64), floor_min)
  while counts.sum() > total:  # the minimum pushed past the total: take from the most over-served above it
    over = np.where(counts > floor_min, counts - quota, -np.inf)
    counts[int(np.argmax(over))] -= 1
  remainder = quota - counts
  for i in np.argsort(-remainder, kind="stable")[: total - int(counts.sum())]:
    counts[i] += 1
  return counts.tolist()


def _fill(total: int, weights: Sequence[float], available: Sequence[int]) -> list[int]:
  """:func:`apportion` of ``total`` (at least one each), each count capped at what its task has; a task's
  shortfall goes to the others that have more, by weight (the total is short only when all are spent)."""
  counts = [min(c, a) for c, a in zip(apportion(total, weights, at_least_one=True), available, strict=True)]
  while (left := total - sum(counts)) > 0:
    spare = [i for i, (c, a) in enumerate(zip(counts, available, strict=True)) if c < a]
    if not spare:
      break
    extra = apportion(left, [weights[i] for i in spare])
    for i, e in zip(spare, extra, strict=True):
      counts[i] = min(counts[i] + e, available[i])
  return counts


class MixtureTask:
  """Tasks drawn in proportion to their weights, seen through one task's interface.

  Args:
    tasks: ``(task, weight)`` pairs; task names (``task.name``) must be distinct and weights > 0.
    levels: each task's difficulty levels (its problems' ``level`` values), by task name; a task
      not listed has the single level 0.
    heldout_size: held-out prompts in all, split by weight (see the module docstring).

  Attributes:
    tasks: the component tasks by name, in the order given.
    weights: their weights, normalised to sum to 1, by name.
    runs_untrusted_code: whether any component's verifier executes model-written code.
  """

  def __init__(
    self,
    tasks: Sequence[tuple[Any, float]],
    *,
    levels: Mapping[str, Sequence[int]] | None = None,
    heldout_size: int,
  ):
    if len(tasks) < 2:
      raise ValueError(f"a mixture needs at least two tasks, got {len(tasks)}")
    names = [t.name for t, _ in tasks]
    if len(set(names)) != len(names):
      raise ValueError(f"mixture tasks must be distinct, got {names}")
    weights = np.asarray([w for _, w in tasks], np.float64)
    if not np.all(np.isfinite(weights) & (weights > 0)):
      raise ValueError(f"mixture weights must be finite and > 0, got {weights.tolist()}")
    self.tasks: dict[str, Any] = dict(zip(names, (t for t, _ in tasks), strict=True))
    self.weights: dict[str, float] = dict(zip(names, (weights / weights.sum()).tolist(), strict=True))
    levels = dict(levels or {})
    self.levels: dict[str, tuple[int, ...]] = {n: tuple(int(x) for x in levels.get(n, (0,))) for n in names}
    self.runs_untrusted_code = any(getattr(t, "runs_untrusted_code", False) for t in self.tasks.values())
    pools = [task.heldout() for task in self.tasks.values()]
    counts = _fill(heldout_size, list(self.weights.values()), [len(p) for p in pools])
    heldout: list[Any] = []
    for pool, count in zip(pools, counts, strict=True):
      heldout.extend(pool[:count])
    self._heldout = heldout
    self._heldout_uids = frozenset(p.uid for p in heldout)

  @property
  def name(self) -> str:
    """``"arith+gsm8k"``: the component names (each problem carries its own task's name)."""
    return "+".join(self.tasks)

  def _task_of(self, problem: Any) -> Any:
    try:
      return self.tasks[problem.task]
    except KeyError:
      raise ValueError(f"problem of task {problem.task!r} is not in the mixture {list(self.tasks)}") from None

  # ---- data ---------------------------------------------------------------------------

  def heldout(self) -> list[Any]:
    """The held-out problems of every task, each task's block in mixture order (a new list)."""
    return list(self._heldout)

  def is_heldout(self, problem: Any) -> bool:
    return problem.uid in self._heldout_uids

  def strata(self) -> dict[tuple[str, int], float]:
    """Target share of each ``(task, level)``: the task's weight split evenly over its levels."""
    return {
      (name, level): self.weights[name] / len(self.levels[name]) for name in self.tasks for level in self.levels[name]
    }

  def sample(self, rng: np.random.Generator, n: int) -> list[Any]:
    """``n`` training problems, the count of each task a multinomial draw by weight (candidates for the
    stratified sampler; none held out by any task's own rule)."""
    counts = rng.multinomial(n, list(self.weights.values()))
    out: list[Any] = []
    for task, count in zip(self.tasks.values(), counts.tolist(), strict=True):
      out.extend(task.sample(rng, count))
    return [out[i] for i in rng.permutation(len(out)).tolist()]

  def sft_examples(self, rng: np.random.Generator, n: int, *, easiest: bool = False) -> list[tuple[str, str]]:
    """``n`` demonstrations, each task's count a multinomial draw by weight, shuffled together (``easiest``:
    each task's easiest level only)."""
    counts = rng.multinomial(n, list(self.weights.values()))
    out: list[tuple[str, str]] = []
    for task, count in zip(self.tasks.values(), counts.tolist(), strict=True):
      out.extend(task.sft_examples(rng, count, easiest=easiest))
    return [out[i] for i in rng.permutation(len(out)).tolist()]

  def tokenizer_corpus(self) -> list[str]:
    """Every task's tokenizer corpus, in mixture order."""
    return [line for task in self.tasks.values() for line in task.tokenizer_corpus()]

  def problem_from_dict(self, fields: Mapping[str, Any]) -> Any:
    """Rebuilds a problem saved as ``dataclasses.asdict`` (a checkpointed prompt pool), by its task's class."""
    template = self._template(fields["task"])
    return type(template)(**fields)

  def _template(self, name: str) -> Any:
    if name not in self.tasks:
      raise ValueError(f"a saved problem of task {name!r} is not in the mixture {list(self.tasks)}")
    return (self.tasks[name].heldout() or self.tasks[name].sample(np.random.default_rng(0), 1))[0]

  # ---- verification -------------------------------------------------------------------

  def reward(self, problem: Any, completion_text: str) -> float:
    """The verifier of the problem's own task."""
    return self._task_of(problem).reward(problem, completion_text)

  def reward_components(self, problem: Any, completion_text: str) -> dict[str, float]:
    """The problem's task's ``reward_components`` (code tasks' reward-hacking probe); ``{}`` for tasks without."""
    task = self._task_of(problem)
    return task.reward_components(problem, completion_text) if hasattr(task, "reward_components") else {}
