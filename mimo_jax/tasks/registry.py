"""Task construction from the data config: a task (prompts, verifier, SFT data) and its tokenizer.

A task exposes ``heldout()``, ``sample(rng, n)``, ``reward(problem, text)``,
``sft_examples(rng, n)`` and ``tokenizer_corpus()``; its problems have ``prompt``,
``answer`` and ``uid`` (a content hash, used to keep held-out prompts out of training).
"""

from __future__ import annotations

import os
from typing import Any

from mimo_jax.config import DataConfig, parse_int_list
from mimo_jax.config_base import ConfigError
from mimo_jax.tasks.arith import ArithTask, build_tokenizer
from mimo_jax.tasks.gsm8k import GSM8KTask
from mimo_jax.tokenization import Tokenizer, load_tokenizer, train_sentencepiece

# The held-out split is fixed across run seeds, so runs with different seeds are
# evaluated on the same prompts.
HELDOUT_SEED = 1234
# Vocabulary of the SentencePiece model trained on the fly for text tasks without a tokenizer.
TEXT_VOCAB = 2000


def build_task(cfg: DataConfig, *, seed: int, hf_checkpoint: str = "") -> tuple[Any, Tokenizer]:
  """Returns ``(task, tokenizer)`` for ``cfg.task``.

  Args:
    cfg: the data config.
    seed: the run seed (training prompt order comes from the trainer's own RNG).
    hf_checkpoint: a checkpoint directory whose tokenizer is used when
      ``cfg.tokenizer_path`` is empty.

  Raises:
    ConfigError: the task is not available, or its files are unusable.
  """
  del seed
  if cfg.task == "arith":
    task = ArithTask(
      levels=parse_int_list("arith_levels", cfg.arith_levels),
      seed=HELDOUT_SEED,
      heldout_size=max(cfg.eval_prompts, 1),
      reverse_answer=cfg.arith_reverse,
      sft_wrong_carry_fraction=cfg.sft_wrong_fraction,
    )
    return task, _tokenizer(cfg, hf_checkpoint) or build_tokenizer(task)
  if cfg.task == "gsm8k":
    for name in ("data_path", "eval_data_path"):
      path = getattr(cfg, name)
      if path and not os.path.isfile(path):
        raise ConfigError(f"--{name}={path!r}: no such file")
    try:
      task = GSM8KTask(cfg.data_path or None, cfg.eval_data_path or None)
    except ValueError as e:
      raise ConfigError(f"--data_path/--eval_data_path: {e}") from None
    tokenizer = _tokenizer(cfg, hf_checkpoint)
    if tokenizer is None:
      # Small-scale runs without a pretrained tokenizer: an exact-round-trip model trained
      # on the training split only (held-out text never reaches it).
      tokenizer = train_sentencepiece(task.tokenizer_corpus(), vocab_size=TEXT_VOCAB)
    return task, tokenizer
  raise ConfigError(f"--task={cfg.task!r} has no trainer task yet; available: 'arith', 'gsm8k'")


def _tokenizer(cfg: DataConfig, hf_checkpoint: str) -> Tokenizer | None:
  if cfg.tokenizer_path:
    return load_tokenizer(cfg.tokenizer_path)
  if hf_checkpoint:
    return load_tokenizer(hf_checkpoint)
  return None
