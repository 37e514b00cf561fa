"""Sample replay: the completions worth reading from each RL step, with their provenance.

Each RL step, :func:`select_samples` picks the ``k`` highest- and ``k`` lowest-reward
completions of the trained batch and the ``k`` prompts with the largest KL to the reference
(each with its highest-KL completion), and returns one JSON-able row per pick for
``RUN_DIR/samples.jsonl``: the step, the prompt's id, the batch id and policy version that
produced it, the sampling parameters, the prompt and completion texts, the raw reward and every
reward component, the completion's length and finish reason (``stop``: a stop id; ``length``:
the token budget ran out).  Reading the extremes of every step is how a collapse, a reward hack
or a formatting drift is seen before the curves show it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mimo_jax import multihost
from mimo_jax.rollout import FINISH_LENGTH

__all__ = ["KINDS", "select_samples", "samples_markdown"]

# What picked a row: the top and bottom of the reward, the top of the per-prompt KL.
KINDS = ("reward_top", "reward_bottom", "kl_top")


def _finite_or_none(x: Any) -> float | None:
  f = float(x)
  return f if math.isfinite(f) else None


def _order(values: np.ndarray, k: int, *, largest: bool) -> list[int]:
  """Indices of the k largest values (ties: the lower index first), or of the k smallest (ties: the higher
  index first, so that on a batch of equal rewards the two ends show different completions)."""
  index = np.arange(values.shape[0])
  order = np.lexsort((index, -values)) if largest else np.lexsort((-index, values))
  return [int(i) for i in order[:k]]


def select_samples(
  batch: Any,
  k: int,
  *,
  step: int,
  group_size: int,
  lengths: np.ndarray,
  finish: np.ndarray,
  tokenizer: Any,
  kl_per_seq: np.ndarray | None = None,
) -> list[dict[str, Any]]:
  """The rows of one RL step's sample replay.

  Args:
    batch: the step's :class:`~mimo_jax.train.rollout_worker.RolloutBatch`.
    k: completions per kind (0: none).
    step: the RL step (1-based, as logged).
    group_size: samples per prompt (rows of a group are contiguous).
    lengths: int ``[B]`` completion lengths (host).
    finish: int ``[B]`` finish reasons (host).
    tokenizer: decodes the rows whose text this process does not hold (multi-process runs).
    kl_per_seq: float ``[B]`` token-mean KL of each completion to the reference (None: no reference;
      no KL rows then).

  In a multi-process run every process must call this (a pick whose text is another host's is
  decoded from the gathered tokens, a collective); process 0 writes the rows.
  """
  if k <= 0:
    return []
  rewards = batch.rewards
  values = np.asarray(rewards.logged, np.float64)  # the raw reward, as logged
  picks: list[tuple[str, int, float | None]] = []
  picks += [("reward_top", i, None) for i in _order(values, k, largest=True)]
  picks += [("reward_bottom", i, None) for i in _order(values, k, largest=False)]
  if kl_per_seq is not None:
    kl = np.asarray(kl_per_seq, np.float64)
    per_prompt = kl.reshape(-1, group_size).mean(axis=1)
    for g in _order(per_prompt, k, largest=True):
      rows = np.arange(g * group_size, (g + 1) * group_size)
      picks.append(("kl_top", int(rows[np.argmax(kl[rows])]), float(per_prompt[g])))
  texts = list(rewards.texts)
  if multihost.multi_process():
    # Each host holds only its own rows' texts: decode the others' picks from the gathered tokens
    # (every process gathers, whatever it holds, so the collective runs on all of them).
    tokens = multihost.to_host(batch.rollout.completion_tokens)
    for _, i, _ in picks:
      if texts[i] is None:
        texts[i] = tokenizer.decode(tokens[i, : int(lengths[i])].tolist())
  exp = batch.experience
  out = []
  for kind, i, prompt_kl in picks:
    problem = batch.problems[i // group_size]
    row = {
      "step": int(step),
      "kind": kind,
      "row": i,
      "prompt_id": int(exp.prompt_id[i]),
      "uid": str(problem.uid),
      "task": str(getattr(problem, "task", "")),
      "batch_id": int(exp.batch_id[i]),
      "policy_version": int(exp.policy_version[i]),
      "temperature": float(batch.temperature),
      "top_k": int(exp.top_k[i]),
      "top_p": float(exp.top_p[i]),
      "prompt": problem.prompt,
      "completion": texts[i],
      "reward": _finite_or_none(values[i]),
      "correct": bool(rewards.correct[i]),
      "components": {name: _finite_or_none(v[i]) for name, v in sorted(rewards.components.items())},
      "length": int(lengths[i]),
      "finish_reason": "length" if int(finish[i]) == FINISH_LENGTH else "stop",
    }
    if kl_per_seq is not None:
      row["kl"] = _finite_or_none(kl_per_seq[i])
    if prompt_kl is not None:
      row["prompt_kl"] = _finite_or_none(prompt_kl)
    out.append(row)
  return out


def samples_markdown(rows: list[dict[str, Any]]) -> str:
  """One step's sample rows as Markdown (TensorBoard's text plugin renders it)."""
  parts = []
  for r in rows:
    head = f"**{r['kind']}** reward {r['reward']}, {r['length']} tokens ({r['finish_reason']}), prompt {r['prompt_id']}"
    if "prompt_kl" in r:
      head += f", prompt KL {r['prompt_kl']}"
    parts.append(f"{head}\n\n```\n{r['prompt']}\n```\n\n```\n{r['completion']}\n```")
  return "\n\n---\n\n".join(parts)
