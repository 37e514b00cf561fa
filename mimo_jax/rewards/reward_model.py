"""A learned reward model: Bradley-Terry training on preference pairs, and a batched scorer.

The reward model is the foundation's :class:`~mimo_jax.models.ValueModel` (the policy's
backbone with a scalar head) read at the **last real token** of ``prompt + completion``,
in the repository's usual layout: the prompt left-padded to a bucket ``P``, the completion
right-padded to ``M``, positions counted over the real tokens.  Because the score is read
at one position selected by the mask, padding never changes it.

Training minimises the Bradley-Terry loss ``-log sigmoid(r(chosen) - r(rejected))`` with
the policy trainer's own machinery (:class:`~mimo_jax.optim.TrainState`, AdamW from
:func:`~mimo_jax.optim.make_optimizer`, the non-finite-guarded
:func:`~mimo_jax.optim.apply_gradients`); chosen and rejected rows are scored in one
forward pass.  A trained model is checkpointed with :class:`~mimo_jax.ckpt.Checkpointer`
under ``<run_dir>/reward_model/`` (the model config rides in the schema's ``model_config``
field of the metadata) and read back with :func:`load_reward_model`.

:class:`RewardModelScorer` is a batched reward source: ``scorer(samples) -> list[float]``
for any objects with ``prompt``, ``completion`` and ``truncated`` attributes (the
``RewardSample`` of :mod:`mimo_jax.rewards.base`).  Rows are processed in chunks of a
fixed ``batch_rows`` (short chunks are padded), so the compiled shape depends only on
the prompt bucket, never on the number of samples.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from mimo_jax import multihost, sharding
from mimo_jax.ckpt import Checkpointer
from mimo_jax.config import OptimConfig
from mimo_jax.models.config import ModelConfig
from mimo_jax.models.create import abstract_state, create_sharded
from mimo_jax.models.transformer import Transformer, ValueModel, positions_from_mask
from mimo_jax.optim import OPTIMIZER_LAYOUT, TrainState, apply_gradients, make_optimizer
from mimo_jax.rollout.sampler import bucket_for, left_pad
from mimo_jax.tokenization import keep_last_tokens

if TYPE_CHECKING:
  from mimo_jax.rewards.base import RewardSample
  from mimo_jax.tokenization import Tokenizer

__all__ = [
  "CHECKPOINT_SUBDIR",
  "PreferenceBatch",
  "RewardModelScorer",
  "bradley_terry_loss",
  "last_token_scores",
  "load_reward_model",
  "make_rm_score_fn",
  "make_rm_train_step",
  "pair_accuracy",
  "preference_scores",
  "train_reward_model",
]

# Where train_reward_model checkpoints inside its run_dir.
CHECKPOINT_SUBDIR = "reward_model"
# Marks reward-model checkpoints in their metadata (the policy loop never writes this key).
_KIND = "reward_model"


# ----------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------


def _rules(mesh: Mesh | None):
  import contextlib

  return contextlib.nullcontext() if mesh is None else sharding.use_rules(mesh, sharding.TRAIN_RULES)


def last_token_scores(
  model: ValueModel,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  completion_tokens: jax.Array,
  completion_mask: jax.Array,
) -> jax.Array:
  """float32 ``[B]``: the value head at the last real token of each ``prompt + completion`` row.

  Args:
    model: the reward model.
    prompt_tokens: int32 ``[B, P]``, left-padded.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``, right-padded.
    completion_mask: bool ``[B, M]`` (an all-False row scores the prompt's last token).
  """
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1).astype(jnp.int32)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  values = model(tokens, attention_mask=mask, positions=positions_from_mask(mask))  # [B, T]
  T = tokens.shape[1]
  # The last True of each row (argmax finds the first True of the reversed mask).
  last = T - 1 - jnp.argmax(mask[:, ::-1], axis=1)
  return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0].astype(jnp.float32)


def make_rm_score_fn(graphdef: Any, mesh: Mesh | None):
  """A jitted ``(params, prompt_tokens, prompt_mask, completion_tokens, completion_mask) -> scores [B]``.

  Args:
    graphdef: the static half of ``nnx.split(value_model)``.
    mesh: the mesh the parameters live on (None: one device, no activation constraints).

  Returns:
    The jitted scoring function (float32 scores, one per row); the same object for equal
    ``(graphdef, mesh)``, so scorers of one architecture share their compilations.
  """
  return _cached_score_fn(graphdef, mesh)


@functools.lru_cache(maxsize=16)
def _cached_score_fn(graphdef: Any, mesh: Mesh | None):
  def score(params, prompt_tokens, prompt_mask, completion_tokens, completion_mask):
    model = nnx.merge(graphdef, params)
    with _rules(mesh):
      return last_token_scores(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask)

  return jax.jit(score)


# ----------------------------------------------------------------------------
# Bradley-Terry
# ----------------------------------------------------------------------------


def bradley_terry_loss(
  chosen_scores: jax.Array, rejected_scores: jax.Array, *, margin: jax.Array | float | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The Bradley-Terry preference loss ``mean(-log sigmoid(chosen - rejected [- margin]))``.

  Args:
    chosen_scores: float ``[B]``, rewards of the preferred completions.
    rejected_scores: float ``[B]``, rewards of the dispreferred ones.
    margin: optional scalar or ``[B]`` required gap (Llama-2 style): the loss asks for
      ``chosen - rejected > margin``.

  Returns:
    ``(loss, metrics)``; metrics ``accuracy`` (fraction with chosen strictly above
    rejected) and ``margin`` (the mean of ``chosen - rejected``), all float32 scalars.
  """
  chosen = jnp.asarray(chosen_scores, jnp.float32)
  rejected = jnp.asarray(rejected_scores, jnp.float32)
  diff = chosen - rejected
  logits = diff if margin is None else diff - jnp.asarray(margin, jnp.float32)
  loss = -jnp.mean(jax.nn.log_sigmoid(logits))
  metrics = {"accuracy": jnp.mean((diff > 0).astype(jnp.float32)), "margin": jnp.mean(diff)}
  return loss, metrics


@flax.struct.dataclass
class PreferenceBatch:
  """Preference pairs sharing a prompt (``B`` pairs).

  Attributes:
    prompt_tokens: int32 ``[B, P]``, left-padded.
    prompt_mask: bool ``[B, P]``.
    chosen_tokens: int32 ``[B, M]``, right-padded preferred completions.
    chosen_mask: bool ``[B, M]``.
    rejected_tokens: int32 ``[B, M]``, right-padded dispreferred completions.
    rejected_mask: bool ``[B, M]``.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  chosen_tokens: jax.Array
  chosen_mask: jax.Array
  rejected_tokens: jax.Array
  rejected_mask: jax.Array


def preference_scores(model: ValueModel, batch: PreferenceBatch) -> tuple[jax.Array, jax.Array]:
  """``(chosen [B], rejected [B])`` scores from one forward pass over the ``2B`` stacked rows."""
  B = batch.prompt_tokens.shape[0]
  prompt_tokens = jnp.concatenate([batch.prompt_tokens, batch.prompt_tokens], axis=0)
  prompt_mask = jnp.concatenate([batch.prompt_mask, batch.prompt_mask], axis=0)
  completion_tokens = jnp.concatenate([batch.chosen_tokens, batch.rejected_tokens], axis=0)
  completion_mask = jnp.concatenate([batch.chosen_mask, batch.rejected_mask], axis=0)
  scores = last_token_scores(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask)
  return scores[:B], scores[B:]


def make_rm_train_step(mesh: Mesh | None, *, center_coef: float = 0.0):
  """A jitted ``(state, PreferenceBatch) -> (state, metrics)`` Bradley-Terry step (state donated).

  Args:
    mesh: the mesh the state lives on (None: one device).
    center_coef: weight of ``mean((chosen + rejected)^2)``, which keeps the scores centred
      at zero (the BT loss alone only fixes differences); 0 disables it.

  Returns:
    The jitted step; metrics ``rm_loss`` (the BT loss), ``loss`` (with the centring term),
    ``accuracy``, ``margin``, ``score_mean`` and the optimizer's ``grad_norm``,
    ``update_norm``, ``skipped``.
  """

  def step(state: TrainState, batch: PreferenceBatch):
    def loss_fn(params):
      model = nnx.merge(state.graphdef, params)
      with _rules(mesh):
        chosen, rejected = preference_scores(model, batch)
      bt, metrics = bradley_terry_loss(chosen, rejected)
      loss = bt
      if center_coef:
        loss = loss + center_coef * jnp.mean(jnp.square(chosen + rejected))
      metrics = {**metrics, "rm_loss": bt, "score_mean": 0.5 * jnp.mean(chosen + rejected)}
      return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state, opt_metrics = apply_gradients(state, grads, loss)
    return state, {"loss": loss, **metrics, **opt_metrics}

  return jax.jit(step, donate_argnums=(0,))


# ----------------------------------------------------------------------------
# Host-side encoding
# ----------------------------------------------------------------------------


def _encode_prompt(tokenizer: Tokenizer, text: str, limit: int) -> tuple[list[int], bool]:
  """Prompt ids (BOS when the tokenizer has one), cut to BOS and the last tokens (``limit`` in all); and
  whether it was cut.

  Same convention as :func:`mimo_jax.train.loop.encode_prompts`.
  """
  ids = tokenizer.encode(text, add_bos=tokenizer.adds_bos)
  return keep_last_tokens(ids, limit, tokenizer.bos_id), len(ids) > limit


def _encode_completion(tokenizer: Tokenizer, text: str, limit: int, *, add_eos: bool = True) -> tuple[list[int], bool]:
  """Completion ids (+ EOS), cut to the first ``limit`` tokens; and whether it was cut.

  Same convention as :func:`mimo_jax.train.loop.encode_targets`.
  """
  ids = tokenizer.encode(text, add_eos=add_eos)
  return ids[:limit], len(ids) > limit


def _right_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), bool)
  for i, s in enumerate(seqs):
    tokens[i, : len(s)] = s
    mask[i, : len(s)] = True
  return tokens, mask


def _batch_shards(mesh: Mesh | None) -> int:
  if mesh is None:
    return 1
  spec = sharding.logical_to_spec(("batch",), sharding.TRAIN_RULES, mesh)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return int(np.prod([mesh.shape[a] for a in axes]))


def _place(x: np.ndarray, mesh: Mesh | None) -> jax.Array:
  """Puts a host array on the mesh, rows sharded like the ``batch`` logical axis."""
  if mesh is None:
    return jnp.asarray(x)
  spec = sharding.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), sharding.TRAIN_RULES, mesh, x.shape)
  return jax.device_put(x, NamedSharding(mesh, spec))


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


def _init_reward_model(
  cfg: ModelConfig, policy: Transformer | None, mesh: Mesh | None, seed: int, head_init_std: float
) -> ValueModel:
  def make():
    return ValueModel(cfg, rngs=nnx.Rngs(seed))

  if mesh is None:
    # One compiled initialiser instead of one small compile per parameter shape.
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    model = nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1])())
  else:
    model = create_sharded(make, mesh)
  if policy is not None:
    target = nnx.state(model.decoder)
    source = nnx.state(policy.decoder)
    placed = jax.tree.map(lambda s, t: jax.device_put(jnp.copy(s), t.sharding), source, target)
    nnx.update(model.decoder, placed)
  if head_init_std > 0:
    # A random head gives untrained scores that differ between completions (pair
    # accuracy starts at chance, not at ties) and a non-zero backbone gradient at step 0.
    head = model.value_head_d.get_value()
    key = jax.random.fold_in(jax.random.key(seed), 0x4845)  # "HE"
    values = head_init_std * jax.random.normal(key, head.shape, jnp.float32)
    model.value_head_d.set_value(jax.device_put(values, head.sharding))
  return model


def _pair_batches(num_pairs: int, batch_size: int, rng: np.random.Generator):
  """Index batches over epochs of fresh permutations (a batch may span two epochs)."""
  order = np.zeros((0,), np.int64)
  while True:
    while order.size < batch_size:
      order = np.concatenate([order, rng.permutation(num_pairs)])
    yield order[:batch_size]
    order = order[batch_size:]


def _model_config_to_json(cfg: ModelConfig) -> dict[str, Any]:
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _model_config_from_json(fields: dict[str, Any]) -> ModelConfig:
  return ModelConfig.from_dict(fields)


def train_reward_model(
  pairs: Sequence[tuple[str, str, str]],
  *,
  tokenizer: Tokenizer,
  model_cfg: ModelConfig | None = None,
  policy: Transformer | None = None,
  mesh: Mesh | None = None,
  steps: int,
  batch_size: int,
  learning_rate: float = 1e-3,
  seed: int = 0,
  buckets: Sequence[int] = (16, 32, 64, 128, 256, 512),
  max_completion_len: int = 64,
  run_dir: str | None = None,
  optim: OptimConfig | None = None,
  optimizer: optax.GradientTransformation | None = None,
  center_coef: float = 0.0,
  head_init_std: float = 0.02,
  log_fn: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[Any, Any, list[dict[str, float]]]:
  """Trains a Bradley-Terry reward model on ``(prompt, chosen, rejected)`` text pairs.

  Prompts are encoded like the policy's (BOS, left-padded to the smallest fitting bucket,
  over-long prompts keep their last tokens); completions get EOS and are right-padded to
  ``max_completion_len`` (over-long ones keep their first tokens).  Each step draws
  ``batch_size`` pairs from successive random permutations of ``pairs``.

  Args:
    pairs: ``(prompt, chosen_text, rejected_text)`` triples.
    tokenizer: the tokenizer (its vocabulary must fit the model's).
    model_cfg: the backbone's config, for a randomly initialised backbone.
    policy: a policy ``Transformer`` whose backbone initialises the reward model (exactly
      one of ``model_cfg`` and ``policy``).
    mesh: the mesh to train on (None: one device).
    steps: optimizer steps (0 returns the initial model).
    batch_size: pairs per step.
    learning_rate: peak AdamW learning rate (ignored when ``optim`` or ``optimizer`` is given).
    seed: seeds the initialisation, the head and the pair order.
    buckets: allowed padded prompt lengths.
    max_completion_len: the completion buffer ``M``.
    run_dir: when given, the final model is checkpointed to ``<run_dir>/reward_model/``.
    optim: optimizer settings (default: AdamW at ``learning_rate``, 10% warm-up, cosine decay).
    optimizer: an optax transformation that replaces ``optim`` entirely (e.g. plain SGD in tests).
    center_coef: see :func:`make_rm_train_step`.
    head_init_std: standard deviation of the random head initialisation (0: zero head).
    log_fn: called as ``log_fn(step, metrics)`` after every step (this syncs with the device).

  Returns:
    ``(graphdef, params, history)``: the :class:`ValueModel`'s two halves and one dict
    of float metrics per step.

  Raises:
    ValueError: on empty pairs, a non-positive batch size, negative steps, or a tokenizer
      larger than the model's vocabulary.
  """
  if not pairs:
    raise ValueError("pairs is empty")
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  if steps < 0:
    raise ValueError(f"steps must be >= 0, got {steps}")
  if (model_cfg is None) == (policy is None):
    raise ValueError("pass exactly one of model_cfg (a fresh backbone) and policy (initialise from a policy)")
  cfg = policy.config if policy is not None else model_cfg
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is {cfg.vocab_size}")
  model = _init_reward_model(cfg, policy, mesh, seed, head_init_std)

  if optimizer is None:
    optim = optim or OptimConfig(learning_rate=learning_rate, warmup_steps=max(steps // 10, 0))
    optimizer, _ = make_optimizer(optim, max(steps, 1))
  state = TrainState.create(model, optimizer, jax.random.key(seed))
  del model

  # Encode every pair once.
  limit = max(buckets)
  prompts = [_encode_prompt(tokenizer, p, limit)[0] for p, _, _ in pairs]
  chosen = [_encode_completion(tokenizer, c, max_completion_len)[0] for _, c, _ in pairs]
  rejected = [_encode_completion(tokenizer, r, max_completion_len)[0] for _, _, r in pairs]
  for i, p in enumerate(prompts):
    if not p:
      raise ValueError(f"pair {i} has an empty prompt (and the tokenizer adds no BOS)")

  step_fn = make_rm_train_step(mesh, center_coef=center_coef)
  rng = np.random.default_rng(seed)
  batches = _pair_batches(len(pairs), batch_size, rng)
  pad = tokenizer.pad_id
  device_metrics = []
  for i in range(steps):
    idx = next(batches)
    p_ids = [prompts[j] for j in idx]
    p_tok, p_mask = left_pad(p_ids, bucket_for(max(len(p) for p in p_ids), buckets), pad)
    c_tok, c_mask = _right_pad([chosen[j] for j in idx], max_completion_len, pad)
    r_tok, r_mask = _right_pad([rejected[j] for j in idx], max_completion_len, pad)
    batch = PreferenceBatch(*(_place(x, mesh) for x in (p_tok, p_mask, c_tok, c_mask, r_tok, r_mask)))
    state, metrics = step_fn(state, batch)
    if log_fn is not None:
      log_fn(i + 1, {k: float(v) for k, v in jax.device_get(metrics).items()})
    device_metrics.append(metrics)
  history = [{k: float(v) for k, v in m.items()} for m in jax.device_get(device_metrics)]

  graphdef, params = nnx.split(state.model())
  if run_dir is not None:
    _save(run_dir, steps, params, cfg, history, num_pairs=len(pairs), tokenizer=tokenizer)
  return graphdef, params, history


def _save(
  run_dir: str,
  step: int,
  params: Any,
  cfg: ModelConfig,
  history: list[dict[str, float]],
  *,
  num_pairs: int,
  tokenizer: Tokenizer,
) -> None:
  """Checkpoints the parameters with metadata that passes ``checkpoints_schema/`` (v1)."""
  model_config = _model_config_to_json(cfg)
  last = history[-1] if history else {}
  info = {
    "steps": step,
    "num_pairs": num_pairs,
    "tokenizer_vocab_size": tokenizer.vocab_size,
    "final_metrics": {k: last[k] for k in ("rm_loss", "accuracy", "margin") if k in last},
  }
  meta = {
    # The schema's required fields.  Reward-model training is a supervised phase; it has
    # no RL buffer, so the buffer fields are empty.
    "phase": "sft",
    "step": step,
    "log_step": step,
    "optimizer_layout": OPTIMIZER_LAYOUT,  # (only the parameters are saved)
    "created_unix": time.time(),
    "config_digest": hashlib.sha1(json.dumps([model_config, info], sort_keys=True).encode()).hexdigest()[:12],
    "model_config": model_config,
    "data_rng": {},
    "buffer": {"next_batch_id": 0, "policy_version": 0, "sampling_params_version": "", "batches": [], "pending": []},
    # Extra fields (the schema allows them): what this checkpoint is.
    "kind": _KIND,
    _KIND: info,
  }
  ckpt = Checkpointer(os.path.join(run_dir, CHECKPOINT_SUBDIR), keep_last=1, async_save=False)
  try:
    ckpt.save(step, {"params": params}, meta)
  finally:
    ckpt.close()


def load_reward_model(
  run_dir: str, mesh: Mesh | None = None, *, step: int | None = None
) -> tuple[Any, Any, ModelConfig]:
  """Restores a reward model written by :func:`train_reward_model` (fingerprints verified).

  Args:
    run_dir: the ``run_dir`` given to :func:`train_reward_model`.
    mesh: the mesh to restore onto (None: the first device).
    step: which checkpoint (default: the latest).

  Returns:
    ``(graphdef, params, model_cfg)``.

  Raises:
    FileNotFoundError: no reward-model checkpoint (or not the requested step) under ``run_dir``.
    ValueError: the checkpoint is not a reward model's.
    mimo_jax.ckpt.manager.CheckpointCorrupted: unreadable or corrupted files.
  """
  directory = os.path.join(run_dir, CHECKPOINT_SUBDIR)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{run_dir}: no reward-model checkpoint ({directory} does not exist)")
  ckpt = Checkpointer(directory, keep_last=1, async_save=False, read_only=True)
  try:
    step = ckpt.resolve_step(step)
    meta = ckpt.read_meta(step)
    if meta.get("kind") != _KIND:
      raise ValueError(f"{directory}: checkpoint {step} is not a reward model (kind={meta.get('kind')!r})")
    cfg = _model_config_from_json(meta["model_config"])
    graphdef, abstract = abstract_state(lambda: ValueModel(cfg, rngs=nnx.Rngs(0)), mesh)
    if mesh is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract)
    restored, _ = ckpt.restore(step, {"params": abstract})
  finally:
    ckpt.close()
  return graphdef, restored["params"], cfg


# ----------------------------------------------------------------------------
# The batched reward source
# ----------------------------------------------------------------------------


class RewardModelScorer:
  """A batched reward source scoring completions with a trained reward model.

  ``scorer(samples)`` encodes each sample's ``prompt`` and ``completion`` text (EOS
  appended unless ``sample.truncated``, matching how :func:`train_reward_model` encodes
  finished answers) and returns one float per sample.

  Args:
    graphdef: the reward model's graphdef.
    params: its parameters (on ``mesh``).
    tokenizer: the reward model's tokenizer.
    mesh: the mesh the parameters live on (None: one device).
    buckets: allowed padded prompt lengths.
    max_completion_len: the completion buffer ``M``; longer completions keep their first
      ``M`` tokens (counted in :meth:`last_metrics`).
    batch_rows: rows per device call; rounded up to a multiple of the mesh's batch shards.
  """

  def __init__(
    self,
    graphdef: Any,
    params: Any,
    tokenizer: Tokenizer,
    *,
    mesh: Mesh | None = None,
    buckets: Sequence[int] = (16, 32, 64, 128, 256, 512),
    max_completion_len: int = 64,
    batch_rows: int = 32,
  ):
    if batch_rows <= 0:
      raise ValueError(f"batch_rows must be positive, got {batch_rows}")
    if max_completion_len <= 0:
      raise ValueError(f"max_completion_len must be positive, got {max_completion_len}")
    self.graphdef = graphdef
    self.params = params
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.buckets = tuple(sorted(buckets))
    self.max_completion_len = max_completion_len
    shards = _batch_shards(mesh)
    self.batch_rows = -(-batch_rows // shards) * shards
    self._score = make_rm_score_fn(graphdef, mesh)
    self._metrics: dict[str, float] = {}

  def update_params(self, params: Any) -> None:
    """Points the scorer at new parameters (same graphdef and shardings: no recompile)."""
    self.params = params

  def score(
    self, prompts: Sequence[str], completions: Sequence[str], truncated: Sequence[bool] | None = None
  ) -> np.ndarray:
    """float32 ``[n]`` scores of ``prompt + completion`` texts.

    Args:
      prompts: prompt texts.
      completions: completion texts (same length as ``prompts``).
      truncated: per row, whether the completion was cut by the length limit (no EOS is
        appended then); default all False.
    """
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    n = len(prompts)
    truncated = [False] * n if truncated is None else list(truncated)
    if len(truncated) != n:
      raise ValueError(f"{n} prompts but {len(truncated)} truncated flags")
    limit, M, pad = self.buckets[-1], self.max_completion_len, self.tokenizer.pad_id
    cut_prompts = cut_completions = 0
    p_ids, c_ids = [], []
    for prompt, completion, was_cut in zip(prompts, completions, truncated, strict=True):
      ids, cut = _encode_prompt(self.tokenizer, prompt, limit)
      if not ids:
        raise ValueError("an empty prompt (and the tokenizer adds no BOS) cannot be scored")
      p_ids.append(ids)
      cut_prompts += cut
      ids, cut = _encode_completion(self.tokenizer, completion, M, add_eos=not was_cut)
      c_ids.append(ids)
      cut_completions += cut
    out = np.zeros((n,), np.float32)
    R = self.batch_rows
    for start in range(0, n, R):
      chunk_p, chunk_c = p_ids[start : start + R], c_ids[start : start + R]
      rows = len(chunk_p)
      # Filler rows: a one-token prompt and an empty completion (scored, then dropped).
      chunk_p = chunk_p + [[pad]] * (R - rows)
      chunk_c = chunk_c + [[]] * (R - rows)
      p_tok, p_mask = left_pad(chunk_p, bucket_for(max(len(p) for p in chunk_p), self.buckets), pad)
      c_tok, c_mask = _right_pad(chunk_c, M, pad)
      scores = self._score(self.params, *(_place(x, self.mesh) for x in (p_tok, p_mask, c_tok, c_mask)))
      out[start : start + rows] = multihost.to_host(scores)[:rows]  # whole on every host
    self._metrics = {
      "num_samples": float(n),
      "cut_prompts": float(cut_prompts),
      "cut_completions": float(cut_completions),
      "score_mean": float(out.mean()) if n else 0.0,
    }
    return out

  def __call__(self, samples: Sequence[RewardSample]) -> list[float]:
    """The batched reward-source interface: one float per sample."""
    samples = list(samples)
    if not samples:
      return []
    scores = self.score(
      [s.prompt for s in samples],
      [s.completion for s in samples],
      [bool(getattr(s, "truncated", False)) for s in samples],
    )
    return [float(x) for x in scores]

  def last_metrics(self) -> dict[str, float]:
    """Counts of the last call: samples, cut prompts and completions, mean score."""
    return dict(self._metrics)


def pair_accuracy(scorer: RewardModelScorer, pairs: Sequence[tuple[str, str, str]]) -> float:
  """Fraction of ``(prompt, chosen, rejected)`` pairs whose chosen text scores strictly higher."""
  if not pairs:
    raise ValueError("pairs is empty")
  prompts = [p for p, _, _ in pairs]
  scores = scorer.score(prompts + prompts, [c for _, c, _ in pairs] + [r for _, _, r in pairs])
  n = len(pairs)
  return float(np.mean(scores[:n] > scores[n:]))
