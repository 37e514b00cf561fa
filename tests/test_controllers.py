"""Training-dynamics controllers: hand-computed values and simulated runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax.rl import controllers as C

# ----------------------------------------------------------------------------
# KL coefficient
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kl, expected",
  [
    (0.04, 0.1 * (1 + 0.2 * 0.128)),  # error 1.0, clipped to +0.2
    (0.021, 0.1 * (1 + 0.05 * 0.128)),  # error 0.05, inside the clip
    (0.01, 0.1 * (1 - 0.2 * 0.128)),  # error -0.5, clipped to -0.2
    (0.02, 0.1),  # on target
  ],
)
def test_adaptive_kl_golden(kl, expected):
  got = C.adaptive_kl_coef(0.1, kl, target=0.02, n=128, horizon=1000, beta_min=0.05, beta_max=0.5)
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_adaptive_kl_is_bounded_and_ignores_nan():
  kw = dict(target=0.02, n=128, horizon=10, beta_min=0.05, beta_max=0.5)
  assert float(C.adaptive_kl_coef(0.5, 10.0, **kw)) == 0.5
  assert float(C.adaptive_kl_coef(0.05, 0.0, **kw)) == pytest.approx(0.05)
  assert float(C.adaptive_kl_coef(0.2, jnp.nan, **kw)) == pytest.approx(0.2)
  # Repeated high KL drives the coefficient up to the bound, repeated low KL down to the other.
  beta = 0.1
  for _ in range(200):
    beta = C.adaptive_kl_coef(beta, 0.1, **kw)
  assert float(beta) == pytest.approx(0.5)
  for _ in range(400):
    beta = C.adaptive_kl_coef(beta, 0.001, **kw)
  assert float(beta) == pytest.approx(0.05)


def test_kl_budget_is_loose_early_and_tight_late():
  np.testing.assert_allclose(
    [C.kl_budget_target(f, start=0.1, end=0.02) for f in (0.0, 0.5, 1.0, 2.0)], [0.1, 0.06, 0.02, 0.02], rtol=1e-6
  )


# ----------------------------------------------------------------------------
# Entropy, reward shaping, overlong
# ----------------------------------------------------------------------------


def test_adaptive_entropy_golden_and_bounds():
  np.testing.assert_allclose(C.adaptive_entropy_coef(0.01, 0.3, target=0.5, lr=0.01, coef_max=0.05), 0.012)
  np.testing.assert_allclose(C.adaptive_entropy_coef(0.01, 0.9, target=0.5, lr=0.01, coef_max=0.05), 0.006)
  assert float(C.adaptive_entropy_coef(0.049, 0.0, target=0.5, lr=0.01, coef_max=0.05)) == pytest.approx(0.05)
  assert float(C.adaptive_entropy_coef(0.001, 5.0, target=0.5, lr=0.01, coef_max=0.05)) == 0.0
  assert float(C.adaptive_entropy_coef(0.01, jnp.nan, target=0.5, lr=0.01, coef_max=0.05)) == pytest.approx(0.01)


def test_quantile_clip_golden():
  x = np.arange(21.0)  # quantiles 5% / 95% of 0..20 are 1 and 19
  got = np.asarray(C.quantile_clip(x, 0.05, 0.95))
  np.testing.assert_allclose(got, np.clip(x, 1.0, 19.0))
  np.testing.assert_array_equal(C.quantile_clip(x, 0.0, 1.0), x)
  # One outlier no longer dominates a batch of continuous values.
  y = np.concatenate([np.linspace(0.0, 1.0, 19), [1000.0]])
  assert float(jnp.max(C.quantile_clip(y, 0.05, 0.95))) < 60.0


def test_quantile_clip_keeps_rare_successes():
  # 3 successes in 100 samples: the plain 95% quantile is 0 and would erase all three.
  x = np.array([0.0] * 97 + [1.0] * 3)
  assert float(jnp.quantile(x, 0.95)) == 0.0
  got = np.asarray(C.quantile_clip(x, 0.05, 0.95))
  assert got[-3:].min() > got[:97].max()  # the successes stay above the failures
  np.testing.assert_allclose(got, np.clip(x, 0.05, 0.95))  # the two levels' own 5% / 95% points
  # Graded levels: none is merged into another.
  g = np.array([0.0] * 90 + [0.5] * 8 + [1.0] * 2)
  assert len(np.unique(np.asarray(C.quantile_clip(g, 0.05, 0.95)))) == 3


def test_ema_moments_initialise_then_decay():
  m, v = C.ema_moments(0.0, 1.0, False, jnp.array([1.0, 3.0]), 0.9)
  np.testing.assert_allclose([m, v], [2.0, 1.0])  # the first batch initialises
  m, v = C.ema_moments(m, v, True, jnp.array([4.0, 4.0]), 0.9)
  np.testing.assert_allclose([m, v], [0.9 * 2 + 0.1 * 4, 0.9 * 1 + 0.1 * 0], rtol=1e-6)


def test_shape_rewards_without_clip_or_ema_is_batch_whitening():
  r = jnp.array([0.0, 1.0, 1.0, 3.0])
  shaped, mean, var = C.shape_rewards(r, 0.0, 1.0, True, clip_low=0.0, clip_high=1.0, decay=0.0)
  np.testing.assert_allclose(shaped, (r - r.mean()) / (r.std() + 1e-6), rtol=1e-5)
  np.testing.assert_allclose([mean, var], [r.mean(), r.var()], rtol=1e-6)


def test_overlong_penalty_and_mask():
  lengths = jnp.array([5, 6, 7, 8])
  truncated = jnp.array([False, False, False, True])
  r, keep = C.overlong_shaping(jnp.ones(4), lengths, truncated, max_len=8, buffer=2, mode="penalty")
  np.testing.assert_allclose(r, [1.0, 1.0, 0.5, 0.0])  # soft zone 7..8, -1 at the limit
  assert bool(jnp.all(keep))
  r, keep = C.overlong_shaping(jnp.ones(4), lengths, truncated, max_len=8, buffer=2, mode="mask")
  np.testing.assert_allclose(r, 1.0)
  np.testing.assert_array_equal(keep, [True, True, True, False])
  with pytest.raises(ValueError, match="overlong mode"):
    C.overlong_shaping(jnp.ones(4), lengths, truncated, max_len=8, buffer=2, mode="cut")


# ----------------------------------------------------------------------------
# Phases, LR, clipping
# ----------------------------------------------------------------------------

FRACS = (0.1, 0.7, 0.2)


def test_phase_lr_shape():
  lr = lambda phase, step, start: float(C.phase_lr_multiplier(phase, step, start, 100, FRACS))  # noqa: E731
  assert lr(0, 0, 0) == pytest.approx(0.1) and lr(0, 4, 0) == pytest.approx(0.5) and lr(0, 9, 0) == 1.0
  assert lr(1, 10, 10) == pytest.approx(1.0)
  assert lr(1, 45, 10) == pytest.approx(0.55)  # half-way down the cosine from 1 to 0.1
  assert lr(1, 80, 10) == pytest.approx(0.1) and lr(1, 95, 10) == pytest.approx(0.1)
  assert lr(2, 90, 80) == pytest.approx(0.1)


def test_phase_update_plateau_and_budget():
  kw = dict(total_steps=1000, fracs=FRACS, slope_threshold=0.01, tolerance=5)
  # A flat slope ends warm-up only once half its budget (50 steps) has run.
  phase, start, flat = C.phase_update(0, 0, 10, 0.0, 30, **kw)
  assert (int(phase), int(flat)) == (0, 11)
  phase, start, flat = C.phase_update(0, 0, 10, 0.0, 60, **kw)
  assert (int(phase), int(start), int(flat)) == (1, 60, 0)
  # A rising reward resets the flat count; the budget end still switches (10% + 70% = step 800).
  phase, start, flat = C.phase_update(1, 60, 3, 0.5, 500, **kw)
  assert (int(phase), int(flat)) == (1, 0)
  phase, start, flat = C.phase_update(1, 60, 0, 0.5, 800, **kw)
  assert (int(phase), int(start)) == (2, 800)
  # Fine-tune is final.
  assert int(C.phase_update(2, 800, 100, 0.0, 999, **kw)[0]) == 2


def test_lr_linked_clip():
  np.testing.assert_allclose([C.lr_linked_clip(1.0, r) for r in (1.0, 0.5, 0.01)], [1.0, 0.5, 0.1])


def test_simulated_run_switches_phases_on_plateaus_before_the_budget():
  """A reward that rises for 30 steps then stays flat: warm-up and main end early, on the plateau."""
  settings = C.ControllerSettings(total_steps=1000, phased=True, phase_tolerance=10)
  ctl = C.init_controllers(kl_coef=0.1, entropy_coef=0.0)
  update = jax.jit(lambda c, s, t: C.update_controllers(c, s, t, settings))
  phases = []
  rng = np.random.default_rng(0)
  for step in range(1, 1001):
    reward = min(step, 30) / 100 + rng.normal(0, 0.002)
    signals = C.StepSignals(
      kl=jnp.float32(0), entropy=jnp.float32(1), reward_mean=jnp.float32(reward), value_loss=jnp.float32(jnp.nan)
    )
    ctl = update(ctl, signals, step)
    phases.append(int(ctl.phase))
  first_main, first_finetune = phases.index(1) + 1, phases.index(2) + 1
  assert 50 <= first_main < 100  # after half the warm-up budget, before its end
  assert first_main + 350 <= first_finetune < 800  # after half the main budget, before its end
  assert phases == sorted(phases)


def test_a_real_learning_curve_is_not_flat_for_the_phase_detector():
  """The embedded default's curve: 0.3 -> 0.8 over 800 steps, ~6e-4 per step.  An absolute threshold of
  0.01 per step called it flat from the first steps; its relative slope (~0.9) is above the default 0.5."""
  settings = C.ControllerSettings(total_steps=800, phased=True, phase_tolerance=10)
  ctl = C.init_controllers(kl_coef=0.1, entropy_coef=0.0)
  update = jax.jit(lambda c, s, t: C.update_controllers(c, s, t, settings))
  rng = np.random.default_rng(0)
  phases = []
  for step in range(1, 400):
    reward = 0.3 + 0.5 * step / 800 + rng.normal(0, 0.002)
    signals = C.StepSignals(
      kl=jnp.float32(0), entropy=jnp.float32(1), reward_mean=jnp.float32(reward), value_loss=jnp.float32(jnp.nan)
    )
    ctl = update(ctl, signals, step)
    phases.append(int(ctl.phase))
  assert int(ctl.flat_steps) == 0
  assert float(C.relative_slope(ctl.slope, ctl.smooth_reward, 800)) == pytest.approx(0.5 * 800 / 800 / 0.55, rel=0.3)
  # Warm-up ends at its budget (10% of 800), main has not ended early.
  assert phases.index(1) + 1 == 80 and 2 not in phases
  assert float(C.relative_slope(6e-4, 0.5, 800)) == pytest.approx(0.96)
  assert float(C.relative_slope(1e-4, 0.0, 800)) == pytest.approx(1.6)  # measured against the floor near 0


@pytest.mark.parametrize("total, tolerance, smoothing", [(400, 20, (0.95, 0.95, 0.97)), (200, 10, (0.9, 0.95, 0.97))])
def test_a_reward_rising_from_the_first_step_is_not_flat_while_the_slopes_average_fills(total, tolerance, smoothing):
  """A clean linear rise (relative slope ~1.6, the threshold 0.5): the warm-up runs to its budget.  The
  slope's average starts at 0 and read as flat for its first ~1 / (1 - smoothing) steps: the warm-up ended
  at 21 of its 40 steps, and at 11 of 20."""
  settings = C.ControllerSettings(
    total_steps=total, phased=True, phase_tolerance=tolerance, phase_smoothing=smoothing
  )  # fmt: skip
  ctl = C.init_controllers(kl_coef=0.1, entropy_coef=0.0)
  update = jax.jit(lambda c, s, t: C.update_controllers(c, s, t, settings))
  nan = jnp.float32(jnp.nan)
  for step in range(1, total // 10 + 2):
    reward = jnp.float32(0.3 + 0.5 * (step - 1) / total)
    ctl = update(ctl, C.StepSignals(kl=nan, entropy=nan, reward_mean=reward, value_loss=nan), step)
    if int(ctl.phase):
      break
  assert int(ctl.phase_start) == total // 10  # the budget's end, not a plateau


# ----------------------------------------------------------------------------
# Value update frequency
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "history, count, expected",
  [
    ([1.0, 1.0, 1.0, 1.0], 4, 3),  # stalled -> more passes
    ([1.0, 1.0, 1.2, 1.3], 4, 3),  # rising -> more passes
    ([1.0, 1.0, 0.5, 0.5], 4, 1),  # falling fast -> fewer
    ([1.0, 1.0, 0.9, 0.9], 4, 2),  # falling slowly -> unchanged
    ([1.0, 1.0, 1.0, 1.0], 3, 2),  # window not full -> unchanged
  ],
)
def test_value_update_count(history, count, expected):
  got = C.value_update_count(jnp.array(history), count, 2, min_updates=1, max_updates=4, fast_drop=0.2)
  assert int(got) == expected


def test_value_update_count_bounds_and_window_push():
  rising = jnp.array([1.0, 2.0, 3.0, 4.0])
  assert int(C.value_update_count(rising, 4, 4, min_updates=1, max_updates=4, fast_drop=0.2)) == 4
  falling = jnp.array([4.0, 3.0, 1.0, 0.5])
  assert int(C.value_update_count(falling, 4, 1, min_updates=1, max_updates=4, fast_drop=0.2)) == 1
  np.testing.assert_array_equal(C.push_history(jnp.array([1.0, 2.0, 3.0]), 4.0), [2.0, 3.0, 4.0])


def test_update_controllers_adapts_value_passes_to_a_stalled_loss():
  settings = C.ControllerSettings(value_window=4, value_max_updates=3)
  ctl = C.init_controllers(kl_coef=0.1, entropy_coef=0.0, value_updates=1, value_window=4)
  nan = jnp.float32(jnp.nan)
  passes = []
  for step in range(1, 13):
    signals = C.StepSignals(kl=nan, entropy=nan, reward_mean=jnp.float32(0.5), value_loss=jnp.float32(1.0))
    ctl = C.update_controllers(ctl, signals, step, settings)
    passes.append(int(ctl.value_updates))
  # Each full window of a flat loss adds a pass, up to the bound; a decision consumes the window.
  assert passes == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]
  # A fixed controller and no KL signal keep the coefficients where they were.
  assert float(ctl.kl_coef) == pytest.approx(0.1) and float(ctl.entropy_coef) == 0.0


def test_value_window_0_keeps_the_value_passes_fixed_through_the_trainer_settings():
  """``--value_window=0`` means a fixed number of critic passes: a critic loss halving every step
  (a "fast drop") lowered them 3 -> 1 (the floor stayed at --value_min_updates), a rising one may not
  raise them either."""
  from mimo_jax.main import parse_config
  from mimo_jax.train.learner import controller_settings, init_controller_state

  flags = ["prog", "--advantage=gae", "--use_value_model", "--value_window=0", "--value_updates=3"]
  cfg = parse_config(flags)
  settings = controller_settings(cfg)
  nan = jnp.float32(jnp.nan)
  for losses in ([2.0**-k for k in range(10)], [2.0**k for k in range(10)]):
    ctl = init_controller_state(cfg)
    passes = []
    for step, loss in enumerate(losses, start=1):
      signals = C.StepSignals(kl=nan, entropy=nan, reward_mean=jnp.float32(0.5), value_loss=jnp.float32(loss))
      ctl = C.update_controllers(ctl, signals, step, settings)
      passes.append(int(ctl.value_updates))
    assert passes == [3] * 10


def test_dynamic_coefs_route_kl_and_scale_by_phase():
  settings = C.ControllerSettings(total_steps=100, phased=True, grad_clip=2.0, grad_clip_lr_linked=True)
  ctl = C.init_controllers(kl_coef=0.1, entropy_coef=0.01).replace(phase=jnp.int32(2), phase_start=jnp.int32(80))
  kw = dict(clip_low=0.2, clip_high=0.28, use_kl=True)
  loss = C.dynamic_coefs(ctl, 90, 1.0, settings, kl_in_reward=False, **kw)
  reward = C.dynamic_coefs(ctl, 90, 1.0, settings, kl_in_reward=True, **kw)
  np.testing.assert_allclose([loss.kl_coef, loss.kl_reward_coef], [0.2, 0.0], rtol=1e-6)  # fine-tune doubles KL
  np.testing.assert_allclose([reward.kl_coef, reward.kl_reward_coef], [0.0, 0.2], rtol=1e-6)
  np.testing.assert_allclose([loss.clip_low, loss.clip_high], [0.15, 0.21], rtol=1e-6)  # tightened x0.75
  np.testing.assert_allclose([loss.lr_mult, loss.clip_norm], [0.1, 0.2], rtol=1e-6)  # LR 1/10, clip linked
  off = C.dynamic_coefs(ctl, 90, 1.0, settings, kl_in_reward=False, clip_low=0.2, clip_high=0.28, use_kl=False)
  assert float(off.kl_coef) == 0.0 and float(off.kl_reward_coef) == 0.0


def test_the_linked_clip_follows_the_lr_the_update_applies():
  """After rollbacks lowered the optimizer's LR factor (``lr_scale``, applied on top of the schedule), the
  LR-linked clip tightens with it: ``grad_clip * max(applied LR / peak, 0.1)``, phased or not (it stayed
  at the schedule's ratio)."""
  kw = dict(clip_low=0.2, clip_high=0.2, kl_in_reward=False, use_kl=True)
  ctl = C.init_controllers(kl_coef=0.05, entropy_coef=0.0)
  plain = C.ControllerSettings(total_steps=100, grad_clip=1.0, grad_clip_lr_linked=True)
  for lr_ratio, lr_scale, expected in ((1.0, 0.25, 0.25), (0.5, 0.5, 0.25), (1.0, 0.01, 0.1), (1.0, 1.0, 1.0)):
    c = C.dynamic_coefs(ctl, 50, lr_ratio, plain, lr_scale=lr_scale, **kw)
    np.testing.assert_allclose(float(c.clip_norm), expected, rtol=1e-6)
  phased = C.ControllerSettings(total_steps=100, phased=True, grad_clip=1.0, grad_clip_lr_linked=True)
  ctl = ctl.replace(phase=jnp.int32(1), phase_start=jnp.int32(10))
  full = C.dynamic_coefs(ctl, 50, 1.0, phased, **kw)
  halved = C.dynamic_coefs(ctl, 50, 1.0, phased, lr_scale=0.5, **kw)
  np.testing.assert_allclose(float(halved.clip_norm), max(0.5 * float(full.lr_mult), 0.1), rtol=1e-6)
  assert float(halved.lr_mult) == float(full.lr_mult)  # the factor is the optimizer's to apply, not the schedule's


def test_apply_gradients_clip_norm_and_lr_mult():
  from mimo_jax.optim import apply_gradients

  params = {"w": jnp.zeros(4)}
  grads = {"w": jnp.array([6.0, 8.0, 0.0, 0.0])}  # norm 10

  from mimo_jax.optim import TrainState, sgd

  state = TrainState(
    step=jnp.int32(0),
    params=params,
    opt_state=sgd(1.0).init(params),
    rng=jax.random.key(0),
    lr_scale=jnp.float32(1.0),
    graphdef=None,
    tx=sgd(1.0),
  )
  new, m = apply_gradients(state, grads, jnp.float32(0), clip_norm=jnp.float32(1.0))
  np.testing.assert_allclose(new.params["w"], [-0.6, -0.8, 0, 0], rtol=1e-6)
  assert float(m["grad_norm"]) == pytest.approx(10.0)
  new, _ = apply_gradients(state, grads, jnp.float32(0), clip_norm=jnp.float32(1.0), lr_mult=jnp.float32(0.5))
  np.testing.assert_allclose(new.params["w"], [-0.3, -0.4, 0, 0], rtol=1e-6)
  new, _ = apply_gradients(state, grads, jnp.float32(0), clip_norm=jnp.float32(100.0))
  np.testing.assert_allclose(new.params["w"], [-6.0, -8.0, 0, 0], rtol=1e-6)


def test_ema_standardisation_changes_grpo_advantages_instead_of_cancelling():
  """GRPO's per-group std undoes any affine map of the batch: with the EMA on, the running std is
  the scale (group-centred rewards over it), so the shaping changes the advantages."""
  from mimo_jax.train.steps import AdvantageInputs, AdvantageSettings, make_advantage_fn

  B, M, G = 8, 3, 4
  rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
  zeros = jnp.zeros((B, M), jnp.float32)
  inputs = AdvantageInputs(
    rewards=rewards,
    lengths=jnp.full((B,), M, jnp.int32),
    truncated=jnp.zeros((B,), bool),
    completion_mask=jnp.ones((B, M), bool),
    old_logprobs=zeros,
    ref_logprobs=zeros,
    values=zeros,
  )
  coefs = C.DynamicCoefs(
    kl_coef=jnp.float32(0), entropy_coef=jnp.float32(0), kl_reward_coef=jnp.float32(0), reward_decay=jnp.float32(0.9)
  )
  ctl = C.init_controllers(kl_coef=0.0, entropy_coef=0.0)
  # A previous batch's running statistics: mean 0.2, variance 0.04 (std 0.2).
  ctl = ctl.replace(reward_mean=jnp.float32(0.2), reward_var=jnp.float32(0.04), reward_seen=jnp.ones((), bool))
  base = dict(estimator="grpo", group_size=G, max_len=M, use_reference=False)
  plain, _, _ = make_advantage_fn(AdvantageSettings(**base))(inputs, ctl, coefs)
  shaped, new_ctl, _ = make_advantage_fn(AdvantageSettings(**base, shape_rewards=True, reward_ema=True))(
    inputs, ctl, coefs
  )
  mean, var = float(new_ctl.reward_mean), float(new_ctl.reward_var)
  assert mean == pytest.approx(0.9 * 0.2 + 0.1 * 0.5) and var == pytest.approx(0.9 * 0.04 + 0.1 * 0.25)
  centred = rewards.reshape(-1, G) - rewards.reshape(-1, G).mean(axis=1, keepdims=True)
  expected = (centred.reshape(-1) / (np.sqrt(var) + 1e-6))[:, None] * np.ones((1, M))
  np.testing.assert_allclose(np.asarray(shaped.advantages), expected, rtol=1e-4)
  assert not np.allclose(np.asarray(shaped.advantages), np.asarray(plain.advantages), rtol=1e-2)
