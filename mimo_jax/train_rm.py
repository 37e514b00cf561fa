"""Reward-model training from the command line.

``python -m mimo_jax.train_rm --flagfile=FLAGS --run_dir=RM_DIR`` (the same as ``python -m mimo_jax.main
--mode=reward_model``) trains a Bradley-Terry reward model (:mod:`mimo_jax.rewards.reward_model`) with the
task, tokenizer and model flags of a policy run, and checkpoints it under ``RM_DIR/reward_model/``; a policy
run given ``--reward_model=RM_DIR`` with the same task and tokenizer flags then adds its score as the
``reward_model`` component.

Preference pairs come from ``--rm_pairs`` (a JSONL of ``{"prompt", "chosen", "rejected"}`` rows;
malformed rows are counted and reported, never silently dropped) or, by default, from the task itself:
each drawn training problem's gold completion is *chosen*, and a copy with one digit of its final answer
changed is *rejected*; both are checked by the task's own verifier (the gold must pass, the corrupted copy
must fail), so a pair never teaches the opposite of the verifier.  The held-out accuracy (the fraction of
pairs whose chosen completion scores higher) is measured on pairs built the same way from the task's
held-out problems (from a file: its last 10% of rows, not trained on) and written with the training curve to
``RM_DIR/reward_model.json``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mimo_jax.config import Config
from mimo_jax.config_base import ConfigError

__all__ = ["corrupt_answer", "gold_completion", "load_pairs", "main", "run_reward_model", "task_pairs"]

# Attempts at a corruption the verifier rejects before a problem is skipped.
_CORRUPT_TRIES = 8
_NUMBER = re.compile(r"\d+")


def gold_completion(problem: Any) -> str:
  """The reference completion of a problem: a worked solution where the task has one (GSM8K: ``" " +
  solution``, as its warm start shows it), else the gold answer (arithmetic)."""
  solution = getattr(problem, "solution", "")
  return " " + solution if solution else problem.answer


def corrupt_answer(text: str, rng: np.random.Generator) -> str | None:
  """``text`` with one digit of its last number replaced by another digit (None: ``text`` has no digits)."""
  numbers = list(_NUMBER.finditer(text))
  if not numbers:
    return None
  last = numbers[-1]
  i = last.start() + int(rng.integers(last.end() - last.start()))
  digit = str((int(text[i]) + int(rng.integers(1, 10))) % 10)
  return text[:i] + digit + text[i + 1 :]


def task_pairs(task: Any, problems: Sequence[Any], rng: np.random.Generator) -> tuple[list[tuple[str, str, str]], int]:
  """``(prompt, gold, corrupted)`` pairs of ``problems``, both sides checked by ``task.reward``.

  Returns:
    The pairs and the number of problems skipped (a gold the verifier rejects, or no corruption it rejects).
  """
  pairs, skipped = [], 0
  for problem in problems:
    chosen = gold_completion(problem)
    if not task.reward(problem, chosen) > 0:
      skipped += 1
      continue
    for _ in range(_CORRUPT_TRIES):
      rejected = corrupt_answer(chosen, rng)
      if rejected is not None and not task.reward(problem, rejected) > 0:
        pairs.append((problem.prompt, chosen, rejected))
        break
    else:
      skipped += 1
  return pairs, skipped


def _check_pair(row: dict[str, Any]) -> Any:
  from mimo_jax.tasks.splits import Malformed, check_string_fields

  problem = check_string_fields(row, ("prompt", "chosen", "rejected"))
  if problem is not None:
    return problem
  if row["chosen"] == row["rejected"]:
    return Malformed("failed_check", "chosen and rejected are the same text")
  return None


def load_pairs(path: str) -> tuple[list[tuple[str, str, str]], int]:
  """The ``(prompt, chosen, rejected)`` rows of a JSONL file, and how many rows were malformed (reported).

  Raises:
    ConfigError: naming ``--rm_pairs``: no such file, or fewer than two usable rows.
  """
  from mimo_jax.tasks.splits import describe_kinds, read_jsonl_rows

  if not os.path.isfile(path):
    raise ConfigError(f"--rm_pairs={path!r}: no such file")
  rows, bad = read_jsonl_rows(path, _check_pair, "preference pair")
  if len(rows) < 2:
    raise ConfigError(
      f"--rm_pairs={path!r}: {len(rows)} usable rows (at least 2 needed); {int(bad)} malformed"
      + (f" ({describe_kinds(bad.by_kind)})" if bad else "")
    )
  return [(r["prompt"], r["chosen"], r["rejected"]) for r in rows], int(bad)


def run_reward_model(cfg: Config, run_dir: str) -> dict[str, Any]:
  """Trains, checkpoints and evaluates the reward model of ``cfg``; returns (and writes) its report."""
  import jax

  from mimo_jax import sharding
  from mimo_jax.files import write_atomic
  from mimo_jax.models import load_hf
  from mimo_jax.rewards.reward_model import RewardModelScorer, pair_accuracy, train_reward_model
  from mimo_jax.tasks.registry import build_task
  from mimo_jax.train.rundir import RunDirLock

  with RunDirLock(run_dir):
    mesh = sharding.build_mesh(cfg.mesh)
    task, tokenizer = build_task(cfg.data, seed=cfg.run.seed, hf_checkpoint=cfg.model.hf_checkpoint)
    rng = np.random.default_rng(cfg.run.seed)
    source, skipped, malformed = "task", 0, 0
    if cfg.data.rm_pairs:
      pairs, malformed = load_pairs(cfg.data.rm_pairs)
      cut = max(1, len(pairs) // 10)
      train, heldout = pairs[:-cut], pairs[-cut:]
      source = cfg.data.rm_pairs
    else:
      train, skipped = task_pairs(task, task.sample(rng, cfg.data.rm_num_pairs), rng)
      heldout, _ = task_pairs(task, task.heldout()[: max(cfg.data.eval_prompts, 1)], rng)
      if len(train) < 2 or not heldout:
        raise ConfigError(
          f"--task={cfg.data.task}: its verifier left {len(train)} training and {len(heldout)} held-out pairs "
          "(a gold completion it accepts and a one-digit corruption it rejects are needed); give --rm_pairs"
        )
    policy, model_cfg = None, None
    if cfg.model.hf_checkpoint:
      policy = load_hf(cfg.model.hf_checkpoint, mesh=mesh, dtype=cfg.model.param_dtype or "float32")
    else:
      model_cfg = cfg.model.model_config().replace(vocab_size=cfg.model.vocab_for(tokenizer.vocab_size))
    print(
      f"reward model: {len(train)} training pairs, {len(heldout)} held-out ({source}; {skipped} problems "
      f"skipped, {malformed} malformed rows), {cfg.run.rm_steps} steps of {cfg.data.rm_batch_size}",
      flush=True,
    )
    t0 = time.perf_counter()
    graphdef, params, history = train_reward_model(
      train,
      tokenizer=tokenizer,
      model_cfg=model_cfg,
      policy=policy,
      mesh=mesh,
      steps=cfg.run.rm_steps,
      batch_size=cfg.data.rm_batch_size,
      learning_rate=cfg.optim.rm_learning_rate,
      seed=cfg.run.seed,
      buckets=cfg.rollout.buckets,
      max_completion_len=cfg.rollout.max_new_tokens,
      run_dir=run_dir,
    )
    scorer = RewardModelScorer(
      graphdef,
      params,
      tokenizer,
      mesh=mesh,
      buckets=cfg.rollout.buckets,
      max_completion_len=cfg.rollout.max_new_tokens,
      batch_rows=cfg.data.rm_batch_size,
    )
    report = {
      "run_dir": run_dir,
      "pairs_source": source,
      "train_pairs": len(train),
      "heldout_pairs": len(heldout),
      "skipped_problems": skipped,
      "malformed_rows": malformed,
      "steps": cfg.run.rm_steps,
      "train_s": round(time.perf_counter() - t0, 1),
      "final": history[-1] if history else {},
      "heldout_pair_accuracy": pair_accuracy(scorer, heldout),
      "tokenizer_vocab_size": tokenizer.vocab_size,
      "history": history[:: max(1, len(history) // 50)],
      "devices": jax.device_count(),
    }
    write_atomic(os.path.join(run_dir, "reward_model.json"), json.dumps(report, indent=1) + "\n")
  print(
    f"reward model: held-out pair accuracy {100 * report['heldout_pair_accuracy']:.1f}% "
    f"(loss {report['final'].get('rm_loss', float('nan')):.3f}); use it with --reward_model={run_dir}",
    flush=True,
  )
  return report


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m mimo_jax.train_rm <main flags>``: ``python -m mimo_jax.main --mode=reward_model``."""
  from mimo_jax import main as entry

  argv = list(sys.argv if argv is None else argv)
  return entry.main([*argv, "--mode=reward_model"])


if __name__ == "__main__":
  sys.exit(main())
