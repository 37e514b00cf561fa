"""Jitted step functions: SFT, scoring (old/reference log-probs), advantages, the policy update.

Every step has the form ``(state, batch) -> (state, metrics)`` or is a pure function of
arrays; batches are frozen ``flax.struct`` dataclasses with documented shapes; the
update phase (epochs x minibatches x micro-batches) is one jitted function built on
``lax.scan`` with the state donated.  Metrics come back as one pytree of scalars.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mimo_jax import sharding
from mimo_jax.models.logprobs import completion_hidden, completion_logprobs, completion_stats
from mimo_jax.models.reference import dense_reference
from mimo_jax.optim import TrainState, apply_gradients
from mimo_jax.rl.advantages import gae, group_advantages, masked_mean, masked_var, masked_whiten
from mimo_jax.rl.controllers import ControllerState, DynamicCoefs, overlong_shaping, shape_rewards
from mimo_jax.rl.kl import kl_estimate
from mimo_jax.rl.losses import aggregate, policy_loss, value_loss

# ----------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class SequenceBatch:
  """Prompt + completion token batch (SFT targets, or rollouts to score).

  Attributes:
    prompt_tokens: int32 ``[B, P]``, left-padded.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``, right-padded.
    completion_mask: bool ``[B, M]``, the tokens that are trained on / scored.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array


@flax.struct.dataclass
class PolicyBatch:
  """A scored rollout batch ready for the policy update (``B`` rows).

  Attributes:
    prompt_tokens: int32 ``[B, P]``.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``.
    completion_mask: bool ``[B, M]``.
    advantages: float32 ``[B]`` (one per sequence) or ``[B, M]`` (per token, e.g. GAE).
    old_logprobs: float32 ``[B, M]``, the behaviour policy's log-probs.
    ref_logprobs: float32 ``[B, M]``, the frozen reference's log-probs (zeros without KL).
    temperature: float32 ``[B]``, the sampling temperature (log-probs are recomputed at it).
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array
  advantages: jax.Array
  old_logprobs: jax.Array
  ref_logprobs: jax.Array
  temperature: jax.Array


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
  """Static settings of the policy update (hashable; part of the compiled function).

  Attributes:
    policy_loss: ``ppo`` / ``gspo`` / ``cispo``.
    clip_low, clip_high, clip_c: clip ranges (see ``rl.losses.policy_loss``).
    loss_agg: loss aggregation mode.
    agg_norm: the constant of ``seq-mean-token-sum-norm`` (the completion length).
    kl_estimator: ``k1`` / ``k2`` / ``k3`` / ``abs``.
    use_kl: whether the KL term (and the reference) is used at all.
    epochs: passes over the batch.
    num_minibatches: optimizer updates per pass.
    grad_accum: micro-batches per minibatch.
    logprob_impl: the ``fused`` streaming kernel (default) or ``full`` logits for log-probs/entropy.
    prompt_group: rows per shared prompt (``models.logprobs.completion_stats``; 1: none), and the
      unit the minibatch shuffle deals out: with ``num_minibatches > 1`` whole runs of this many
      rows are shuffled, so every minibatch holds whole groups.
  """

  policy_loss: str = "ppo"
  clip_low: float = 0.2
  clip_high: float = 0.28
  clip_c: float | None = 3.0
  loss_agg: str = "token-mean"
  agg_norm: float | None = None
  kl_estimator: str = "k3"
  use_kl: bool = True
  epochs: int = 1
  num_minibatches: int = 1
  grad_accum: int = 1
  logprob_impl: str = "fused"
  prompt_group: int = 1


def minibatch_order(rng: jax.Array, rows: int, num_minibatches: int, group: int = 1) -> jax.Array:
  """The row order of one pass over ``rows`` rows split into ``num_minibatches`` minibatches.

  One minibatch: the rows as they are.  Otherwise a random permutation; with ``group`` > 1 of
  whole runs of ``group`` contiguous rows (a GRPO group), each kept in order, so that a
  minibatch holds whole groups and can run each group's prompt once.
  """
  if num_minibatches == 1:
    return jnp.arange(rows)
  if group <= 1:
    return jax.random.permutation(rng, rows)
  if rows % group:
    raise ValueError(f"{rows} rows do not split into groups of {group}")
  groups = jax.random.permutation(rng, rows // group)
  return (groups[:, None] * group + jnp.arange(group)[None, :]).reshape(-1)


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def _rules(mesh: Mesh | None):
  import contextlib

  return contextlib.nullcontext() if mesh is None else sharding.use_rules(mesh, sharding.TRAIN_RULES)


def _split_rows(tree: Any, parts: int) -> Any:
  """``[B, ...] -> [parts, B // parts, ...]`` for every leaf."""
  return jax.tree.map(lambda x: x.reshape((parts, x.shape[0] // parts) + x.shape[1:]), tree)


def _num_seqs(mask: jax.Array) -> jax.Array:
  return jnp.maximum(jnp.sum(jnp.any(mask, axis=-1)), 1).astype(jnp.float32)


def _num_tokens(mask: jax.Array) -> jax.Array:
  return jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)


def _zeros_f32(params: Any) -> Any:
  """Gradient accumulators: float32 whatever the parameter dtype (bf16 sums lose the small terms)."""
  return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)


def _add_f32(acc: Any, grads: Any) -> Any:
  return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


# Metrics combined across micro-batches by max rather than by token-weighted mean.
_MAX_METRICS = ("ratio_max",)


# ----------------------------------------------------------------------------
# SFT
# ----------------------------------------------------------------------------


def make_sft_step(mesh: Mesh | None):
  """A jitted ``(state, SequenceBatch) -> (state, metrics)`` cross-entropy step (state donated)."""

  def step(state: TrainState, batch: SequenceBatch):
    def loss_fn(params):
      model = nnx.merge(state.graphdef, params)
      with _rules(mesh):
        logp = completion_logprobs(
          model, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens, batch.completion_mask
        )
      return -aggregate(logp, batch.completion_mask, "token-mean")

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    state, opt_metrics = apply_gradients(state, grads, loss)
    return state, {"sft_loss": loss, **opt_metrics}

  return jax.jit(step, donate_argnums=(0,))


# ----------------------------------------------------------------------------
# Scoring: behaviour and reference log-probs
# ----------------------------------------------------------------------------


def _map_rows(fn, batch: Any, micro_batches: int):
  """``fn(batch)`` computed over ``micro_batches`` row chunks in sequence (``lax.map``), results re-joined.

  Peak activation memory is that of one chunk: the rollout batch of a large run does not
  fit one forward pass (``B x (P + M)`` activations and ``[B, M, V]`` logits).
  """
  if micro_batches == 1:
    return fn(batch)
  out = jax.lax.map(fn, _split_rows(batch, micro_batches))
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)


def make_score_fn(
  graphdef: Any,
  mesh: Mesh | None,
  *,
  use_reference: bool,
  logprob_impl: str = "fused",
  micro_batches: int = 1,
  reference_offload: str = "none",
  use_policy: bool = True,
  prompt_group: int = 1,
):
  """A jitted ``(params, ref_params, batch, temperature) -> (old_logprobs, ref_logprobs)``.

  Both are teacher-forced at the sampling temperature, over ``micro_batches`` row chunks
  in sequence (the same rows per forward pass as the update's micro-batches).  Without a
  reference the second output is zeros (and no reference forward pass is compiled); with
  ``use_policy=False`` the first is (the caller has the behaviour log-probs already).  The
  reference may be stored in another form (``models.reference``: bf16, int8, host memory); it is
  made dense in the policy's dtypes once, before the chunks.  ``prompt_group`` > 1: each run of
  that many contiguous rows shares its prompt, run once (``models.logprobs.completion_stats``).
  """

  def logprobs(model, *args):
    if logprob_impl == "full":
      return completion_logprobs(model, *args, prompt_group=prompt_group)
    return completion_stats(model, *args, impl=logprob_impl, prompt_group=prompt_group)[0]

  def score(params, ref_params, batch: SequenceBatch, temperature):
    if use_reference:
      ref_params = dense_reference(ref_params, params, offload=reference_offload)

    def chunk(rows):
      b, temp = rows
      args = (b.prompt_tokens, b.prompt_mask, b.completion_tokens, b.completion_mask, temp)
      zeros = jnp.zeros(b.completion_tokens.shape, jnp.float32)
      with _rules(mesh):
        old = logprobs(nnx.merge(graphdef, params), *args) if use_policy else zeros
        if use_reference:
          ref = logprobs(nnx.merge(graphdef, jax.lax.stop_gradient(ref_params)), *args)
        else:
          ref = zeros
      return old, ref

    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), batch.prompt_tokens.shape[:1])
    return _map_rows(chunk, (batch, temperature), micro_batches)

  return jax.jit(score)


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
  """Static settings of the advantage stage.

  Attributes:
    estimator: ``grpo`` / ``drgrpo`` / ``rloo`` / ``reinforce_baseline`` (group-relative,
      one advantage per sequence) or ``gae`` (per token, from the value model).
    group_size: samples per prompt (rows of a group are contiguous).
    max_len: the completion length limit (for overlong shaping).
    overlong: ``none`` / ``penalty`` / ``mask`` (see ``rl.controllers.overlong_shaping``).
    overlong_buffer: width of the soft-penalty zone in tokens.
    shape_rewards: quantile-clip and EMA-standardise the rewards (advantage path only).
    reward_clip_low, reward_clip_high: the clipping quantiles.
    reward_ema: the shaping standardises with running (EMA) statistics.  GRPO then centres each
      group and divides by the running std instead of the group's own: the standardisation is an
      affine map of the whole batch, which a per-group std division would cancel exactly.
    kl_estimator: estimator of the per-token KL used in the reward and in the metrics' tails.
    use_reference: whether there is a reference policy; without one the reference log-probs are
      zeros, so no KL to it is computed or logged (``kl_prompt_*`` would measure against zeros).
    gamma, lam: GAE discount and lambda.
  """

  estimator: str = "grpo"
  group_size: int = 2
  max_len: int = 1
  overlong: str = "none"
  overlong_buffer: int = 4
  shape_rewards: bool = False
  reward_clip_low: float = 0.0
  reward_clip_high: float = 1.0
  reward_ema: bool = False
  kl_estimator: str = "k1"
  use_reference: bool = True
  gamma: float = 0.99
  lam: float = 0.95


@flax.struct.dataclass
class AdvantageInputs:
  """Everything the advantage stage reads (``B`` rollout rows, ``M`` completion tokens).

  Attributes:
    rewards: float32 ``[B]`` raw rewards from the verifier / reward sources.
    lengths: int32 ``[B]`` completion lengths.
    truncated: bool ``[B]``, the completion hit the length limit.
    completion_mask: bool ``[B, M]``.
    old_logprobs: float32 ``[B, M]`` behaviour log-probs.
    ref_logprobs: float32 ``[B, M]`` reference log-probs (zeros without a reference).
    values: float32 ``[B, M]`` value predictions at rollout time (zeros without a value model).
  """

  rewards: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  completion_mask: jax.Array
  old_logprobs: jax.Array
  ref_logprobs: jax.Array
  values: jax.Array


@flax.struct.dataclass
class AdvantageOutput:
  """Advantages ``[B, M]`` (per token; group estimators broadcast theirs), returns ``[B, M]``
  (GAE targets of the value model; zeros otherwise), and the loss mask ``[B, M]`` (the
  completion mask minus rows excluded by overlong masking)."""

  advantages: jax.Array
  returns: jax.Array
  loss_mask: jax.Array


def _per_prompt_kl_tail(old_logp, ref_logp, mask, group_size: int) -> dict[str, jax.Array]:
  """Per-sequence token-mean k3 KL to the reference, averaged per prompt; mean, p95 and max over prompts,
  and the per-sequence values themselves (``kl_per_seq`` ``[B]``: the sample replay's KL rows)."""
  k3 = kl_estimate(old_logp, ref_logp, "k3")
  per_seq = jnp.sum(jnp.where(mask, k3, 0.0), axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)
  per_prompt = per_seq.reshape(-1, group_size).mean(axis=1)
  return {
    "kl_prompt_mean": jnp.mean(per_prompt),
    "kl_prompt_p95": jnp.quantile(per_prompt, 0.95),
    "kl_prompt_max": jnp.max(per_prompt),
    "kl_per_seq": per_seq,
  }


def _explained_variance(values, returns, mask) -> jax.Array:
  """``1 - Var(returns - values) / Var(returns)`` over valid tokens (1 = perfect, <= 0 = useless)."""
  var_ret = masked_var(returns, mask, unbiased=False)
  return 1.0 - masked_var(returns - values, mask, unbiased=False) / jnp.maximum(var_ret, 1e-8)


def make_advantage_fn(settings: AdvantageSettings):
  """The jitted advantage stage.

  ``(inputs, ctl, coefs) -> (AdvantageOutput, ctl, metrics)`` with ``ctl`` a
  :class:`~mimo_jax.rl.controllers.ControllerState` (its reward-shaping statistics are
  advanced) and ``coefs`` the step's :class:`~mimo_jax.rl.controllers.DynamicCoefs`.
  Order: raw reward -> overlong shaping -> quantile clip + EMA standardisation ->
  minus the KL penalty (when the KL is in the reward) -> the estimator.  Logged rewards are
  the raw ones; this stage only feeds the advantages.
  """
  s = settings

  def advantages(inputs: AdvantageInputs, ctl: ControllerState, coefs: DynamicCoefs):
    mask = inputs.completion_mask.astype(bool)
    raw = inputs.rewards.astype(jnp.float32)
    rewards, keep = overlong_shaping(
      raw, inputs.lengths, inputs.truncated, max_len=s.max_len, buffer=s.overlong_buffer, mode=s.overlong
    )
    metrics = {"overlong_penalty": jnp.mean(rewards - raw), "frac_rows_masked": 1.0 - jnp.mean(keep)}
    if s.shape_rewards:
      rewards, mean, var = shape_rewards(
        rewards,
        ctl.reward_mean,
        ctl.reward_var,
        ctl.reward_seen,
        clip_low=s.reward_clip_low,
        clip_high=s.reward_clip_high,
        decay=coefs.reward_decay,
      )
      ctl = ctl.replace(reward_mean=mean, reward_var=var, reward_seen=jnp.ones((), bool))
      metrics.update(reward_ema_mean=mean, reward_ema_std=jnp.sqrt(var))
    kl_tok = jnp.where(mask, kl_estimate(inputs.old_logprobs, inputs.ref_logprobs, s.kl_estimator), 0.0)
    loss_mask = mask & keep[:, None]
    if s.estimator == "gae":
      # Token rewards: the KL penalty on every token, the sequence reward on the last one.
      last = jax.nn.one_hot(jnp.maximum(inputs.lengths - 1, 0), mask.shape[1], dtype=jnp.float32)
      token_rewards = rewards[:, None] * last - coefs.kl_reward_coef * kl_tok
      adv, returns = gae(token_rewards, inputs.values, mask, gamma=s.gamma, lam=s.lam)
      adv = masked_whiten(adv, loss_mask)
      adv = jnp.where(loss_mask, adv, 0.0)
      metrics["explained_variance"] = _explained_variance(inputs.values, returns, mask)
      metrics["value_pred_mean"] = masked_mean(inputs.values, mask)
      metrics["return_mean"] = masked_mean(returns, mask)
    else:
      seq_rewards = rewards - coefs.kl_reward_coef * jnp.sum(kl_tok, axis=1)
      # With EMA standardisation GRPO's scale is the running std (the rewards are already divided by
      # it): centring alone; the group's own std would undo the shaping.
      mode = "drgrpo" if s.estimator == "grpo" and s.shape_rewards and s.reward_ema else s.estimator
      seq_adv = group_advantages(seq_rewards, s.group_size, mode=mode)
      adv = jnp.where(loss_mask, seq_adv[:, None], 0.0)
      returns = jnp.zeros_like(adv)
    grouped = raw.reshape(-1, s.group_size)
    metrics.update(
      adv_abs_mean=masked_mean(jnp.abs(adv), loss_mask),
      frac_groups_all_equal=jnp.mean(jnp.all(grouped == grouped[:, :1], axis=1)),
      shaped_reward_mean=jnp.mean(rewards),
    )
    if s.use_reference:
      metrics.update(_per_prompt_kl_tail(inputs.old_logprobs, inputs.ref_logprobs, mask, s.group_size))
    return AdvantageOutput(advantages=adv, returns=returns, loss_mask=loss_mask), ctl, metrics

  return jax.jit(advantages)


# ----------------------------------------------------------------------------
# Policy update
# ----------------------------------------------------------------------------


def policy_objective(
  params: Any, graphdef: Any, mb: PolicyBatch, coefs: DynamicCoefs, num_tokens, num_seqs, settings: UpdateSettings
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Policy-gradient loss + KL penalty - entropy bonus for one micro-batch.

  Normalisers are the *minibatch's* token and sequence counts, so the sum of
  micro-batch losses (and gradients) equals the loss of the whole minibatch.
  """
  model = nnx.merge(graphdef, params)
  logp, entropy = completion_stats(
    model,
    mb.prompt_tokens,
    mb.prompt_mask,
    mb.completion_tokens,
    mb.completion_mask,
    mb.temperature,
    impl=settings.logprob_impl,
    prompt_group=settings.prompt_group,
  )
  mask = mb.completion_mask
  pg_loss, pg_metrics = policy_loss(
    logp,
    mb.old_logprobs,
    mb.advantages,
    mask,
    mode=settings.policy_loss,
    clip_low=settings.clip_low if coefs.clip_low is None else coefs.clip_low,
    clip_high=settings.clip_high if coefs.clip_high is None else coefs.clip_high,
    clip_c=settings.clip_c,
    agg=settings.loss_agg,
    norm=settings.agg_norm,
    num_tokens=num_tokens,
    num_seqs=num_seqs,
  )
  tokens_share = jnp.sum(mask) / num_tokens  # this micro-batch's share of the minibatch's tokens
  entropy_term = aggregate(entropy, mask, "token-mean", num_tokens=num_tokens)
  loss = pg_loss - coefs.entropy_coef * entropy_term
  metrics = {k: (v if k in _MAX_METRICS else v * tokens_share) for k, v in pg_metrics.items()}
  if settings.use_kl:
    kl = kl_estimate(logp, mb.ref_logprobs, settings.kl_estimator)
    kl_term = aggregate(kl, mask, settings.loss_agg, norm=settings.agg_norm, num_tokens=num_tokens, num_seqs=num_seqs)
    loss = loss + coefs.kl_coef * kl_term
    metrics["kl_loss"] = kl_term
    metrics["kl_k3"] = aggregate(kl_estimate(logp, mb.ref_logprobs, "k3"), mask, "token-mean", num_tokens=num_tokens)
  metrics.update(pg_loss=pg_loss, entropy=entropy_term, loss=loss)
  return loss, metrics


def make_update_fn(mesh: Mesh | None, settings: UpdateSettings):
  """The whole update phase as one jitted, state-donating function.

  ``(state, batch, coefs) -> (state, metrics)``: ``settings.epochs`` passes, each
  shuffling the batch (with a key split from ``state.rng``; whole groups of
  ``settings.prompt_group`` rows, see :func:`minibatch_order`) into
  ``settings.num_minibatches`` minibatches, each accumulated over
  ``settings.grad_accum`` micro-batches, each minibatch one guarded optimizer update.
  Metrics are averaged over the updates (maxima for ``*_max``).
  """
  grad_fn = jax.value_and_grad(policy_objective, has_aux=True)

  def minibatch_update(state: TrainState, coefs: DynamicCoefs, mb: PolicyBatch):
    num_tokens, num_seqs = _num_tokens(mb.completion_mask), _num_seqs(mb.completion_mask)
    micro = _split_rows(mb, settings.grad_accum)

    def accumulate(grads, micro_batch):
      with _rules(mesh):
        (loss, metrics), g = grad_fn(state.params, state.graphdef, micro_batch, coefs, num_tokens, num_seqs, settings)
      return _add_f32(grads, g), metrics

    zeros = _zeros_f32(state.params)
    grads, metrics = jax.lax.scan(accumulate, zeros, micro)
    metrics = {k: (jnp.max(v) if k in _MAX_METRICS else jnp.sum(v)) for k, v in metrics.items()}
    state, opt_metrics = apply_gradients(
      state, grads, metrics["loss"], lr_mult=coefs.lr_mult, clip_norm=coefs.clip_norm
    )
    return state, {**metrics, **opt_metrics}

  def update(state: TrainState, batch: PolicyBatch, coefs: DynamicCoefs):
    B = batch.advantages.shape[0]

    def epoch(state, _):
      rng, perm_rng = jax.random.split(state.rng)
      state = state.replace(rng=rng)
      perm = minibatch_order(perm_rng, B, settings.num_minibatches, settings.prompt_group)
      minibatches = _split_rows(jax.tree.map(lambda x: x[perm], batch), settings.num_minibatches)
      return jax.lax.scan(lambda s, mb: minibatch_update(s, coefs, mb), state, minibatches)

    state, metrics = jax.lax.scan(epoch, state, None, length=settings.epochs)
    metrics = {k: (jnp.max(v) if k in _MAX_METRICS else jnp.mean(v)) for k, v in metrics.items()}
    return state, metrics

  return jax.jit(update, donate_argnums=(0,))


# ----------------------------------------------------------------------------
# Value model (PPO)
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class ValueBatch:
  """A rollout batch with value targets (``B`` rows).

  Attributes:
    prompt_tokens: int32 ``[B, P]``.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``.
    completion_mask: bool ``[B, M]``.
    old_values: float32 ``[B, M]``, the value model's predictions at rollout time.
    returns: float32 ``[B, M]``, the GAE returns (targets).
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array
  old_values: jax.Array
  returns: jax.Array


@dataclasses.dataclass(frozen=True)
class ValueSettings:
  """Static settings of one value-model pass.

  Attributes:
    clip: value clip range (see ``rl.losses.value_loss``).
    loss_agg: aggregation mode.
    agg_norm: the constant of ``seq-mean-token-sum-norm``.
    num_minibatches: optimizer updates per pass.
    grad_accum: micro-batches per minibatch.
    prompt_group: rows per shared prompt, and the unit of the minibatch shuffle (as
      :class:`UpdateSettings`').
  """

  clip: float = 0.2
  loss_agg: str = "token-mean"
  agg_norm: float | None = None
  num_minibatches: int = 1
  grad_accum: int = 1
  prompt_group: int = 1


def completion_values(
  value_model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, prompt_group: int = 1
) -> jax.Array:
  """Value predictions ``[B, M]`` for the state *before* each completion token (0 where masked).

  Position ``P - 1 + t`` has seen the prompt and the first ``t`` completion tokens, the
  state in which token ``t`` is chosen (the same positions that predict it).  ``prompt_group``
  > 1: each run of that many rows shares one prompt, run once
  (:func:`mimo_jax.models.logprobs.completion_hidden`).
  """
  hidden = completion_hidden(value_model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, prompt_group)
  return jnp.where(completion_mask, value_model.values_from_hidden(hidden), 0.0)


def make_value_fn(graphdef: Any, mesh: Mesh | None, *, micro_batches: int = 1, prompt_group: int = 1):
  """A jitted ``(value_params, SequenceBatch) -> values [B, M]`` over ``micro_batches`` row chunks
  (``prompt_group``: rows per shared prompt, as in :func:`make_score_fn`)."""

  def values(params, batch: SequenceBatch):
    def chunk(b: SequenceBatch):
      with _rules(mesh):
        model = nnx.merge(graphdef, params)
        return completion_values(
          model, b.prompt_tokens, b.prompt_mask, b.completion_tokens, b.completion_mask, prompt_group
        )

    return _map_rows(chunk, batch, micro_batches)

  return jax.jit(values)


def make_value_update_fn(mesh: Mesh | None, settings: ValueSettings):
  """One jitted, state-donating pass of clipped value-loss updates: ``(state, ValueBatch) -> (state, metrics)``.

  The batch is shuffled (key from ``state.rng``) into ``num_minibatches`` minibatches,
  each accumulated over ``grad_accum`` micro-batches with the minibatch's global token
  and sequence counts.  The trainer calls it as many times per RL step as the value
  update-frequency controller asks (the pass count is a host integer: no recompiles).
  """

  def objective(params, graphdef, mb: ValueBatch, num_tokens, num_seqs):
    model = nnx.merge(graphdef, params)
    values = completion_values(
      model, mb.prompt_tokens, mb.prompt_mask, mb.completion_tokens, mb.completion_mask, settings.prompt_group
    )
    loss, metrics = value_loss(
      values,
      mb.old_values,
      mb.returns,
      mb.completion_mask,
      clip=settings.clip,
      agg=settings.loss_agg,
      norm=settings.agg_norm,
      num_tokens=num_tokens,
      num_seqs=num_seqs,
    )
    share = jnp.sum(mb.completion_mask) / num_tokens
    return loss, {"value_loss": loss, **{k: v * share for k, v in metrics.items()}}

  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def minibatch_update(state: TrainState, mb: ValueBatch):
    num_tokens, num_seqs = _num_tokens(mb.completion_mask), _num_seqs(mb.completion_mask)

    def accumulate(grads, micro_batch):
      with _rules(mesh):
        (_, metrics), g = grad_fn(state.params, state.graphdef, micro_batch, num_tokens, num_seqs)
      return _add_f32(grads, g), metrics

    zeros = _zeros_f32(state.params)
    grads, metrics = jax.lax.scan(accumulate, zeros, _split_rows(mb, settings.grad_accum))
    metrics = {k: jnp.sum(v) for k, v in metrics.items()}
    state, opt_metrics = apply_gradients(state, grads, metrics["value_loss"])
    return state, {**metrics, **{f"value_{k}": v for k, v in opt_metrics.items()}}

  def update(state: TrainState, batch: ValueBatch):
    B = batch.returns.shape[0]
    rng, perm_rng = jax.random.split(state.rng)
    state = state.replace(rng=rng)
    perm = minibatch_order(perm_rng, B, settings.num_minibatches, settings.prompt_group)
    minibatches = _split_rows(jax.tree.map(lambda x: x[perm], batch), settings.num_minibatches)
    state, metrics = jax.lax.scan(minibatch_update, state, minibatches)
    return state, {k: jnp.mean(v) for k, v in metrics.items()}

  return jax.jit(update, donate_argnums=(0,))
