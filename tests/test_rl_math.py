"""Tests for mimo_jax.rl: advantages, KL estimators, policy/value losses, aggregation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax import rl

GROUP_MODES = tuple(rl.ADVANTAGE_ESTIMATORS)
AGG_MODES = tuple(rl.AGGREGATIONS)
PG_MODES = tuple(rl.POLICY_LOSSES)


def maybe_jit(fn, use_jit, **static):
  """fn with the static (string/int) arguments bound, optionally jitted."""
  bound = functools.partial(fn, **static)
  return jax.jit(bound) if use_jit else bound


def right_padded_mask(rng, batch, length, min_len=0):
  lengths = rng.integers(min_len, length + 1, size=batch)
  return np.arange(length)[None, :] < lengths[:, None]


# ---------------------------------------------------------------------------
# Registries and errors
# ---------------------------------------------------------------------------


def test_registries_hold_the_documented_names():
  assert set(rl.ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "reinforce_baseline"}
  assert set(rl.KL_ESTIMATORS) == {"k1", "k2", "k3", "abs"}
  assert set(rl.POLICY_LOSSES) == {"ppo", "gspo", "cispo"}
  assert set(rl.AGGREGATIONS) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}


def _assert_lists_names(excinfo, names):
  for name in names:
    assert name in str(excinfo.value)


def test_unknown_names_raise_listing_allowed():
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="nope") as e:
    rl.group_advantages(jnp.ones(4), 2, mode="nope")
  _assert_lists_names(e, GROUP_MODES)
  with pytest.raises(ValueError, match="nope") as e:
    rl.kl_estimate(x, x, "nope")
  _assert_lists_names(e, rl.KL_ESTIMATORS)
  with pytest.raises(ValueError, match="nope") as e:
    rl.aggregate(x, x, "nope")
  _assert_lists_names(e, AGG_MODES)
  with pytest.raises(ValueError, match="nope") as e:
    rl.policy_loss(x, x, jnp.ones(2), x, mode="nope", clip_low=0.2, clip_high=0.2)
  _assert_lists_names(e, PG_MODES)
  with pytest.raises(ValueError, match="nope") as e:
    rl.policy_loss(x, x, jnp.ones(2), x, mode="ppo", clip_low=0.2, clip_high=0.2, agg="nope")
  _assert_lists_names(e, AGG_MODES)


@pytest.mark.parametrize("mode", ["grpo", "rloo"])
def test_group_size_one_raises_for_modes_that_need_two(mode):
  with pytest.raises(ValueError, match="group_size >= 2"):
    rl.group_advantages(jnp.arange(4.0), 1, mode=mode)


@pytest.mark.parametrize("mode", ["drgrpo", "reinforce_baseline"])
def test_group_size_one_is_all_zero_for_mean_baselines(mode):
  out = rl.group_advantages(jnp.arange(4.0), 1, mode=mode)
  np.testing.assert_array_equal(out, np.zeros(4))


def test_group_size_must_divide_and_scores_must_be_flat():
  with pytest.raises(ValueError, match="does not divide"):
    rl.group_advantages(jnp.arange(6.0), 4, mode="drgrpo")
  with pytest.raises(ValueError, match="rank 1"):
    rl.group_advantages(jnp.ones((2, 2)), 2, mode="drgrpo")
  with pytest.raises(ValueError, match="does not divide"):
    rl.group_stats(jnp.arange(5.0), 2)


def test_norm_required_for_seq_mean_token_sum_norm():
  with pytest.raises(ValueError, match="norm"):
    rl.aggregate(jnp.ones((2, 3)), jnp.ones((2, 3)), "seq-mean-token-sum-norm")


def test_dual_clip_rejected_outside_ppo_and_when_not_above_one():
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="clip_c"):
    rl.policy_loss(x, x, jnp.ones(2), x, mode="gspo", clip_low=0.2, clip_high=0.2, clip_c=3.0)
  with pytest.raises(ValueError, match="clip_c"):
    rl.policy_loss(x, x, jnp.ones(2), x, mode="ppo", clip_low=0.2, clip_high=0.2, clip_c=1.0)


# ---------------------------------------------------------------------------
# Group advantages
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("use_jit", [False, True])
def test_group_advantages_golden(use_jit):
  scores = jnp.array([1.0, 0.0, 1.0, 1.0])
  # mean 0.75; unbiased std = sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5.
  grpo = maybe_jit(rl.group_advantages, use_jit, group_size=4, mode="grpo")(scores)
  np.testing.assert_allclose(grpo, [0.5, -1.5, 0.5, 0.5], rtol=1e-4)
  drgrpo = maybe_jit(rl.group_advantages, use_jit, group_size=4, mode="drgrpo")(scores)
  np.testing.assert_allclose(drgrpo, [0.25, -0.75, 0.25, 0.25], rtol=1e-6)
  # Leave-one-out: 1 - mean(0, 1, 1) = 1/3; 0 - mean(1, 1, 1) = -1.
  rloo = maybe_jit(rl.group_advantages, use_jit, group_size=4, mode="rloo")(scores)
  np.testing.assert_allclose(rloo, [1 / 3, -1.0, 1 / 3, 1 / 3], rtol=1e-6)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("mode", GROUP_MODES)
def test_all_equal_groups_are_exactly_zero(mode, use_jit):
  # 0.1 and 2.2 in groups of 3 do not round-trip through sum / 3 in float32, so a plain
  # (s - mean) / (std + eps) would give O(1e-2) garbage here instead of 0.
  equal = [0.1, 0.1, 0.1, 2.2, 2.2, 2.2, 0.0, 0.0, 0.0, -5.0, -5.0, -5.0]
  varied = [0.0, 1.0, 0.5]
  fn = maybe_jit(rl.group_advantages, use_jit, group_size=3, mode=mode)
  for scores in (equal, equal + varied):
    out = np.asarray(fn(jnp.array(scores, jnp.float32)))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[: len(equal)], np.zeros(len(equal)))
  # The one varied group does get a signal.
  assert np.any(out[len(equal) :] != 0)


def test_grpo_is_shift_and_scale_invariant_per_group():
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(5, 6)).astype(np.float32)
  base = rl.group_advantages(scores.reshape(-1), 6, mode="grpo")
  shift = rng.normal(size=(5, 1)) * 10
  scale = rng.uniform(0.5, 20, size=(5, 1))
  np.testing.assert_allclose(rl.group_advantages((scores + shift).reshape(-1), 6, mode="grpo"), base, atol=1e-4)
  np.testing.assert_allclose(rl.group_advantages((scores * scale).reshape(-1), 6, mode="grpo"), base, atol=1e-4)
  # Unit unbiased std within each group.
  np.testing.assert_allclose(np.std(np.asarray(base).reshape(5, 6), axis=1, ddof=1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("mode", ["drgrpo", "rloo"])
def test_mean_baselines_are_shift_invariant_and_scale_linearly(mode):
  rng = np.random.default_rng(1)
  scores = rng.normal(size=(4, 5)).astype(np.float32)
  base = np.asarray(rl.group_advantages(scores.reshape(-1), 5, mode=mode))
  shift = rng.normal(size=(4, 1)) * 10
  np.testing.assert_allclose(rl.group_advantages((scores + shift).reshape(-1), 5, mode=mode), base, atol=1e-4)
  np.testing.assert_allclose(rl.group_advantages((scores * 3).reshape(-1), 5, mode=mode), 3 * base, atol=1e-5)


def test_rloo_matches_leave_one_out_loop():
  rng = np.random.default_rng(2)
  g = 5
  scores = rng.normal(size=4 * g)
  expected = np.zeros_like(scores)
  for p in range(4):
    for i in range(g):
      others = [scores[p * g + j] for j in range(g) if j != i]
      expected[p * g + i] = scores[p * g + i] - np.mean(others)
  np.testing.assert_allclose(rl.group_advantages(scores, g, mode="rloo"), expected, rtol=1e-5, atol=1e-6)


def test_drgrpo_matches_group_mean_loop():
  rng = np.random.default_rng(3)
  scores = rng.normal(size=12)
  expected = np.concatenate([s - s.mean() for s in scores.reshape(3, 4)])
  np.testing.assert_allclose(rl.group_advantages(scores, 4, mode="drgrpo"), expected, rtol=1e-5, atol=1e-6)


def test_reinforce_baseline_is_whitened_over_the_batch():
  rng = np.random.default_rng(4)
  scores = rng.normal(loc=3.0, scale=4.0, size=(8, 4))
  out = np.asarray(rl.group_advantages(scores.reshape(-1), 4, mode="reinforce_baseline"))
  assert abs(out.mean()) < 1e-5
  np.testing.assert_allclose(out.std(ddof=1), 1.0, rtol=1e-4)
  # Still ordered like the group-centred scores: a positive multiple of them.
  centred = (scores - scores.mean(axis=1, keepdims=True)).reshape(-1)
  np.testing.assert_allclose(out, centred / centred.std(ddof=1), rtol=1e-4, atol=1e-5)


def test_group_stats_and_all_equal():
  rng = np.random.default_rng(5)
  scores = rng.normal(size=(3, 4))
  scores[1] = 0.7
  mean, std = rl.group_stats(scores.reshape(-1), 4)
  np.testing.assert_allclose(mean, scores.mean(axis=1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(std, scores.std(axis=1, ddof=1), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(rl.group_all_equal(scores.reshape(-1), 4), [False, True, False])
  mean1, std1 = rl.group_stats(jnp.arange(3.0), 1)
  np.testing.assert_array_equal(mean1, [0.0, 1.0, 2.0])
  np.testing.assert_array_equal(std1, [0.0, 0.0, 0.0])


# ---------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------


def test_masked_statistics_match_numpy():
  rng = np.random.default_rng(6)
  x = rng.normal(size=(4, 7)).astype(np.float32)
  mask = right_padded_mask(rng, 4, 7, min_len=2)
  x_padded = np.where(mask, x, 1e6).astype(np.float32)  # padding must not matter
  valid = x[mask]
  np.testing.assert_allclose(rl.masked_mean(x_padded, mask), valid.mean(), rtol=1e-5)
  rows = [x[b][mask[b]].mean() for b in range(4)]
  np.testing.assert_allclose(rl.masked_mean(x_padded, mask, axis=1), rows, rtol=1e-5)
  np.testing.assert_allclose(rl.masked_var(x_padded, mask), valid.var(ddof=1), rtol=1e-5)
  np.testing.assert_allclose(rl.masked_var(x_padded, mask, unbiased=False), valid.var(), rtol=1e-5)
  w = np.asarray(rl.masked_whiten(x_padded, mask))
  np.testing.assert_allclose(w[mask], (valid - valid.mean()) / valid.std(ddof=1), rtol=1e-4, atol=1e-5)
  assert np.all(w[~mask] == 0)
  w2 = np.asarray(rl.masked_whiten(x_padded, mask, shift_mean=False))
  np.testing.assert_allclose(w2[mask], (valid - valid.mean()) / valid.std(ddof=1) + valid.mean(), rtol=1e-4, atol=1e-5)


def test_masked_statistics_of_empty_selection_are_zero():
  x = jnp.ones((2, 3))
  mask = jnp.zeros((2, 3), bool)
  assert float(rl.masked_mean(x, mask)) == 0.0
  assert float(rl.masked_var(x, mask)) == 0.0
  np.testing.assert_array_equal(rl.masked_mean(x, mask, axis=1), [0.0, 0.0])
  one = jnp.array([[True, False, False], [False, False, False]])
  assert float(rl.masked_var(x * 5, one)) == 0.0


# ---------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------


def np_gae(rewards, values, mask, gamma, lam):
  """Reference: the textbook backward recursion, visiting only the valid tokens."""
  adv = np.zeros(rewards.shape, np.float64)
  for b in range(rewards.shape[0]):
    next_value, next_adv = 0.0, 0.0
    for t in reversed(np.flatnonzero(mask[b])):
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      next_adv = delta + gamma * lam * next_adv
      next_value = values[b, t]
      adv[b, t] = next_adv
  return adv, np.where(mask, adv + values, 0.0)


def test_gae_hand_case():
  # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lam 0.8:
  #   delta2 = 1 - 0.7 = 0.3                  A2 = 0.3
  #   delta1 = 0.9 * 0.7 - 0.6 = 0.03         A1 = 0.03 + 0.72 * 0.3 = 0.246
  #   delta0 = 0.9 * 0.6 - 0.5 = 0.04         A0 = 0.04 + 0.72 * 0.246 = 0.21712
  rewards = jnp.array([[0.0, 0.0, 1.0, 9.0]])
  values = jnp.array([[0.5, 0.6, 0.7, 9.0]])
  mask = jnp.array([[True, True, True, False]])
  adv, ret = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
  np.testing.assert_allclose(adv, [[0.21712, 0.246, 0.3, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(ret, [[0.71712, 0.846, 1.0, 0.0]], rtol=1e-5)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_reference_on_right_padded_batch(gamma, lam, use_jit):
  rng = np.random.default_rng(7)
  b, t = 6, 11
  mask = right_padded_mask(rng, b, t)
  mask[0] = False  # an empty row
  mask[1] = True  # a full row
  rewards = rng.normal(size=(b, t)).astype(np.float32)
  values = rng.normal(size=(b, t)).astype(np.float32)
  fn = maybe_jit(rl.gae, use_jit, gamma=gamma, lam=lam)
  adv, ret = fn(rewards, values, mask)
  ref_adv, ref_ret = np_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(adv)[~mask] == 0) and np.all(np.asarray(ret)[~mask] == 0)
  if gamma == lam == 1.0:
    # Telescoping: A_t = sum of rewards from t on - V_t.
    future = np.cumsum((rewards * mask)[:, ::-1], axis=1)[:, ::-1]
    np.testing.assert_allclose(adv, np.where(mask, future - values, 0.0), rtol=1e-4, atol=1e-5)
  if lam == 0.0:
    # One-step TD error, bootstrapping 0 after the last valid token.
    next_v = np.concatenate([values[:, 1:] * mask[:, 1:], np.zeros((b, 1))], axis=1)
    np.testing.assert_allclose(adv, np.where(mask, rewards + gamma * next_v - values, 0.0), rtol=1e-4, atol=1e-5)


def test_gae_carries_through_holes():
  rng = np.random.default_rng(8)
  mask = rng.random((5, 9)) < 0.6
  rewards = rng.normal(size=(5, 9)).astype(np.float32)
  values = rng.normal(size=(5, 9)).astype(np.float32)
  adv, ret = rl.gae(rewards, values, mask, gamma=0.97, lam=0.9)
  ref_adv, ref_ret = np_gae(rewards, values, mask, 0.97, 0.9)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("use_jit", [False, True])
def test_kl_estimators_golden(use_jit):
  logp = jnp.array([-1.0, -2.0, -0.5])
  ref = jnp.array([-1.2, -1.0, -3.0])
  d = np.array([0.2, -1.0, 2.5])  # logp - ref
  get = lambda kind: maybe_jit(rl.kl_estimate, use_jit, kind=kind)(logp, ref)
  np.testing.assert_allclose(get("k3"), [0.01873, 0.71828, 1.58208], atol=1e-5)
  np.testing.assert_allclose(get("k1"), d, rtol=1e-6)
  np.testing.assert_allclose(get("k2"), 0.5 * d**2, rtol=1e-6)
  np.testing.assert_allclose(get("abs"), np.abs(d), rtol=1e-6)


def test_k3_clamps_extreme_log_ratios():
  logp = jnp.array([-100.0, 0.0, -1.0])
  ref = jnp.array([0.0, -100.0, -1.0])
  k3 = np.asarray(rl.kl_estimate(logp, ref, "k3"))
  assert np.all(np.isfinite(k3))
  # ref >> logp: exp(20) - 20 - 1 clamps to 10; ref << logp: exp(-20) + 20 - 1 ~ 19 clamps to 10.
  np.testing.assert_allclose(k3, [10.0, 10.0, 0.0], atol=1e-6)


# ---------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------

AGG_X = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
AGG_MASK = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]])
# token-mean: 29 / 6; seq-mean-token-mean: (1.5 + 6.5) / 2; seq-mean-token-sum: (3 + 26) / 2;
# seq-mean-token-sum-norm: (3 + 26) / 4 / 2.
AGG_GOLDEN = {
  "token-mean": 29 / 6,
  "seq-mean-token-mean": 4.0,
  "seq-mean-token-sum": 14.5,
  "seq-mean-token-sum-norm": 3.625,
}


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_golden(mode, use_jit):
  fn = maybe_jit(rl.aggregate, use_jit, mode=mode, norm=4.0)
  np.testing.assert_allclose(fn(AGG_X, AGG_MASK), AGG_GOLDEN[mode], rtol=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_ignores_empty_sequences_and_padding_values(mode):
  x = jnp.concatenate([AGG_X, jnp.full((1, 4), jnp.inf)]).at[0, 3].set(jnp.nan)
  mask = jnp.concatenate([AGG_MASK, jnp.zeros((1, 4), int)])
  np.testing.assert_allclose(rl.aggregate(x, mask, mode, norm=4.0), AGG_GOLDEN[mode], rtol=1e-5)


def test_aggregate_uses_global_counts():
  # Global counts replace local ones: token-mean sums / num_tokens, seq modes / num_seqs.
  np.testing.assert_allclose(rl.aggregate(AGG_X, AGG_MASK, "token-mean", num_tokens=29.0), 1.0, rtol=1e-6)
  np.testing.assert_allclose(rl.aggregate(AGG_X, AGG_MASK, "seq-mean-token-mean", num_seqs=8), 1.0, rtol=1e-6)
  np.testing.assert_allclose(rl.aggregate(AGG_X, AGG_MASK, "seq-mean-token-sum", num_seqs=29), 1.0, rtol=1e-6)
  np.testing.assert_allclose(
    rl.aggregate(AGG_X, AGG_MASK, "seq-mean-token-sum-norm", norm=4.0, num_seqs=jnp.array(1.0)), 7.25, rtol=1e-6
  )


# ---------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------


def _one_token(ratio, adv):
  logp = jnp.array([[float(np.log(ratio))]])
  return logp, jnp.zeros((1, 1)), jnp.array([adv]), jnp.ones((1, 1), bool)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize(
  "ratio,adv,clip_c,expected",
  [
    (1.5, 1.0, 3.0, -1.28),  # upper clip at 1 + 0.28
    (5.0, -1.0, 3.0, 3.0),  # dual clip: min(-5, -1.2) = -5 floored at 3 * -1
    (0.5, -1.0, 3.0, 0.8),  # lower clip at 1 - 0.2
    (5.0, -1.0, None, 5.0),  # no dual clip: unbounded
    (1.1, 1.0, 3.0, -1.1),  # inside the trust region: plain ratio * A
    (0.5, 1.0, 3.0, -0.5),  # A > 0 with a small ratio: min picks the unclipped 0.5
  ],
)
def test_ppo_golden(ratio, adv, clip_c, expected, use_jit):
  fn = maybe_jit(rl.policy_loss, use_jit, mode="ppo", clip_low=0.2, clip_high=0.28, clip_c=clip_c)
  loss, _ = fn(*_one_token(ratio, adv))
  np.testing.assert_allclose(loss, expected, rtol=1e-4)


def test_ppo_metrics_by_hand():
  # Tokens: ratio 1.5 A+ (high clip), 0.5 A- (low clip), 5 A- (dual clip), 1.0 A+ (none),
  # and a padded token holding -inf.
  ratios = np.array([1.5, 0.5, 5.0, 1.0, 1.0])
  logp = jnp.array([np.log(ratios)]).at[0, 4].set(-jnp.inf)
  old = jnp.zeros((1, 5))
  adv = jnp.array([[1.0, -1.0, -1.0, 1.0, 1.0]])
  mask = jnp.array([[1, 1, 1, 1, 0]], bool)
  loss, m = rl.policy_loss(logp, old, adv, mask, mode="ppo", clip_low=0.2, clip_high=0.28, clip_c=3.0)
  np.testing.assert_allclose(loss, (-1.28 + 0.8 + 3.0 - 1.0) / 4, rtol=1e-5)
  np.testing.assert_allclose(m["clipfrac_high"], 0.25)
  np.testing.assert_allclose(m["clipfrac_low"], 0.25)
  np.testing.assert_allclose(m["clipfrac"], 0.5)
  np.testing.assert_allclose(m["dual_clip_frac"], 0.25)
  np.testing.assert_allclose(m["ratio_mean"], (1.5 + 0.5 + 5.0 + 1.0) / 4, rtol=1e-5)
  np.testing.assert_allclose(m["ratio_max"], 5.0, rtol=1e-5)
  np.testing.assert_allclose(m["approx_kl"], np.mean(0.5 * np.log(ratios[:4]) ** 2), rtol=1e-5)
  for v in m.values():
    assert v.shape == () and np.isfinite(v)
  grad = jax.grad(lambda lp: rl.policy_loss(lp, old, adv, mask, mode="ppo", clip_low=0.2, clip_high=0.28)[0])(logp)
  assert np.all(np.isfinite(grad))


def _batch(seed=9, b=8, t=6):
  rng = np.random.default_rng(seed)
  mask = right_padded_mask(rng, b, t, min_len=1)
  mask[3] = False  # a sequence with no valid token
  old = rng.normal(-1.5, 0.5, size=(b, t)).astype(np.float32)
  logp = (old + rng.normal(0, 0.3, size=(b, t))).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask)


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", PG_MODES)
def test_gradient_accumulation_matches_full_batch(mode, agg, per_token_adv):
  logp, old, adv, mask = _batch()
  if per_token_adv:
    adv = adv[:, None] * jnp.linspace(0.5, 1.5, logp.shape[1])[None, :]
  num_tokens = jnp.sum(mask)
  num_seqs = jnp.sum(jnp.any(mask, axis=1))
  kwargs = dict(mode=mode, clip_low=0.2, clip_high=0.28, clip_c=3.0 if mode == "ppo" else None, agg=agg, norm=6.0)

  def full(lp):
    return rl.policy_loss(lp, old, adv, mask, **kwargs)[0]

  def micro(lp, s):
    return rl.policy_loss(lp, old[s], adv[s], mask[s], num_tokens=num_tokens, num_seqs=num_seqs, **kwargs)[0]

  full_loss, full_grad = jax.value_and_grad(full)(logp)
  slices = [slice(i, i + 2) for i in range(0, 8, 2)]
  parts = [jax.value_and_grad(micro)(logp[s], s) for s in slices]
  acc_loss = sum(p[0] for p in parts)
  acc_grad = jnp.concatenate([p[1] for p in parts])
  np.testing.assert_allclose(acc_loss, full_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(acc_grad, full_grad, rtol=1e-5, atol=1e-8)
  # The test is only meaningful if something flows.
  assert float(jnp.abs(full_grad).sum()) > 0
  # Without global counts, micro-batch losses do not in general sum to the full loss.
  local = sum(rl.policy_loss(logp[s], old[s], adv[s], mask[s], **kwargs)[0] for s in slices)
  assert not np.isclose(local, full_loss, rtol=1e-3)


def test_policy_loss_gradient_is_zero_on_padding_even_with_inf():
  logp, old, adv, mask = _batch()
  bad = jnp.where(mask, logp, -jnp.inf)
  for mode in PG_MODES:
    loss, grad = jax.value_and_grad(
      lambda lp, mode=mode: rl.policy_loss(lp, old, adv, mask, mode=mode, clip_low=0.2, clip_high=0.28)[0]
    )(bad)
    assert np.isfinite(loss)
    assert np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[~np.asarray(mask)] == 0)


def test_gspo_sequence_ratio_is_exp_mean_log_ratio():
  logp, old, adv, mask = _batch(seed=10)
  _, ratio, _ = rl.POLICY_LOSSES["gspo"](
    jnp.where(mask, logp, 0.0), jnp.where(mask, old, 0.0), adv[:, None] * mask, mask, 0.2, 0.28, None
  )
  m = np.asarray(mask)
  for b in range(8):
    if m[b].any():
      expected = np.exp(np.mean((np.asarray(logp) - np.asarray(old))[b][m[b]]))
      np.testing.assert_allclose(np.asarray(ratio)[b][m[b]], expected, rtol=1e-5)
      # The per-sequence metric agrees.
      row = slice(b, b + 1)
      _, metrics = rl.policy_loss(logp[row], old[row], adv[row], mask[row], mode="gspo", clip_low=0.2, clip_high=0.28)
      np.testing.assert_allclose(metrics["ratio_mean"], expected, rtol=1e-5)
      np.testing.assert_allclose(metrics["ratio_max"], expected, rtol=1e-5)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gspo_on_policy_equals_ppo(agg):
  logp, _, adv, mask = _batch(seed=11)
  kwargs = dict(clip_low=0.2, clip_high=0.28, agg=agg, norm=6.0)
  gspo = lambda lp: rl.policy_loss(lp, logp, adv, mask, mode="gspo", **kwargs)[0]
  ppo = lambda lp: rl.policy_loss(lp, logp, adv, mask, mode="ppo", **kwargs)[0]
  # Ratio 1: the loss is the aggregated -A.
  expected = rl.aggregate(-jnp.broadcast_to(adv[:, None], mask.shape), mask, agg, norm=6.0)
  np.testing.assert_allclose(gspo(logp), expected, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(gspo)(logp), jax.grad(ppo)(logp), rtol=1e-6, atol=1e-8)


def test_gspo_gradient_is_sequence_ratio_times_advantage():
  # Per-token log-ratios vary (some beyond the token clip range) but each sequence's mean
  # stays inside it, so no sequence is clipped and d loss / d logp_t = -s_i * A_i / N.
  rng = np.random.default_rng(12)
  mask = np.ones((3, 4), bool)
  mask[2, 3] = False
  noise = rng.normal(0, 0.5, size=(3, 4))
  noise = noise - (noise * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True) + np.array([[0.05], [-0.1], [0.0]])
  old = np.full((3, 4), -1.0)
  logp = jnp.asarray(old + noise, jnp.float32)
  adv = jnp.array([1.0, -2.0, 0.5])
  fn = lambda lp: rl.policy_loss(lp, old, adv, mask, mode="gspo", clip_low=0.2, clip_high=0.28)[0]
  s = np.exp(np.array([0.05, -0.1, 0.0]))
  expected = -(s * np.asarray(adv))[:, None] * mask / mask.sum()
  np.testing.assert_allclose(jax.grad(fn)(logp), expected, rtol=1e-4, atol=1e-7)
  # Push sequence 0 past the upper clip with A > 0: its gradient vanishes as a whole.
  clipped = logp.at[0].add(0.5)
  g = np.asarray(jax.grad(fn)(clipped))
  assert np.all(g[0] == 0) and np.all(g[1] != 0)
  _, m = rl.policy_loss(clipped, old, adv, mask, mode="gspo", clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(m["clipfrac_high"], 4 / 11, rtol=1e-6)


@pytest.mark.parametrize("use_jit", [False, True])
def test_cispo_gradient_is_clipped_weight_times_advantage(use_jit):
  logp, old, adv, mask = _batch(seed=13)
  fn = maybe_jit(rl.policy_loss, use_jit, mode="cispo", clip_low=0.2, clip_high=0.28)
  grad = jax.grad(lambda lp: fn(lp, old, adv, mask)[0])(logp)
  ratio = np.exp(np.asarray(logp) - np.asarray(old))
  m = np.asarray(mask)
  expected = -np.clip(ratio, 0.8, 1.28) * np.asarray(adv)[:, None] * m / m.sum()
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)
  # Clipped tokens still get gradient (unlike PPO), as long as A != 0.
  clipped = m & ((ratio > 1.28) | (ratio < 0.8))
  assert clipped.any() and np.all(np.asarray(grad)[clipped] != 0)
  loss, _ = fn(logp, old, adv, mask)
  expected_loss = np.sum(-np.clip(ratio, 0.8, 1.28) * np.asarray(adv)[:, None] * np.asarray(logp) * m) / m.sum()
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


@pytest.mark.parametrize("mode", PG_MODES)
def test_policy_loss_accepts_traced_counts_under_jit(mode):
  logp, old, adv, mask = _batch(seed=14)
  fn = jax.jit(functools.partial(rl.policy_loss, mode=mode, clip_low=0.2, clip_high=0.28))
  loss, metrics = fn(logp, old, adv, mask, num_tokens=jnp.sum(mask), num_seqs=jnp.array(7))
  eager, _ = rl.policy_loss(logp, old, adv, mask, mode=mode, clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(loss, eager, rtol=1e-5)
  names = {"clipfrac_high", "clipfrac_low", "clipfrac", "dual_clip_frac", "approx_kl", "ratio_mean", "ratio_max"}
  assert set(metrics) == names


def test_policy_loss_rejects_bad_advantage_shapes():
  x = jnp.zeros((2, 3))
  with pytest.raises(AssertionError):
    rl.policy_loss(x, x, jnp.ones(3), x, mode="ppo", clip_low=0.2, clip_high=0.2)
  with pytest.raises(ValueError, match="advantages"):
    rl.policy_loss(x, x, jnp.ones((2, 3, 1)), x, mode="ppo", clip_low=0.2, clip_high=0.2)


# ---------------------------------------------------------------------------
# Value loss and entropy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("use_jit", [False, True])
def test_value_loss_hand_case(use_jit):
  # clip 0.2.  Token 0: v 1.5, old 1.0, R 2.0: unclipped (1.5 - 2)^2 = 0.25; clipped v = 1.2,
  #   (1.2 - 2)^2 = 0.64 -> 0.5 * 0.64 = 0.32 (clip active).
  # Token 1: v 0.9, old 1.0, R 0.5: inside the clip range, 0.5 * 0.4^2 = 0.08.
  # Token 2 is padding (garbage values).  token-mean = (0.32 + 0.08) / 2 = 0.2.
  values = jnp.array([[1.5, 0.9, jnp.nan]])
  old = jnp.array([[1.0, 1.0, jnp.inf]])
  returns = jnp.array([[2.0, 0.5, 3.0]])
  mask = jnp.array([[True, True, False]])
  fn = maybe_jit(rl.value_loss, use_jit, clip=0.2)
  loss, m = fn(values, old, returns, mask)
  np.testing.assert_allclose(loss, 0.2, rtol=1e-5)
  np.testing.assert_allclose(m["vf_clipfrac"], 0.5)
  np.testing.assert_allclose(m["value_mean"], 1.2, rtol=1e-6)
  # d loss / d v: token 0's max picks the clipped term, constant in v -> 0; token 1: (v - R) / 2 = 0.2.
  grad = jax.grad(lambda v: fn(v, old, returns, mask)[0])(values)
  np.testing.assert_allclose(grad, [[0.0, 0.2, 0.0]], atol=1e-6)


def np_entropy(logits):
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


@pytest.mark.parametrize("use_jit", [False, True])
def test_entropy_from_logits_matches_numpy(use_jit):
  rng = np.random.default_rng(15)
  logits = rng.normal(0, 3, size=(2, 3, 11))
  fn = jax.jit(rl.entropy_from_logits) if use_jit else rl.entropy_from_logits
  ent = fn(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
  assert ent.shape == (2, 3) and ent.dtype == jnp.float32
  np.testing.assert_allclose(ent, np_entropy(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float64)), rtol=1e-5)
  # Uniform over V: log V.  Large offsets do not cancel badly.  Masked (-inf) entries are ignored.
  np.testing.assert_allclose(fn(jnp.zeros((1, 1, 11))), [[np.log(11)]], rtol=1e-6)
  np.testing.assert_allclose(fn(jnp.asarray(logits + 1e4, jnp.float32)), np_entropy(logits), rtol=1e-3, atol=1e-3)
  masked = logits.copy()
  masked[..., 5:] = -np.inf
  np.testing.assert_allclose(fn(jnp.asarray(masked)), np_entropy(logits[..., :5]), rtol=1e-5)
  grad = jax.grad(lambda x: fn(x).sum())(jnp.asarray(masked, jnp.float32))
  assert np.all(np.isfinite(grad))
