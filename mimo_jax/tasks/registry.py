"""Task construction from the data config: a task (prompts, verifier, SFT data) and its tokenizer.

A task exposes ``heldout()``, ``sample(rng, n)``, ``reward(problem, text)``,
``sft_examples(rng, n)`` and ``tokenizer_corpus()``; its problems have ``prompt``,
``answer`` and ``uid`` (a content hash, used to keep held-out prompts out of training).

A task whose class sets ``runs_untrusted_code`` (HumanEval: its verifier executes the
model's program) is only built where the sandbox has kernel isolation, or with
``--allow_weak_sandbox`` (:func:`check_sandbox`).
"""

from __future__ import annotations

import os
from typing import Any

from mimo_jax.config import CHAT_TEMPLATES, DataConfig
from mimo_jax.config_base import ConfigError
from mimo_jax.rewards import sandbox_policy
from mimo_jax.rewards.code import program_timeout_s
from mimo_jax.tasks import gsm8k, humaneval
from mimo_jax.tasks.arith import ArithTask, build_tokenizer
from mimo_jax.tasks.gsm8k import GSM8KTask
from mimo_jax.tasks.humaneval import HumanEvalTask
from mimo_jax.tasks.jsonl import JsonlTask, parse_field_map
from mimo_jax.tasks.mixture import MixtureTask
from mimo_jax.tasks.splits import MalformedCount, describe_kinds
from mimo_jax.tasks.tfds_sources import load_prompt_source
from mimo_jax.tokenization import CHAT_TEMPLATE_FILE, Tokenizer, load_tokenizer, train_sentencepiece

# The held-out split is fixed across run seeds, so runs with different seeds are
# evaluated on the same prompts.
HELDOUT_SEED = 1234
# Vocabulary of the SentencePiece model trained on the fly for text tasks without a tokenizer.
TEXT_VOCAB = 2000
CODE_VOCAB = 1000
# TFDS array_record cache of the prompt sources when --tfds_dir is not given (jsonl task only).
DEFAULT_TFDS_DIR = "~/.cache/mimo_jax/tfds"
# The task class of each --task, for what is known before building it (whether it runs code).
TASK_CLASSES: dict[str, type] = {"arith": ArithTask, "gsm8k": GSM8KTask, "humaneval": HumanEvalTask, "jsonl": JsonlTask}


def runs_untrusted_code(cfg: DataConfig) -> bool:
  """Whether a verifier of ``cfg.task`` (any task of a mixture) executes model-written code (its class's
  ``runs_untrusted_code``)."""
  return any(getattr(TASK_CLASSES.get(name), "runs_untrusted_code", False) for name, _ in cfg.task_mix)


def check_sandbox(cfg: DataConfig) -> dict[str, Any] | None:
  """Applies the sandbox policy to ``cfg.task``; returns the isolation record a run stores (None: no code runs).

  Tasks that run no code return None without probing the sandbox.  For the others the
  sandbox's isolation is probed (once per process) and, without kernel isolation, the run
  is refused unless ``--allow_weak_sandbox`` is set
  (:func:`~mimo_jax.rewards.sandbox_policy.require_isolation`, which also prints the
  isolation in effect, once).

  Raises:
    ConfigError: the task runs code, the sandbox has no kernel isolation and
      ``--allow_weak_sandbox`` is not set.
  """
  if not runs_untrusted_code(cfg):
    return None
  return sandbox_policy.require_isolation(allow_weak=cfg.allow_weak_sandbox, what=f"--task={cfg.task}")


def build_task(cfg: DataConfig, *, seed: int, hf_checkpoint: str = "") -> tuple[Any, Tokenizer]:
  """Returns ``(task, tokenizer)`` for ``cfg.task``: one task, or a :class:`MixtureTask` of several.

  Args:
    cfg: the data config.
    seed: the run seed (training prompt order comes from the trainer's own RNG).
    hf_checkpoint: a checkpoint directory whose tokenizer is used when
      ``cfg.tokenizer_path`` is empty.

  Raises:
    ConfigError: the task is not available, or its files are unusable, or it runs
      model-written code and the sandbox has no kernel isolation (without
      ``--allow_weak_sandbox``).
  """
  del seed
  # Before anything is loaded or trained (tokenizers): every path that builds a task (trainer,
  # evaluator, dry run) refuses to run untrusted code without kernel isolation here.
  check_sandbox(cfg)
  mix = cfg.task_mix
  if len(mix) == 1:
    task = _build_one(cfg, mix[0][0])
    return task, _tokenizer(cfg, hf_checkpoint) or _default_tokenizer(task)
  task = MixtureTask(
    [(_build_one(cfg, name), weight) for name, weight in mix],
    levels={"arith": cfg.arith_levels},
    heldout_size=max(cfg.eval_prompts, 1),
  )
  # One vocabulary for every task of the mixture, fitted to all their training texts (byte fallback:
  # code and free text have characters a small vocabulary may lack).
  tokenizer = _tokenizer(cfg, hf_checkpoint) or train_sentencepiece(
    task.tokenizer_corpus(), vocab_size=TEXT_VOCAB, byte_fallback=True
  )
  return task, tokenizer


def data_counts(task: Any) -> dict[str, Any]:
  """``summary.json``'s ``data``: for each task that reads files (each of a mixture's), what reading them
  kept and dropped (:meth:`~mimo_jax.tasks.splits.SplitTask.data_counts`), by task name; the built-in
  arithmetic task reads none."""
  tasks = task.tasks if isinstance(task, MixtureTask) else {task.name: task}
  return {name: sub.data_counts() for name, sub in tasks.items() if hasattr(sub, "data_counts")}


def build_arith_task(cfg: DataConfig) -> ArithTask:
  """The arithmetic task of ``cfg``: its held-out split is the first ``--eval_prompts`` of a fixed stream."""
  return ArithTask(
    levels=cfg.arith_levels,
    seed=HELDOUT_SEED,
    heldout_size=max(cfg.eval_prompts, 1),
    reverse_answer=cfg.arith_reverse,
    sft_wrong_carry_fraction=cfg.sft_wrong_fraction,
  )


def _build_one(cfg: DataConfig, name: str) -> Any:
  """The task ``name`` (``--data_path``/``--eval_data_path`` go to the file task; in a mixture there is at most one)."""
  if name == "arith":
    return build_arith_task(cfg)
  for path_flag in ("data_path", "eval_data_path"):
    path = getattr(cfg, path_flag)
    if path and not os.path.isfile(path):
      raise ConfigError(f"--{path_flag}={path!r}: no such file")
  if name == "jsonl":
    return _jsonl_task(cfg)
  if name == "gsm8k":
    try:
      return GSM8KTask(cfg.data_path or None, cfg.eval_data_path or None, loader=_tfds_loader(cfg, gsm8k))
    except ValueError as e:
      raise ConfigError(f"--data_path/--eval_data_path: {e}") from None
  if name == "humaneval":
    try:
      return HumanEvalTask(
        cfg.data_path or None,
        cfg.eval_data_path or None,
        # Inside the reward call's limit, so a program that never ends is a failing verdict, not an outage.
        timeout_s=program_timeout_s(cfg.reward_timeout_s),
        loader=_tfds_loader(cfg, humaneval),
        # The same rule again in every process that runs a verification (reward workers probe anew).
        require_kernel_isolation=not cfg.allow_weak_sandbox,
      )
    except ValueError as e:
      raise ConfigError(f"--data_path/--eval_data_path: {e}") from None
  raise ConfigError(f"--task={name!r} has no trainer task yet; available: {', '.join(TASK_CLASSES)}")


def _default_tokenizer(task: Any) -> Tokenizer:
  """A single task's built-in tokenizer, when neither ``--tokenizer_path`` nor a checkpoint gives one."""
  if task.name == "arith":
    return build_tokenizer(task)
  if task.name == "gsm8k":
    # Small-scale runs without a pretrained tokenizer: an exact-round-trip model trained
    # on the training split only (held-out text never reaches it).
    return train_sentencepiece(task.tokenizer_corpus(), vocab_size=TEXT_VOCAB)
  if task.name == "humaneval":
    # Byte fallback: code has characters a small vocabulary fitted to 40 problems lacks.
    return train_sentencepiece(task.tokenizer_corpus(), vocab_size=CODE_VOCAB, byte_fallback=True)
  return train_sentencepiece(task.tokenizer_corpus(), vocab_size=TEXT_VOCAB, byte_fallback=True)


def _tfds_dir(cfg: DataConfig) -> str:
  return os.path.expanduser(cfg.tfds_dir or DEFAULT_TFDS_DIR)


def _tfds_loader(cfg: DataConfig, module: Any):
  """A task loader reading a split through its TFDS ``array_record`` builder (``--tfds_dir``).

  Rows are re-checked with the task module's own row validator (stricter than the
  builder's field checks, e.g. HumanEval programs must compile); malformed rows are counted
  either way, never dropped silently.  Without ``--tfds_dir`` the task reads its JSONL
  files directly (None: the task's default loader).
  """
  if not cfg.tfds_dir:
    return None
  kind = module.TASK_NAME

  def load(path: str) -> tuple[list[dict[str, Any]], int]:
    split = (
      "test" if os.path.abspath(path) == os.path.abspath(cfg.eval_data_path or module.DEFAULT_TEST_PATH) else "train"
    )
    source = load_prompt_source(kind, path, _tfds_dir(cfg), split=split)
    rows, by_kind = [], dict(source.malformed_by_kind)
    first = (source.first_malformed["line"], source.first_malformed["reason"]) if source.first_malformed else None
    for record in source:
      line = record.pop("source_line", 0)
      problem = module._check_row(record)
      if problem is None:
        rows.append(record)
      else:
        by_kind[problem.kind] = by_kind.get(problem.kind, 0) + 1
        if first is None or line < first[0]:
          first = (line, problem.reason)
    bad = MalformedCount(by_kind, first)
    if not rows:
      raise ValueError(f"{path}: no usable rows ({int(bad)} malformed: {describe_kinds(by_kind)})")
    return rows, bad

  return load


def _jsonl_task(cfg: DataConfig) -> JsonlTask:
  """Any JSONL of prompts with answers, through the TFDS ``jsonl`` builder and ``--jsonl_fields``."""
  if not cfg.data_path or not cfg.eval_data_path:
    raise ConfigError("--task=jsonl needs --data_path and --eval_data_path (JSONL files)")
  try:
    field_map = parse_field_map(cfg.jsonl_fields)
  except ValueError as e:
    raise ConfigError(f"--jsonl_fields={cfg.jsonl_fields!r}: {e}") from None
  try:
    sources = [
      load_prompt_source("jsonl", path, _tfds_dir(cfg), split=split, field_map=field_map)
      for path, split in ((cfg.data_path, "train"), (cfg.eval_data_path, "test"))
    ]
    return JsonlTask(
      list(sources[0]),
      list(sources[1]),
      train_path=cfg.data_path,
      test_path=cfg.eval_data_path,
      num_malformed_train=MalformedCount(sources[0].malformed_by_kind),
      num_malformed_test=MalformedCount(sources[1].malformed_by_kind),
    )
  except ValueError as e:
    raise ConfigError(f"--data_path/--eval_data_path: {e}") from None


def _tokenizer(cfg: DataConfig, hf_checkpoint: str) -> Tokenizer | None:
  path = cfg.tokenizer_path or hf_checkpoint
  if not path:
    return None
  tokenizer = load_tokenizer(path)
  if cfg.chat_template == "model":
    if tokenizer.chat_template is None:
      raise ConfigError(
        f"--chat_template=model: the tokenizer at {path!r} has no chat template (tokenizer_config.json's "
        f"'chat_template' or {CHAT_TEMPLATE_FILE}); allowed values: {', '.join(CHAT_TEMPLATES)}"
      )
    tokenizer = tokenizer.with_chat_prompts()
  return tokenizer
