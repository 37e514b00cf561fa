"""The learner seam: one ``Experience`` in, one compiled, state-donating ``learn`` program out.

::

    RolloutWorker (host + sampler)            Learner (one jitted program, state donated)
    prompts -> generate -> decode -> rewards  -> Experience -> learn(state, exp, step, poison)
                                                 score (behaviour + reference log-probs) -> values
                                                 -> dynamic coefficients -> advantages
                                                 -> policy update (epochs x minibatches x micro-batches)
                                                 -> critic passes (as many as its controller asks)
                                                 -> controllers
                                              -> (LearnerState, metrics)

Everything the learner reads from a rollout is one :class:`Experience` pytree; everything
it owns on device is one :class:`LearnerState` pytree.  :func:`build_learner` is a pure
function of the configuration: the trainer, ``--dry_run`` and the tests build the same
program from it, so they cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from mimo_jax import multihost, sharding, xla_defaults
from mimo_jax.config import Config
from mimo_jax.models.config import ModelConfig
from mimo_jax.models.logprobs import shares_prompts
from mimo_jax.optim import TrainState, make_optimizer
from mimo_jax.rl.controllers import (
  ControllerSettings,
  ControllerState,
  StepSignals,
  dynamic_coefs,
  init_controllers,
  update_controllers,
)
from mimo_jax.rl.importance import behaviour_gap, importance_weights
from mimo_jax.train.ledger import FlopCounter, Ledger
from mimo_jax.train.steps import (
  AdvantageInputs,
  AdvantageSettings,
  PolicyBatch,
  SequenceBatch,
  UpdateSettings,
  ValueBatch,
  ValueSettings,
  make_advantage_fn,
  make_score_fn,
  make_update_fn,
  make_value_fn,
  make_value_update_fn,
)

# ----------------------------------------------------------------------------
# The two pytrees of the seam
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class Experience:
  """One rollout batch, the only thing that passes from rollout to learner (``B`` rows, ``P``
  prompt and ``M`` completion tokens; rows of a prompt's group are contiguous, with equal
  ``prompt_tokens`` and ``prompt_mask``: with ``--share_prompts`` the learner runs each group's
  prompt once, from its first row).

  Attributes:
    prompt_tokens: int32 ``[B, P]``, left-padded.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``, right-padded.
    completion_mask: bool ``[B, M]``, the generated tokens (stop token included).
    lengths: int32 ``[B]`` completion lengths.
    truncated: bool ``[B]``, the completion hit the length limit.
    rewards: float32 ``[B]``, the raw mixed reward (what is logged).
    reward_components: ``{name: float32 [B]}``, each reward source's raw value.
    logprobs: float32 ``[B, M]``, the sampled tokens' log-probs under the full softmax at the row's
      temperature, recorded by the sampler (what the learner's behaviour pass recomputes, to rounding,
      when the weights that generated are the learner's: ``--behaviour_logprobs``).
    sampler_logprobs: float32 ``[B, M]``, the sampler's own log-probs of the sampled tokens
      (under the truncated top-k/top-p distribution it drew from).
    temperature: float32 ``[B]``, the sampling temperature of each row.
    top_k: int32 ``[B]``, the top-k of each row (0: off).
    top_p: float32 ``[B]``, the top-p of each row (1: off).
    policy_version: int32 ``[B]``, the learner version that generated each row: the RL steps its
      weights had been trained through (the learner's staleness of a row is its step minus this).
    prompt_id: int32 ``[B]``, a stable 31-bit id of each row's prompt (from its content hash).
    batch_id: int32 ``[B]``, the generation batch each row came from.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  rewards: jax.Array
  reward_components: dict[str, jax.Array]
  logprobs: jax.Array
  sampler_logprobs: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  policy_version: jax.Array
  prompt_id: jax.Array
  batch_id: jax.Array

  @property
  def sequences(self) -> SequenceBatch:
    return SequenceBatch(self.prompt_tokens, self.prompt_mask, self.completion_tokens, self.completion_mask)


class LearnerState(flax.struct.PyTreeNode):
  """All device state of learning, donated into every ``learn`` call.

  Attributes:
    policy: the policy's ``TrainState`` (params, optimizer state, its RNG, update counters).
    controllers: every controller's state (KL, entropy, reward shaping, phase, critic passes).
    reference: the frozen reference policy's params (None without a KL term); never updated.
    value: the critic's ``TrainState`` (None without a value model).
  """

  policy: TrainState
  controllers: ControllerState
  reference: Any = None
  value: TrainState | None = None

  # Read-only conveniences: the policy's fields the loop reports.
  @property
  def params(self) -> Any:
    return self.policy.params

  @property
  def step(self) -> jax.Array:
    return self.policy.step

  @property
  def skipped(self) -> jax.Array:
    return self.policy.skipped

  @property
  def lr_scale(self) -> jax.Array:
    return self.policy.lr_scale


# ----------------------------------------------------------------------------
# Settings derived from the configuration (one place, used by the loop and the dry run)
# ----------------------------------------------------------------------------


def uses_kl(cfg: Config) -> bool:
  return cfg.algo.kl_coef > 0


def update_settings(cfg: Config, mesh: Mesh | None = None) -> UpdateSettings:
  a = cfg.algo
  return UpdateSettings(
    policy_loss=a.policy_loss,
    clip_low=a.clip_low,
    clip_high=a.clip_high,
    clip_c=a.clip_c if a.policy_loss == "ppo" else None,
    loss_agg=a.loss_agg,
    agg_norm=float(cfg.rollout.max_new_tokens),
    kl_estimator=a.kl_estimator,
    use_kl=uses_kl(cfg) and a.kl_in == "loss",
    epochs=a.ppo_epochs,
    num_minibatches=a.num_minibatches,
    grad_accum=a.grad_accum,
    logprob_impl=a.logprob_impl,
    prompt_group=prompt_group(cfg, mesh),
  )


def prompt_group(cfg: Config, mesh: Mesh | None = None, grad_accum: int | None = None) -> int:
  """Rows per shared prompt in the learner's passes, score and update alike (``--share_prompts``; 1:
  every row runs its own prompt), at ``cfg``'s ``--grad_accum`` or at ``grad_accum``.

  The rollout lays a prompt's ``num_samples`` rows out contiguously with equal prompt tokens
  (:class:`Experience`), so the learner can run each prompt once: in every pass whose row chunks
  (``num_minibatches x grad_accum`` micro-batches) hold whole groups that split over ``mesh``'s
  batch shards as the rows do.  The updates' minibatch shuffle then deals out whole groups
  (``steps.minibatch_order``).  At one new token there is nothing to share (the prompt's last
  position is the only one scored).  The learner's programs decide the same at trace time
  (``models.logprobs.shares_prompts``); the compute ledger counts what this returns.
  """
  a, N = cfg.algo, cfg.rollout.num_samples
  rows = minibatch_rows(cfg) // (grad_accum or a.grad_accum)
  if not a.share_prompts or not shares_prompts(rows, cfg.rollout.max_new_tokens, N, mesh=mesh):
    return 1
  return N


def minibatch_rows(cfg: Config) -> int:
  """Rows per update minibatch: ``--prompts_per_step x --num_samples / --num_minibatches``."""
  return cfg.data.prompts_per_step * cfg.rollout.num_samples // cfg.algo.num_minibatches


def grad_accum_choices(cfg: Config, batch_shards: int) -> list[int]:
  """The ``--grad_accum`` values valid on ``batch_shards`` batch shards, ascending: those that divide the
  minibatch into micro-batches that split evenly over the shards (``config.validate``'s rule)."""
  minibatch = minibatch_rows(cfg)
  return [g for g in range(1, minibatch + 1) if minibatch % g == 0 and (minibatch // g) % batch_shards == 0]


def prompt_sharing_note(cfg: Config, mesh: Mesh | None = None) -> str | None:
  """Why the learner runs every row's own prompt although its rows come in groups that share one, and
  the ``--grad_accum`` that would run each prompt once; None when it does (or there is nothing to
  share: ``--share_prompts`` off, one sample per prompt, one new token)."""
  a, N = cfg.algo, cfg.rollout.num_samples
  if not a.share_prompts or N < 2 or cfg.rollout.max_new_tokens < 2 or prompt_group(cfg, mesh) > 1:
    return None
  minibatch = minibatch_rows(cfg)
  micro = minibatch // a.grad_accum
  shards = 1 if mesh is None else mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
  if micro % N:
    why = f"its micro-batches of {micro} rows do not hold whole groups of --num_samples={N}"
  else:
    why = f"its micro-batches of {micro} rows ({micro // N} groups of {N}) do not split into whole groups over the {shards} batch shards"
  why = (
    f"the learner runs every row's own prompt: {why} (micro-batch = --prompts_per_step x --num_samples / "
    f"(--num_minibatches x --grad_accum))"
  )
  for g in reversed([c for c in grad_accum_choices(cfg, shards) if c < a.grad_accum]):
    if prompt_group(cfg, mesh, grad_accum=g) > 1:
      return (
        f"{why}; --grad_accum={g} would run each prompt once (micro-batches of {minibatch // g} rows: more "
        f"activation memory, see --dry_run_topology)"
      )
  return f"{why}; no smaller --grad_accum would: fewer --num_minibatches or more --prompts_per_step would"


def advantage_settings(cfg: Config) -> AdvantageSettings:
  a = cfg.algo
  return AdvantageSettings(
    estimator=a.advantage,
    group_size=cfg.rollout.num_samples,
    max_len=cfg.rollout.max_new_tokens,
    overlong=a.overlong,
    overlong_buffer=a.overlong_buffer,
    shape_rewards=a.shapes_rewards,
    reward_ema=a.reward_ema > 0,
    reward_clip_low=a.reward_clip_low,
    reward_clip_high=a.reward_clip_high,
    kl_estimator=a.kl_estimator,
    use_reference=uses_kl(cfg),
    gamma=a.gae_gamma,
    lam=a.gae_lambda,
  )


def value_settings(cfg: Config, mesh: Mesh | None = None) -> ValueSettings:
  a = cfg.algo
  return ValueSettings(
    clip=a.value_clip,
    loss_agg=a.loss_agg,
    agg_norm=float(cfg.rollout.max_new_tokens),
    num_minibatches=a.num_minibatches,
    grad_accum=a.grad_accum,
    prompt_group=prompt_group(cfg, mesh),
  )


def controller_settings(cfg: Config) -> ControllerSettings:
  a = cfg.algo
  return ControllerSettings(
    # The policy's own steps: those after the critic's warm-up (the phases' budgets and the KL budget's
    # schedule run over them, as the base LR schedule does).
    total_steps=max(cfg.run.max_steps - a.value_warmup_steps, 1),
    batch_size=cfg.data.prompts_per_step * cfg.rollout.num_samples,
    kl_controller=a.kl_controller,
    kl_target=a.kl_target,
    kl_budget_start=a.kl_budget_start,
    kl_horizon=a.kl_horizon,
    kl_coef_min=a.kl_coef_min,
    kl_coef_max=a.kl_coef_max,
    entropy_controller=a.entropy_controller,
    entropy_target=a.entropy_target,
    entropy_lr=a.entropy_lr,
    entropy_coef_max=a.entropy_coef_max,
    reward_clip_low=a.reward_clip_low,
    reward_clip_high=a.reward_clip_high,
    reward_ema=a.reward_ema,
    phased=a.phase_schedule,
    phase_fracs=a.phase_fracs,
    phase_slope_threshold=a.phase_slope_threshold,
    phase_tolerance=a.phase_tolerance,
    phase_smoothing=a.phase_smoothing,
    phase_clip_mults=a.phase_clip_mults,
    phase_kl_mults=a.phase_kl_mults,
    grad_clip=cfg.optim.grad_clip,
    grad_clip_lr_linked=cfg.optim.grad_clip_mode == "lr_linked",
    value_window=max(a.value_window, 2),
    # --value_window=0: a fixed number of passes, neither raised nor lowered (the floor too).
    value_min_updates=a.value_min_updates if a.value_window else a.value_updates,
    value_max_updates=a.value_max_updates if a.value_window else a.value_updates,
    value_fast_drop=a.value_fast_drop,
  )


def is_correction(cfg: Config) -> str:
  """The importance correction in effect.

  ``--is_correction=auto``: decoupled PPO when samples can be stale; token-level TIS when the
  sampler truncates its distribution (top-k / top-p: it draws from a renormalised ``mu`` while the
  learner scores the full softmax, so ``pi / mu <= 1`` on every kept token); none otherwise.
  """
  mode = cfg.algo.is_correction
  if mode != "auto":
    return mode
  if cfg.rollout.staleness > 0:
    return "decoupled"
  if cfg.rollout.top_k > 0 or cfg.rollout.top_p < 1:
    return "tis"
  return "none"


def sampler_behaviour(cfg: Config) -> bool:
  """Whether the PPO ratio's old log-probs are the sampler's own (``--behaviour_logprobs``).

  The sampler records each token's log-prob under the full softmax at the row's temperature
  (``Experience.logprobs``, whatever top-k/top-p it then drew from): with synchronous rollout the
  weights that generated are the learner's current ones, so these are the learner's behaviour
  log-probs to rounding and its teacher-forced behaviour pass is redundant.  ``auto`` takes them
  wherever that holds; with stale samples (async rollout) the learner recomputes (the decoupled
  correction needs the current, proximal policy's).
  """
  mode = cfg.algo.behaviour_logprobs
  if mode == "recompute":
    return False
  return cfg.rollout.staleness == 0 if mode == "auto" else True


def build_ledger(cfg: Config, mesh: Mesh | None, model_cfg: ModelConfig, *, rollout_devices: int = 1) -> Ledger:
  """The compute ledger of a run with this config: FLOPs of each phase as this learner runs them
  (which passes run, which share prompts) and device-seconds on ``mesh`` (the learner's devices)
  and ``rollout_devices``."""
  group = prompt_group(cfg, mesh)
  return Ledger(
    FlopCounter.of(model_cfg),
    use_reference=uses_kl(cfg),
    use_value=cfg.algo.use_value_model,
    use_behaviour_pass=not sampler_behaviour(cfg),
    epochs=cfg.algo.ppo_epochs,
    remat=model_cfg.remat,
    fused_head=cfg.algo.logprob_impl == "fused",
    rollout_devices=rollout_devices,
    learner_devices=1 if mesh is None else mesh.devices.size,
    sample_group=cfg.rollout.num_samples,
    score_group=group,
    update_group=group,
  )


def rl_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The policy's RL optimizer: the clip threshold is injected every update (fixed or LR-linked, from
  the controllers); with the phase schedule the LR shape comes from the controllers, on a constant
  base.

  The schedule advances once per applied update, and an RL step applies ``num_minibatches x
  ppo_epochs`` of them: its warm-up and length are counted in those, so they span ``--warmup_steps``
  and ``--max_steps`` RL steps (sized in RL steps, 4 minibatches ended the warm-up at a quarter of it
  and reached the cosine's floor at a quarter of the run).  The first ``--value_warmup_steps`` RL
  steps train only the critic and apply no policy update, so the schedule spans the steps after them
  (spanning all of ``--max_steps``, it ended that many steps short of its floor)."""
  per_step = cfg.algo.num_minibatches * cfg.algo.ppo_epochs
  optim = dataclasses.replace(cfg.optim, warmup_steps=cfg.optim.warmup_steps * per_step)
  policy_steps = max(cfg.run.max_steps - cfg.algo.value_warmup_steps, 1)
  return make_optimizer(optim, policy_steps * per_step, constant=cfg.algo.phase_schedule)


def value_optimizer(cfg: Config) -> optax.GradientTransformation:
  value_optim = dataclasses.replace(cfg.optim, learning_rate=cfg.algo.value_learning_rate, warmup_steps=0)
  return make_optimizer(value_optim, max(cfg.run.max_steps, 1), constant=True)[0]


def init_controller_state(cfg: Config) -> ControllerState:
  a = cfg.algo
  return init_controllers(
    kl_coef=a.kl_coef, entropy_coef=a.entropy_coef, value_updates=a.value_updates, value_window=a.value_window
  )


# ----------------------------------------------------------------------------
# The learn program
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class Faults:
  """Fault-injection inputs of the learn program (tests provoke failures with them; a normal step passes
  :meth:`none`).

  Attributes:
    nan_advantages: bool scalar; True replaces row 0's advantages with NaN (``--debug_nan_steps``).
    lr_mult: float32 scalar multiplying the policy update's learning rate this step
      (``--debug_lr_spike_steps``; 1 otherwise).
  """

  nan_advantages: jax.Array
  lr_mult: jax.Array

  @classmethod
  def of(cls, *, nan_advantages: bool = False, lr_mult: float = 1.0) -> Faults:
    return cls(nan_advantages=jnp.bool_(nan_advantages), lr_mult=jnp.float32(lr_mult))

  @classmethod
  def none(cls) -> Faults:
    return cls.of()


@flax.struct.dataclass
class Scores:
  """The score pass's outputs over a rollout's completion tokens (float32 ``[B, M]``): the behaviour
  log-probs (the sampler's own under ``--behaviour_logprobs=sampler``), the reference's and the critic's
  values (zeros without a reference, without a critic)."""

  old_logprobs: jax.Array
  ref_logprobs: jax.Array
  values: jax.Array


@dataclasses.dataclass(frozen=True)
class Learner:
  """The compiled learn step of one configuration and the optimizers its state was built with.

  Attributes:
    learn: jitted ``(state, experience, step, faults) -> (state, metrics)``; ``state`` is
      donated.  ``step`` is the 0-based RL step (int32 scalar); ``faults`` (:class:`Faults`) are the
      fault-injection inputs for tests (``Faults.none()`` in a normal step).
    score: the same step's first part alone, jitted ``(state, experience) -> Scores`` (nothing donated).
    update: the rest, jitted ``(state, experience, scores, step, faults) -> (state, metrics)`` (``state``
      donated); ``update(state, exp, score(state, exp), step, faults)`` is ``learn``'s step as two
      programs, so the score pass can be timed alone (``--time_split=measured``).
    tx: the policy optimizer.
    schedule: its base LR schedule.
    value_tx: the critic's optimizer (None without a critic).
  """

  learn: Any
  score: Any
  update: Any
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  value_tx: optax.GradientTransformation | None


def _nan_like(tree: Any) -> Any:
  return jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), tree)


def build_learner(cfg: Config, mesh: Mesh | None, graphdef: Any, value_graphdef: Any = None) -> Learner:
  """The learner of ``cfg`` on ``mesh``: one program per RL step after the rollout.

  Args:
    cfg: the run configuration.
    mesh: the device mesh (None: unsharded).
    graphdef: the policy's static half (``nnx.split``).
    value_graphdef: the critic's static half (required with ``--use_value_model``).

  Returns:
    A :class:`Learner`.  Its program, in order: behaviour and reference log-probs of the
    rollout at its sampling temperatures, critic values, the step's dynamic coefficients,
    advantages (shaping statistics advanced), the policy update (skipped inside the program
    during ``--value_warmup_steps``), ``controllers.value_updates`` critic passes, and the
    controllers' update from the step's signals.
  """
  a = cfg.algo
  use_kl = uses_kl(cfg)
  use_value = a.use_value_model
  if use_value and value_graphdef is None:
    raise ValueError("build_learner: --use_value_model needs the value model's graphdef")
  micro = a.num_minibatches * a.grad_accum  # score and value passes over the update's micro-batch rows
  from_sampler = sampler_behaviour(cfg)
  score = make_score_fn(
    graphdef,
    mesh,
    use_reference=use_kl,
    logprob_impl=a.logprob_impl,
    micro_batches=micro,
    reference_offload=a.reference_offload,
    use_policy=not from_sampler,
    prompt_group=prompt_group(cfg, mesh),
  )
  advantages = make_advantage_fn(advantage_settings(cfg))
  upd_settings = update_settings(cfg, mesh)
  update = make_update_fn(mesh, upd_settings)
  ctl_settings = controller_settings(cfg)
  tx, schedule = rl_optimizer(cfg)
  peak = cfg.optim.learning_rate
  coefficients = functools.partial(
    dynamic_coefs,
    settings=ctl_settings,
    clip_low=a.clip_low,
    clip_high=a.clip_high,
    kl_in_reward=a.kl_in == "reward",
    use_kl=use_kl,
  )
  value_tx = value_optimizer(cfg) if use_value else None
  values_of = (
    make_value_fn(value_graphdef, mesh, micro_batches=micro, prompt_group=prompt_group(cfg, mesh))
    if use_value
    else None
  )
  value_update = make_value_update_fn(mesh, value_settings(cfg, mesh)) if use_value else None
  warmup = a.value_warmup_steps
  correction = is_correction(cfg)

  def score_rollout(state: LearnerState, exp: Experience) -> Scores:
    # ---- score: behaviour and reference log-probs, critic values
    seqs = exp.sequences
    old_logp, ref_logp = score(state.policy.params, state.reference, seqs, exp.temperature)
    if from_sampler:  # the sampler's own log-probs of its tokens: the same weights, temperature and softmax
      old_logp = jnp.where(exp.completion_mask, exp.logprobs, 0.0)
    values = values_of(state.value.params, seqs) if use_value else jnp.zeros_like(old_logp)
    return Scores(old_logprobs=old_logp, ref_logprobs=ref_logp, values=values)

  def update_from(state: LearnerState, exp: Experience, scores: Scores, step: jax.Array, faults: Faults):
    old_logp, ref_logp, values = scores.old_logprobs, scores.ref_logprobs, scores.values
    # ---- coefficients and advantages
    base_lr = schedule(state.policy.step)
    # The controllers count the policy's own steps: while the critic warms up the policy waits, and its
    # phases (their budgets, the warm-up's LR ramp) have not begun.
    policy_step = step - warmup
    coefs = coefficients(state.controllers, jnp.maximum(policy_step, 0), base_lr / peak, lr_scale=state.lr_scale)
    coefs = coefs.replace(lr_mult=coefs.lr_mult * faults.lr_mult)
    adv_in = AdvantageInputs(
      rewards=exp.rewards,
      lengths=exp.lengths,
      truncated=exp.truncated,
      completion_mask=exp.completion_mask,
      old_logprobs=old_logp,
      ref_logprobs=ref_logp,
      values=values,
    )
    adv_out, controllers, adv_metrics = advantages(adv_in, state.controllers, coefs)
    # A vector, not a scalar metric: the sample replay picks the prompts with the largest KL from it.
    kl_per_seq = adv_metrics.pop("kl_per_seq", None)
    adv = adv_out.advantages
    # ---- the behaviour gap: rows drawn by the sampler (stale weights, its own numerics) vs the learner
    weights, is_metrics = importance_weights(
      old_logp, exp.sampler_logprobs, exp.completion_mask, mode=correction, clip=a.is_clip
    )
    if correction != "none":
      adv = adv * weights
    staleness = (step - exp.policy_version).astype(jnp.float32)
    rollout_metrics = {
      **is_metrics,
      "sampler_learner_kl": behaviour_gap(old_logp, exp.sampler_logprobs, exp.completion_mask),
      "staleness_mean": jnp.mean(staleness),
      "staleness_max": jnp.max(staleness),
    }
    adv = adv.at[0].set(jnp.where(faults.nan_advantages, jnp.nan, adv[0]))
    batch = PolicyBatch(
      prompt_tokens=exp.prompt_tokens,
      prompt_mask=exp.prompt_mask,
      completion_tokens=exp.completion_tokens,
      completion_mask=adv_out.loss_mask,
      advantages=adv,
      old_logprobs=old_logp,
      ref_logprobs=ref_logp,
      temperature=exp.temperature,
    )
    # ---- policy update (held back while the critic warms up)
    if warmup > 0:
      waiting = step < warmup
      skipped_metrics = _nan_like(jax.eval_shape(update, state.policy, batch, coefs)[1])
      policy, train_metrics = jax.lax.cond(
        waiting,
        lambda p: (p, skipped_metrics),
        lambda p: update(p, batch, coefs),
        state.policy,
      )
    else:
      waiting = jnp.zeros((), bool)
      policy, train_metrics = update(state.policy, batch, coefs)
    # ---- critic passes: as many as the update-frequency controller set for this step
    value, value_metrics = state.value, {}
    if use_value:
      vbatch = ValueBatch(
        prompt_tokens=exp.prompt_tokens,
        prompt_mask=exp.prompt_mask,
        completion_tokens=exp.completion_tokens,
        completion_mask=exp.completion_mask,
        old_values=values,
        returns=adv_out.returns,
      )
      passes = state.controllers.value_updates
      empty = _nan_like(jax.eval_shape(value_update, state.value, vbatch)[1])
      value, value_metrics = jax.lax.fori_loop(
        0, passes, lambda _, carry: value_update(carry[0], vbatch), (state.value, empty)
      )
      value_metrics = {**value_metrics, "value_passes": passes.astype(jnp.float32), "value_lr_scale": value.lr_scale}
    # ---- controllers
    nan = jnp.float32(jnp.nan)
    # The KL to the reference (none without one: then no KL controller runs to read it).
    kl = adv_metrics.get("kl_prompt_mean", jnp.zeros((), jnp.float32))
    if upd_settings.use_kl:
      kl = jnp.where(waiting, kl, train_metrics["kl_k3"])
    signals = StepSignals(
      kl=kl,
      entropy=jnp.where(waiting, nan, train_metrics["entropy"]),
      reward_mean=jnp.mean(exp.rewards.astype(jnp.float32)),
      value_loss=value_metrics.get("value_loss", nan),
    )
    controllers = update_controllers(controllers, signals, policy_step + 1, ctl_settings)
    new_state = state.replace(policy=policy, controllers=controllers, value=value)
    metrics = {
      "train": train_metrics,
      "advantage": adv_metrics,
      "rollout": rollout_metrics,
      "value": value_metrics,
      "coefs": coefs,
      "base_lr": base_lr,
      "controllers": controllers,
      "lr_scale": policy.lr_scale,
    }
    if kl_per_seq is not None:
      metrics["kl_per_seq"] = kl_per_seq
    return new_state, metrics

  def learn(state: LearnerState, exp: Experience, step: jax.Array, faults: Faults):
    return update_from(state, exp, score_rollout(state, exp), step, faults)

  # The learner's programs compile on XLA:CPU's loop emitters (``xla_defaults.learner_compiler_options``).
  options = xla_defaults.learner_compiler_options(sharding.mesh_platform(mesh))
  return Learner(
    learn=StateLayoutJit(learn, options),
    score=jax.jit(score_rollout, compiler_options=options),
    update=StateLayoutJit(update_from, options),
    tx=tx,
    schedule=schedule,
    value_tx=value_tx,
  )


# ----------------------------------------------------------------------------
# The learner's input layout, and compiling its programs ahead
# ----------------------------------------------------------------------------


def experience_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
  """Where the learner takes an :class:`Experience` array of ``shape``: rows over the batch shards of the
  training rules, every other dim whole."""
  return sharding.named_sharding(mesh, ("batch",) + (None,) * (len(shape) - 1), sharding.TRAIN_RULES, shape)


def place_experience(exp: Experience, mesh: Mesh | None) -> Experience:
  """``exp`` in the learner's one input layout (:func:`experience_sharding`): the sampler's arrays
  wherever its program left them and the host's rewards and provenance (numpy) alike.  An array already
  there is not moved.  One layout is one program, and one that is known before the rollout exists
  (:func:`compile_ahead`).  ``mesh`` None (one device, no mesh): returned as it is."""
  if mesh is None:
    return exp
  return jax.tree.map(lambda x: multihost.put(x, experience_sharding(mesh, x.shape)), exp)


def abstract_experience(
  mesh: Mesh, *, rows: int, prompt_len: int, completion_len: int, reward_names: Sequence[str]
) -> Experience:
  """The :class:`Experience` of ``rows`` rollout rows (prompts left-padded to ``prompt_len``, completions
  ``completion_len`` long) as ``ShapeDtypeStruct``s in the layout :func:`place_experience` gives."""
  B, P, M = rows, prompt_len, completion_len

  def a(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=experience_sharding(mesh, shape))

  return Experience(
    prompt_tokens=a((B, P), jnp.int32),
    prompt_mask=a((B, P), jnp.bool_),
    completion_tokens=a((B, M), jnp.int32),
    completion_mask=a((B, M), jnp.bool_),
    lengths=a((B,), jnp.int32),
    truncated=a((B,), jnp.bool_),
    rewards=a((B,), jnp.float32),
    reward_components={name: a((B,), jnp.float32) for name in sorted(reward_names)},
    logprobs=a((B, M), jnp.float32),
    sampler_logprobs=a((B, M), jnp.float32),
    temperature=a((B,), jnp.float32),
    top_k=a((B,), jnp.int32),
    top_p=a((B,), jnp.float32),
    policy_version=a((B,), jnp.int32),
    prompt_id=a((B,), jnp.int32),
    batch_id=a((B,), jnp.int32),
  )


def compile_ahead(learner: Learner, state: Any, exp: Experience, *, split: bool) -> None:
  """Compiles the learner's step programs for ``state`` and ``exp`` (arrays or ``ShapeDtypeStruct``s;
  nothing is read or donated) into their jit caches, so a later call with arguments of these shapes and
  shardings runs without compiling.  ``split``: the two programs of ``--time_split=measured`` (``score``,
  then ``update`` on its outputs) instead of ``learn``.  The trainer runs this in a thread beside the
  first rollout, whose generate program compiles meanwhile (see ``RLRun.step``)."""
  step = jnp.int32(0)
  faults = Faults.none()
  if not split:
    learner.learn.lower(state, exp, step, faults).compile()
    return
  scored = learner.score.lower(state, exp).compile()
  scores = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), scored.out_info, scored.output_shardings
  )
  learner.update.lower(state, exp, scores, step, faults).compile()


class StateLayoutJit:
  """``jax.jit(fn, donate_argnums=0)`` for ``fn(state, *args) -> (state, out)`` whose state comes out in
  the layout it went in.

  Left to itself XLA may lay an output out differently from the donated input it replaces (seen: an
  Adam moment of a norm scale over 8 devices); the next call then compiles again, and an AOT
  executable refuses the state it returned.  The layout of the first state given (every leaf's
  ``sharding``, arrays or ``ShapeDtypeStruct``s) is constrained on the output, so one program serves
  every step.  Without named shardings (one device, no mesh) nothing is constrained.
  ``compiler_options``: ``jax.jit``'s, for this program.
  """

  def __init__(self, fn: Any, compiler_options: dict | None = None):
    self._fn, self._options = fn, compiler_options
    self._jitted = None

  def _jit(self, state: Any) -> Any:
    if self._jitted is None:
      layout = [getattr(x, "sharding", None) for x in jax.tree.leaves(state)]
      fn = self._fn
      if any(isinstance(s, NamedSharding) for s in layout):

        @functools.wraps(self._fn)  # the program keeps the step's name (compile logs, profiles)
        def fn(state, *args):
          new_state, out = self._fn(state, *args)
          leaves, treedef = jax.tree.flatten(new_state)
          leaves = [
            jax.lax.with_sharding_constraint(x, s) if isinstance(s, NamedSharding) else x
            for x, s in zip(leaves, layout, strict=True)
          ]
          return jax.tree.unflatten(treedef, leaves), out

      self._jitted = jax.jit(fn, donate_argnums=(0,), compiler_options=self._options)
    return self._jitted

  def __call__(self, state: Any, *args: Any) -> Any:
    return self._jit(state)(state, *args)

  def lower(self, state: Any, *args: Any) -> Any:
    return self._jit(state).lower(state, *args)
