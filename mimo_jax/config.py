"""The run configuration: one frozen dataclass per concern, composed in :class:`Config`.

``mimo_jax/main.py`` exposes every field as a flat absl flag of the same name (names
are unique across concerns; a test checks) and builds a :class:`Config` once.  Field
validation happens in each ``__post_init__``; checks that need several concerns, or the
device count, happen in :func:`validate`.  Both run before any compute.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

from mimo_jax.config_base import ConfigError, check, check_fields, field, format_list
from mimo_jax.models.config import PRESETS, REMAT_POLICIES, ModelConfig, get_preset
from mimo_jax.rl.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGES
from mimo_jax.rl.controllers import ENTROPY_CONTROLLERS, KL_CONTROLLERS, OVERLONG_MODES
from mimo_jax.rl.importance import IS_CORRECTIONS
from mimo_jax.rl.kl import KL_ESTIMATORS
from mimo_jax.rl.losses import AGGREGATIONS, POLICY_LOSSES
from mimo_jax.sharding import MeshConfig, validate_model_on_mesh

DTYPE_CHOICES = ("", "float32", "bfloat16", "float16")
# The trainer's tasks (--task), and those that read prompt files (--data_path / --eval_data_path).
TASK_NAMES = ("arith", "gsm8k", "humaneval", "jsonl")
# --chat_template: a prompt as the task writes it, or through the tokenizer's own chat template.
CHAT_TEMPLATES = ("none", "model")
FILE_TASKS = ("gsm8k", "humaneval", "jsonl")
# The tasks whose evaluation extracts an answer to vote on (maj@K): eval.evaluator.DEFAULT_ANSWER_FNS.
MAJORITY_TASKS = ("arith", "gsm8k")
SHAPE_FLAGS = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")


def default_ks(num_samples: int) -> tuple[int, ...]:
  """The k of pass@k / maj@k an evaluation reports: 1, the powers of 8 below ``num_samples``, and
  ``num_samples`` (``1, 8, 64`` for 64)."""
  ks, k = {1, num_samples}, 8
  while k < num_samples:
    ks.add(k)
    k *= 8
  return tuple(sorted(ks))


def parse_int_list(name: str, text: str) -> tuple[int, ...]:
  """Parses ``"64,128"`` into ``(64, 128)``; raises ConfigError naming the flag."""
  try:
    values = tuple(int(v) for v in text.split(",") if v.strip())
  except ValueError:
    raise ConfigError(f"--{name}={text!r}: expected a comma-separated list of integers") from None
  check(len(values) > 0 and all(v > 0 for v in values), name, text, "expected positive integers")
  return values


def parse_task_mix(text: str) -> tuple[tuple[str, float], ...]:
  """Parses ``--task``: ``"arith"`` -> ``(("arith", 1.0),)``; ``"arith:0.5,gsm8k:0.5"`` -> two weighted tasks.

  Raises:
    ConfigError: naming ``--task``, for an unknown or repeated task, a weight that is not a finite
      number > 0, or an empty entry.
  """
  allowed = f"allowed tasks: {', '.join(TASK_NAMES)}; a mixture is name:weight,name:weight"
  if not isinstance(text, str) or not text.strip():
    raise ConfigError(f"--task={text!r}: {allowed}")
  out: list[tuple[str, float]] = []
  for entry in text.split(","):
    name, sep, weight_text = entry.strip().partition(":")
    name = name.strip()
    check(name in TASK_NAMES, "task", text, f"unknown task {name!r}; {allowed}")
    check(name not in [n for n, _ in out], "task", text, f"{name!r} appears twice")
    weight = 1.0
    if sep:
      try:
        weight = float(weight_text)
      except ValueError:
        weight = float("nan")
      check(math.isfinite(weight) and weight > 0, "task", text, f"the weight of {name!r} must be a finite number > 0")
    out.append((name, weight))
  return tuple(out)


def format_task_mix(mix: tuple[tuple[str, float], ...]) -> str:
  """The canonical ``--task`` text of a parsed mixture (a single task is its bare name)."""
  if len(mix) == 1:
    return mix[0][0]
  return ",".join(f"{name}:{weight:.12g}" for name, weight in mix)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Which model to build or load, and its numerics."""

  model_preset: str = field("tiny", "Model preset.", choices=tuple(PRESETS))
  hf_checkpoint: str = field("", "Hugging Face checkpoint directory to load instead of random preset weights.")
  param_dtype: str = field("", "Parameter dtype (empty: the preset's).", choices=DTYPE_CHOICES)
  compute_dtype: str = field("", "Matmul dtype (empty: the preset's).", choices=DTYPE_CHOICES)
  remat: str = field("", "Layer rematerialisation (empty: the preset's).", choices=("",) + REMAT_POLICIES)
  vocab_size: int = field(0, "Override the preset's vocabulary size (0: keep; set from the tokenizer).", ge=0)
  max_seq_len: int = field(0, "Override the preset's maximum sequence length (0: keep).", ge=0)
  # The model's shape, each overriding the preset (0: keep): size sweeps and side-by-side benchmarks.
  d_model: int = field(0, "Override the preset's residual width (0: keep).", ge=0)
  num_layers: int = field(0, "Override the preset's number of layers (0: keep).", ge=0)
  num_heads: int = field(0, "Override the preset's number of query heads (0: keep).", ge=0)
  num_kv_heads: int = field(
    0, "Override the preset's number of key/value heads (0: keep; must divide num_heads).", ge=0
  )
  head_dim: int = field(0, "Override the preset's head width (0: keep the preset's, or d_model // num_heads).", ge=0)
  mlp_dim: int = field(0, "Override the preset's SwiGLU hidden width (0: keep).", ge=0)

  def __post_init__(self):
    check_fields(self)
    if self.hf_checkpoint:
      for name in (*SHAPE_FLAGS, "vocab_size", "max_seq_len"):
        check(
          not getattr(self, name),
          name,
          getattr(self, name),
          f"the shape comes from --hf_checkpoint={self.hf_checkpoint}; leave --{name} at 0",
        )
    else:
      self.model_config()  # the resolved shape is checked here, before any compute

  def shape_changes(self) -> dict[str, int]:
    """The shape flags that are set, as ModelConfig fields."""
    return {name: getattr(self, name) for name in SHAPE_FLAGS if getattr(self, name)}

  def vocab_for(self, tokenizer_vocab: int) -> int:
    """The vocabulary of a model built from the preset: ``--vocab_size``, else the tokenizer's.

    Raises:
      ConfigError: ``--vocab_size`` is set below the tokenizer's size (its ids past it would have no
        embedding row: the embedding gather gives NaN for them).
    """
    check(
      not self.vocab_size or self.vocab_size >= tokenizer_vocab,
      "vocab_size",
      self.vocab_size,
      f"is smaller than the tokenizer's {tokenizer_vocab} tokens; leave it at 0 or set at least {tokenizer_vocab}",
    )
    return self.vocab_size or tokenizer_vocab

  def model_config(self) -> ModelConfig:
    """The resolved ModelConfig for a preset (HF checkpoints resolve their own on load)."""
    cfg = get_preset(self.model_preset)
    changes: dict[str, Any] = {}
    if self.param_dtype:
      changes["param_dtype"] = self.param_dtype
    if self.compute_dtype:
      changes["dtype"] = self.compute_dtype
    if self.remat:
      changes["remat"] = self.remat
    if self.vocab_size:
      changes["vocab_size"] = self.vocab_size
    if self.max_seq_len:
      changes["max_seq_len"] = self.max_seq_len
    changes.update(self.shape_changes())
    return cfg.replace(**changes)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Generation: buckets, lengths and sampling parameters."""

  num_samples: int = field(8, "Samples per prompt (the GRPO group size G).", ge=1)
  prompt_buckets: tuple[int, ...] = field(
    (32, 64, 128), "Comma-separated prompt bucket lengths (prompts are left-padded to one).", items=int, gt=0
  )
  max_new_tokens: int = field(64, "Maximum completion length (static; completions are padded to it).", ge=1)
  temperature: float = field(1.0, "Sampling temperature at the start of training (0: greedy).", ge=0)
  temperature_final: float = field(
    -1.0, "Temperature at the end of training (linear schedule; -1: constant).", ge=0, also=(-1.0,)
  )
  top_p: float = field(1.0, "Nucleus sampling mass (1: off).", gt=0, le=1)
  top_k: int = field(0, "Top-k sampling (0: off).", ge=0)
  unrolled_decode: bool = field(
    True,
    "Decode with the layers unrolled over per-layer caches and a per-layer copy of the weights (faster "
    "steps; a decode program that grows with depth, and the copy in memory while generating); false: the "
    "scanned layer stack, one layer's program whatever the depth, no copy.",
  )
  share_prompt_cache: bool = field(
    True,
    "The num_samples rows of a prompt read its keys and values from one copy in the KV cache instead of a copy "
    "each (the prompt's cache memory and reads divided by num_samples); the same tokens and log-probs up to "
    "float rounding. Applies when num_samples > 1 and the prompts split evenly over the batch shards.",
  )
  # ---- async rollout
  async_rollout: bool = field(
    False,
    "Generate in a producer thread that runs ahead of the learner by at most --max_staleness policy versions "
    "(batch b is generated with exactly the policy of step b - K).",
  )
  max_staleness: int = field(
    -1, "Policy versions a batch may lag the step that trains on it (-1: 1 with --async_rollout).", ge=0, also=(-1,)
  )
  rollout_devices: int = field(
    0,
    "Devices that generate (the first K of the global mesh; the rest learn); 0: generation shares every "
    "device and the overlap is of host work (decoding, rewards) and dispatch.",
    ge=0,
  )

  def __post_init__(self):
    check_fields(self)
    check(
      self.async_rollout or self.max_staleness < 0,
      "max_staleness",
      self.max_staleness,
      "bounds the lag of --async_rollout; set --async_rollout (a synchronous run is never stale)",
    )
    check(
      self.async_rollout or self.rollout_devices == 0,
      "rollout_devices",
      self.rollout_devices,
      "a rollout sub-mesh needs --async_rollout",
    )

  @property
  def staleness(self) -> int:
    """The staleness bound in effect: 0 for a synchronous run."""
    if not self.async_rollout:
      return 0
    return 1 if self.max_staleness < 0 else self.max_staleness

  @property
  def buckets(self) -> tuple[int, ...]:
    """The prompt bucket lengths, shortest first."""
    return tuple(sorted(self.prompt_buckets))


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The RL algorithm: advantage estimator, policy loss, KL and entropy terms."""

  advantage: str = field("grpo", "Advantage estimator.", choices=ADVANTAGES)
  policy_loss: str = field("ppo", "Policy loss.", choices=tuple(POLICY_LOSSES))
  loss_agg: str = field("token-mean", "Loss aggregation.", choices=tuple(AGGREGATIONS))
  clip_low: float = field(0.2, "PPO lower clip epsilon (ratio >= 1 - clip_low).", ge=0, lt=1)
  clip_high: float = field(0.28, "PPO upper clip epsilon (clip-higher: ratio <= 1 + clip_high).", ge=0)
  clip_c: float = field(3.0, "Dual-clip constant for negative advantages (> 1).", gt=1)
  kl_coef: float = field(0.001, "Initial KL coefficient to the reference policy (0: no reference).", ge=0)
  kl_estimator: str = field("k3", "KL estimator.", choices=tuple(KL_ESTIMATORS))
  entropy_coef: float = field(
    0.0,
    "Entropy bonus coefficient, on the per-token mean entropy whatever --loss_agg (verl aggregates the bonus "
    "like the loss: under a sequence-sum aggregation its coefficients are about a completion's length larger).",
    ge=0,
  )
  ppo_epochs: int = field(1, "Passes over each rollout batch.", ge=1)
  num_minibatches: int = field(1, "Minibatches per pass.", ge=1)
  grad_accum: int = field(1, "Micro-batches per minibatch (gradient accumulation).", ge=1)
  use_value_model: bool = field(False, "Train a value model (PPO with GAE).")
  logprob_impl: str = field(
    "fused",
    "Training log-probs/entropy: the fused streaming kernel (no [tokens, vocab] logits), or full logits.",
    choices=("fused", "full"),
  )
  share_prompts: bool = field(
    True,
    "The learner runs each group's prompt once (its num_samples rows share it) instead of once per row: the "
    "same log-probs up to float rounding, less work. Under num_minibatches > 1 the shuffle then deals out whole "
    "groups (false: single rows).",
  )
  reference_dtype: str = field(
    "",
    "How the frozen reference is stored: '' (like the policy), float32, bfloat16, or int8 (weight-only, one "
    "scale per output channel, dequantised in the score pass).",
    choices=("", "float32", "bfloat16", "int8"),
  )
  reference_offload: str = field(
    "none",
    "Where the frozen reference lives: none (device memory) or host (host memory, copied to the devices for "
    "the score pass).",
    choices=("none", "host"),
  )
  # ---- KL to the reference: where it acts and how its coefficient is controlled
  kl_in: str = field(
    "loss", "Where the KL penalty acts: in the loss or subtracted from the reward.", choices=("loss", "reward")
  )
  kl_controller: str = field(
    "fixed", "KL coefficient controller: fixed, adaptive (target), budget (target tightening).", choices=KL_CONTROLLERS
  )
  kl_target: float = field(0.02, "KL target of the adaptive controller (the final budget for 'budget').", gt=0)
  kl_budget_start: float = field(0.1, "The budget controller's initial (loose) KL target.", gt=0)
  kl_horizon: float = field(10000.0, "Adaptive KL controller horizon in samples (larger reacts slower).", gt=0)
  kl_coef_min: float = field(
    1e-4, "Lower bound of the controlled KL coefficient (the default --kl_coef=0.001 lies inside).", gt=0
  )
  kl_coef_max: float = field(1.0, "Upper bound of the controlled KL coefficient.", gt=0)
  # ---- entropy
  entropy_controller: str = field(
    "fixed", "Entropy coefficient controller: fixed, or adaptive toward --entropy_target.", choices=ENTROPY_CONTROLLERS
  )
  entropy_target: float = field(0.5, "Entropy (nats per token) the adaptive controller steers toward.", ge=0)
  entropy_lr: float = field(0.001, "Adaptive entropy controller step size.", gt=0)
  entropy_coef_max: float = field(0.05, "Upper bound of the adaptive entropy coefficient.", ge=0)
  # ---- reward shaping (advantage path only; logged rewards stay raw)
  reward_clip_low: float = field(
    0.0, "Clip each batch's rewards at this quantile before the advantages (0: off).", ge=0, lt=0.5
  )
  reward_clip_high: float = field(
    1.0, "Clip each batch's rewards at this quantile before the advantages (1: off).", gt=0.5, le=1
  )
  reward_ema: float = field(
    0.0,
    "EMA decay of the reward statistics used to standardise rewards (0: off). With --phase_schedule each "
    "phase's own decay replaces the value, which then only switches the EMA on.",
    ge=0,
    lt=1,
  )
  overlong: str = field(
    "none", "Completions hitting the length limit: none, penalty (soft), mask.", choices=OVERLONG_MODES
  )
  overlong_buffer: int = field(4, "Soft overlong penalty zone (tokens before the limit).", ge=1)
  # ---- phased schedule
  phase_schedule: bool = field(False, "Warm-up / main / fine-tune phases switched by the smoothed reward slope.")
  phase_fracs: tuple[float, ...] = field(
    (0.1, 0.7, 0.2), "Step budget fractions of the warm-up, main and fine-tune phases.", items=float, length=3, gt=0
  )
  phase_slope_threshold: float = field(
    0.5,
    "The reward is flat when a whole run at its smoothed slope would add less than this fraction of the "
    "smoothed reward (a relative slope: the same threshold for any run length and reward scale).",
    ge=0,
  )
  phase_tolerance: int = field(20, "Consecutive flat steps that end a phase.", ge=1)
  phase_smoothing: tuple[float, ...] = field(
    (0.9, 0.95, 0.97), "Reward-smoothing EMA decay per phase (rising).", items=float, length=3, ge=0, lt=1
  )
  phase_clip_mults: tuple[float, ...] = field(
    (1.5, 1.0, 0.75), "PPO clip range multiplier per phase (loose, then tightening).", items=float, length=3, ge=0
  )
  phase_kl_mults: tuple[float, ...] = field(
    (1.0, 1.0, 2.0), "KL coefficient multiplier per phase (raised in fine-tune).", items=float, length=3, ge=0
  )
  # ---- value model (PPO)
  value_learning_rate: float = field(1e-4, "Value model peak learning rate (its own optimizer).", gt=0)
  gae_gamma: float = field(0.99, "GAE discount.", gt=0, le=1)
  gae_lambda: float = field(0.95, "GAE lambda.", ge=0, le=1)
  value_clip: float = field(0.2, "Clip range of the value loss.", gt=0)
  value_warmup_steps: int = field(0, "RL steps that train only the value model (the policy waits).", ge=0)
  value_updates: int = field(1, "Initial value-model passes per RL step.", ge=1)
  value_min_updates: int = field(1, "Fewest value-model passes per step.", ge=1)
  value_max_updates: int = field(4, "Most value-model passes per step.", ge=1)
  value_window: int = field(
    8, "Value-loss window of the update-frequency controller (0: fixed passes).", ge=2, also=(0,)
  )
  value_fast_drop: float = field(
    0.2, "Relative value-loss drop over the window that counts as 'falling fast'.", gt=0, lt=1
  )
  # ---- off-policy correction (async rollout's stale samples, sampler/learner mismatch)
  is_correction: str = field(
    "auto",
    "Importance correction of the gap between the sampling policy and the learner's: none, tis (token-level "
    "truncated), mis (sequence-level masked), decoupled (decoupled PPO); auto: decoupled when samples can "
    "be stale (--async_rollout with --max_staleness > 0), tis when the sampler truncates (--top_k, --top_p), "
    "none otherwise.",
    choices=("auto", *IS_CORRECTIONS),
  )
  is_clip: float = field(2.0, "Threshold C of the importance correction (weights truncated at / masked above C).", ge=1)
  behaviour_logprobs: str = field(
    "auto",
    "The PPO ratio's old log-probs: recompute (a teacher-forced forward pass of the policy in the learner), "
    "sampler (the full-softmax log-probs the sampler recorded while generating: the same weights and "
    "temperature, one forward pass fewer; needs synchronous rollout), or auto (sampler where allowed, else "
    "recompute).",
    choices=("auto", "recompute", "sampler"),
  )
  # ---- DAPO dynamic sampling
  dynamic_sampling: bool = field(False, "Drop groups whose rewards are all equal and refill with fresh prompts.")
  dynamic_sampling_max_rounds: int = field(3, "Most extra generation rounds per step to refill the batch.", ge=0)

  def __post_init__(self):
    check_fields(self)
    check(
      self.advantage != "gae" or self.use_value_model,
      "advantage",
      self.advantage,
      "gae needs a value model (--use_value_model)",
    )
    check(
      self.value_warmup_steps == 0 or self.use_value_model,
      "value_warmup_steps",
      self.value_warmup_steps,
      "warms up a value model (--use_value_model); without one the policy would only wait",
    )
    check(
      not self.use_value_model or self.advantage == "gae",
      "use_value_model",
      self.use_value_model,
      f"the value model is only used by --advantage=gae (got --advantage={self.advantage})",
    )
    check(
      self.kl_coef_min <= self.kl_coef_max,
      "kl_coef_min",
      self.kl_coef_min,
      f"must be <= --kl_coef_max={self.kl_coef_max}",
    )
    check(
      self.entropy_controller == "fixed" or self.entropy_coef <= self.entropy_coef_max,
      "entropy_coef",
      self.entropy_coef,
      f"a controlled coefficient starts at most --entropy_coef_max={self.entropy_coef_max}",
    )
    if self.kl_controller != "fixed":
      check(self.kl_coef > 0, "kl_controller", self.kl_controller, "needs a reference: set --kl_coef > 0")
      check(
        self.kl_coef_min <= self.kl_coef <= self.kl_coef_max,
        "kl_coef",
        self.kl_coef,
        f"a controlled coefficient starts inside [kl_coef_min, kl_coef_max] = [{self.kl_coef_min}, {self.kl_coef_max}]",
      )
    check(
      abs(sum(self.phase_fracs) - 1) < 1e-6,
      "phase_fracs",
      format_list(self.phase_fracs),
      "3 fractions > 0 summing to 1",
    )
    check(
      self.value_min_updates <= self.value_updates <= self.value_max_updates,
      "value_updates",
      self.value_updates,
      f"must be in [value_min_updates, value_max_updates] = [{self.value_min_updates}, {self.value_max_updates}]",
    )
    check(
      not self.dynamic_sampling or self.advantage != "gae",
      "dynamic_sampling",
      self.dynamic_sampling,
      "drops all-equal groups, which only group-relative estimators have (not --advantage=gae)",
    )

  @property
  def shapes_rewards(self) -> bool:
    """Whether rewards are clipped/standardised on the advantage path."""
    return self.reward_clip_low > 0 or self.reward_clip_high < 1 or self.reward_ema > 0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with warm-up and cosine decay, global-norm clipping."""

  learning_rate: float = field(1e-5, "Peak learning rate.", gt=0)
  warmup_steps: int = field(0, "Linear warm-up steps from 0.", ge=0)
  lr_schedule: str = field("cosine", "Decay after warm-up.", choices=("cosine", "constant"))
  weight_decay: float = field(0.0, "AdamW weight decay.", ge=0)
  adam_b1: float = field(0.9, "Adam beta1.", ge=0, lt=1)
  adam_b2: float = field(0.999, "Adam beta2.", ge=0, lt=1)
  grad_clip: float = field(1.0, "Global-norm gradient clip (0: off).", ge=0)
  grad_clip_mode: str = field(
    "fixed",
    "fixed threshold, or lr_linked: the threshold scales with the LR's ratio to its peak.",
    choices=("fixed", "lr_linked"),
  )
  sft_learning_rate: float = field(1e-3, "Peak learning rate of the supervised warm-start phase.", gt=0)
  sft_grad_clip: float = field(
    1.0,
    "Global-norm gradient clip of the supervised warm start (0: off). The warm start takes no other "
    "optimizer flag (--grad_clip, --lr_schedule, --weight_decay, Adam's betas are the RL policy's): "
    "changing an RL hyperparameter leaves the warm start as it was.",
    ge=0,
  )
  rm_learning_rate: float = field(1e-3, "--mode=reward_model: peak learning rate.", gt=0)
  master_dtype: str = field(
    "float32",
    "Dtype of the optimizer's master copy of the weights and of its moments. With bfloat16 parameters "
    "the update goes to a float32 copy (bfloat16 alone rounds small updates away); bfloat16 keeps "
    "no copy.",
    choices=("float32", "bfloat16"),
  )

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Prompt data."""

  task: str = field(
    "arith",
    f"Prompt source: one of {', '.join(TASK_NAMES)}, or a weighted mixture such as arith:0.5,gsm8k:0.5 "
    "(prompts stratified by task and difficulty level, rewards standardised per task before mixing, "
    "held-out prompts split by weight and reported per task).",
  )
  data_path: str = field(
    "", "Training prompts file (gsm8k/humaneval/jsonl; in a mixture, its one file task); empty: the shipped sample."
  )
  eval_data_path: str = field(
    "", "Held-out prompts file (gsm8k/humaneval/jsonl; in a mixture, its one file task); empty: the shipped sample."
  )
  tokenizer_path: str = field("", "Tokenizer (.model, tokenizer.json or an HF directory); empty: built-in.")
  chat_template: str = field(
    "none",
    "How a prompt reaches the policy: none (the task's text after BOS) or model (the one user message of a "
    "conversation rendered by the tokenizer's own chat template, tokenizer_config.json's or chat_template.jinja, "
    "as transformers renders it; for instruction-tuned models; needs --tokenizer_path or --hf_checkpoint).",
    choices=CHAT_TEMPLATES,
  )
  prompts_per_step: int = field(8, "Prompts per training step (each sampled num_samples times).", ge=1)
  eval_prompts: int = field(64, "Held-out prompts per evaluation.", ge=0)
  arith_levels: tuple[int, ...] = field(
    (1, 2), "Difficulty levels of the built-in arithmetic task (comma-separated).", items=int, ge=1, le=4
  )
  arith_reverse: bool = field(False, "Built-in arithmetic: answers written least-significant digit first.")
  sft_batch_size: int = field(32, "Demonstrations per supervised warm-start step.", ge=1)
  rm_batch_size: int = field(32, "--mode=reward_model: preference pairs per step.", ge=1)
  rm_pairs: str = field(
    "",
    "--mode=reward_model: a JSONL of preference pairs (prompt, chosen, rejected); empty: drawn from the task, "
    "each gold completion against a copy with one digit of its final answer changed (both checked by the "
    "task's verifier).",
  )
  rm_num_pairs: int = field(4096, "--mode=reward_model: pairs drawn from the task when --rm_pairs is empty.", ge=2)
  sft_wrong_fraction: float = field(
    0.0,
    "Fraction of carry problems whose warm-start demonstration shows the no-carry mistake (arith).",
    ge=0,
    le=1,
  )
  tfds_dir: str = field(
    "",
    "TFDS array_record cache: read gsm8k/humaneval through TFDS builders (empty: JSONL reader; jsonl task: ~/.cache).",
  )
  jsonl_fields: str = field(
    "prompt=prompt,answer=answer",
    "--task=jsonl: which JSONL fields hold the prompt and answer (a string or a JSON number).",
  )
  reward_workers: int = field(0, "Reward worker processes with per-sample timeouts (0: in-process).", ge=0)
  reward_timeout_s: float = field(
    10.0,
    "Per-sample reward time limit in the workers (seconds). Tasks that run model-written code (humaneval) "
    "give each program (this - 2) / 2 s, so a program that never ends fails its tests within the limit.",
    gt=0,
  )
  allow_weak_sandbox: bool = field(
    False,
    "Tasks that run model-written code (humaneval): go on where the sandbox has no kernel isolation (user, "
    "mount, network and PID namespaces), with Python-level guards only. Guard mode is NOT containment: "
    "determined code escapes it. Off: such a run is refused before any compute.",
  )
  reward_normalize: str = field(
    "auto",
    "Reward components: mixed raw (none), or standardised per task with running statistics first "
    "(task_running); auto: task_running for a task mixture, none for one task.",
    choices=("auto", "none", "task_running"),
  )
  format_reward_weight: float = field(0.0, "Weight of the math format component (0: logged only).", ge=0)
  digit_reward_weight: float = field(
    0.0,
    "Arithmetic: add a dense `digits` component, the fraction of answer digits in place (units first; a "
    "missing or extra digit costs its share), with this weight beside the exact-match `correct` (0: none).",
    ge=0,
  )
  reward_model: str = field("", "Reward-model run directory (rewards.reward_model) added as a reward component.")
  reward_model_weight: float = field(1.0, "Weight of the reward-model component.", ge=0)
  reward_hacking_probe: bool = field(False, "Code tasks: track completions a naive checker would pass (logged only).")
  json_reward_weight: float = field(
    0.0,
    "Weight of a `json` component: 1 when the completion is (or has, in a ```json block) JSON matching "
    "--json_schema; added when this is > 0 or --json_schema is set (0: logged only).",
    ge=0,
  )
  json_schema: str = field(
    "", "The `json` component's JSON Schema (a subset): inline JSON or a file; empty: any JSON value earns 1."
  )
  judge_checkpoint: str = field(
    "",
    "A model as judge (a `judge` component): a Hugging Face checkpoint directory (config, safetensors, "
    "tokenizer) whose sampled verdicts score each completion (empty: off).",
  )
  judge_mode: str = field(
    "score",
    "score: the judge rates each answer 0-10 ('Score: N', averaged over --judge_samples); pairwise: it "
    "compares the answer with the gold answer in both orders (position bias cancels).",
    choices=("score", "pairwise"),
  )
  judge_weight: float = field(1.0, "Weight of the judge component.", ge=0)
  judge_samples: int = field(4, "Judge outputs per completion (per order, pairwise).", ge=1)
  judge_max_new_tokens: int = field(64, "Longest judge output, in tokens.", ge=1)
  judge_temperature: float = field(1.0, "The judge's sampling temperature (0: greedy).", ge=0)
  curriculum: bool = field(False, "Prefer prompts whose pass rate is in --curriculum_band (from a larger pool).")
  curriculum_band: tuple[float, ...] = field(
    (0.4, 0.7), "Target pass-rate band of the curriculum (low,high).", items=float, length=2, ge=0, le=1
  )
  curriculum_pool: int = field(256, "Candidate prompts the curriculum chooses from (refreshed from the task).", ge=1)
  data_order: str = field(
    "sample",
    "How RL prompts are drawn: sample (uniformly with replacement), shuffle (epochs over the training prompts, "
    "each in a fresh order) or sequential (epochs in one fixed order: file order, or the drawn order of "
    "--train_prompts for the built-in arithmetic task). The position is checkpointed.",
    choices=("sample", "shuffle", "sequential"),
  )
  train_prompts: int = field(
    0,
    "Train RL on this many prompts only: the first N of the training file, or N drawn once for the built-in "
    "arithmetic task (generated without end, so shuffle and sequential need it); 0: all.",
    ge=0,
  )

  def __post_init__(self):
    check_fields(self)
    mix = parse_task_mix(self.task)
    # One spelling per mixture (the run's identity compares it): "arith:1" is "arith".
    object.__setattr__(self, "task", format_task_mix(mix))
    files = [name for name, _ in mix if name in FILE_TASKS]
    for name in ("data_path", "eval_data_path"):
      check(
        not getattr(self, name) or len(files) <= 1,
        name,
        getattr(self, name),
        f"is ambiguous in a mixture of several file tasks ({', '.join(files)}); each uses its shipped sample",
      )
    check(
      self.digit_reward_weight == 0 or any(name == "arith" for name, _ in mix),
      "digit_reward_weight",
      self.digit_reward_weight,
      f"is the arithmetic task's component; --task={self.task} has no arith",
    )
    check(
      self.reward_timeout_s >= 3 or not any(name == "humaneval" for name, _ in mix),
      "reward_timeout_s",
      self.reward_timeout_s,
      "must be >= 3 with humaneval: each program run gets (this - 2) / 2 s, at least half a second",
    )
    check(
      self.format_reward_weight == 0 or any(name == "gsm8k" for name, _ in mix),
      "format_reward_weight",
      self.format_reward_weight,
      f"is the gsm8k task's component; --task={self.task} has no gsm8k",
    )
    check(
      not self.curriculum or self.curriculum_pool >= self.prompts_per_step,
      "curriculum_pool",
      self.curriculum_pool,
      f"must hold at least --prompts_per_step={self.prompts_per_step} problems (a step's prompts are distinct)",
    )
    low, high = self.curriculum_band
    check(
      low < high, "curriculum_band", format_list(self.curriculum_band), "expected low,high with 0 <= low < high <= 1"
    )
    for name, used in (("data_order", self.data_order != "sample"), ("train_prompts", self.train_prompts > 0)):
      value = getattr(self, name)
      check(not used or not self.curriculum, name, value, "does not combine with --curriculum (it picks its prompts)")
      check(not used or not self.is_mixture, name, value, f"does not combine with a mixture (--task={self.task})")
    check(
      self.data_order == "sample" or self.train_prompts > 0 or self.task != "arith",
      "data_order",
      self.data_order,
      "needs --train_prompts=N with --task=arith (its problems are generated without end)",
    )

  @property
  def task_mix(self) -> tuple[tuple[str, float], ...]:
    """``((task, weight), ...)``: one entry for a single task; weights as given (not normalised)."""
    return parse_task_mix(self.task)

  @property
  def is_mixture(self) -> bool:
    """Whether ``--task`` names more than one task."""
    return len(self.task_mix) > 1

  @property
  def reward_normalization(self) -> str:
    """``--reward_normalize`` resolved: ``auto`` is ``task_running`` for a mixture, ``none`` otherwise."""
    if self.reward_normalize == "auto":
      return "task_running" if self.is_mixture else "none"
    return self.reward_normalize


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints of the train state."""

  checkpoint_every: int = field(0, "Save every N steps, SFT and RL (0: only at phase ends).", ge=0)
  keep_last: int = field(3, "Newest checkpoints to keep.", ge=1)
  keep_every: int = field(
    0,
    "Also keep every checkpoint whose step in its phase (SFT step, RL step) is a multiple of this (0: none).",
    ge=0,
  )
  async_save: bool = field(True, "Write checkpoints in the background while training continues.")
  resume: bool = field(True, "Resume from the run directory's latest intact checkpoint if there is one.")
  rollback_to: int = field(
    -1, "Restore the full state of this RL step (dropping later checkpoints) and continue (-1: off).", ge=0, also=(-1,)
  )
  max_bad_steps: int = field(
    3, "Roll back to the last good checkpoint after this many consecutive non-finite steps.", ge=1
  )
  rollback_reset_optimizer: bool = field(False, "Re-initialise the optimizer state when rolling back.")
  rollback_lr_factor: float = field(0.5, "Multiply the learning rate by this after a non-finite rollback.", gt=0, le=1)
  max_rollbacks: int = field(
    3, "End the run (committed state intact) when non-finite steps would need more rollbacks than this.", ge=0
  )
  overwrite: bool = field(
    False,
    "Start afresh in a run directory that holds another configuration's run, or checkpoints none of which "
    "restores (its checkpoints, reference, metrics and summary are deleted); refused otherwise.",
  )
  keep_best: str = field(
    "",
    "Also keep the checkpoint with the best held-out metric (greedy_accuracy, pass@K or maj@K; higher is "
    "better) in RUN_DIR/best/, beside the last --keep_last (empty: off). Evaluated steps only: see --eval_every.",
  )

  def __post_init__(self):
    check_fields(self)
    check(
      not self.keep_best or re.fullmatch(r"greedy_accuracy|(pass|maj)@[1-9][0-9]*", self.keep_best) is not None,
      "keep_best",
      self.keep_best,
      "allowed values: greedy_accuracy, pass@K, maj@K (K a positive integer), or empty",
    )


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Where and how often the run reports."""

  run_dir: str = field("", "Run directory (default runs/<experiment>-<timestamp>).")
  log_every: int = field(1, "Print a progress line every N steps.", ge=1)
  tensorboard: bool = field(True, "Write TensorBoard event files.")
  log_samples: int = field(
    2,
    "Sample replay: each RL step, the k highest- and k lowest-reward completions and the k prompts with "
    "the largest KL go to RUN_DIR/samples.jsonl (and TensorBoard text); 0 turns it off.",
    ge=0,
  )
  wandb_project: str = field(
    "", "Also log the metrics, histograms and samples to this Weights & Biases project (empty: off; the wandb extra)."
  )
  wandb_mode: str = field(
    "online",
    "W&B mode: online, offline (written under RUN_DIR/wandb/ for a later `wandb sync`; no network) or disabled.",
    choices=("online", "offline", "disabled"),
  )
  # Failure-shape alarms (mimo_jax/train/alarms.py): what each detector fires on, and what a firing does.
  on_alarm: str = field(
    "log",
    "What a firing alarm does: log (RUN_DIR/alarms.jsonl and the log) or rollback (also restore the last "
    "checkpoint before the alarm's onset and continue with --alarm_lr_factor and --alarm_kl_factor applied; "
    "a reward_jitter alarm instead reshuffles a --data_order=sequential prompt order, without a rollback).",
    choices=("log", "rollback"),
  )
  max_alarm_rollbacks: int = field(2, "With --on_alarm=rollback: at most this many alarm rollbacks per run.", ge=0)
  time_split: str = field(
    "auto",
    "How the learner's time (time_train_s) splits into time_score_s and time_update_s: measured (the score "
    "pass and the update run as two programs and the first is timed alone; one host wait between them), "
    "apportioned (one program, its time split by counted FLOPs), or auto: measured, but apportioned on "
    "several emulated CPU devices (where the update program alone can deadlock XLA:CPU's collectives).",
    choices=("auto", "measured", "apportioned"),
  )
  alarm_window: int = field(
    10,
    "Alarm smoothing window in RL steps (nothing fires before two windows, but a value-loss spike: one "
    "window and a step).",
    ge=2,
  )
  alarm_reward_drop: float = field(
    0.5, "reward_collapse: the smoothed reward lost this fraction of its rise above the first window.", gt=0, le=1
  )
  alarm_reward_min_rise: float = field(0.05, "reward_collapse: only after a rise of at least this much.", gt=0)
  alarm_entropy_floor: float = field(
    0.1, "entropy_collapse: the smoothed entropy fell below this fraction of the first window's.", gt=0, lt=1
  )
  alarm_entropy_solved: float = field(
    0.95,
    "entropy_collapse: not raised while the smoothed batch accuracy (where a verifier reports one) is at least "
    "this (a policy that answers nearly everything right has converged, not collapsed).",
    gt=0,
    le=1,
  )
  alarm_kl_max: float = field(1.0, "kl_blowup: the smoothed KL to the reference (kl_k3) exceeds this.", gt=0)
  alarm_value_spike: float = field(
    10.0, "value_loss_spike: the value loss exceeds this times the median of the window before.", gt=1
  )
  alarm_length_growth: float = field(
    3.0, "length_explosion: the smoothed response length exceeds this times the first window's.", gt=1
  )
  alarm_grad_floor: float = field(
    0.01, "grad_norm_collapse: the smoothed gradient norm fell below this fraction of the first window's.", gt=0, lt=1
  )
  alarm_jitter_acf: float = field(
    0.6,
    "reward_jitter: the reward changes' autocorrelation at a period of 2 .. alarm_window steps and at twice it exceeds this.",
    gt=0,
    lt=1,
  )
  alarm_lr_factor: float = field(
    0.5,
    "With --on_alarm=rollback: multiply the learning rate by this (for a value_loss_spike the critic's too).",
    gt=0,
    le=1,
  )
  alarm_kl_factor: float = field(2.0, "With --on_alarm=rollback: multiply the KL coefficient by this.", ge=1)

  def __post_init__(self):
    check_fields(self)
    if self.wandb_project:
      import importlib.util

      check(
        importlib.util.find_spec("wandb") is not None,
        "wandb_project",
        self.wandb_project,
        "Weights & Biases is not installed: pip install 'mimo-jax[wandb]' (or leave --wandb_project empty)",
      )


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The job itself."""

  experiment: str = field("default", "Experiment name (used in the run directory).")
  mode: str = field(
    "train",
    "What to run: train (SFT warm-start + RL), reward_model (Bradley-Terry reward-model training into "
    "RUN_DIR/reward_model/, for --reward_model of a later run with the same task and tokenizer flags) or "
    "smoke (a forward pass).",
    choices=("train", "reward_model", "smoke"),
  )
  seed: int = field(0, "Random seed of the whole run.")
  max_steps: int = field(10, "RL steps.", ge=0)
  stop_at_step: int = field(
    0,
    "Stop after this RL step as on SIGTERM (state saved; the same command without it goes on to --max_steps; "
    "0: off). The sweep's short-run gate runs the first steps of a point this way.",
    ge=0,
  )
  sft_steps: int = field(0, "Supervised warm-start steps before RL.", ge=0)
  sft_curriculum_steps: int = field(
    0,
    "The first N supervised steps draw only each task's easiest difficulty level (arith: the lowest "
    "--arith_levels, where the digit alignment is learned on short operands first; tasks with one level "
    "are unaffected; at least --sft_steps: the whole warm start); 0: every step draws all levels.",
    ge=0,
  )
  warm_start_from: str = field(
    "",
    "A run directory whose supervised warm start this run takes instead of running its own: the weights, "
    "loop key and data order at its last SFT step (a run of the same warm-start settings: model, seed, "
    "task and SFT flags; RL flags may differ). Used only when this run starts afresh; '': run its own. "
    "The sweep runner shares one warm start per seed this way.",
  )
  rm_steps: int = field(200, "--mode=reward_model: optimizer steps.", ge=1)
  eval_every: int = field(0, "Evaluate every N steps (0: only at the start and end).", ge=0)
  eval_samples: int = field(8, "Samples per held-out prompt for pass@k (k = 1 and this number).", ge=1)
  eval_temperature: float = field(1.0, "Sampling temperature of the pass@k evaluation.", gt=0)
  compile_ahead: bool = field(
    True,
    "Compile the learner's step programs in a background thread while the first rollout generates (their "
    "shapes are known once the first prompts are padded), so the first step does not wait for them after "
    "its rollout; false: each compiles at its first call.",
  )
  dry_run: bool = field(False, "Build and AOT-compile everything abstractly, print memory, exit.")
  dry_run_topology: str = field(
    "",
    "--dry_run: compile for this pod or node instead of this host's devices: <gen>-<n> TPU slices "
    "(v4, v5p, v5e, v6e; e.g. v5p-128), compiled by XLA:TPU through libtpu's compile-only topologies "
    "(the tpu extra), or gpu-8x80gb / gpu-8x141gb (the CPU compiler over 8 devices; approximate).",
  )
  dry_run_headroom: float = field(
    0.1, "--dry_run_topology: share of each device's memory to keep free; less is refused as not fitting.", ge=0, lt=1
  )
  debug_nan_steps: tuple[int, ...] = field(
    (),
    "Fault injection for tests: RL steps (comma-separated, 0-based: 3 is the 4th logged RL step) whose "
    "advantages are NaN.",
    items=int,
    ge=1,
    min_length=0,
  )
  debug_lr_spike_steps: tuple[int, ...] = field(
    (),
    "Fault injection for tests: logged RL steps (comma-separated, as in metrics.jsonl) whose policy update "
    "runs at --debug_lr_spike_factor times the learning rate, once each (redone after a rollback, it runs normally).",
    items=int,
    ge=1,
    min_length=0,
  )
  debug_lr_spike_factor: float = field(
    1000.0, "Fault injection for tests: the learning-rate multiplier of the --debug_lr_spike_steps.", gt=0
  )

  def __post_init__(self):
    check_fields(self)
    if self.dry_run_topology:
      from mimo_jax.topology import parse_topology

      parse_topology(self.dry_run_topology)
      check(self.dry_run, "dry_run_topology", self.dry_run_topology, "needs --dry_run (it only compiles)")
    check(
      not self.warm_start_from or self.sft_steps > 0,
      "warm_start_from",
      self.warm_start_from,
      "needs --sft_steps > 0 (without a supervised warm start there is none to take)",
    )


@dataclasses.dataclass(frozen=True)
class Config:
  """The whole run configuration."""

  run: RunConfig = RunConfig()
  model: ModelSpec = ModelSpec()
  mesh: MeshConfig = MeshConfig()
  rollout: RolloutConfig = RolloutConfig()
  algo: AlgoConfig = AlgoConfig()
  optim: OptimConfig = OptimConfig()
  data: DataConfig = DataConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  logging: LoggingConfig = LoggingConfig()

  def to_dict(self) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


CONCERN_CLASSES: dict[str, type] = {
  "run": RunConfig,
  "model": ModelSpec,
  "mesh": MeshConfig,
  "rollout": RolloutConfig,
  "algo": AlgoConfig,
  "optim": OptimConfig,
  "data": DataConfig,
  "checkpoint": CheckpointConfig,
  "logging": LoggingConfig,
}
# Keys a run's ``config.json`` may hold besides the concerns: records of the machine the run last
# started on (e.g. the sandbox isolation in effect), not settings.  Readers that rebuild a Config
# skip them, and a resume never compares them (the next machine may legitimately differ).
RUN_RECORD_KEYS = ("sandbox", "provenance")
# Settings added after run directories were first written, each defaulting to what the trainer did
# before it existed: a config.json without them reads as that default (an older run's directory stays
# readable by evaluation and export).  Any other missing setting is refused.
ADDED_SETTINGS = {
  "model": SHAPE_FLAGS,
  "logging": (
    "log_samples",
    "wandb_project",
    "wandb_mode",
    "on_alarm",
    "max_alarm_rollbacks",
    "alarm_window",
    "alarm_reward_drop",
    "alarm_reward_min_rise",
    "alarm_entropy_floor",
    "alarm_entropy_solved",
    "alarm_kl_max",
    "alarm_value_spike",
    "alarm_length_growth",
    "alarm_grad_floor",
    "alarm_jitter_acf",
    "alarm_lr_factor",
    "alarm_kl_factor",
    "time_split",
  ),
  "checkpoint": ("keep_best",),
  "run": (
    "stop_at_step",
    "rm_steps",
    "sft_curriculum_steps",
    "debug_lr_spike_steps",
    "debug_lr_spike_factor",
    "compile_ahead",
    "warm_start_from",
  ),
  "rollout": ("unrolled_decode", "share_prompt_cache"),
  # sft_grad_clip absent: the warm start was clipped at --grad_clip (ADDED_FROM).
  "optim": ("rm_learning_rate", "sft_grad_clip"),
  # Absent reads as auto / shared: each differs from the older behaviour by rounding only, and only in training.
  "algo": ("behaviour_logprobs", "share_prompts"),
  "data": (
    "rm_batch_size",
    "rm_pairs",
    "rm_num_pairs",
    "json_reward_weight",
    "json_schema",
    "judge_checkpoint",
    "judge_mode",
    "judge_weight",
    "judge_samples",
    "judge_max_new_tokens",
    "judge_temperature",
    "digit_reward_weight",
    "data_order",
    "train_prompts",
    "chat_template",
  ),
}
# Added settings whose older behaviour was another setting's value: absent, they read as that field.
ADDED_FROM = {"optim": {"sft_grad_clip": "grad_clip"}}


def hf_max_positions(path: str) -> int | None:
  """A Hugging Face checkpoint's ``max_position_embeddings`` (2048 where unset, as it is loaded), or
  None where its ``config.json`` cannot be read (loading it then says why)."""
  try:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
      value = json.load(f).get("max_position_embeddings", 2048)
  except (OSError, ValueError, AttributeError):
    return None
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def validate(cfg: Config, num_devices: int) -> None:
  """Cross-concern checks that need the device count; raises ConfigError.

  With ``--rollout_devices=K`` the first K devices generate and the mesh flags describe the
  learner's mesh over the other ``num_devices - K``.
  """
  r = cfg.rollout
  if r.rollout_devices:
    check(
      r.rollout_devices < num_devices,
      "rollout_devices",
      r.rollout_devices,
      f"must leave devices to learn on: fewer than the {num_devices} devices",
    )
    check(
      cfg.data.prompts_per_step % r.rollout_devices == 0,
      "prompts_per_step",
      cfg.data.prompts_per_step,
      f"must be a multiple of --rollout_devices={r.rollout_devices} (each rollout device generates its share)",
    )
    num_devices -= r.rollout_devices
  cfg.mesh.resolve(num_devices)
  if not cfg.model.hf_checkpoint:
    validate_model_on_mesh(cfg.model.model_config(), cfg.mesh, num_devices)
  check(
    cfg.data.chat_template == "none" or bool(cfg.data.tokenizer_path or cfg.model.hf_checkpoint),
    "chat_template",
    cfg.data.chat_template,
    "renders prompts with a model tokenizer's own chat template: pass --tokenizer_path or --hf_checkpoint "
    "(the built-in tokenizers have none); allowed values: " + ", ".join(CHAT_TEMPLATES),
  )
  if cfg.checkpoint.keep_best:
    check(
      cfg.data.eval_prompts > 0,
      "keep_best",
      cfg.checkpoint.keep_best,
      "needs held-out evaluations: --eval_prompts=0 evaluates nothing",
    )
  if cfg.checkpoint.keep_best.startswith("maj@"):
    without = [name for name, _ in cfg.data.task_mix if name not in MAJORITY_TASKS]
    check(
      not without,
      "keep_best",
      cfg.checkpoint.keep_best,
      f"maj@K needs an answer to vote on, which only {', '.join(MAJORITY_TASKS)} extract (not {', '.join(without)})",
    )
  if cfg.checkpoint.keep_best.startswith(("pass@", "maj@")):
    ks = default_ks(cfg.run.eval_samples)
    check(
      int(cfg.checkpoint.keep_best.split("@")[1]) in ks,
      "keep_best",
      cfg.checkpoint.keep_best,
      f"the run evaluates k in {list(ks)} (from --eval_samples={cfg.run.eval_samples})",
    )
  check(
    cfg.algo.behaviour_logprobs != "sampler" or cfg.rollout.staleness == 0,
    "behaviour_logprobs",
    "sampler",
    "needs synchronous rollout (or --max_staleness=0): a stale sample's log-probs are an older policy's; "
    "use auto or recompute",
  )
  check(
    cfg.algo.advantage not in ADVANTAGE_ESTIMATORS or cfg.rollout.num_samples >= 2,
    "num_samples",
    cfg.rollout.num_samples,
    f"group advantages ({cfg.algo.advantage}) need at least 2 samples per prompt",
  )
  check(
    cfg.algo.advantage not in ADVANTAGE_ESTIMATORS or cfg.rollout.temperature > 0 or cfg.rollout.temperature_final > 0,
    "temperature",
    cfg.rollout.temperature,
    f"greedy samples of a prompt are all alike, so group advantages ({cfg.algo.advantage}) are all 0; sample "
    "(--temperature > 0)",
  )
  check(
    cfg.algo.overlong != "penalty" or cfg.algo.overlong_buffer < cfg.rollout.max_new_tokens,
    "overlong_buffer",
    cfg.algo.overlong_buffer,
    f"must be smaller than --max_new_tokens={cfg.rollout.max_new_tokens}",
  )
  check(
    not cfg.algo.phase_schedule or cfg.optim.warmup_steps == 0,
    "warmup_steps",
    cfg.optim.warmup_steps,
    "the phase schedule shapes the learning rate itself (warm-up ramp, cosine, fine-tune); set --warmup_steps=0",
  )
  batch = cfg.data.prompts_per_step * cfg.rollout.num_samples
  check(
    batch % cfg.algo.num_minibatches == 0,
    "num_minibatches",
    cfg.algo.num_minibatches,
    f"must divide the rollout batch prompts_per_step*num_samples={batch}",
  )
  minibatch = batch // cfg.algo.num_minibatches
  check(
    minibatch % cfg.algo.grad_accum == 0,
    "grad_accum",
    cfg.algo.grad_accum,
    f"must divide the minibatch of {minibatch} rows",
  )
  data, fsdp, _ = cfg.mesh.resolve(num_devices)
  micro = minibatch // cfg.algo.grad_accum
  check(
    micro % (data * fsdp) == 0 and cfg.data.prompts_per_step % (data * fsdp) == 0,
    "prompts_per_step",
    cfg.data.prompts_per_step,
    f"prompts per step ({cfg.data.prompts_per_step}) and micro-batch rows ({micro}) must be multiples of the "
    f"batch shards mesh_data*mesh_fsdp={data * fsdp}",
  )
  longest = max(cfg.rollout.buckets) + cfg.rollout.max_new_tokens
  limit = hf_max_positions(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else cfg.model.model_config().max_seq_len
  check(
    limit is None or longest <= limit,
    "max_new_tokens",
    cfg.rollout.max_new_tokens,
    f"longest prompt bucket + max_new_tokens = {longest} exceeds the model's max_seq_len {limit}",
  )
