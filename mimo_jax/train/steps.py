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
from mimo_jax.models.logprobs import completion_logprobs, completion_stats
from mimo_jax.rl.advantages import group_advantages
from mimo_jax.rl.kl import kl_estimate
from mimo_jax.rl.losses import aggregate, policy_loss
from mimo_jax.train.state import TrainState, apply_gradients

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
    advantages: float32 ``[B]``, one per sequence.
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


@flax.struct.dataclass
class LossCoefs:
  """Dynamic loss coefficients (controllers may change them every step without recompiling)."""

  kl_coef: jax.Array
  entropy_coef: jax.Array


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
    logprob_impl: ``full`` logits or the ``fused`` streaming kernel for log-probs/entropy.
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
  logprob_impl: str = "full"


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


def make_score_fn(graphdef: Any, mesh: Mesh | None, *, use_reference: bool, logprob_impl: str = "full"):
  """A jitted ``(params, ref_params, batch, temperature) -> (old_logprobs, ref_logprobs)``.

  Both are teacher-forced at the sampling temperature.  Without a reference the
  second output is zeros (and no reference forward pass is compiled).
  """

  def logprobs(model, *args):
    if logprob_impl == "full":
      return completion_logprobs(model, *args)
    return completion_stats(model, *args, impl=logprob_impl)[0]

  def score(params, ref_params, batch: SequenceBatch, temperature):
    args = (batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens, batch.completion_mask, temperature)
    with _rules(mesh):
      old = logprobs(nnx.merge(graphdef, params), *args)
      if use_reference:
        ref = logprobs(nnx.merge(graphdef, jax.lax.stop_gradient(ref_params)), *args)
      else:
        ref = jnp.zeros_like(old)
    return old, ref

  return jax.jit(score)


def make_advantage_fn(group_size: int, mode: str):
  """A jitted ``rewards [B] -> (advantages [B], metrics)`` (group-relative estimators)."""

  def advantages(rewards):
    adv = group_advantages(rewards, group_size, mode=mode)
    grouped = rewards.reshape(-1, group_size)
    solved_all = jnp.mean(jnp.all(grouped == grouped[:, :1], axis=1))
    return adv, {"adv_abs_mean": jnp.mean(jnp.abs(adv)), "frac_groups_all_equal": solved_all}

  return jax.jit(advantages)


# ----------------------------------------------------------------------------
# Policy update
# ----------------------------------------------------------------------------


def policy_objective(
  params: Any, graphdef: Any, mb: PolicyBatch, coefs: LossCoefs, num_tokens, num_seqs, settings: UpdateSettings
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
  )
  mask = mb.completion_mask
  pg_loss, pg_metrics = policy_loss(
    logp,
    mb.old_logprobs,
    mb.advantages,
    mask,
    mode=settings.policy_loss,
    clip_low=settings.clip_low,
    clip_high=settings.clip_high,
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
  shuffling the batch (with a key split from ``state.rng``) into
  ``settings.num_minibatches`` minibatches, each accumulated over
  ``settings.grad_accum`` micro-batches, each minibatch one guarded optimizer update.
  Metrics are averaged over the updates (maxima for ``*_max``).
  """
  grad_fn = jax.value_and_grad(policy_objective, has_aux=True)

  def minibatch_update(state: TrainState, coefs: LossCoefs, mb: PolicyBatch):
    num_tokens, num_seqs = _num_tokens(mb.completion_mask), _num_seqs(mb.completion_mask)
    micro = _split_rows(mb, settings.grad_accum)

    def accumulate(grads, micro_batch):
      with _rules(mesh):
        (loss, metrics), g = grad_fn(state.params, state.graphdef, micro_batch, coefs, num_tokens, num_seqs, settings)
      return jax.tree.map(jnp.add, grads, g), metrics

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, metrics = jax.lax.scan(accumulate, zeros, micro)
    metrics = {k: (jnp.max(v) if k in _MAX_METRICS else jnp.sum(v)) for k, v in metrics.items()}
    state, opt_metrics = apply_gradients(state, grads, metrics["loss"])
    return state, {**metrics, **opt_metrics}

  def update(state: TrainState, batch: PolicyBatch, coefs: LossCoefs):
    B = batch.advantages.shape[0]

    def epoch(state, _):
      rng, perm_rng = jax.random.split(state.rng)
      state = state.replace(rng=rng)
      perm = jax.random.permutation(perm_rng, B) if settings.num_minibatches > 1 else jnp.arange(B)
      minibatches = _split_rows(jax.tree.map(lambda x: x[perm], batch), settings.num_minibatches)
      return jax.lax.scan(lambda s, mb: minibatch_update(s, coefs, mb), state, minibatches)

    state, metrics = jax.lax.scan(epoch, state, None, length=settings.epochs)
    metrics = {k: (jnp.max(v) if k in _MAX_METRICS else jnp.mean(v)) for k, v in metrics.items()}
    return state, metrics

  return jax.jit(update, donate_argnums=(0,))
