"""Async rollout: bounded, exact staleness; zero staleness equal to the synchronous loop; IS corrections."""

import json
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax import rl
from mimo_jax.ckpt import Checkpointer
from mimo_jax.config import ConfigError, validate
from mimo_jax.main import main, parse_config
from mimo_jax.testing import count_compilations, kill_resume
from mimo_jax.train.async_rollout import AsyncRollout, RolloutStopped
from mimo_jax.train.learner import Faults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
# An entropy bonus moves the policy at every update even while the tiny model's rewards are all 0,
# so stale samples really are off-policy.
SMALL = [
  f"--flagfile={FLAGFILE}",
  "--model_preset=tiny",
  "--sft_steps=10",
  "--entropy_coef=0.01",
  "--warmup_steps=0",
  "--sft_batch_size=16",
  "--max_steps=6",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--eval_every=3",
  "--max_new_tokens=6",
  "--checkpoint_every=1",
  "--keep_last=50",
  "--mesh_fsdp=8",
  "--tensorboard=false",
  "--learning_rate=3e-4",
]


def _rl_records(run_dir):
  return [r for r in kill_resume.load_metrics(str(run_dir)) if "reward_mean" in r]


def _metas(run_dir):
  ckpt = Checkpointer(os.path.join(str(run_dir), "checkpoints"), read_only=True)
  try:
    return [ckpt.read_meta(s) for s in ckpt.all_steps()]
  finally:
    ckpt.close()


def _final_meta(run_dir):
  return _metas(run_dir)[-1]


# ----------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--max_staleness=2"], "--max_staleness=2: bounds the lag of --async_rollout"),
    (["--rollout_devices=2"], "--rollout_devices=2: a rollout sub-mesh needs --async_rollout"),
    (["--is_correction=tris"], "--is_correction"),
    (["--is_clip=0.5"], "--is_clip=0.5: must be >= 1"),
    (["--async_rollout", "--max_staleness=-2"], "--max_staleness=-2: must be -1 or >= 0"),
  ],
)
def test_bad_async_flags_fail_before_compute(argv, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    parse_config(["prog", *argv])


def test_rollout_devices_must_leave_devices_to_learn_on():
  cfg = parse_config(["prog", "--async_rollout", f"--rollout_devices={jax.device_count()}"])
  with pytest.raises(ConfigError, match="--rollout_devices=8: must leave devices to learn on"):
    validate(cfg, jax.device_count())


def test_staleness_and_correction_defaults_resolve():
  from mimo_jax.train.learner import is_correction

  sync = parse_config(["prog"])
  assert sync.rollout.staleness == 0 and is_correction(sync) == "none"
  default_async = parse_config(["prog", "--async_rollout"])
  assert default_async.rollout.staleness == 1 and is_correction(default_async) == "decoupled"
  lockstep = parse_config(["prog", "--async_rollout", "--max_staleness=0"])
  assert lockstep.rollout.staleness == 0 and is_correction(lockstep) == "none"
  chosen = parse_config(["prog", "--async_rollout", "--max_staleness=3", "--is_correction=tis"])
  assert chosen.rollout.staleness == 3 and is_correction(chosen) == "tis"
  # A truncating sampler draws from a renormalised distribution the learner does not score.
  assert is_correction(parse_config(["prog", "--top_k=20"])) == "tis"
  assert is_correction(parse_config(["prog", "--top_p=0.9"])) == "tis"
  assert is_correction(parse_config(["prog", "--top_p=0.9", "--is_correction=none"])) == "none"


# ----------------------------------------------------------------------------
# The corrections, against hand-computed values
# ----------------------------------------------------------------------------

# Two rows of three tokens; row 1's last token is padding.  Log-ratios log(pi_prox / mu):
LOG_RATIO = np.log(np.array([[1.0, 3.0, 0.5], [1.5, 1.5, 9.0]]))
MASK = np.array([[True, True, True], [True, True, False]])
BEHAVIOUR = np.full((2, 3), -1.0)
PROXIMAL = BEHAVIOUR + LOG_RATIO


@pytest.mark.parametrize(
  "mode, weights, clipfrac",
  [
    ("none", [[1, 1, 1], [1, 1, 0]], 0.0),
    # min(ratio, 2)
    ("tis", [[1, 2, 0.5], [1.5, 1.5, 0]], 1 / 5),
    # geometric means: row 0 (1 * 3 * 0.5)^(1/3) = 1.145 (kept), row 1 1.5 (kept)
    ("mis", [[1, 1, 1], [1, 1, 0]], 0.0),
    # the ratio itself, masked above 2
    ("decoupled", [[1, 0, 0.5], [1.5, 1.5, 0]], 1 / 5),
  ],
)
def test_importance_weights_match_hand_computed_values(mode, weights, clipfrac):
  w, m = rl.importance_weights(PROXIMAL, BEHAVIOUR, MASK, mode=mode, clip=2.0)
  np.testing.assert_allclose(np.asarray(w), weights, rtol=1e-6)
  np.testing.assert_allclose(float(m["is_ratio_mean"]), (1 + 3 + 0.5 + 1.5 + 1.5) / 5, rtol=1e-6)
  np.testing.assert_allclose(float(m["is_ratio_max"]), 3.0, rtol=1e-6)  # the padded 9 is not counted
  np.testing.assert_allclose(float(m["is_clipfrac"]), clipfrac, rtol=1e-6)


def test_masked_is_drops_whole_rows_outside_the_band():
  # Row 0's geometric mean is 1.145; with C = 1.1 it falls outside [1/1.1, 1.1], row 1 (1.5) too.
  w, m = rl.importance_weights(PROXIMAL, BEHAVIOUR, MASK, mode="mis", clip=1.1)
  np.testing.assert_allclose(np.asarray(w), np.zeros((2, 3)))
  assert float(m["is_clipfrac"]) == 1.0
  # A row far below 1 is dropped as well: ratios 0.25 everywhere.
  w, _ = rl.importance_weights(BEHAVIOUR + np.log(0.25), BEHAVIOUR, MASK, mode="mis", clip=2.0)
  assert float(jnp.sum(w)) == 0.0


def test_weights_carry_no_gradient_and_bad_arguments_are_refused():
  grad = jax.grad(lambda p: jnp.sum(rl.importance_weights(p, BEHAVIOUR, MASK, mode="tis", clip=2.0)[0]))(PROXIMAL)
  assert float(jnp.abs(grad).sum()) == 0.0
  with pytest.raises(ValueError, match="unknown IS correction 'x'"):
    rl.importance_weights(PROXIMAL, BEHAVIOUR, MASK, mode="x", clip=2.0)
  with pytest.raises(ValueError, match="must be >= 1"):
    rl.importance_weights(PROXIMAL, BEHAVIOUR, MASK, mode="tis", clip=0.5)


def test_behaviour_gap_is_the_k3_estimate_and_zero_on_policy():
  assert float(rl.behaviour_gap(BEHAVIOUR, BEHAVIOUR, MASK)) == 0.0
  r = np.exp(LOG_RATIO)  # pi_prox / mu, samples from mu: k3 = r - 1 - log r
  expected = ((r - 1 - LOG_RATIO) * MASK).sum() / MASK.sum()
  np.testing.assert_allclose(float(rl.behaviour_gap(PROXIMAL, BEHAVIOUR, MASK)), expected, rtol=1e-5)


# ----------------------------------------------------------------------------
# The producer's admission control, on a host-only worker
# ----------------------------------------------------------------------------


class _HostWorker:
  """The two things the producer uses of a RolloutWorker, on the host: ``produce`` and its state."""

  def __init__(self):
    self.made = []  # (batch id, version of the weights it was made with, versions published then)
    self.params = None
    self.draws = 0
    self.rollout = None

  def update_params(self, params):
    self.params = params

  def produce(self, step, policy_version):
    assert self.params == policy_version  # made with exactly the version it is stamped with
    self.made.append((step, policy_version, sorted(self.rollout._versions)))
    self.draws += 1
    time.sleep(0.001)
    return ("batch", step, policy_version)

  def host_state(self, *, with_data):
    return {"draws": self.draws, "loop_key": np.zeros(2, np.uint32)}


@pytest.mark.parametrize("threaded", [True, False], ids=["thread", "inline"])
@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_the_producer_runs_exactly_k_versions_ahead(staleness, threaded):
  worker = _HostWorker()
  rollout = AsyncRollout(worker, max_staleness=staleness, to_rollout=lambda p: p, end=8, threaded=threaded)
  worker.rollout = rollout
  rollout.start(0, 0, 0)
  for step in range(8):
    if step:
      rollout.publish(step, step)
    assert rollout.get(step) == ("batch", step, max(step - staleness, 0))
    assert rollout.queue_len() <= staleness
  # Batch b was made with version b - K, which existed by then.
  for b, version, published in worker.made:
    assert version == max(b - staleness, 0) and version in published
  assert [b for b, _, _ in worker.made] == list(range(8))
  rollout.stop()


@pytest.mark.parametrize("threaded", [True, False], ids=["thread", "inline"])
def test_paused_lends_the_worker_between_the_same_two_batches_and_refreshes_the_record(threaded):
  worker = _HostWorker()
  rollout = AsyncRollout(worker, max_staleness=2, to_rollout=lambda p: p, end=10, threaded=threaded)
  worker.rollout = rollout
  rollout.start(0, 0, 0)
  rollout.get(0)
  with rollout.paused() as w:
    # Every batch version 0 admits (0, 1, 2) is made before the caller gets the worker.
    assert [b for b, _, _ in worker.made] == [0, 1, 2]
    w.draws += 100
  assert rollout.record_before(3)["draws"] == 103
  assert rollout.pending(1) == [1, 2]
  rollout.stop()


def test_paused_right_after_a_publish_waits_for_the_batch_it_admits():
  """A fast step: the learner publishes version 1 (admitting batch 2), takes batch 1 and pauses at once.
  The producer was waiting for a version a moment before; the pause still comes after batch 2 (the
  evaluation's draw falls between the same two batches on every run), in every one of 50 tries."""
  for _ in range(50):
    worker = _HostWorker()
    rollout = AsyncRollout(worker, max_staleness=1, to_rollout=lambda p: p, end=10, threaded=True)
    worker.rollout = rollout
    rollout.start(0, 0, 0)
    rollout.get(0)
    time.sleep(0.01)  # the producer has made 0 and 1 and waits for version 1
    rollout.publish(1, 1)
    rollout.get(1)
    with rollout.paused() as w:
      assert [b for b, _, _ in worker.made] == [0, 1, 2]
      w.draws += 100
    assert rollout.record_before(3)["draws"] == 103
    rollout.stop()


def test_the_inline_producer_makes_the_same_batches_at_the_same_hand_offs_as_the_thread():
  """What several processes run: every batch made in the learner's thread, with the versions, the order
  and the worker state at each hand-off of the threaded producer."""
  seen = {}
  for threaded in (True, False):
    worker = _HostWorker()
    rollout = AsyncRollout(worker, max_staleness=1, to_rollout=lambda p: p, end=6, threaded=threaded)
    worker.rollout = rollout
    rollout.start(0, 0, 0)
    records = []
    for step in range(6):
      if step:
        rollout.publish(step, step)
      got = rollout.get(step)
      rollout.produce_ahead()  # the learner's call after each step (nothing to do for a thread)
      if step == 3:
        with rollout.paused() as w:
          w.draws += 10  # an evaluation between the same two batches
      records.append((got, rollout.record_before(step + 1)["draws"] if step < 5 else None))
    rollout.stop()
    seen[threaded] = (records, [(b, v) for b, v, _ in worker.made])
  assert seen[True] == seen[False]
  assert seen[False][1] == [(b, max(b - 1, 0)) for b in range(6)]


def test_a_producer_error_reaches_the_learner_and_stop_unblocks_it():
  class Failing(_HostWorker):
    def produce(self, step, policy_version):
      raise RuntimeError("reward worker died")

  rollout = AsyncRollout(Failing(), max_staleness=1, to_rollout=lambda p: p, end=4)
  rollout.start(0, 0, 0)
  with pytest.raises(RuntimeError, match="reward worker died"):
    rollout.get(0)
  rollout.stop()

  worker = _HostWorker()
  rollout = AsyncRollout(worker, max_staleness=0, to_rollout=lambda p: p, end=4)
  worker.rollout = rollout
  rollout.start(0, 0, 0)
  rollout.get(0)
  errors = []

  def wait_for_batch_1():  # batch 1 needs version 1, never published
    try:
      rollout.get(1)
    except RolloutStopped as e:
      errors.append(e)

  t = threading.Thread(target=wait_for_batch_1)
  t.start()
  time.sleep(0.05)
  rollout.stop()  # the producer waits for version 1; stopping it must wake the learner too
  t.join(timeout=10)
  assert not t.is_alive() and errors


# ----------------------------------------------------------------------------
# End to end: the real worker, sampler and learner
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("async")
  flags = {
    "sync": [],
    "lockstep": ["--async_rollout", "--max_staleness=0"],
    "stale2": ["--async_rollout", "--max_staleness=2"],
  }
  for name, extra in flags.items():
    assert main(["prog", *SMALL, *extra, f"--run_dir={base / name}"]) == 0, name
  return base


def test_zero_staleness_is_bit_identical_to_the_synchronous_loop(runs):
  assert kill_resume.compare(str(runs / "sync"), str(runs / "lockstep")) == []
  # Every update moved the policy: otherwise "identical" would be cheap.
  assert all(r["grad_norm"] > 0 and r["update_norm"] > 0 for r in _rl_records(runs / "sync"))


def test_staleness_is_exact_and_logged_every_step(runs):
  records = _rl_records(runs / "stale2")
  assert [r["staleness_max"] for r in records] == [0, 1, 2, 2, 2, 2]
  assert [r["staleness_mean"] for r in records] == [0, 1, 2, 2, 2, 2]
  for r in records:
    for key in ("is_ratio_mean", "is_ratio_max", "is_clipfrac", "sampler_learner_kl"):
      assert np.isfinite(r[key]), key
  # The timing observations (load_metrics leaves them out): idle times, and the producer at most
  # max_staleness batches ahead.
  raw = [json.loads(line) for line in open(runs / "stale2" / "metrics.jsonl")]
  idle = [r for r in raw if "reward_mean" in r]
  assert len(idle) == 6 and all(r["time_rollout_idle_s"] >= 0 and r["time_learner_idle_s"] >= 0 for r in idle)
  assert all(0 <= r["queue_len"] <= 2 for r in idle)
  # The rollout share is the learner's wait for a batch: a share of its step (the producer's generating
  # time, which overlapped earlier steps, came to 1.95x the step).
  for r in idle:
    assert r["rollout_share"] == pytest.approx(min(r["time_learner_idle_s"] / r["time_step_s"], 1.0), abs=1e-9)
  # Stale rows are off-policy: once the policy has moved, the ratios leave 1.
  assert max(abs(r["is_ratio_mean"] - 1) for r in records[2:]) > 1e-4
  assert all(r["staleness_max"] == 0 for r in _rl_records(runs / "sync"))


def test_a_stale_run_does_not_depend_on_thread_timing(runs, tmp_path):
  # The same configuration again, the machine busy differently: every batch comes from the same
  # weights, so the two runs are identical.
  assert main(["prog", *SMALL, "--async_rollout", "--max_staleness=2", f"--run_dir={tmp_path / 'again'}"]) == 0
  assert kill_resume.compare(str(runs / "stale2"), str(tmp_path / "again")) == []


def test_checkpoints_list_the_real_pending_batches(runs):
  rl_metas = [m for m in _metas(runs / "stale2") if m["phase"] == "rl" and 0 < m["step"] < 6]
  assert rl_metas
  for m in rl_metas:
    buf, s = m["buffer"], m["step"]
    consumed = [b["batch_id"] for b in buf["batches"] if b["status"] == "consumed"]
    assert consumed == list(range(s))  # every batch before step s, once
    pending = [b for b in buf["batches"] if b["status"] == "pending"]
    assert [b["batch_id"] for b in pending] == buf["pending"]
    assert buf["pending"] == list(range(s, s + len(buf["pending"]))) and len(buf["pending"]) <= 3
    assert all(b["policy_version"] == max(b["batch_id"] - 2, 0) for b in pending)
  assert _final_meta(runs / "stale2")["buffer"]["pending"] == []


def test_a_resume_regenerates_pending_batches_deterministically_and_loses_none(runs, tmp_path):
  # Resuming mid-run (what a kill -9 leads to) twice from the same checkpoint: the two resumed runs
  # are identical, and they drew exactly the prompts of the uninterrupted run (same data RNG at the end).
  copies = []
  for name in ("a", "b"):
    dst = tmp_path / name
    shutil.copytree(runs / "stale2", dst)
    assert main(["prog", *SMALL, "--async_rollout", "--max_staleness=2", f"--run_dir={dst}", "--rollback_to=3"]) == 0
    copies.append(dst)
  assert kill_resume.compare(str(copies[0]), str(copies[1])) == []
  records = _rl_records(copies[0])
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # nothing trained on twice
  assert _final_meta(copies[0])["data_rng"] == _final_meta(runs / "stale2")["data_rng"]
  consumed = [b["batch_id"] for b in _final_meta(copies[0])["buffer"]["batches"]]
  assert consumed == list(range(6))
  # The regenerated batches came from the restored (fresher) policy: staleness restarts at 0.
  assert [r["staleness_max"] for r in records] == [0, 1, 2, 0, 1, 2]


# ----------------------------------------------------------------------------
# The learner's ratios against a direct recomputation under the generating policy
# ----------------------------------------------------------------------------


def _learner_run(tmp_path, *extra):
  from mimo_jax.train.loop import RLRun

  cfg = parse_config(["prog", *SMALL, f"--run_dir={tmp_path}", *extra])
  run = RLRun(cfg, str(tmp_path))
  run.open_logger(None)
  return run


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_stale_ratios_equal_a_direct_recomputation_under_the_generating_policy(tmp_path, mode):
  from mimo_jax.models.logprobs import completion_stats
  from mimo_jax.rl.advantages import masked_mean

  # A stale batch simulated in a synchronous run: the learner must recompute its behaviour log-probs
  # (in a real async run --behaviour_logprobs=auto does, staleness being possible).
  run = _learner_run(tmp_path, f"--is_correction={mode}", "--is_clip=1.05", "--behaviour_logprobs=recompute")
  state = run.begin_rl(run.fresh_state("rl").params, {})
  generating = jax.tree.map(jnp.copy, state.params)
  batch = run.worker.produce(2, 0)  # made by version 0, trained on at step 2: two versions stale
  # The learner's policy moved on (two perturbed versions later).
  leaves, treedef = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  moved = [p + 0.02 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys, strict=True)]
  state = state.replace(policy=state.policy.replace(params=jax.tree.unflatten(treedef, moved)))
  learner_params = jax.tree.map(jnp.copy, state.params)
  same_state = jax.tree.map(jnp.copy, state)
  # Rewards that differ within groups (the tiny model's own are all 0), so the advantages are not 0.
  exp = batch.experience
  exp = exp.replace(rewards=np.arange(exp.rewards.shape[0], dtype=np.float32) % 3)
  _, metrics = run.learner.learn(state, exp, jnp.int32(2), Faults.none())
  metrics = jax.device_get(metrics)
  # The weights reach the update: the uncorrected learner's loss on the same state and batch differs.
  from mimo_jax.train.learner import build_learner

  plain_cfg = parse_config(["prog", *SMALL, "--is_correction=none", "--behaviour_logprobs=recompute"])
  plain = build_learner(plain_cfg, run.mesh, run.graphdef)
  _, plain_metrics = plain.learn(same_state, exp, jnp.int32(2), Faults.none())
  assert float(plain_metrics["train"]["pg_loss"]) != pytest.approx(float(metrics["train"]["pg_loss"]), rel=1e-4)
  np.testing.assert_allclose(plain_metrics["rollout"]["is_ratio_mean"], metrics["rollout"]["is_ratio_mean"], rtol=1e-6)

  from flax import nnx

  def logp(params):
    model = nnx.merge(run.graphdef, params)
    args = (exp.prompt_tokens, exp.prompt_mask, exp.completion_tokens, exp.completion_mask, exp.temperature)
    return completion_stats(model, *args, impl="full")[0]

  mask = exp.completion_mask
  # The sampler's own log-probs are the generating policy's.
  np.testing.assert_allclose(
    np.asarray(exp.sampler_logprobs)[np.asarray(mask)], np.asarray(logp(generating))[np.asarray(mask)], atol=2e-4
  )
  ratio = jnp.exp(logp(learner_params) - logp(generating))
  np.testing.assert_allclose(metrics["rollout"]["is_ratio_mean"], float(masked_mean(ratio, mask)), rtol=1e-3)
  np.testing.assert_allclose(metrics["rollout"]["is_ratio_max"], float(jnp.max(jnp.where(mask, ratio, 0))), rtol=1e-3)
  changed = ratio > 1.05
  # (one token within rounding of the threshold may fall either side)
  one_token = 1.0 / float(jnp.sum(mask))
  np.testing.assert_allclose(metrics["rollout"]["is_clipfrac"], float(masked_mean(changed, mask)), atol=one_token)
  assert 0 < metrics["rollout"]["is_clipfrac"] < 1  # the threshold matters on this batch
  assert metrics["rollout"]["staleness_max"] == 2.0
  run.close()


def test_async_steps_compile_nothing_after_warmup(tmp_path):
  run = _learner_run(tmp_path, "--async_rollout", "--max_staleness=1", "--max_steps=6", "--eval_every=0")
  state = run.begin_rl(run.fresh_state("rl").params, {})
  state, _ = run.step(state, 0)
  state, _ = run.step(state, 1)
  with count_compilations() as c:
    for step in range(2, 6):
      state, (record, *_) = run.step(state, step)
  assert c.count == 0
  assert record["staleness_max"] == 1.0
  run.close()


def test_the_async_run_directory_records_the_flags(runs):
  cfg = json.load(open(runs / "stale2" / "config.json"))
  assert cfg["rollout"]["async_rollout"] is True and cfg["rollout"]["max_staleness"] == 2
  assert cfg["algo"]["is_correction"] == "auto"


# ----------------------------------------------------------------------------
# The rollout sub-mesh: its own devices, the generation layout, the same outputs
# ----------------------------------------------------------------------------


def test_the_generation_layout_is_its_own_table_and_generates_the_same_outputs():
  from flax import nnx

  from mimo_jax import sharding
  from mimo_jax.models import Transformer, create_sharded
  from mimo_jax.models.config import tiny
  from mimo_jax.rollout import generate

  assert sharding.GENERATE_RULES != sharding.TRAIN_RULES
  assert dict(sharding.GENERATE_RULES)["embed"] is None and dict(sharding.TRAIN_RULES)["embed"] == "fsdp"
  cfg = tiny().replace(num_heads=4, num_kv_heads=2)
  train_mesh = sharding.build_mesh(sharding.MeshConfig(1, 8, 1))
  trained = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(3)), train_mesh)
  graphdef, params = nnx.split(trained)
  rollout_devices, _ = sharding.split_devices(4)
  rmesh = sharding.rollout_mesh(rollout_devices)
  moved = jax.device_put(params, sharding.generation_shardings(params, rmesh))
  # Moved device to device onto the rollout devices, replicated over fsdp there.
  train_leaves, moved_leaves = jax.tree.leaves(params), jax.tree.leaves(moved)
  assert all(set(x.sharding.device_set) == set(rollout_devices) for x in moved_leaves)
  assert any("fsdp" in str(x.sharding.spec) for x in train_leaves)
  assert not any("fsdp" in str(x.sharding.spec) for x in moved_leaves)
  for a, b in zip(train_leaves, moved_leaves, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17]]
  for kw in (dict(temperature=0.0), dict(temperature=0.8, top_k=50, seed=11)):
    a = generate(trained, prompts, max_new_tokens=8, num_samples=2, mesh=train_mesh, **kw)
    b = generate(nnx.merge(graphdef, moved), prompts, max_new_tokens=8, num_samples=2, mesh=rmesh, **kw)
    np.testing.assert_array_equal(np.asarray(a.completion_tokens), np.asarray(b.completion_tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


def test_a_run_on_a_rollout_sub_mesh_generates_on_its_own_devices(tmp_path):
  run = _learner_run(
    tmp_path, "--async_rollout", "--max_staleness=1", "--rollout_devices=4", "--mesh_fsdp=-1", "--max_steps=3"
  )
  rollout_devices = set(jax.devices()[:4])
  assert set(run.mesh.devices.flat) == set(jax.devices()[4:])
  state = run.begin_rl(run.fresh_state("rl").params, {})
  records = []
  for step in range(3):
    state, (record, *_) = run.step(state, step)
    records.append(record)
  batch_leaf = run.rollout.worker.sampler._state  # the producer's current weights
  assert all(set(x.sharding.device_set) == rollout_devices for x in jax.tree.leaves(batch_leaf))
  assert all(set(x.sharding.device_set) == set(jax.devices()[4:]) for x in jax.tree.leaves(state.params))
  assert [r["staleness_max"] for r in records] == [0, 1, 1]
  assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
  run.close()


def test_the_rollout_sub_mesh_must_fit_the_batch():
  cfg = parse_config(["prog", "--async_rollout", "--rollout_devices=3", "--prompts_per_step=8"])
  with pytest.raises(ConfigError, match="--prompts_per_step=8: must be a multiple of --rollout_devices=3"):
    validate(cfg, jax.device_count())


def test_the_async_benchmark_measures_the_trainers_step():
  from mimo_jax.bench.async_rollout import SHAPES, measure

  assert set(SHAPES["large"]["modes"]) == {"sync", "async_shared", "async_split"}
  flags = ["--model_preset=tiny", "--prompts_per_step=8", "--num_samples=2", "--max_new_tokens=4", "--mesh_fsdp=8"]
  m = measure([*flags, "--async_rollout", "--max_staleness=1"], warmup=1, steps=2)
  assert m["staleness_mean"] == 1.0 and m["samples_per_s"] > 0
  assert 0 <= m["learner_idle_share"] <= 1 and 0 <= m["rollout_idle_share"] <= 1
  assert measure(flags, warmup=1, steps=2)["staleness_mean"] == 0.0


def test_the_dry_run_counts_the_rollout_sub_mesh(tmp_path):
  from mimo_jax.train.dry_run import dry_run

  flags = ["prog", f"--flagfile={FLAGFILE}", "--dry_run", f"--run_dir={tmp_path}", "--async_rollout"]
  report = dry_run(parse_config([*flags, "--rollout_devices=4"]), write=False)
  assert report["rollout_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
  assert report["devices"] == 4 and report["mesh"]["fsdp"] == 4  # the learner's mesh: the other 4
  b = report["per_device_bytes"]
  # The rollout copy is whole on every rollout device; the learner's params are split 4 ways over fsdp.
  assert b["params"] < b["rollout_params"] <= 4 * b["params"]
  shared = dry_run(parse_config(flags), write=False)
  assert shared["rollout_mesh"] is None and "rollout_params" not in shared["per_device_bytes"]


@pytest.mark.slow
def test_kill_9_with_batches_in_flight_loses_nothing_and_trains_on_nothing_twice(tmp_path):
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  flags = [
    *[f for f in SMALL if not f.startswith(("--mesh_fsdp", "--max_steps", "--eval_every"))],
    "--mesh_fsdp=2",
    "--max_steps=12",
    "--eval_every=5",
    "--async_rollout",
    "--max_staleness=2",
  ]
  ref, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
  kill_resume.run_uninterrupted(flags, ref, env)
  kills = kill_resume.run_with_kills(flags, killed, env, kills=2, seed=1)
  assert len(kills) == 2, kills
  resumed = [s for phase, s in kill_resume.resumes(open(killed + ".log").read()) if phase == "rl"]
  assert len(resumed) == 2 and all(0 < s < 12 for s in resumed), resumed
  records = _rl_records(killed)
  assert [r["step"] for r in records] == list(range(1, 13))  # every step once
  final, final_ref = _final_meta(killed), _final_meta(ref)
  assert final["data_rng"] == final_ref["data_rng"]  # the same prompts drawn, none lost, none twice
  assert [b["batch_id"] for b in final["buffer"]["batches"]] == list(range(12))
  assert all(b["status"] == "consumed" for b in final["buffer"]["batches"])
  # Right after each resume the regenerated batches come from the restored policy.
  for s in resumed:
    assert records[s]["staleness_max"] == 0  # RL step s + 1, the first trained after the resume


def test_a_truncating_sampler_is_corrected_by_default_and_its_ratios_are_at_most_one(tmp_path):
  # Drawn from the renormalised top-k distribution, scored under the full softmax: on every kept
  # token pi / mu is the kept probability mass, at most 1, and below 1 somewhere.
  run = _learner_run(tmp_path, "--top_k=3")
  state = run.begin_rl(run.fresh_state("rl").params, {})
  exp = run.worker.produce(0, 0).experience
  _, metrics = run.learner.learn(state, exp, jnp.int32(0), Faults.none())
  m = jax.device_get(metrics["rollout"])
  assert m["is_ratio_max"] <= 1 + 1e-5 and m["is_ratio_mean"] < 0.999
  assert m["staleness_max"] == 0 and m["sampler_learner_kl"] > 0
  run.close()
