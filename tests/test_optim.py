"""The one optimizer (``optim.make_optimizer``): the guarded, hyperparameter-injected chain against
plain optax with the clip and the LR multiplier applied by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mimo_jax.config import OptimConfig
from mimo_jax.optim import TrainState, apply_gradients, hyperparams, make_optimizer


def _params():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {
    "w_in": jax.random.normal(k1, (6, 4)) * 0.1,
    "embed": jax.random.normal(k2, (5, 6)) * 0.1,
    "norm": {"scale": jnp.ones(4) + 0.01 * jax.random.normal(k3, (4,))},
  }


def _state(params, tx):
  return TrainState(
    step=jnp.int32(0),
    params=params,
    opt_state=tx.init(params),
    rng=jax.random.key(0),
    lr_scale=jnp.float32(1.0),
    graphdef=None,
    tx=tx,
  )


CFG = OptimConfig(learning_rate=3e-2, warmup_steps=2, weight_decay=0.1, grad_clip=1.0)


def test_the_guarded_optimizer_equals_plain_adamw_with_the_clip_and_lr_multiplier_by_hand():
  total = 8
  tx, schedule = make_optimizer(CFG, total)
  plain = optax.adamw(
    schedule,
    b1=CFG.adam_b1,
    b2=CFG.adam_b2,
    weight_decay=CFG.weight_decay,
    mask=lambda p: {"w_in": True, "embed": True, "norm": {"scale": False}},
  )
  params = _params()
  state, ref_params, ref_opt = _state(params, tx), params, plain.init(params)
  # (gradient scale, LR multiplier, clip threshold): clipped, unclipped, clip off, LR halved, state's scale.
  plan = [(5.0, None, None), (0.01, None, None), (3.0, 0.5, jnp.inf), (2.0, 1.0, 0.5), (1.0, 0.25, 2.0)]
  for i, (g_scale, lr_mult, clip) in enumerate(plan):
    if i == 4:
      state = state.replace(lr_scale=jnp.float32(0.5))
    grads = jax.tree.map(lambda p, i=i, g=g_scale: g * jnp.sin(p * 7.0 + i), params)
    state, metrics = apply_gradients(state, grads, jnp.float32(1.0), lr_mult=lr_mult, clip_norm=clip)
    # The oracle: clip by hand (threshold CFG.grad_clip unless given), adamw, then scale by the multipliers.
    threshold = CFG.grad_clip if clip is None else float(clip)
    norm = float(optax.tree.norm(grads))
    scale = min(1.0, threshold / norm)
    clipped = jax.tree.map(lambda g, s=scale: g * s, grads)
    updates, ref_opt = plain.update(clipped, ref_opt, ref_params)
    mult = float(state.lr_scale) * (1.0 if lr_mult is None else lr_mult)
    ref_params = optax.apply_updates(ref_params, jax.tree.map(lambda u, m=mult: u * m, updates))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params), strict=True):
      # atol: Adam divides by sqrt(nu), which turns float-level differences of tiny gradients into
      # ~1e-7 (the updates are ~3e-2 each).
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"update {i}")
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-6)
    assert float(metrics["skipped"]) == 0.0
    hp = hyperparams(state.opt_state)
    assert float(hp["learning_rate"]) == pytest.approx(float(schedule(i)), rel=1e-6)  # at the count before it
    assert float(hp["lr_mult"]) == pytest.approx(mult) and float(hp["clip_norm"]) == pytest.approx(threshold)
  assert int(state.step) == len(plan) and int(state.skipped) == 0


@pytest.mark.parametrize("what", ["loss", "gradient"])
def test_a_non_finite_loss_or_gradient_skips_the_update_and_is_counted(what):
  tx, _ = make_optimizer(CFG, 8)
  state = _state(_params(), tx)
  grads = jax.tree.map(jnp.ones_like, state.params)
  state, _ = apply_gradients(state, grads, jnp.float32(1.0))  # one good update first
  before = jax.tree.map(np.asarray, (state.params, state.opt_state.inner_state))
  loss = jnp.float32(jnp.nan if what == "loss" else 1.0)
  if what == "gradient":
    grads = {**grads, "w_in": grads["w_in"].at[0, 0].set(jnp.inf)}
  state, metrics = apply_gradients(state, grads, loss)
  assert float(metrics["skipped"]) == 1.0 and float(metrics["update_norm"]) == 0.0
  assert int(state.skipped) == 1 and int(state.step) == 1
  after = jax.tree.map(np.asarray, (state.params, state.opt_state.inner_state))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)
  # The next good update is the second one the schedule and Adam see.
  state, _ = apply_gradients(state, jax.tree.map(jnp.ones_like, state.params), jnp.float32(1.0))
  assert int(state.step) == 2 and int(state.opt_state.inner_state.count) == 2 and int(state.skipped) == 1


def test_without_grad_clip_the_threshold_is_infinite():
  tx, _ = make_optimizer(OptimConfig(grad_clip=0.0), 4)
  assert float(hyperparams(tx.init(_params()))["clip_norm"]) == float("inf")


def test_weight_decay_reaches_a_real_models_matrices_and_no_norm_or_bias():
  """The decay mask on an nnx model's state (each path ends in ``.value``: read as the parameter's name,
  nothing decayed and ``--weight_decay`` did nothing): with zero gradients one update scales every
  ``w_*``, embedding and head matrix of the policy and the critic by ``1 - lr * weight_decay``, and
  leaves the norm scales, the critic's head vector and its bias as they were."""
  from flax import nnx

  from mimo_jax.models import Transformer
  from mimo_jax.models.config import tiny
  from mimo_jax.models.transformer import ValueModel

  cfg = OptimConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5, grad_clip=0.0, lr_schedule="constant")
  policy = Transformer(tiny().replace(tie_embeddings=False), rngs=nnx.Rngs(0))
  for model in (policy, ValueModel.from_policy(policy, rngs=nnx.Rngs(1))):
    tx, _ = make_optimizer(cfg, 4)
    state = TrainState.create(model, tx, jax.random.key(0))
    grads = jax.tree.map(jnp.zeros_like, state.params)
    after, _ = apply_gradients(state, grads, jnp.float32(1.0))
    decayed = set()
    for (path, a), b in zip(
      jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(after.params), strict=True
    ):
      name = jax.tree_util.keystr(path)
      matrix = any(f"'{p}" in name for p in ("w_", "embed", "lm_head"))
      expected = np.asarray(a) * (1 - 0.1 * 0.5) if matrix else np.asarray(a)
      np.testing.assert_allclose(b, expected, rtol=1e-6, atol=1e-8, err_msg=name)
      if matrix:
        decayed.add(name.split("'")[-2])
    assert {"embed_vd", "w_up_df", "w_down_fd"} <= decayed, decayed
    assert ("lm_head_dv" in decayed) == (model is policy)
