"""Training-dynamics controllers: KL coefficient, entropy bonus, reward shaping, phases, value updates.

The RL-scaling reports treat these knobs as the difference between a run that keeps
improving and one that collapses.  Each controller is a pure, jit-compatible function of
arrays (tested against hand-computed values); their joint state is one pytree,
:class:`ControllerState`, that the trainer keeps in its train state and checkpoints, and
:func:`update_controllers` advances it once per RL step from the step's metrics, on the
device, without a host round trip.  :func:`loss_coefficients` turns the state into the
dynamic (non-recompiling) coefficients of the update step.

Controllers
-----------
* KL coefficient (:func:`adaptive_kl_coef`): ``fixed``; ``adaptive``, the proportional
  controller of Ziegler et al. 2019 (arXiv:1909.08593, Sec. 2.2),
  ``beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)``, bounded to
  ``[beta_min, beta_max]``; ``budget``, the same controller chasing a KL target that
  tightens linearly over training (loose early, tight late: :func:`kl_budget_target`).
* Entropy coefficient (:func:`adaptive_entropy_coef`): an integral controller that raises
  the bonus while the policy entropy is below a target and lowers it above.
* Reward shaping for the *advantage path only* (:func:`shape_rewards`): clip the batch at
  its own quantiles, then standardise with an EMA of the reward mean and variance.  The
  logged rewards stay raw (the trainer passes raw rewards to its logger).
* Overlong completions (:func:`overlong_shaping`): DAPO's soft length penalty (Yu et al.
  2025, Eq. 13) or masking truncated completions out of the loss.
* Phases (:func:`phase_update`): warm-up / main / fine-tune.  A phase ends when the slope
  of the smoothed reward stays below a threshold for a tolerance window (after at least
  half its step budget), or when its step budget (fractions, [10% / 70% / 20%]) is spent.
  :func:`phase_lr_multiplier` gives the LR shape (ramp, cosine to 10%, flat 10%).
* Gradient clipping linked to the learning rate (:func:`lr_linked_clip`).
* Decoupled value updates (:func:`value_update_count`): more value-model passes per step
  when the value loss stalls or rises over a window, fewer when it falls fast.
"""

from __future__ import annotations

import dataclasses
import math

import chex
import flax.struct
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

KL_CONTROLLERS = ("fixed", "adaptive", "budget")
ENTROPY_CONTROLLERS = ("fixed", "adaptive")
OVERLONG_MODES = ("none", "penalty", "mask")
PHASES = ("warmup", "main", "finetune")
# The adaptive controller's per-step proportional error is clipped to this (Ziegler et al.).
KL_ERROR_CLIP = 0.2


# ----------------------------------------------------------------------------
# KL coefficient
# ----------------------------------------------------------------------------


def adaptive_kl_coef(
  beta: ArrayLike,
  kl: ArrayLike,
  *,
  target: ArrayLike,
  n: float,
  horizon: float,
  beta_min: float,
  beta_max: float,
) -> jax.Array:
  """One step of the proportional KL controller.

  ``beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)``, then clipped to
  ``[beta_min, beta_max]``.  A non-finite ``kl`` leaves ``beta`` unchanged.

  Args:
    beta: current coefficient (scalar).
    kl: measured KL to the reference this step (scalar, e.g. the token-mean k3).
    target: the KL the controller steers toward (> 0).
    n: samples this step (the batch size).
    horizon: how many samples the controller takes to act fully (larger = slower).
    beta_min: lower bound.
    beta_max: upper bound.

  Returns:
    The new coefficient, float32 scalar.
  """
  beta = jnp.asarray(beta, jnp.float32)
  kl = jnp.asarray(kl, jnp.float32)
  error = jnp.clip(kl / jnp.asarray(target, jnp.float32) - 1.0, -KL_ERROR_CLIP, KL_ERROR_CLIP)
  new = jnp.clip(beta * (1.0 + error * (n / horizon)), beta_min, beta_max)
  return jnp.where(jnp.isfinite(kl), new, beta)


def kl_budget_target(frac: ArrayLike, *, start: float, end: float) -> jax.Array:
  """The KL budget at training fraction ``frac`` in [0, 1]: linear from ``start`` (loose) to ``end`` (tight)."""
  frac = jnp.clip(jnp.asarray(frac, jnp.float32), 0.0, 1.0)
  return start + frac * (end - start)


# ----------------------------------------------------------------------------
# Entropy coefficient
# ----------------------------------------------------------------------------


def adaptive_entropy_coef(
  coef: ArrayLike, entropy: ArrayLike, *, target: float, lr: float, coef_max: float
) -> jax.Array:
  """``clip(coef + lr * (target - entropy), 0, coef_max)``: more bonus while entropy is below target.

  A non-finite ``entropy`` leaves ``coef`` unchanged.
  """
  coef = jnp.asarray(coef, jnp.float32)
  entropy = jnp.asarray(entropy, jnp.float32)
  new = jnp.clip(coef + lr * (target - entropy), 0.0, coef_max)
  return jnp.where(jnp.isfinite(entropy), new, coef)


# ----------------------------------------------------------------------------
# Reward shaping (advantage path only)
# ----------------------------------------------------------------------------


def quantile_clip(x: ArrayLike, low: float, high: float) -> jax.Array:
  """Clips ``x`` [B] to the ``low`` and ``high`` quantiles of its distinct values (linear interpolation).

  On continuous values (no ties) these are the batch's own quantiles: an outlier is pulled in.
  Ties mark discrete levels (a verifier's 0/1, a rubric's grades): every level then counts once,
  so a level present in the batch is never clipped onto another one.  Plain quantiles would
  erase every success of a batch where fewer than ``1 - high`` of the samples succeed (the 95%
  quantile of 97 zeros and 3 ones is 0), the hard prompts where they matter most.
  ``low = 0, high = 1`` is the identity.
  """
  x = jnp.asarray(x, jnp.float32)
  chex.assert_rank(x, 1)
  ordered = jnp.sort(x)
  first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  distinct = jnp.sort(jnp.where(first, ordered, jnp.inf))  # the distinct values first, in order
  n = jnp.sum(first)

  def quantile(q: float) -> jax.Array:
    pos = q * (n - 1).astype(jnp.float32)
    i = jnp.floor(pos).astype(jnp.int32)
    j = jnp.minimum(i + 1, n - 1)
    frac = pos - i.astype(jnp.float32)
    return distinct[i] + frac * (distinct[j] - distinct[i])

  return jnp.clip(x, quantile(low), quantile(high))


def ema_moments(
  mean: ArrayLike, var: ArrayLike, seen: ArrayLike, x: ArrayLike, decay: ArrayLike
) -> tuple[jax.Array, jax.Array]:
  """EMA of a batch's mean and (biased) variance; the first batch (``seen`` False) initialises them.

  Returns:
    ``(mean, var)`` after ``decay * old + (1 - decay) * batch``.
  """
  x = jnp.asarray(x, jnp.float32)
  batch_mean, batch_var = jnp.mean(x), jnp.var(x)
  decay = jnp.where(jnp.asarray(seen, bool), jnp.asarray(decay, jnp.float32), 0.0)
  new_mean = decay * jnp.asarray(mean, jnp.float32) + (1.0 - decay) * batch_mean
  new_var = decay * jnp.asarray(var, jnp.float32) + (1.0 - decay) * batch_var
  return new_mean, new_var


def shape_rewards(
  rewards: ArrayLike,
  mean: ArrayLike,
  var: ArrayLike,
  seen: ArrayLike,
  *,
  clip_low: float,
  clip_high: float,
  decay: ArrayLike,
  eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Quantile-clips the batch, updates the EMA statistics, then standardises with them.

  With ``decay = 0`` the standardisation uses the batch's own statistics; with no clipping
  (``clip_low = 0``, ``clip_high = 1``) and ``decay = 0`` this is plain batch whitening.

  Args:
    rewards: raw rewards ``[B]``.
    mean: EMA mean of the clipped rewards so far.
    var: EMA variance.
    seen: whether any batch was seen (False initialises the EMA from this batch).
    clip_low: lower quantile (e.g. 0.05).
    clip_high: upper quantile (e.g. 0.95).
    decay: EMA decay (e.g. 0.9-0.95).
    eps: added to the standard deviation.

  Returns:
    ``(shaped [B], new_mean, new_var)``.
  """
  clipped = quantile_clip(rewards, clip_low, clip_high)
  new_mean, new_var = ema_moments(mean, var, seen, clipped, decay)
  shaped = (clipped - new_mean) / (jnp.sqrt(new_var) + eps)
  return shaped, new_mean, new_var


def overlong_shaping(
  rewards: ArrayLike, lengths: ArrayLike, truncated: ArrayLike, *, max_len: int, buffer: int, mode: str
) -> tuple[jax.Array, jax.Array]:
  """Length handling for completions that approach or hit the limit.

  * ``penalty`` (DAPO's soft overlong punishment): ``0`` for ``L <= max_len - buffer``,
    ``((max_len - buffer) - L) / buffer`` inside the buffer, ``-1`` at the limit; added to the reward.
  * ``mask``: truncated completions are kept out of the loss (the returned ``keep`` is False).
  * ``none``: nothing.

  Args:
    rewards: float ``[B]``.
    lengths: int ``[B]`` completion lengths.
    truncated: bool ``[B]``, the completion hit ``max_len`` without a stop token.
    max_len: the completion length limit.
    buffer: the soft-penalty zone width (tokens, >= 1).
    mode: one of :data:`OVERLONG_MODES`.

  Returns:
    ``(rewards [B], keep [B] bool)``.
  """
  if mode not in OVERLONG_MODES:
    raise ValueError(f"overlong mode must be one of {OVERLONG_MODES}, got {mode!r}")
  rewards = jnp.asarray(rewards, jnp.float32)
  truncated = jnp.asarray(truncated, bool)
  keep = jnp.ones(rewards.shape, bool)
  if mode == "penalty":
    lengths = jnp.asarray(lengths, jnp.float32)
    penalty = jnp.clip(((max_len - buffer) - lengths) / max(buffer, 1), -1.0, 0.0)
    penalty = jnp.where(truncated, -1.0, penalty)
    rewards = rewards + penalty
  elif mode == "mask":
    keep = ~truncated
  return rewards, keep


# ----------------------------------------------------------------------------
# Phases and the learning rate
# ----------------------------------------------------------------------------


def phase_lr_multiplier(
  phase: ArrayLike, step: ArrayLike, phase_start: ArrayLike, total_steps: int, fracs: tuple[float, float, float]
) -> jax.Array:
  """The LR multiplier (of the peak) for the phased schedule.

  * warm-up: linear ramp from 0 over the warm-up budget (``fracs[0] * total_steps``);
  * main: cosine from 1 down to 0.1 over the main budget, counted from the phase's start;
  * fine-tune: 0.1 (a tenth of the peak).
  """
  step = jnp.asarray(step, jnp.float32)
  since = step - jnp.asarray(phase_start, jnp.float32)
  warm_len = max(fracs[0] * total_steps, 1.0)
  main_len = max(fracs[1] * total_steps, 1.0)
  warm = jnp.minimum((step + 1.0) / warm_len, 1.0)
  frac = jnp.clip(since / main_len, 0.0, 1.0)
  main = 0.1 + 0.9 * 0.5 * (1.0 + jnp.cos(math.pi * frac))
  return jnp.select([phase == 0, phase == 1], [warm, main], 0.1).astype(jnp.float32)


#: Rewards closer to 0 than this are measured against it (a sparse start is not "flat" by division).
RELATIVE_SLOPE_FLOOR = 0.05


def relative_slope(slope: ArrayLike, smooth_reward: ArrayLike, total_steps: int) -> jax.Array:
  """The smoothed reward's slope as what a whole run at that rate would add, relative to the reward.

  ``slope * total_steps / max(|smooth_reward|, RELATIVE_SLOPE_FLOOR)``: a curve climbing from 0.3 to
  0.8 over an 800-step run has an absolute slope of ~6e-4 per step but a relative slope of ~1, so
  one threshold (``--phase_slope_threshold``) means the same for any run length and reward scale.
  """
  scale = jnp.maximum(jnp.abs(jnp.asarray(smooth_reward, jnp.float32)), RELATIVE_SLOPE_FLOOR)
  return jnp.asarray(slope, jnp.float32) * total_steps / scale


def phase_update(
  phase: ArrayLike,
  phase_start: ArrayLike,
  flat_steps: ArrayLike,
  slope: ArrayLike,
  step: ArrayLike,
  *,
  total_steps: int,
  fracs: tuple[float, float, float],
  slope_threshold: float,
  tolerance: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Advances the phase after ``step`` (1-based count of completed steps).

  A phase (warm-up or main; fine-tune is final) ends when either
  * the smoothed reward's relative slope (:func:`relative_slope`) has stayed below ``slope_threshold`` for ``tolerance``
    consecutive steps and the phase has run at least half its budget, or
  * the cumulative budget is spent: warm-up by ``fracs[0] * total_steps``, main by
    ``(fracs[0] + fracs[1]) * total_steps``.

  Returns:
    ``(phase, phase_start, flat_steps)`` after this step.
  """
  phase = jnp.asarray(phase, jnp.int32)
  phase_start = jnp.asarray(phase_start, jnp.int32)
  step = jnp.asarray(step, jnp.int32)
  flat = jnp.where(jnp.asarray(slope) < slope_threshold, jnp.asarray(flat_steps, jnp.int32) + 1, 0)
  budgets = jnp.asarray([fracs[0] * total_steps, fracs[1] * total_steps, math.inf], jnp.float32)
  ends = jnp.asarray([fracs[0] * total_steps, (fracs[0] + fracs[1]) * total_steps, math.inf], jnp.float32)
  budget, end = budgets[phase], ends[phase]
  ran = (step - phase_start).astype(jnp.float32)
  plateau = (flat >= tolerance) & (ran >= 0.5 * budget)
  advance = (phase < 2) & (plateau | (step.astype(jnp.float32) >= end))
  new_phase = jnp.where(advance, phase + 1, phase)
  return new_phase, jnp.where(advance, step, phase_start), jnp.where(advance, 0, flat)


def lr_linked_clip(grad_clip: float, lr_ratio: ArrayLike, *, floor: float = 0.1) -> jax.Array:
  """Global-norm clip threshold ``grad_clip * max(lr / peak, floor)``: tighter when the LR is low."""
  return grad_clip * jnp.maximum(jnp.asarray(lr_ratio, jnp.float32), floor)


# ----------------------------------------------------------------------------
# Value-model update frequency
# ----------------------------------------------------------------------------


def value_update_count(
  history: ArrayLike, count: ArrayLike, updates: ArrayLike, *, min_updates: int, max_updates: int, fast_drop: float
) -> jax.Array:
  """Value-model passes for the next step, from the value-loss trend over a window.

  ``history`` is a ring buffer of the last ``W`` value losses (``count`` of them valid).
  With a full window, compare the mean of its newer half with its older half:
  * stalled or rising (newer >= older): one more pass (up to ``max_updates``);
  * falling fast (newer < (1 - fast_drop) * older): one fewer (down to ``min_updates``);
  * otherwise unchanged.
  The ring buffer is ordered oldest-to-newest by :func:`push_history` (see there).
  """
  history = jnp.asarray(history, jnp.float32)
  chex.assert_rank(history, 1)
  w = history.shape[0]
  half = w // 2
  older, newer = jnp.mean(history[:half]), jnp.mean(history[w - half :])
  full = jnp.asarray(count) >= w
  updates = jnp.asarray(updates, jnp.int32)
  more = jnp.minimum(updates + 1, max_updates)
  fewer = jnp.maximum(updates - 1, min_updates)
  new = jnp.where(newer >= older, more, jnp.where(newer < (1.0 - fast_drop) * older, fewer, updates))
  return jnp.where(full & jnp.isfinite(newer) & jnp.isfinite(older), new, updates)


def push_history(history: ArrayLike, value: ArrayLike) -> jax.Array:
  """Appends ``value`` to a fixed-size window, dropping the oldest (index 0 oldest, -1 newest)."""
  history = jnp.asarray(history, jnp.float32)
  return jnp.concatenate([history[1:], jnp.asarray(value, jnp.float32)[None]])


# ----------------------------------------------------------------------------
# The joint state and its per-step update
# ----------------------------------------------------------------------------


class ControllerState(flax.struct.PyTreeNode):
  """Every controller's state (float32/int32 scalars and one small window); checkpointed.

  Attributes:
    kl_coef: current KL coefficient.
    entropy_coef: current entropy-bonus coefficient.
    reward_mean, reward_var: EMA statistics of the (clipped) rewards for shaping.
    reward_seen: whether the EMA holds any batch yet.
    smooth_reward: EMA of the batch mean reward (the phase detector's signal).
    slope: EMA of the per-step change of ``smooth_reward``.
    phase: 0 warm-up, 1 main, 2 fine-tune.
    phase_start: step at which the current phase began.
    flat_steps: consecutive steps with ``slope`` below the threshold.
    value_updates: value-model passes per step.
    value_history: the last value losses (oldest first).
    value_count: value losses recorded so far.
  """

  kl_coef: jax.Array
  entropy_coef: jax.Array
  reward_mean: jax.Array
  reward_var: jax.Array
  reward_seen: jax.Array
  smooth_reward: jax.Array
  slope: jax.Array
  phase: jax.Array
  phase_start: jax.Array
  flat_steps: jax.Array
  value_updates: jax.Array
  value_history: jax.Array
  value_count: jax.Array


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
  """Static controller settings (from the config; hashable).

  Attributes:
    total_steps: RL steps of the run.
    batch_size: rollout rows per step (``n`` of the adaptive KL controller).
    kl_controller: ``fixed`` / ``adaptive`` / ``budget``.
    kl_target: KL target (the final budget for ``budget``).
    kl_budget_start: the ``budget`` controller's initial (loose) target.
    kl_horizon: adaptive controller horizon (samples).
    kl_coef_min, kl_coef_max: bounds of the adaptive coefficient.
    entropy_controller: ``fixed`` / ``adaptive``.
    entropy_target, entropy_lr, entropy_coef_max: adaptive entropy settings.
    reward_clip_low, reward_clip_high: shaping quantiles.
    reward_ema: EMA decay of the shaping statistics (0: per-batch statistics).
    phased: whether the phase schedule is on.
    phase_fracs: step budget fractions of the phases.
    phase_slope_threshold: relative slope (:func:`relative_slope`) below which the reward counts as flat.
    phase_tolerance: flat steps that end a phase.
    phase_smoothing: EMA decay of the reward signal, per phase (rising).
    phase_clip_mults: multipliers of the PPO clip range, per phase (loose, then tightening).
    phase_kl_mults: multipliers of the KL coefficient, per phase (raised in fine-tune).
    grad_clip: global-norm clip threshold (0: off).
    grad_clip_lr_linked: scale the threshold by the LR ratio to the peak.
    value_window: value-loss window of the update-frequency controller.
    value_min_updates, value_max_updates, value_fast_drop: its bounds and "falling fast" ratio.
  """

  total_steps: int = 1
  batch_size: int = 1
  kl_controller: str = "fixed"
  kl_target: float = 0.02
  kl_budget_start: float = 0.1
  kl_horizon: float = 10000.0
  kl_coef_min: float = 1e-4
  kl_coef_max: float = 1.0
  entropy_controller: str = "fixed"
  entropy_target: float = 0.5
  entropy_lr: float = 0.001
  entropy_coef_max: float = 0.05
  reward_clip_low: float = 0.0
  reward_clip_high: float = 1.0
  reward_ema: float = 0.0
  phased: bool = False
  phase_fracs: tuple[float, float, float] = (0.1, 0.7, 0.2)
  phase_slope_threshold: float = 0.5
  phase_tolerance: int = 20
  phase_smoothing: tuple[float, float, float] = (0.9, 0.95, 0.97)
  phase_clip_mults: tuple[float, float, float] = (1.5, 1.0, 0.75)
  phase_kl_mults: tuple[float, float, float] = (1.0, 1.0, 2.0)
  grad_clip: float = 1.0
  grad_clip_lr_linked: bool = False
  value_window: int = 8
  value_min_updates: int = 1
  value_max_updates: int = 4
  value_fast_drop: float = 0.2

  def __post_init__(self):
    if self.kl_controller not in KL_CONTROLLERS:
      raise ValueError(f"kl_controller must be one of {KL_CONTROLLERS}, got {self.kl_controller!r}")
    if self.entropy_controller not in ENTROPY_CONTROLLERS:
      raise ValueError(f"entropy_controller must be one of {ENTROPY_CONTROLLERS}, got {self.entropy_controller!r}")


def init_controllers(
  *, kl_coef: float, entropy_coef: float, value_updates: int = 1, value_window: int = 8
) -> ControllerState:
  """The controllers' state at RL step 0."""
  f32, i32 = jnp.float32, jnp.int32
  return ControllerState(
    kl_coef=jnp.asarray(kl_coef, f32),
    entropy_coef=jnp.asarray(entropy_coef, f32),
    reward_mean=jnp.zeros((), f32),
    reward_var=jnp.ones((), f32),
    reward_seen=jnp.zeros((), bool),
    smooth_reward=jnp.zeros((), f32),
    slope=jnp.zeros((), f32),
    phase=jnp.zeros((), i32),
    phase_start=jnp.zeros((), i32),
    flat_steps=jnp.zeros((), i32),
    value_updates=jnp.asarray(value_updates, i32),
    value_history=jnp.zeros((max(value_window, 2),), f32),
    value_count=jnp.zeros((), i32),
  )


@flax.struct.dataclass
class StepSignals:
  """What the controllers read from one RL step (float32 scalars; NaN = not measured).

  Attributes:
    kl: token-mean KL to the reference (k3).
    entropy: token-mean policy entropy.
    reward_mean: batch mean of the raw reward.
    value_loss: the value model's loss (NaN without one).
  """

  kl: jax.Array
  entropy: jax.Array
  reward_mean: jax.Array
  value_loss: jax.Array


def update_controllers(
  ctl: ControllerState, signals: StepSignals, step: ArrayLike, settings: ControllerSettings
) -> ControllerState:
  """Advances every controller after RL step ``step`` (1-based: the number of completed steps; the
  learner counts the policy's own steps, so a step at or below 0, while the critic warms up and the policy
  waits, moves no phase and starts no slope)."""
  s = settings
  step = jnp.asarray(step, jnp.int32)
  frac = jnp.maximum(step, 0).astype(jnp.float32) / max(s.total_steps, 1)
  # ---- KL coefficient
  kl_coef = ctl.kl_coef
  if s.kl_controller != "fixed":
    target = s.kl_target
    if s.kl_controller == "budget":
      target = kl_budget_target(frac, start=s.kl_budget_start, end=s.kl_target)
    kl_coef = adaptive_kl_coef(
      kl_coef,
      signals.kl,
      target=target,
      n=s.batch_size,
      horizon=s.kl_horizon,
      beta_min=s.kl_coef_min,
      beta_max=s.kl_coef_max,
    )
  # ---- entropy coefficient
  entropy_coef = ctl.entropy_coef
  if s.entropy_controller == "adaptive":
    entropy_coef = adaptive_entropy_coef(
      entropy_coef, signals.entropy, target=s.entropy_target, lr=s.entropy_lr, coef_max=s.entropy_coef_max
    )
  # ---- smoothed reward, its slope, the phase
  smoothing = jnp.asarray(s.phase_smoothing, jnp.float32)[ctl.phase]
  first = step <= 1
  r = jnp.where(jnp.isfinite(signals.reward_mean), signals.reward_mean, ctl.smooth_reward)
  smooth = jnp.where(first, r, smoothing * ctl.smooth_reward + (1.0 - smoothing) * r)
  slope = jnp.where(first, 0.0, smoothing * ctl.slope + (1.0 - smoothing) * (smooth - ctl.smooth_reward))
  phase, phase_start, flat = ctl.phase, ctl.phase_start, ctl.flat_steps
  if s.phased:
    # The first step has no slope yet; it never counts as flat.
    phase, phase_start, flat = phase_update(
      phase,
      phase_start,
      jnp.where(first, -1, flat),
      # The slope's average starts at 0: divided by its weight so far (as Adam corrects its moments), so
      # a reward rising from the first steps does not read as flat while the average fills.
      jnp.where(
        first,
        jnp.inf,
        relative_slope(slope / (1.0 - smoothing ** (step - 1).astype(jnp.float32)), smooth, s.total_steps),
      ),
      step,
      total_steps=s.total_steps,
      fracs=s.phase_fracs,
      slope_threshold=s.phase_slope_threshold,
      tolerance=s.phase_tolerance,
    )
  # ---- value-model update frequency
  measured = jnp.isfinite(signals.value_loss)
  history = jnp.where(measured, push_history(ctl.value_history, signals.value_loss), ctl.value_history)
  count = ctl.value_count + measured.astype(jnp.int32)
  value_updates = value_update_count(
    history,
    count,
    ctl.value_updates,
    min_updates=s.value_min_updates,
    max_updates=s.value_max_updates,
    fast_drop=s.value_fast_drop,
  )
  # A full window is consumed by a decision: the next one needs fresh evidence.
  decided = value_updates != ctl.value_updates
  count = jnp.where(decided, 0, count)
  return ctl.replace(
    kl_coef=kl_coef,
    entropy_coef=entropy_coef,
    smooth_reward=smooth,
    slope=slope,
    phase=phase,
    phase_start=phase_start,
    flat_steps=flat,
    value_updates=value_updates,
    value_history=history,
    value_count=count,
  )


@flax.struct.dataclass
class DynamicCoefs:
  """The dynamic coefficients of one RL step (float32 scalars): the one type the controllers
  produce and the advantage and update functions read, so none is copied field by field.

  :func:`dynamic_coefs` fills every field; a caller driving the update by hand (a test, a
  benchmark) may give only the loss coefficients, and a field left None means "the static
  setting" (the ``UpdateSettings`` clip range, no LR multiplier, no dynamic clip).

  Attributes:
    kl_coef: KL coefficient applied in the loss (0 when KL is in the reward or off).
    entropy_coef: entropy-bonus coefficient.
    kl_reward_coef: KL coefficient applied to the reward (0 when KL is in the loss or off).
    clip_low, clip_high: the PPO clip range this step.
    lr_mult: multiplier of the optimizer's update (phase LR shape; 1 without phases).
    clip_norm: the global-norm gradient clip threshold (inf: off).
    reward_decay: the EMA decay of the reward-shaping statistics this step.
  """

  kl_coef: jax.Array
  entropy_coef: jax.Array
  kl_reward_coef: jax.Array | None = None
  clip_low: jax.Array | None = None
  clip_high: jax.Array | None = None
  lr_mult: jax.Array | None = None
  clip_norm: jax.Array | None = None
  reward_decay: jax.Array | None = None


def dynamic_coefs(
  ctl: ControllerState,
  step: ArrayLike,
  lr_ratio: ArrayLike,
  settings: ControllerSettings,
  *,
  clip_low: float,
  clip_high: float,
  kl_in_reward: bool,
  use_kl: bool,
  lr_scale: ArrayLike = 1.0,
) -> DynamicCoefs:
  """The coefficients of RL step ``step`` (0-based) from the controllers' state.

  Args:
    ctl: the controllers' state.
    step: the step about to run.
    lr_ratio: the base schedule's LR relative to its peak at this step (for the linked clip).
    settings: static settings.
    clip_low, clip_high: the configured clip range (scaled per phase).
    kl_in_reward: put the KL penalty in the reward instead of the loss.
    use_kl: whether there is a reference at all.
    lr_scale: the optimizer's own LR factor on top of the schedule (lowered by a rollback or an alarm's
      rollback): the linked clip follows the LR the update applies.
  """
  s = settings
  phase = ctl.phase
  kl = ctl.kl_coef * jnp.asarray(s.phase_kl_mults, jnp.float32)[phase] if s.phased else ctl.kl_coef
  kl = kl if use_kl else jnp.zeros((), jnp.float32)
  clip_mult = jnp.asarray(s.phase_clip_mults, jnp.float32)[phase] if s.phased else jnp.ones((), jnp.float32)
  if s.phased:
    lr_mult = phase_lr_multiplier(phase, step, ctl.phase_start, s.total_steps, s.phase_fracs)
    lr_ratio = lr_mult
  else:
    lr_mult = jnp.ones((), jnp.float32)
  if s.grad_clip <= 0:
    clip_norm = jnp.asarray(jnp.inf, jnp.float32)
  elif s.grad_clip_lr_linked:
    clip_norm = lr_linked_clip(s.grad_clip, lr_ratio * jnp.asarray(lr_scale, jnp.float32))
  else:
    clip_norm = jnp.asarray(s.grad_clip, jnp.float32)
  decay = jnp.asarray(s.phase_smoothing, jnp.float32)[phase] if s.phased and s.reward_ema > 0 else s.reward_ema
  zero = jnp.zeros((), jnp.float32)
  return DynamicCoefs(
    kl_coef=zero if kl_in_reward else kl,
    kl_reward_coef=kl if kl_in_reward else zero,
    entropy_coef=ctl.entropy_coef,
    clip_low=jnp.minimum(clip_low * clip_mult, 0.95).astype(jnp.float32),
    clip_high=(clip_high * clip_mult).astype(jnp.float32),
    lr_mult=lr_mult.astype(jnp.float32),
    clip_norm=clip_norm.astype(jnp.float32),
    reward_decay=jnp.asarray(decay, jnp.float32),
  )
