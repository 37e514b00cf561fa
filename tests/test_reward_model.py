"""The learned reward model: Bradley-Terry loss, last-token scoring, training on the arith
task, checkpoint round trip, no recompiles in the scorer, sharded == single device."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax.models import Transformer, ValueModel
from mimo_jax.models.config import tiny
from mimo_jax.optim import sgd
from mimo_jax.rewards.base import RewardSample
from mimo_jax.rewards.reward_model import (
  CHECKPOINT_SUBDIR,
  RewardModelScorer,
  bradley_terry_loss,
  load_reward_model,
  make_rm_score_fn,
  pair_accuracy,
  train_reward_model,
)
from mimo_jax.sharding import MeshConfig, build_mesh
from mimo_jax.tasks.arith import ArithTask, build_tokenizer
from mimo_jax.testing import count_compilations

BUCKETS = (8,)
M = 4  # up to three answer digits + EOS


def _pairs(problems, rng):
  """(prompt, correct answer, a wrong answer drawn uniformly from 0..198)."""
  out = []
  for p in problems:
    wrong = int(p.answer)
    while wrong == int(p.answer):
      wrong = int(rng.integers(0, 199))
    out.append((p.prompt, p.answer, str(wrong)))
  return out


@pytest.fixture(scope="module")
def arith():
  task = ArithTask(levels=(1,), seed=0, heldout_size=256)
  tokenizer = build_tokenizer(task)
  cfg = tiny().replace(vocab_size=tokenizer.vocab_size, max_seq_len=32)
  train = _pairs(task.sample(np.random.default_rng(0), 4000), np.random.default_rng(0))
  heldout = _pairs(task.heldout(), np.random.default_rng(1))
  return task, tokenizer, cfg, train, heldout


@pytest.fixture(scope="module")
def trained(arith, tmp_path_factory):
  """The untrained and the trained reward model (the trained one checkpointed)."""
  _, tokenizer, cfg, train, _ = arith
  run_dir = str(tmp_path_factory.mktemp("rm") / "run")
  common = dict(tokenizer=tokenizer, model_cfg=cfg, batch_size=64, buckets=BUCKETS, max_completion_len=M, seed=0)
  init = train_reward_model(train, steps=0, **common)
  final = train_reward_model(train, steps=600, learning_rate=3e-3, run_dir=run_dir, **common)
  return init, final, run_dir


def _scorer(graphdef, params, tokenizer, mesh=None, batch_rows=256):
  return RewardModelScorer(
    graphdef, params, tokenizer, mesh=mesh, buckets=BUCKETS, max_completion_len=M, batch_rows=batch_rows
  )


# ----------------------------------------------------------------------------
# Bradley-Terry loss
# ----------------------------------------------------------------------------


def test_bradley_terry_golden_values():
  # Hand values: -log sigmoid(x) = log(1 + e^-x).
  loss, m = bradley_terry_loss(jnp.array([2.0]), jnp.array([0.0]))
  np.testing.assert_allclose(loss, 0.126928, atol=1e-6)
  assert float(m["accuracy"]) == 1.0 and float(m["margin"]) == 2.0
  loss, m = bradley_terry_loss(jnp.array([0.5]), jnp.array([0.5]))
  np.testing.assert_allclose(loss, math.log(2.0), atol=1e-6)
  assert float(m["accuracy"]) == 0.0  # a tie is not a win

  # Mean over pairs: log(1+e^-2), log 2, log(1+e^2) = 0.126928, 0.693147, 2.126928.
  loss, m = bradley_terry_loss(jnp.array([2.0, 0.0, -1.0]), jnp.array([0.0, 0.0, 1.0]))
  np.testing.assert_allclose(loss, (0.126928 + 0.693147 + 2.126928) / 3, atol=1e-5)
  np.testing.assert_allclose(m["accuracy"], 1 / 3, atol=1e-7)
  np.testing.assert_allclose(m["margin"], 0.0, atol=1e-7)

  # A margin asks for a bigger gap: log(1 + e^-(2 - 1)) = 0.313262; metrics use the raw gap.
  loss, m = bradley_terry_loss(jnp.array([2.0]), jnp.array([0.0]), margin=1.0)
  np.testing.assert_allclose(loss, 0.313262, atol=1e-6)
  assert float(m["margin"]) == 2.0

  # Numerically stable at large gaps (a naive log(sigmoid(x)) gives inf at -1000).
  loss, _ = bradley_terry_loss(jnp.array([1000.0, -1000.0]), jnp.array([0.0, 0.0]))
  np.testing.assert_allclose(loss, 500.0, rtol=1e-6)


# ----------------------------------------------------------------------------
# Last-token scoring
# ----------------------------------------------------------------------------


def _build(make):
  """``make()`` built by one compiled initialiser (eager construction compiles every op)."""
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1])())


def test_score_is_read_at_the_last_valid_token():
  cfg = tiny()

  def make():
    model = ValueModel(cfg, rngs=nnx.Rngs(0))
    model.value_head_d.set_value(jax.random.normal(jax.random.key(1), (cfg.d_model,)))  # a non-zero head
    return model

  graphdef, params = nnx.split(_build(make))
  score = make_rm_score_fn(graphdef, None)

  prompt_mask = np.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]], bool)
  completion_mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  rng = np.random.default_rng(0)
  prompt = rng.integers(4, 200, prompt_mask.shape).astype(np.int32)
  completion = rng.integers(4, 200, completion_mask.shape).astype(np.int32)
  base = np.asarray(score(params, prompt, prompt_mask, completion, completion_mask))

  # The value at the last position of the unpadded sequence (both rows have 7 real tokens).
  forward = jax.jit(lambda params, seq: nnx.merge(graphdef, params)(seq)[:, -1])
  unpadded = np.stack([np.concatenate([prompt[b][prompt_mask[b]], completion[b][completion_mask[b]]]) for b in (0, 1)])
  np.testing.assert_allclose(base, np.asarray(forward(params, unpadded)), atol=1e-5)

  # Padded positions (prompt and completion) do not matter ...
  p2, c2 = prompt.copy(), completion.copy()
  p2[~prompt_mask] = 7
  c2[~completion_mask] = 9
  np.testing.assert_array_equal(np.asarray(score(params, p2, prompt_mask, c2, completion_mask)), base)
  # ... the last real token does (row 0: completion slot 2; row 1: slot 4).
  c3 = completion.copy()
  c3[0, 2] += 1
  c3[1, 4] += 1
  changed = np.asarray(score(params, prompt, prompt_mask, c3, completion_mask))
  assert np.all(np.abs(changed - base) > 1e-4)
  # An empty completion scores the prompt's last token.
  empty = np.zeros_like(completion_mask)
  np.testing.assert_allclose(
    np.asarray(score(params, prompt, prompt_mask, completion, empty))[0],
    np.asarray(forward(params, prompt[:1, 2:]))[0],
    atol=1e-5,
  )


# ----------------------------------------------------------------------------
# Training on the arithmetic task
# ----------------------------------------------------------------------------


def test_reward_model_learns_arith_preferences(arith, trained):
  _, tokenizer, _, _, heldout = arith
  (g0, p0, h0), (g1, p1, history), _ = trained
  assert h0 == [] and len(history) == 600
  before = pair_accuracy(_scorer(g0, p0, tokenizer), heldout)
  scorer = _scorer(g1, p1, tokenizer)
  after = pair_accuracy(scorer, heldout)
  assert 0.35 <= before <= 0.65, before  # the untrained model is at chance
  assert after >= 0.85, after
  # Not a length shortcut: pairs whose answers have the same number of digits are ranked too.
  same_length = [p for p in heldout if len(p[1]) == len(p[2])]
  assert len(same_length) >= 50
  assert pair_accuracy(scorer, same_length) >= 0.7
  assert history[-1]["rm_loss"] < 0.5 * math.log(2.0) and history[0]["skipped"] == 0.0


def test_checkpoint_round_trip_gives_identical_scores(arith, trained):
  _, tokenizer, cfg, _, heldout = arith
  _, (graphdef, params, _), run_dir = trained
  assert os.path.isdir(os.path.join(run_dir, CHECKPOINT_SUBDIR))
  g2, p2, cfg2 = load_reward_model(run_dir)
  assert cfg2 == cfg
  samples = [RewardSample(p, c) for p, c, _ in heldout[:20]]
  np.testing.assert_array_equal(_scorer(g2, p2, tokenizer)(samples), _scorer(graphdef, params, tokenizer)(samples))


def test_scorer_does_not_recompile_for_other_sample_counts(arith, trained):
  _, tokenizer, _, _, heldout = arith
  _, (graphdef, params, _), _ = trained
  scorer = _scorer(graphdef, params, tokenizer, batch_rows=8)
  samples = [RewardSample(p, c) for p, c, _ in heldout[:19]]
  first = scorer(samples[:3])  # warm-up compiles once
  with count_compilations() as counter:
    second = scorer(samples[:7])
    third = scorer(samples)  # three chunks of 8 rows
  assert counter.count == 0
  assert len(second) == 7 and len(third) == 19
  # A sample's score does not depend on the other rows of its call.
  np.testing.assert_allclose(second[:3], first, atol=1e-6)
  np.testing.assert_allclose(third[:7], second, atol=1e-6)
  assert scorer.last_metrics()["num_samples"] == 19.0
  # Truncated completions get no EOS, so they are scored at their last digit instead.
  cut = scorer([dataclasses.replace(samples[0], truncated=True)])
  assert abs(cut[0] - first[0]) > 1e-4


def test_sharded_scores_match_single_device(arith, trained):
  _, tokenizer, _, _, heldout = arith
  (g0, p0, _), (graphdef, params, _), run_dir = trained
  mesh = build_mesh(MeshConfig(2, 2, 2))
  g_mesh, p_mesh, _ = load_reward_model(run_dir, mesh)
  w = p_mesh["decoder"]["layers"]["mlp"]["w_gate_df"].get_value()
  assert w.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  samples = [RewardSample(p, c) for p, c, _ in heldout[:24]] + [RewardSample(p, r) for p, _, r in heldout[:24]]
  # The untrained model, laid out like the restored one.
  p0_mesh = jax.device_put(p0, jax.tree.map(lambda x: x.sharding, p_mesh))
  single = _scorer(g0, p0, tokenizer, batch_rows=16)(samples)
  sharded = _scorer(g_mesh, p0_mesh, tokenizer, mesh=mesh, batch_rows=16)(samples)
  np.testing.assert_allclose(sharded, single, atol=1e-5)
  assert np.std(single) > 1e-3  # the scores differ between samples
  # The trained model: scores of order 1-10, and tensor parallelism sums the heads and the
  # MLP in another order, so float32 rounding differs by up to a few 1e-5.
  single = _scorer(graphdef, params, tokenizer, batch_rows=16)(samples)
  sharded = _scorer(g_mesh, p_mesh, tokenizer, mesh=mesh, batch_rows=16)(samples)
  np.testing.assert_allclose(sharded, single, atol=1e-4)
  assert np.std(single) > 0.1


def test_sharded_training_matches_single_device(arith):
  _, tokenizer, cfg, train, _ = arith
  mesh = build_mesh(MeshConfig(2, 2, 2))
  common = dict(
    tokenizer=tokenizer,
    model_cfg=cfg,
    steps=2,
    batch_size=8,
    buckets=BUCKETS,
    max_completion_len=M,
    seed=3,
    optimizer=sgd(0.5),  # linear in the gradient, so parameters compare tightly
  )
  _, single, h_single = train_reward_model(train[:64], **common)
  _, sharded, h_sharded = train_reward_model(train[:64], mesh=mesh, **common)
  for a, b in zip(h_single, h_sharded, strict=True):
    np.testing.assert_allclose(b["rm_loss"], a["rm_loss"], rtol=1e-5)
    assert a["accuracy"] == b["accuracy"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6), single, sharded)
  head = sharded["value_head_d"].get_value()
  assert isinstance(head.sharding, jax.sharding.NamedSharding)
  # The parameters did move.
  assert h_single[1]["grad_norm"] > 0 and h_single[0]["update_norm"] > 0


def test_backbone_initialised_from_policy(arith):
  _, tokenizer, cfg, train, _ = arith
  policy = _build(lambda: Transformer(cfg, rngs=nnx.Rngs(7)))
  graphdef, params, _ = train_reward_model(
    train[:8], tokenizer=tokenizer, policy=policy, steps=0, batch_size=4, buckets=BUCKETS, max_completion_len=M
  )
  rm = nnx.merge(graphdef, params)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(rm.decoder), nnx.state(policy.decoder))
  with pytest.raises(ValueError, match="exactly one"):
    train_reward_model(train[:8], tokenizer=tokenizer, model_cfg=cfg, policy=policy, steps=0, batch_size=4)
  with pytest.raises(ValueError, match="vocabulary"):
    train_reward_model(train[:8], tokenizer=tokenizer, model_cfg=cfg.replace(vocab_size=8), steps=0, batch_size=4)
