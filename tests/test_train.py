"""The GRPO spine: update-step invariants, the guarded update, no recompiles, an end-to-end run."""

import itertools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax.config import Config, ConfigError, OptimConfig, validate
from mimo_jax.eval import pass_at_k
from mimo_jax.main import main, parse_config
from mimo_jax.models import Transformer, create_sharded
from mimo_jax.models.config import tiny
from mimo_jax.optim import TrainState, make_optimizer, sgd
from mimo_jax.rl.controllers import DynamicCoefs
from mimo_jax.rollout import Sampler, SamplingParams, left_pad
from mimo_jax.sharding import MeshConfig, build_mesh
from mimo_jax.testing import count_compilations
from mimo_jax.train.metric_names import describe
from mimo_jax.train.steps import PolicyBatch, SequenceBatch, UpdateSettings, make_score_fn, make_update_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rollout_batch(model, mesh=None, seed=0):
  """A real rollout of the model, scored, with random advantages."""
  sampler = Sampler(model, mesh=mesh)
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(4, 200, rng.integers(2, 8))) for _ in range(4)]
  tokens, mask = left_pad(prompts, 8, 0)
  out = sampler.generate(
    tokens,
    mask,
    num_samples=4,
    max_len=6,
    sampling=SamplingParams(stop_ids=(3,)),
    temperature=1.0,
    key=jax.random.key(seed),
  )
  graphdef, params = nnx.split(model)
  seqs = SequenceBatch(out.prompt_tokens, out.prompt_mask, out.completion_tokens, out.completion_mask)
  old, ref = make_score_fn(graphdef, mesh, use_reference=True)(params, params, seqs, out.temperature)
  adv = jnp.asarray(rng.normal(size=out.lengths.shape), jnp.float32)
  return out, PolicyBatch(
    prompt_tokens=out.prompt_tokens,
    prompt_mask=out.prompt_mask,
    completion_tokens=out.completion_tokens,
    completion_mask=out.completion_mask,
    advantages=adv,
    old_logprobs=old,
    ref_logprobs=ref,
    temperature=out.temperature,
  )


def _state(model, lr=1e-2, tx=None):
  if tx is None:
    tx, _ = make_optimizer(OptimConfig(learning_rate=lr, lr_schedule="constant", grad_clip=0.0), 10)
  return TrainState.create(model, tx, jax.random.key(0))


COEFS = DynamicCoefs(kl_coef=jnp.float32(0.05), entropy_coef=jnp.float32(0.01))


def test_scored_old_logprobs_equal_rollout_logprobs():
  model = Transformer(tiny(), rngs=nnx.Rngs(0))
  out, batch = _rollout_batch(model)
  np.testing.assert_allclose(batch.old_logprobs, out.logprobs, atol=2e-5)
  np.testing.assert_allclose(batch.ref_logprobs, batch.old_logprobs, atol=0)
  assert batch.completion_tokens.shape == (16, 6) and batch.prompt_tokens.shape == (16, 8)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_equals_one_big_batch(agg):
  model = Transformer(tiny(), rngs=nnx.Rngs(1))
  _, batch = _rollout_batch(model, seed=1)
  results = []
  for accum in (1, 4):
    settings = UpdateSettings(loss_agg=agg, agg_norm=6.0, grad_accum=accum)
    # Plain SGD: the parameter change is linear in the gradient (Adam would amplify
    # float noise in near-zero gradients to +-lr steps).
    state0 = _state(Transformer(tiny(), rngs=nnx.Rngs(1)), tx=sgd(1.0))
    state, metrics = make_update_fn(None, settings)(state0, batch, COEFS)
    results.append((state.params, metrics))
  (p1, m1), (p4, m4) = results
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p1, p4)
  for k in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "clipfrac"):
    np.testing.assert_allclose(m1[k], m4[k], rtol=1e-4, atol=1e-7, err_msg=k)


def test_update_changes_params_and_counts_steps():
  model = Transformer(tiny(), rngs=nnx.Rngs(2))
  _, batch = _rollout_batch(model, seed=2)
  state0 = _state(model)
  before = jax.tree.map(np.array, state0.params)
  settings = UpdateSettings(epochs=2, num_minibatches=2)
  state, metrics = make_update_fn(None, settings)(state0, batch, COEFS)
  assert int(state.step) == 4 and int(state.skipped) == 0
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before))
  assert max(diffs) > 0
  assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("minibatches, epochs", [(1, 1), (4, 1), (2, 3)])
def test_the_rl_schedule_spans_the_runs_rl_steps_whatever_the_updates_per_step(minibatches, epochs):
  """The schedule advances once per applied update, ``num_minibatches x ppo_epochs`` of them per RL
  step: at RL step k (that many updates later) it is the hand-computed warm-up and cosine of the run's
  ``--warmup_steps`` and ``--max_steps`` (the pod presets take 4 minibatches: the warm-up ended at RL
  step 5 of 20 and the cosine reached its floor at step 250 of 1000)."""
  from mimo_jax.train.learner import rl_optimizer

  flags = ["--learning_rate=2e-4", "--warmup_steps=20", "--max_steps=1000"]
  cfg = parse_config(["prog", *flags, f"--num_minibatches={minibatches}", f"--ppo_epochs={epochs}"])
  _, schedule = rl_optimizer(cfg)
  for k in (0, 5, 19, 20, 250, 600, 1000):
    hand = 2e-4 * k / 20 if k < 20 else 2e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 20) / 980)))
    assert float(schedule(minibatches * epochs * k)) == pytest.approx(hand, rel=1e-5, abs=1e-12), k


def test_the_policys_schedule_spans_the_steps_after_the_critics_warm_up():
  """``--value_warmup_steps=W`` RL steps apply no policy update, so the policy's warm-up and cosine span
  the ``max_steps - W`` steps after them: the same schedule as a run of that many steps without a critic
  warm-up (spanning all of ``--max_steps``, the cosine ended W steps short of its floor)."""
  from mimo_jax.train.learner import rl_optimizer

  flags = ["--learning_rate=1e-3", "--warmup_steps=2", "--advantage=gae", "--use_value_model"]
  _, warmed = rl_optimizer(parse_config(["prog", *flags, "--max_steps=10", "--value_warmup_steps=5"]))
  _, plain = rl_optimizer(parse_config(["prog", *flags, "--max_steps=5", "--value_warmup_steps=0"]))
  for k in range(6):
    assert float(warmed(k)) == pytest.approx(float(plain(k)), rel=1e-6), k
  assert float(warmed(5)) == pytest.approx(1e-4, rel=1e-6)  # the floor, at the end of the policy's updates


def test_an_optimizer_reset_keeps_the_schedules_position():
  """``--rollback_reset_optimizer``: fresh Adam moments, but the schedule goes on from the update count
  it had (the policy's step counter, at which the trainer reads the logged rate): late in a cosine, the
  next update's rate is the schedule's there, not a warm-up restarted at 0."""
  from mimo_jax.optim import apply_gradients, hyperparams
  from mimo_jax.train.loop import _reset_optimizer

  tx, schedule = make_optimizer(OptimConfig(learning_rate=1.0, warmup_steps=10, grad_clip=0.0), 100)
  state = _state(Transformer(tiny(), rngs=nnx.Rngs(0)), tx=tx)
  grads = jax.tree.map(jnp.ones_like, state.params)
  step = jax.jit(lambda s: apply_gradients(s, grads, jnp.float32(0.0))[0])
  for _ in range(90):
    state = step(state)
  reset = _reset_optimizer(state)
  assert int(reset.opt_state.inner_state.count) == int(reset.step) == 90
  adam = [x for x in jax.tree.leaves(reset.opt_state.inner_state.inner_state) if x.ndim > 0]
  assert adam and all(float(jnp.abs(x).max()) == 0.0 for x in adam)  # the moments are fresh
  after = step(reset)
  assert float(hyperparams(after.opt_state)["learning_rate"]) == pytest.approx(float(schedule(90)), rel=1e-6)
  assert float(schedule(90)) < 0.2  # near the cosine's floor; a restarted warm-up would give 0


def test_non_finite_update_is_skipped_and_counted():
  model = Transformer(tiny(), rngs=nnx.Rngs(3))
  _, batch = _rollout_batch(model, seed=3)
  bad = batch.replace(advantages=batch.advantages.at[0].set(jnp.nan))
  state0 = _state(model)
  params0 = jax.tree.map(np.array, state0.params)
  opt0 = jax.tree.map(np.array, state0.opt_state)
  state, metrics = make_update_fn(None, UpdateSettings())(state0, bad, COEFS)
  assert int(state.skipped) == 1 and int(state.step) == 0 and float(metrics["skipped"]) == 1.0
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.params, params0)
  # The optimizer's inner state (moments, counts, hyperparameters) is untouched; its guard counts the skip.
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.opt_state.inner_state, opt0.inner_state
  )
  assert int(state.opt_state.total_notfinite) == 1 and not bool(state.opt_state.last_finite)
  # The next good batch trains normally.
  state, _ = make_update_fn(None, UpdateSettings())(state, batch, COEFS)
  assert int(state.step) == 1 and int(state.skipped) == 1
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))


def test_sharded_update_matches_single_device():
  cfg = tiny()
  mesh = build_mesh(MeshConfig(2, 2, 2))
  single = Transformer(cfg, rngs=nnx.Rngs(4))
  _, batch = _rollout_batch(single, seed=4)
  linear = sgd(1.0)  # linear in the gradient, so the comparison measures the gradients
  ref_state, ref_m = make_update_fn(None, UpdateSettings())(_state(single, tx=linear), batch, COEFS)
  sharded = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(4)), mesh)
  state, m = make_update_fn(mesh, UpdateSettings())(_state(sharded, tx=linear), batch, COEFS)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_state.params)
  np.testing.assert_allclose(m["loss"], ref_m["loss"], rtol=1e-5)
  w = state.params["decoder"]["layers"]["mlp"]["w_gate_df"]
  assert w.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")


def test_adam_moments_are_sharded_like_params():
  mesh = build_mesh(MeshConfig(1, 4, 2))
  model = create_sharded(lambda: Transformer(tiny(), rngs=nnx.Rngs(5)), mesh)
  state = _state(model)
  params = jax.tree.leaves(state.params)
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert len(moments) == 2 * len(params)
  for p, mu, nu in zip(params, moments[: len(params)], moments[len(params) :], strict=True):
    assert mu.sharding == p.sharding and nu.sharding == p.sharding


def test_warmup_cosine_schedule():
  _, schedule = make_optimizer(OptimConfig(learning_rate=1.0, warmup_steps=10), 110)
  assert float(schedule(0)) == 0.0 and math.isclose(float(schedule(5)), 0.5)
  assert math.isclose(float(schedule(10)), 1.0) and math.isclose(float(schedule(110)), 0.1, rel_tol=1e-5)


@pytest.mark.parametrize("n", [1, 4, 7])
def test_pass_at_k_matches_brute_force(n):
  for c in range(n + 1):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(range(n), k))
      brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
      assert math.isclose(pass_at_k(n, c, k), brute, rel_tol=1e-12, abs_tol=1e-12)
  with pytest.raises(ValueError):
    pass_at_k(4, 5, 1)


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------

FAST = [
  "--model_preset=tiny",
  "--sft_steps=6",
  "--sft_batch_size=16",
  "--max_steps=3",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--eval_every=2",
  "--checkpoint_every=2",
  "--max_new_tokens=6",
]


def _cfg(tmp_path, *extra) -> Config:
  path = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
  return parse_config(["prog", f"--flagfile={path}", f"--run_dir={tmp_path}", *FAST, *extra])


@pytest.mark.parametrize("async_rollout", [False, True], ids=["sync", "async"])
def test_how_often_a_run_evaluates_changes_nothing_it_trains_on(tmp_path, async_rollout):
  """Runs that differ only in ``--eval_every`` log the same RL records (evaluations aside) and end with
  the same arrays: each evaluation drew its key from the loop's stream, so it moved every later
  rollout's keys (the runs parted at the step after the first evaluation).  Two evaluations at one step
  of equal weights agree too: the key is the step's."""
  from mimo_jax.testing import kill_resume

  path = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
  flags = [f"--flagfile={path}", *FAST, "--max_steps=4", f"--async_rollout={str(async_rollout).lower()}"]
  for every in (0, 1):
    assert main(["prog", *flags, f"--eval_every={every}", f"--run_dir={tmp_path / str(every)}"]) == 0
  rl = {
    every: [
      {k: v for k, v in r.items() if not k.startswith("eval/")}
      for r in kill_resume.load_metrics(str(tmp_path / str(every)))
      if "reward_mean" in r
    ]
    for every in (0, 1)
  }
  assert len(rl[0]) == 4 and rl[0] == rl[1]
  every_step = kill_resume.load_metrics(str(tmp_path / "1"))
  assert sum("eval/greedy_accuracy" in r for r in every_step) == 5  # steps 0, 1, 2, 3 and the final one
  ends = [kill_resume.final_arrays(str(tmp_path / str(every))) for every in (0, 1)]
  assert ends[0].keys() == ends[1].keys()
  for k in ends[0]:
    np.testing.assert_array_equal(ends[0][k], ends[1][k], err_msg=k)
  warm = [
    {k: v for r in kill_resume.load_metrics(str(tmp_path / str(e))) if r["step"] == 0 for k, v in r.items() if "/" in k}
    for e in (0, 1)
  ]
  assert warm[0] and warm[0] == warm[1]  # the warm start's evaluation: the same weights, the same key


LEARNER_PROGRAMS = {"learn", "score_rollout", "update_from"}


def test_rl_steps_compile_nothing_after_warmup_and_keep_heldout_out(tmp_path):
  from mimo_jax.train.loop import RLRun

  cfg = _cfg(tmp_path, "--mesh_fsdp=4", "--mesh_data=2")
  run = RLRun(cfg, str(tmp_path))
  run.open_logger(None)
  state = run.begin_rl(run.fresh_state("rl").params, {})
  heldout = {p.uid for p in run.heldout}
  with count_compilations() as first:
    state, _ = run.step(state, 0)
  # --compile_ahead (the default): the learner's program was compiled in its own thread while the first
  # rollout generated, for the very shapes and shardings the step then gave it (else the loop's thread
  # would have compiled it again at the call).
  assert [f for t, f in first.programs if t == "compile-ahead"] == ["learn"], first.programs
  assert not {f for t, f in first.programs if t != "compile-ahead"} & LEARNER_PROGRAMS, first.programs
  # The truncation flags are read on the host, where the reward read them: an eager comparison on the
  # device compiled a program of its own in the first step, beside the learner's compilation.
  assert "equal" not in {f for _, f in first.programs}, first.programs
  state, _ = run.step(state, 1)
  with count_compilations() as c:
    for step in range(2, 5):
      state, (record, hist, _) = run.step(state, step)
  assert c.count == 0
  assert record["time_step_s"] > 0
  assert set(hist) == {"reward_hist", "response_len_hist", "reward/correct", "reward/mixed"}
  # Training prompts never come from the held-out split.
  seen = {p.uid for p in run.task.sample(np.random.default_rng(0), 2000)}
  assert not (seen & heldout)
  run.close()


@pytest.mark.parametrize("flag", ["--unrolled_decode=false", "--share_prompt_cache=false"])
def test_the_decode_flags_reach_the_runs_sampler_and_generate_the_same_rollout(tmp_path, flag):
  """--unrolled_decode=false (the scanned layer stack, no per-layer weight copy) and
  --share_prompt_cache=false (the prompt's keys and values copied into every row): the run's sampler
  takes the flag, and the first rollout's tokens are the defaults' (unrolled, one prompt copy per group)."""
  from mimo_jax.train.loop import RLRun

  name, value = flag[2:].split("=")
  rollouts = {}
  for extra in ((), (flag,)):
    path = tmp_path / str(len(extra))
    run = RLRun(_cfg(path, "--mesh_fsdp=8", *extra), str(path))
    run.open_logger(None)
    try:
      assert getattr(run.sampler, name) is (not extra)
      # 8 prompts over 8 batch shards: the default shares each prompt's cache among its 4 rows.
      assert run.sampler.shares_prompt_cache(8, 4) is (not extra or name != "share_prompt_cache")
      run.worker.update_params(run.rollout_params(run.fresh_state("rl").params))
      rollouts[extra] = np.asarray(run.worker.produce(0, 0).experience.completion_tokens)
    finally:
      run.close()
  np.testing.assert_array_equal(rollouts[(flag,)], rollouts[()])
  with pytest.raises(ConfigError, match=name):
    _cfg(tmp_path, f"--{name}=sometimes")


def test_end_to_end_run_writes_the_run_directory(tmp_path, capsys):
  path = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
  assert main(["prog", f"--flagfile={path}", f"--run_dir={tmp_path}", *FAST, "--mesh_fsdp=8"]) == 0
  out = capsys.readouterr().out
  assert "held-out greedy accuracy: warm-start" in out and str(tmp_path) in out
  lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rl = [r for r in lines if r["step"] >= 1 and "reward_mean" in r]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for key in (
    "reward_mean",
    "reward_std",
    "accuracy",
    "kl_k3",
    "entropy",
    "clipfrac",
    "grad_norm",
    "lr",
    "response_len",
    "time_generate_s",
    "time_reward_s",
    "time_train_s",
  ):
    assert key in rl[0], key
  assert "eval/greedy_accuracy" in rl[1] and "time_checkpoint_s" in rl[1]
  # The learner's time split: on 8 emulated CPU devices the shipped auto is one program split by counted
  # FLOPs (the score passes, behaviour + reference, and the rest); measured is tested in a 1-device process.
  for r in rl:
    assert r["time_score_s"] + r["time_update_s"] == pytest.approx(r["time_train_s"])
    share = (r["flops_score"] + r["flops_reference"]) / (r["flops_score"] + r["flops_reference"] + r["flops_learn"])
    assert r["time_score_s"] == pytest.approx(r["time_train_s"] * share) and 0 < share < 1
  assert sorted({k for r in lines for k in r if describe(k) is None}) == []  # the README's naming table
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["seed"] == 0 and summary["rl_steps"] == 3 and summary["final_checkpoint_s"] > 0
  # The compute ledger: per-step phases add up, the totals accumulate, and the summary holds them.
  assert all(
    r["flops_step"]
    == r["flops_generate"] + r["flops_score"] + r["flops_reference"] + r["flops_value"] + r["flops_learn"]
    for r in rl
  )
  assert all(r["flops_value"] == 0 for r in rl)  # no critic
  assert [r["flops_total"] for r in rl] == list(itertools.accumulate(r["flops_step"] for r in rl))
  assert [r["samples_total"] for r in rl] == [32, 64, 96] and all(r["flops_reference"] > 0 for r in rl)
  assert summary["compute"]["flops_total"] == rl[-1]["flops_total"] and summary["compute"]["samples_total"] == 96
  assert summary["libraries"]["jax"] == jax.__version__ and set(summary["code"]) == {"package", "commit", "dirty"}
  assert summary["data"] == {}  # the built-in arithmetic task reads no file
  assert set(summary["warm_start"]) >= {"greedy_accuracy", "pass@1", "pass@2"}
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["run"]["max_steps"] == 3
  assert os.listdir(tmp_path / "tensorboard")
  # The sample replay: per RL step the 2 best, the 2 worst and the 2 highest-KL prompts' completions.
  samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  for r in rl:
    rows = [s for s in samples if s["step"] == r["step"]]
    assert [s["kind"] for s in rows] == ["reward_top"] * 2 + ["reward_bottom"] * 2 + ["kl_top"] * 2
    assert all(s["batch_id"] == r["step"] - 1 == s["policy_version"] for s in rows)
    rewards = [s["reward"] for s in rows]
    assert rewards[0] >= rewards[1] and rewards[2] <= rewards[3] and rewards[1] >= rewards[3]
    kl = [s for s in rows if s["kind"] == "kl_top"]
    # The largest per-prompt KL is the logged tail's maximum, and its prompt the logged worst id.
    assert kl[0]["prompt_kl"] == pytest.approx(r["kl_prompt_max"], rel=1e-4, abs=1e-9)
    assert kl[0]["prompt_id"] == r["kl_prompt_max_id"] and kl[0]["prompt_kl"] >= kl[1]["prompt_kl"]
    assert all(set(s["components"]) == {"correct"} and s["finish_reason"] in ("stop", "length") for s in rows)
  # One checkpoint axis: SFT steps 1..6, then RL step k at 6 + 1 + k; the newest 3 are kept.
  assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()) == [7, 9, 10]


def test_dry_run_tiny_compiles_every_step(capsys):
  from mimo_jax.train.dry_run import dry_run

  cfg = parse_config(["prog", f"--flagfile={os.path.join(ROOT, 'experiments', 'grpo_tiny.flags')}", "--dry_run"])
  report = dry_run(cfg, write=False)
  assert set(report["compiled"]) == {"learn", "generate"}
  assert report["per_device_gib"]["params"] > 0
  assert "per-device storage" in capsys.readouterr().out


def test_dry_run_of_ppo_counts_the_critic_and_writes_dry_run_json(tmp_path):
  from mimo_jax.train.dry_run import dry_run

  def report_of(name):
    flagfile = os.path.join(ROOT, "experiments", f"{name}.flags")
    return dry_run(parse_config(["prog", f"--flagfile={flagfile}", "--dry_run", f"--run_dir={tmp_path / name}"]))

  grpo, ppo = report_of("grpo_tiny"), report_of("ppo_tiny")
  assert grpo["per_device_bytes"]["value_params"] == 0 == grpo["per_device_bytes"]["value_optimizer_state"]
  critic = ppo["per_device_bytes"]["value_params"]
  # The critic is the policy's backbone plus a scalar head, with its own Adam moments (two per weight).
  assert critic > 0.9 * ppo["per_device_bytes"]["params"]
  assert ppo["per_device_bytes"]["value_optimizer_state"] >= 2 * critic
  # The learn program's arguments hold the whole learner state: the critic and its optimizer included.
  extra = ppo["compiled"]["learn"]["argument_gib"] - grpo["compiled"]["learn"]["argument_gib"]
  assert extra * 1024**3 >= 3 * critic * 0.99
  on_disk = json.loads((tmp_path / "ppo_tiny" / "dry_run.json").read_text())
  assert on_disk["per_device_bytes"] == ppo["per_device_bytes"] and set(on_disk["compiled"]) == {"learn", "generate"}
  assert on_disk["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and on_disk["platform"] == "cpu"
  # Generation on the learner's devices has the learner's state beside its arguments (the weights): the
  # optimizer, the reference and the critic count in its peak (they were left out of it).
  gen, storage = ppo["compiled"]["generate"], ppo["per_device_bytes"]
  beside = storage["optimizer_state"] + storage["reference_params"] + storage["value_params"]
  beside += storage["master"] + storage["value_master"] + storage["value_optimizer_state"]
  assert gen["resident_gib"] * 1024**3 == pytest.approx(beside) and beside > 0
  assert ppo["peak_estimate_gib"] >= max(gen["estimate_gib"], gen.get("peak_gib", 0.0)) + gen["resident_gib"]
  # With --async_rollout the two programs run at once: generation's peak sits on top of learn's.
  flagfile = os.path.join(ROOT, "experiments", "ppo_tiny.flags")
  both = dry_run(parse_config(["prog", f"--flagfile={flagfile}", "--dry_run", "--async_rollout"]), write=False)
  learn = both["compiled"]["learn"]
  assert both["compiled"]["generate"]["resident_gib"] == max(learn["estimate_gib"], learn.get("peak_gib", 0.0))
  # The vocabulary the run would use: the task's tokenizer.
  from mimo_jax.tasks.registry import build_task

  cfg = parse_config(["prog", f"--flagfile={os.path.join(ROOT, 'experiments', 'ppo_tiny.flags')}"])
  assert on_disk["vocab_size"] == build_task(cfg.data, seed=0)[1].vocab_size


def test_update_benchmark_times_the_learner_program():
  import argparse

  from mimo_jax.bench import update

  args = argparse.Namespace(
    preset="tiny", layers=0, rows=8, prompt_len=8, completion_len=8, impls="fused", grad_accum=2, repeats=1
  )
  (record,) = update.run(args)
  assert record["program"] == "learn" and record["logprob_impl"] == "fused" and np.isfinite(record["loss"])
  assert record["devices"] == jax.device_count()
  # The ledger's count of the step's work, its rate per device, and no MFU on a CPU (no known peak).
  rate = record["model_flops_per_step"] / record["step_s"] / record["devices"] / 1e12
  assert record["model_flops_per_step"] > 0 and record["model_tflops_per_device"] == pytest.approx(rate, rel=0.01)
  assert "mfu" not in record


def test_accelerator_peaks_match_the_most_specific_kind():
  from types import SimpleNamespace

  from mimo_jax.bench.devices import peak

  kinds = {
    "NVIDIA H100 80GB HBM3": (989.4, 3350.0),
    "NVIDIA H100 PCIe": (756.0, 2000.0),
    "NVIDIA H200": (989.4, 4800.0),
  }
  for kind, (tflops, gbps) in kinds.items():
    assert peak(SimpleNamespace(device_kind=kind)) == {"device_kind": kind, "bf16_tflops": tflops, "hbm_gbps": gbps}
  assert peak(SimpleNamespace(device_kind="cpu")) is None and peak() is None  # this host's CPU devices


def test_grpo_step_benchmark_times_the_trainers_step_and_its_programs():
  from mimo_jax.bench import grpo_step

  flags = ["--model_preset=tiny", "--prompts_per_step=8", "--num_samples=2", "--max_new_tokens=4", "--mesh_fsdp=8"]
  m = grpo_step.measure(flags, steps=3)
  assert m["first_step_s"] > m["steady_step_s"] > 0  # the first step compiles
  assert m["score_s"] > 0 and m["learn_s"] > 0 and m["generate_s"] > 0 and m["devices"] == jax.device_count()
  assert 0 < m["score_apportioned_s"] < m["learn_s"]
  # Both sides of the side-by-side run one shape: the trainer's flags and the peer's say the same.
  for shape in ("tunix", "demo"):
    cfg = parse_config(["prog", f"--flagfile={grpo_step.FLAGFILE}", *grpo_step.SHAPES[shape]])
    model = cfg.model.model_config()
    peer = dict(f[2:].split("=") for f in grpo_step.PEER_FLAGS[shape])
    dims = (model.num_layers, model.d_model, model.mlp_dim, model.num_heads, model.num_kv_heads)
    assert (*dims, model.resolved_head_dim) == (
      int(peer["layers"]),
      int(peer["d_model"]),
      int(peer["mlp"]),
      int(peer["heads"]),
      int(peer["kv_heads"]),
      int(peer["head_dim"]),
    ), shape
    assert cfg.model.vocab_size == int(peer["vocab"]) == grpo_step.PEER_VOCAB[shape]
    assert cfg.rollout.max_new_tokens == int(peer["max_new_tokens"])
    assert (cfg.data.prompts_per_step, cfg.rollout.num_samples) == (int(peer["prompts"]), int(peer["group"]))
    assert cfg.rollout.buckets == (int(peer["max_prompt_len"]),)
  # The demo shape is the embedded default's but for the vocabulary and the prompt bucket.
  default = parse_config(["prog", f"--flagfile={grpo_step.FLAGFILE}"])
  assert cfg.model.model_preset == default.model.model_preset == "demo"
  assert cfg.rollout.temperature == default.rollout.temperature == float(peer["temperature"])


def test_generate_benchmark_alternates_with_transformers_on_identical_weights(tmp_path):
  """bench.generate at the GRPO benchmark's shape flags: both sides timed each round, greedy
  tokens equal to transformers' on the same weights, the ratios and the JSON record written."""
  from mimo_jax.bench import generate as bench_generate

  out = tmp_path / "gen.json"
  argv = ["--preset=tunix", "--num_layers=2", "--d_model=64", "--mlp_dim=128", "--head_dim=16"]
  argv += ["--batch=1,3", "--prompt_len=8", "--new_tokens=5", "--repeats=2", f"--json_out={out}"]
  records = bench_generate.main(argv)
  assert [r["batch"] for r in records] == [1, 3] and json.loads(out.read_text()) == records
  for r in records:
    assert r["model"] == "tunix" and r["greedy_token_agreement_with_hf"] == 1.0
    assert r["layer_copy"] == "kept"  # the default: rollout.generate's sampler
    # 1 and 3 rows on one CPU device: the decode's products on cpu_rows, which fuses them; not YNNPACK's.
    assert r["cpu_rows_products"] and r["fused_projections"] and not r["ynn_dots"]
    # A decode step reads every weight but the embedding table (untied: 2 layers of d 64, MLP 128, 8 / 4 heads of
    # 16, the final norm and a [64, 512] head) and all 8 + 5 slots of both caches, in float32.
    layer = 64 * 8 * 16 + 2 * 64 * 4 * 16 + 8 * 16 * 64 + 3 * 64 * 128 + 2 * 64
    weights, cache = 2 * layer + 64 + 64 * 512, 2 * 2 * r["batch"] * 4 * 16 * 13
    assert r["mimo-jax"]["decode_bytes_per_step"] == 4 * (weights + cache)
    rate = 4 * (weights + cache) * r["mimo-jax"]["decode_tok_s"] / r["batch"] / 1e9
    assert r["mimo-jax"]["decode_gbps"] == pytest.approx(rate, abs=0.01) and "hbm_share" not in r["mimo-jax"]
    for side in ("mimo-jax", "transformers"):
      assert len(r[side]) and r[side]["total_s"]["min"] <= r[side]["total_s"]["median"] <= r[side]["total_s"]["max"]
    assert np.isfinite(r["ratio_total_hf_over_ours"]) and np.isfinite(r["ratio_prefill_hf_over_ours"])
  cfg = bench_generate.model_config(bench_generate.parse_args(argv))
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (2, 64, 8, 4, 512)
  with pytest.raises(SystemExit):
    bench_generate.parse_args(["--batch=4,x"])
  with pytest.raises(SystemExit):
    bench_generate.parse_args(["--layer_copy=none"])


@pytest.mark.slow
def test_dry_run_13b_on_8_devices():
  from mimo_jax.train.dry_run import dry_run

  cfg = parse_config(["prog", f"--flagfile={os.path.join(ROOT, 'experiments', 'grpo_13b.flags')}", "--dry_run"])
  report = dry_run(cfg, write=False)
  assert report["params"] == 13_015_864_320
  # bf16 parameters, FSDP x tensor over 8 devices: 26 GB / 8 per device.
  np.testing.assert_allclose(report["per_device_gib"]["params"], 13_015_864_320 * 2 / 8 / 1024**3, rtol=0.01)
  # Adam's two float32 moments (on the master copy) are sharded like the parameters (not replicated
  # over fsdp): 8 bytes per parameter against the bf16 weights' 2.
  np.testing.assert_allclose(
    report["per_device_gib"]["optimizer_state"], 4 * report["per_device_gib"]["params"], rtol=0.01
  )
  # The float32 master copy of the bf16 weights: twice the parameters' bytes, and Adam's moments on it.
  np.testing.assert_allclose(report["per_device_gib"]["master"], 2 * report["per_device_gib"]["params"], rtol=0.01)
  learn = report["compiled"]["learn"]
  assert learn["temp_gib"] > 0 and learn["alias_gib"] > 0.9 * learn["output_gib"]  # the state is donated


@pytest.mark.parametrize(
  "correct_samples, expected_reward, normalize",
  [((0, 2), 0.5, "none"), ((0, 1, 2, 3), 1.0, "none"), ((0, 2), 0.5, "task_running")],
)
def test_reward_and_advantage_wiring_with_a_scripted_rollout(tmp_path, correct_samples, expected_reward, normalize):
  from mimo_jax.testing import FakeRollout
  from mimo_jax.train.loop import RLRun

  cfg = _cfg(tmp_path, "--mesh_fsdp=8", "--kl_coef=0", f"--reward_normalize={normalize}")
  holder = {}

  def respond(prompt_ids, g):
    tok = holder["run"].tokenizer
    prompt = tok.decode(prompt_ids)
    problem = next(p for p in holder["problems"] if p.prompt == prompt)
    answer = problem.answer if g in correct_samples else problem.answer + "1"
    return tok.encode(answer) + [tok.eos_id]

  run = RLRun(cfg, str(tmp_path), rollout_factory=lambda model, mesh: FakeRollout(respond, batch_shards=8))
  holder["run"] = run
  run.open_logger(None)
  state = run.begin_rl(run.fresh_state("rl").params, {})
  # Replay the data stream to know which problems the step will draw.
  replay = np.random.default_rng()
  replay.bit_generator.state = run.data_rng.bit_generator.state
  holder["problems"] = run.task.sample(replay, cfg.data.prompts_per_step)
  version = run.sampler.params_version
  state, (record, hist, samples) = run.step(state, 0)
  # The logged reward is the raw one whatever trains; the per-task normalised mix has its own key
  # (the first batch standardised by its own mean 0.5 and std 0.5: +-1, mean 0).
  assert record["reward_mean"] == expected_reward and record["accuracy"] == expected_reward
  if normalize == "none":
    assert "reward_normalized_mean" not in record
  else:
    assert record["reward_normalized_mean"] == pytest.approx(0.0, abs=1e-6)
  assert record["frac_groups_all_equal"] == (1.0 if expected_reward == 1.0 else 0.0)
  if expected_reward == 1.0:
    assert record["adv_abs_mean"] == 0.0 and record["pg_loss"] == 0.0  # nothing to learn from
  else:
    assert record["adv_abs_mean"] > 0.5
  G = cfg.rollout.num_samples
  expected = [float(g in correct_samples) for _ in range(cfg.data.prompts_per_step) for g in range(G)]
  np.testing.assert_array_equal(hist["reward_hist"], expected)
  assert run.sampler.params_version == version + 1  # weights synced after the update
  # The sample replay: the 2 highest rewards (ties: lower rows first), the 2 lowest (ties: higher rows
  # first), with the scripted texts, their rewards and provenance.
  B = len(expected)
  low = sorted(range(B), key=lambda i: (expected[i], -i))[:2]
  high = sorted(range(B), key=lambda i: (-expected[i], i))[:2]
  by_kind = {k: [r for r in samples if r["kind"] == k] for k in ("reward_top", "reward_bottom", "kl_top")}
  assert [r["row"] for r in by_kind["reward_top"]] == high and [r["row"] for r in by_kind["reward_bottom"]] == low
  for r in by_kind["reward_top"] + by_kind["reward_bottom"]:
    problem = holder["problems"][r["row"] // G]
    right = r["row"] % G in correct_samples
    assert r["completion"] == (problem.answer if right else problem.answer + "1") and r["prompt"] == problem.prompt
    assert r["reward"] == float(right) and r["correct"] == right and r["components"]["correct"] == float(right)
    assert (r["step"], r["batch_id"], r["policy_version"], r["finish_reason"]) == (1, 0, 0, "stop")
    assert r["length"] == len(run.tokenizer.encode(r["completion"])) + 1  # the stop token counts
    assert (r["temperature"], r["top_k"], r["top_p"]) == (cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
  assert by_kind["kl_top"] == []  # no reference at kl_coef=0: nothing to measure a KL against
  run.close()


def test_fused_logprob_kernel_in_the_loss_matches_full_logits():
  from mimo_jax.train.steps import make_score_fn

  model = Transformer(tiny(), rngs=nnx.Rngs(6))
  out, batch = _rollout_batch(model, seed=6)
  graphdef, params = nnx.split(model)
  seqs = SequenceBatch(out.prompt_tokens, out.prompt_mask, out.completion_tokens, out.completion_mask)
  temps = out.temperature * jnp.linspace(0.7, 1.3, out.temperature.shape[0])  # per-row temperatures
  full = make_score_fn(graphdef, None, use_reference=True, logprob_impl="full")(params, params, seqs, temps)
  fused = make_score_fn(graphdef, None, use_reference=True, logprob_impl="fused")(params, params, seqs, temps)
  np.testing.assert_allclose(fused[0], full[0], atol=2e-5)
  results = []
  for impl in ("full", "fused"):
    state0 = _state(Transformer(tiny(), rngs=nnx.Rngs(6)), tx=sgd(1.0))
    state, metrics = make_update_fn(None, UpdateSettings(logprob_impl=impl))(state0, batch, COEFS)
    results.append((state.params, metrics))
  (p_full, m_full), (p_fused, m_fused) = results
  for k in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm"):
    np.testing.assert_allclose(m_fused[k], m_full[k], rtol=1e-4, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_fused, p_full)


@pytest.mark.parametrize("temperature", [1.0, (0.7, 0.6, 1.3, 1.0)])
def test_fused_log_probs_use_the_compute_dtype(temperature):
  """f32 parameters, bf16 compute: the kernel multiplies in bf16 like the full logits (not in the params' f32),
  and divides the float32 logits by each row's temperature after the matmul, as the full path and the
  sampler do: folded into the bf16 hidden states, 1 / T rounded them again (log-probs 1.2e-3 off at T = 0.7,
  gradients 4.5e-3 apart)."""
  import dataclasses

  from mimo_jax.models.logprobs import completion_stats

  model = Transformer(dataclasses.replace(tiny(), dtype="bfloat16"), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompt, completion = (jnp.asarray(rng.integers(4, 200, (4, n)), jnp.int32) for n in (8, 6))
  args = (prompt, jnp.ones(prompt.shape, bool), completion, jnp.ones(completion.shape, bool))
  temp = jnp.asarray(temperature, jnp.float32)
  full = completion_stats(model, *args, temp, impl="full")
  fused = completion_stats(model, *args, temp, impl="fused")
  np.testing.assert_allclose(fused[0], full[0], atol=1e-5)  # an f32 unembedding differs by ~2e-3 here
  np.testing.assert_allclose(fused[1], full[1], atol=1e-4)
  graphdef, params = nnx.split(model)

  def grads(impl):
    def loss(p):
      logp, ent = completion_stats(nnx.merge(graphdef, p), *args, temp, impl=impl)
      return jnp.sum(logp) + 0.1 * jnp.sum(ent)

    return jax.grad(loss)(params)

  g_full, g_fused = (
    jnp.concatenate([x.astype(jnp.float32).ravel() for x in jax.tree.leaves(grads(i))]) for i in ("full", "fused")
  )
  assert float(jnp.linalg.norm(g_fused - g_full) / jnp.linalg.norm(g_full)) < 1e-4


def test_fused_kernel_under_the_trainer_mesh_splits_rows_and_vocabulary():
  """On a (data 2, fsdp 2, tensor 2) mesh the fused loss runs per device under ``shard_map`` (rows over
  data x fsdp, vocabulary over tensor) and equals single-device full logits."""
  from mimo_jax import sharding

  cfg = tiny()
  mesh = build_mesh(MeshConfig(2, 2, 2))
  with sharding.use_rules(mesh, sharding.TRAIN_RULES):
    assert sharding.kernel_layout(96, cfg.vocab_size) == (mesh, "tensor", ("data", "fsdp"))
    assert sharding.kernel_layout(96, 255) == (mesh, None, ("data", "fsdp"))  # 255 columns do not split in two
    assert sharding.kernel_layout(6, cfg.vocab_size) == (mesh, "tensor", ("data",))
  assert sharding.kernel_layout(96, cfg.vocab_size) is None
  single = Transformer(cfg, rngs=nnx.Rngs(4))
  _, batch = _rollout_batch(single, seed=4)
  linear = sgd(1.0)
  ref_state, ref_m = make_update_fn(None, UpdateSettings(logprob_impl="full"))(_state(single, tx=linear), batch, COEFS)
  update = make_update_fn(mesh, UpdateSettings(logprob_impl="fused"))
  state0 = _state(create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(4)), mesh), tx=linear)
  assert "shard_map" in str(jax.make_jaxpr(update)(state0, batch, COEFS))
  state, m = update(state0, batch, COEFS)
  for k in ("loss", "pg_loss", "kl_loss", "entropy"):
    np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-4, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_state.params)


def test_micro_batched_scoring_equals_one_pass():
  """The score step over row chunks (the update's micro-batch size) gives the one-pass log-probs."""
  model = create_sharded(lambda: Transformer(tiny(), rngs=nnx.Rngs(0)), None)
  out, batch = _rollout_batch(model)
  graphdef, params = nnx.split(model)
  seqs = SequenceBatch(out.prompt_tokens, out.prompt_mask, out.completion_tokens, out.completion_mask)
  one = make_score_fn(graphdef, None, use_reference=True)(params, params, seqs, out.temperature)
  chunked = make_score_fn(graphdef, None, use_reference=True, micro_batches=4)(params, params, seqs, out.temperature)
  for a, b in zip(one, chunked, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
  assert float(jnp.max(jnp.abs(one[0]))) > 0  # real log-probs, not zeros


def test_shared_prompts_give_the_per_row_log_probs_and_update_with_less_work():
  """--share_prompts: a group's prompt runs once (Decoder.with_prompt). On a real rollout (4 prompts of
  different lengths, left-padded, x 4 samples, stops at different lengths) the score pass and the update
  (micro-batched, and on a data x fsdp x tensor mesh with the fused kernel) equal the per-row forward, and
  the compiled score pass counts far fewer FLOPs."""
  import dataclasses

  from mimo_jax.models.logprobs import shares_prompts
  from mimo_jax.train.learner import prompt_group

  cfg = tiny()
  single = Transformer(cfg, rngs=nnx.Rngs(3))
  out, batch = _rollout_batch(single, seed=3)
  B, P = out.prompt_tokens.shape
  # Completions that stopped at different lengths (a stop token is rare for a random model).
  ends = np.random.default_rng(3).integers(1, out.completion_tokens.shape[1] + 1, B)
  mask = jnp.asarray(np.arange(out.completion_tokens.shape[1])[None] < ends[:, None]) & out.completion_mask
  out, batch = out.replace(completion_mask=mask), batch.replace(completion_mask=mask)
  # The premise, as the sampler lays rows out: a group's rows are contiguous, with equal prompts.
  for x in (out.prompt_tokens, out.prompt_mask):
    x = np.asarray(x).reshape(4, 4, P)
    assert (x == x[:, :1]).all()
  assert len({int(n) for n in np.asarray(out.prompt_mask).sum(axis=1)}) > 1  # different prompt lengths
  assert len({int(n) for n in np.asarray(mask).sum(axis=1)}) > 1  # and completion lengths
  graphdef, params = nnx.split(single)
  seqs = SequenceBatch(out.prompt_tokens, out.prompt_mask, out.completion_tokens, out.completion_mask)
  temps = out.temperature * jnp.linspace(0.7, 1.3, B)
  for impl in ("full", "fused"):
    per_row = make_score_fn(graphdef, None, use_reference=True, logprob_impl=impl)
    shared = make_score_fn(graphdef, None, use_reference=True, logprob_impl=impl, prompt_group=4)
    for a, b in zip(per_row(params, params, seqs, temps), shared(params, params, seqs, temps), strict=True):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5)
    flops = [f.lower(params, params, seqs, temps).cost_analysis()["flops"] for f in (per_row, shared)]
    assert flops[1] < 0.7 * flops[0], flops  # 4 x 8 + 16 x 5 positions instead of 16 x 14

  linear = sgd(1.0)
  ref_state, ref_m = make_update_fn(None, UpdateSettings(logprob_impl="full"))(_state(single, tx=linear), batch, COEFS)
  mesh = build_mesh(MeshConfig(2, 2, 2))
  runs = {
    "micro-batched": (None, UpdateSettings(logprob_impl="full", prompt_group=4, grad_accum=2)),
    "mesh": (mesh, UpdateSettings(logprob_impl="fused", prompt_group=4)),
  }
  for name, (m, settings) in runs.items():
    state0 = _state(create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(3)), m), tx=linear)
    state, metrics = make_update_fn(m, settings)(state0, batch, COEFS)
    for k in ("loss", "pg_loss", "kl_loss", "entropy"):
      np.testing.assert_allclose(metrics[k], ref_m[k], rtol=1e-4, atol=1e-6, err_msg=f"{name}: {k}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_state.params)

  # Several minibatches: the shuffle deals out whole groups, so the update shares prompts there too. The
  # oracle: the per-row update run on each minibatch in turn, in the same order.
  from mimo_jax.train.steps import minibatch_order

  shared_state = _state(Transformer(cfg, rngs=nnx.Rngs(3)), tx=linear)
  order = np.asarray(minibatch_order(jax.random.split(shared_state.rng)[1], B, 2, 4))
  assert sorted(order) == list(range(B)) and (order.reshape(4, 4) - order.reshape(4, 4)[:, :1] == np.arange(4)).all()
  assert (order.reshape(4, 4)[:, 0] % 4 == 0).all() and not (order == np.arange(B)).all()
  ref_state = _state(Transformer(cfg, rngs=nnx.Rngs(3)), tx=linear)
  per_row = make_update_fn(None, UpdateSettings(logprob_impl="full"))
  for half in np.split(order, 2):
    ref_state, _ = per_row(ref_state, jax.tree.map(lambda x, h=half: x[h], batch), COEFS)
  state, _ = make_update_fn(None, UpdateSettings(logprob_impl="full", prompt_group=4, num_minibatches=2))(
    shared_state, batch, COEFS
  )
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_state.params)

  # The critic shares prompts too: its values (whole and micro-batched) and its update equal the per-row ones.
  from mimo_jax.models import ValueModel
  from mimo_jax.train.steps import ValueBatch, ValueSettings, make_value_fn, make_value_update_fn

  def critic():
    value = ValueModel.from_policy(Transformer(cfg, rngs=nnx.Rngs(3)), rngs=nnx.Rngs(4))
    value.value_head_d[...] = 0.3 * jax.random.normal(jax.random.key(5), (cfg.d_model,))  # not the zero init
    return value

  v_graphdef, v_params = nnx.split(critic())
  value_fns = [make_value_fn(v_graphdef, None, micro_batches=n, prompt_group=g) for g, n in ((1, 1), (4, 1), (4, 2))]
  values = [np.asarray(f(v_params, seqs)) for f in value_fns]
  assert np.abs(values[0][np.asarray(mask)]).min() > 0
  for v in values[1:]:
    np.testing.assert_allclose(v, values[0], atol=2e-5)
  flops = [f.lower(v_params, seqs).cost_analysis()["flops"] for f in value_fns[:2]]
  assert flops[1] < 0.7 * flops[0], flops
  returns = jnp.where(mask, jnp.asarray(np.random.default_rng(4).uniform(-1, 1, (B, 1)), jnp.float32), 0.0)
  vbatch = ValueBatch(seqs.prompt_tokens, seqs.prompt_mask, seqs.completion_tokens, mask, values[0] - 0.05, returns)
  ref_state, ref_m = make_value_update_fn(None, ValueSettings(clip=0.1))(_state(critic(), tx=linear), vbatch)
  state, m = make_value_update_fn(None, ValueSettings(clip=0.1, prompt_group=4, grad_accum=2))(
    _state(critic(), tx=linear), vbatch
  )
  np.testing.assert_allclose(m["value_loss"], ref_m["value_loss"], rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_state.params)

  # A group stays on one batch shard, or the prompts are not shared: 4 groups do not split over 8 data shards.
  assert shares_prompts(16, 6, 4, mesh=mesh) and not shares_prompts(16, 6, 4, mesh=build_mesh(MeshConfig(8, 1, 1)))
  assert not shares_prompts(16, 1, 4) and not shares_prompts(18, 6, 4) and shares_prompts(16, 6, 4)

  # Which passes share, from the flags: the shipped default shares both; a row shuffle keeps the update per row.
  c = Config()
  assert prompt_group(c) == c.rollout.num_samples > 1
  with_algo = lambda **kw: dataclasses.replace(c, algo=dataclasses.replace(c.algo, **kw))  # noqa: E731
  assert prompt_group(with_algo(num_minibatches=2)) == c.rollout.num_samples
  # Minibatches that cannot hold whole groups: nothing is shared (and the shuffle deals out rows).
  assert prompt_group(with_algo(num_minibatches=c.data.prompts_per_step * 2)) == 1
  assert prompt_group(with_algo(share_prompts=False)) == 1


def test_the_shipped_pod_presets_share_prompts_on_their_meshes_or_say_which_flag_would():
  """The learner runs each prompt once on the meshes the presets name (the 13B flagfile: v5p-128, fsdp 16
  x tensor 4; the 1B: one 8-GPU host; the 7B: 8 and 16 devices, tensor 2); where a mesh's batch shards
  cannot hold whole groups, the note says so and names the --grad_accum that would share."""
  from jax.sharding import AbstractMesh

  from mimo_jax.train.learner import prompt_group, prompt_sharing_note

  def on(flags, data_fsdp_tensor, *extra):
    cfg = parse_config(["prog", f"--flagfile={os.path.join(ROOT, 'experiments', flags)}", *extra])
    mesh = AbstractMesh(data_fsdp_tensor, ("data", "fsdp", "tensor"))
    return prompt_group(cfg, mesh), prompt_sharing_note(cfg, mesh)

  assert on("grpo_13b.flags", (1, 16, 4)) == (8, None)
  assert on("grpo_1b.flags", (1, 8, 1)) == (8, None)
  assert on("grpo_7b.flags", (1, 4, 2)) == (8, None) == on("grpo_7b.flags", (1, 8, 2))
  group, note = on("grpo_13b.flags", (1, 16, 4), "--grad_accum=4")
  assert group == 1 and note.startswith("the learner runs every row's own prompt: its micro-batches of 32 rows")
  assert "(4 groups of 8) do not split into whole groups over the 16 batch shards" in note
  assert note.endswith(
    "--grad_accum=1 would run each prompt once (micro-batches of 128 rows: more activation memory, see --dry_run_topology)"
  )
  assert on("grpo_1b.flags", (1, 8, 1), "--grad_accum=4")[1].endswith(
    "--grad_accum=2 would run each prompt once (micro-batches of 64 rows: more activation memory, see --dry_run_topology)"
  )
  group, note = on("grpo_13b.flags", (1, 32, 4))
  assert group == 1 and note.endswith(
    "no smaller --grad_accum would: fewer --num_minibatches or more --prompts_per_step would"
  )
  assert "micro-batches of 128 rows (16 groups of 8) do not split into whole groups over the 32 batch shards" in note
  # Nothing to share: one sample per prompt, or sharing turned off.
  assert on("grpo_13b.flags", (1, 32, 4), "--num_samples=1")[1] is None
  assert on("grpo_13b.flags", (1, 32, 4), "--noshare_prompts")[1] is None


def test_the_samplers_behaviour_logprobs_stand_in_for_the_learners_behaviour_pass(tmp_path):
  """--behaviour_logprobs=sampler (what auto picks in synchronous runs): one forward pass fewer, the same update."""
  import dataclasses

  from mimo_jax.train.learner import Faults, build_learner, sampler_behaviour
  from mimo_jax.train.loop import RLRun

  cfg = _cfg(tmp_path, "--mesh_fsdp=8", "--top_k=8", "--behaviour_logprobs=recompute")
  run = RLRun(cfg, str(tmp_path))
  run.open_logger(None)
  state = run.begin_rl(run.fresh_state("rl").params, {})
  exp = run.worker.produce(0, 0).experience
  fast = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, behaviour_logprobs="sampler"))
  assert not sampler_behaviour(cfg) and sampler_behaviour(fast)
  outs = []
  for c in (cfg, fast):
    learner = build_learner(c, run.mesh, run.graphdef)
    new, metrics = learner.learn(jax.tree.map(jnp.copy, state), exp, jnp.int32(0), Faults.none())
    outs.append((new, jax.device_get(metrics)))
  (slow_state, slow), (fast_state, quick) = outs
  for key in ("loss", "pg_loss", "kl_k3", "entropy", "grad_norm"):
    assert quick["train"][key] == pytest.approx(slow["train"][key], rel=1e-4, abs=1e-6), key
  # With top-k the sampler's truncation still gets its correction: the same weights either way.
  assert quick["rollout"]["is_ratio_mean"] == pytest.approx(slow["rollout"]["is_ratio_mean"], rel=1e-4)
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), slow_state.params, fast_state.params)
  assert max(jax.tree.leaves(diff)) < 1e-6
  # The ledger counts the pass that no longer runs.
  assert run.ledger.use_behaviour_pass
  run.close()
  # The shipped default (auto) takes the sampler's in a synchronous run and recomputes in an async one.
  assert sampler_behaviour(_cfg(tmp_path)) and not sampler_behaviour(_cfg(tmp_path, "--async_rollout"))
  with pytest.raises(ConfigError, match="--behaviour_logprobs='sampler': needs synchronous rollout"):
    validate(_cfg(tmp_path, "--behaviour_logprobs=sampler", "--async_rollout"), jax.device_count())


def test_time_split_auto_measures_except_on_several_cpu_devices():
  from mimo_jax.train.loop import resolve_time_split

  assert resolve_time_split("auto", "cpu", 8) == "apportioned" and resolve_time_split("auto", "cpu", 1) == "measured"
  assert resolve_time_split("auto", "gpu", 8) == "measured" == resolve_time_split("auto", "tpu", 256)
  assert resolve_time_split("measured", "cpu", 8) == "measured"
  assert resolve_time_split("apportioned", "gpu", 1) == "apportioned"


def test_the_apportioned_score_time_counts_the_critics_forward():
  """The score program runs the critic's forward beside the behaviour and reference passes, so the
  apportioned ``time_score_s`` counts its FLOPs on the score side, as the measured split times it."""
  from mimo_jax.train.ledger import FlopCounter, Ledger
  from mimo_jax.train.loop import apportioned_score_time

  fc = FlopCounter.of(tiny())
  kw = dict(use_reference=True, epochs=1, rollout_devices=1, learner_devices=1)
  p, c = [4, 6], [2, 3]
  score, value = fc.score(p, c), fc.score(p, c, head="value")
  update, value_update = fc.update(p, c), fc.update(p, c, head="value")
  ppo = {**Ledger(fc, use_value=True, **kw).step(p, c, value_passes=2), "time_train_s": 6.0}
  scored = 2 * score + value
  assert apportioned_score_time(ppo) == pytest.approx(6.0 * scored / (scored + update + 2 * value_update))
  grpo = {**Ledger(fc, use_value=False, **kw).step(p, c), "time_train_s": 6.0}
  assert apportioned_score_time(grpo) == pytest.approx(6.0 * 2 * score / (2 * score + update))


_TWO_PROGRAMS = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from mimo_jax.main import parse_config
from mimo_jax.testing.compiles import count_compilations
from mimo_jax.train.learner import Faults
from mimo_jax.train.loop import RLRun

cfg = parse_config(sys.argv)
run = RLRun(cfg, cfg.logging.run_dir)
run.open_logger(None)
state = run.begin_rl(run.fresh_state("rl").params, {})
with count_compilations() as first:  # the first step: its two learner programs compiled ahead
  state, _ = run.step(state, 0)
exp = run.to_learner(run.worker.produce(0, 0).experience)
exp = exp.replace(rewards=np.arange(exp.rewards.shape[0], dtype=np.float32) % 3)  # advantages not all 0
one, one_metrics = run.learner.learn(jax.tree.map(jnp.copy, state), exp, jnp.int32(0), Faults.none())
scores = run.learner.score(state, exp)
two, two_metrics = run.learner.update(jax.tree.map(jnp.copy, state), exp, scores, jnp.int32(0), Faults.none())

def leaves(tree):
  keyless = jax.tree.map(lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)
  return [np.asarray(x, np.float64).ravel().tolist() for x in jax.tree.leaves(jax.device_get(keyless))]

changed = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(two.params)))
_, (record, *_) = run.step(state, 1)  # the trainer's own step (state donated: used last), as two programs
print(json.dumps({
  "record": {k: record[k] for k in ("time_score_s", "time_update_s", "time_train_s")},
  "one": leaves((one, one_metrics)), "two": leaves((two, two_metrics)), "changed": changed,
  "score_old": float(jnp.max(jnp.abs(scores.old_logprobs))), "score_ref": float(jnp.max(jnp.abs(scores.ref_logprobs))),
  "values_shape_ok": scores.values.shape == scores.old_logprobs.shape, "devices": jax.device_count(),
  "time_split": run.time_split, "first_programs": first.programs,
}))
run.close()
"""


@pytest.mark.parametrize(
  "algo", [["--kl_coef=0.01"], ["--advantage=gae", "--use_value_model", "--kl_coef=0.01"]], ids=["grpo", "ppo"]
)
def test_the_learner_as_two_programs_is_the_one_program_step(tmp_path, algo):
  """--time_split=measured runs the score pass (behaviour and reference log-probs, critic values) and the
  update as two programs: the same new state and metrics as the one learn program.  In a process of its own
  with one CPU device, where auto measures (on 8 emulated devices the update program alone can deadlock
  XLA:CPU's collectives, so the suite's runs keep the one program)."""
  import subprocess
  import sys

  path = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
  flags = [f"--flagfile={path}", f"--run_dir={tmp_path}", *FAST, "--behaviour_logprobs=recompute", "--warmup_steps=0"]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  out = subprocess.run(
    [sys.executable, "-c", _TWO_PROGRAMS, *flags, *algo], env=env, capture_output=True, text=True, check=False
  )
  assert out.returncode == 0, out.stderr[-4000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["devices"] == 1 and r["time_split"] == "measured"
  # Both programs of the measured split were compiled in the compile-ahead thread during the first rollout.
  first = r["first_programs"]
  assert [f for t, f in first if t == "compile-ahead"] == ["score_rollout", "update_from"], first
  assert not {f for t, f in first if t != "compile-ahead"} & LEARNER_PROGRAMS, first
  assert r["score_old"] > 0 and r["score_ref"] > 0 and r["values_shape_ok"]  # the critic's values or zeros
  assert len(r["one"]) == len(r["two"])
  for a, b in zip(r["one"], r["two"], strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  assert r["changed"] > 0  # a real update
  t = r["record"]  # the loop's step: the score pass timed alone, the rest the update
  assert 0 < t["time_score_s"] < t["time_train_s"] and t["time_score_s"] + t["time_update_s"] == pytest.approx(
    t["time_train_s"]
  )


def test_sft_counts_and_warns_of_the_examples_it_cuts(tmp_path, capsys):
  """Supervised targets longer than --max_new_tokens lose their end (the answer): the SFT steps count
  them (and prompts past the largest bucket) in their logged records and warn once."""
  import copy

  from mimo_jax.rollout.encoding import encode_prompts, encode_targets
  from mimo_jax.testing import kill_resume
  from mimo_jax.train.loop import RLRun

  cfg = _cfg(tmp_path, "--sft_steps=3", "--max_new_tokens=3", "--prompt_buckets=4", "--mesh_fsdp=8")
  run = RLRun(cfg, str(tmp_path))
  run.open_logger(None)
  try:
    rng = copy.deepcopy(run.data_rng)
    expected = [0, 0]
    for i in range(3):  # the same examples, encoded on their own
      examples = run.task.sft_examples(rng, 16, easiest=i < cfg.run.sft_curriculum_steps)
      expected[0] += encode_prompts(run.tokenizer, [e[0] for e in examples], (4,))[2]
      expected[1] += sum(len(run.tokenizer.encode(e[1], add_eos=True)) > 3 for e in examples)
    run.sft(run.fresh_state("sft"), 0)
  finally:
    run.close()
  assert expected[0] > 0 and 0 < expected[1] <= 48
  (logged,) = [r for r in kill_resume.load_metrics(str(tmp_path)) if "sft_loss" in r]  # the last SFT step's
  assert (logged["sft_prompt_truncated"], logged["sft_target_truncated"]) == tuple(expected)
  out = capsys.readouterr().out
  assert out.count("supervised targets at SFT step") == 1 and "--max_new_tokens=3" in out
  tokens, mask, cut = encode_targets(run.tokenizer, ["12345", "1"], 3)
  assert cut == 1 and mask.sum(axis=1).tolist() == [3, 2]


def test_the_warm_start_takes_its_own_optimizer_flags_not_the_rl_policys(tmp_path):
  """A sweep point that couples --grad_clip to the LR (or a run that sets --weight_decay or a
  constant schedule) must start RL from the same warm start: SFT reads only the sft_* flags."""
  from mimo_jax.train.loop import RLRun

  def warm(name, *extra):
    run = RLRun(_cfg(tmp_path / name, "--mesh_fsdp=8", *extra), str(tmp_path / name))
    run.open_logger(None)
    try:
      params = run.sft(run.fresh_state("sft"), 0).params
      return jax.tree.map(np.asarray, params)
    finally:
      run.close()

  base = warm("base")
  rl_flags = warm("rl", "--grad_clip=0.05", "--weight_decay=0.1", "--lr_schedule=constant", "--adam_b2=0.9")
  jax.tree.map(np.testing.assert_array_equal, base, rl_flags)
  # The warm start's own clip does apply (the tiny model's SFT gradients are far above 0.05).
  clipped = warm("sft_clip", "--sft_grad_clip=0.05")
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(clipped), strict=True))


def test_a_run_with_chat_prompts_reads_every_prompt_through_the_models_template(tmp_path):
  """``--chat_template=model``: the SFT, RL and held-out prompts all reach the policy through the
  tokenizer's own chat template.  Seen in the run's own records: at a 16-token bucket, which holds every
  prompt's plain text, every one is cut (the template wraps it in a system and a user turn), in each of
  the three paths.  Without a tokenizer, or with one that has no template, the flag is refused before
  any compute (exit 2, naming it)."""
  from mimo_jax.tasks.registry import build_task
  from mimo_jax.testing.hf_models import save_chat_tokenizer
  from mimo_jax.tokenization import load_tokenizer

  d = save_chat_tokenizer(str(tmp_path / "tok"), corpus=("12+30=42 7+5=12",), eos_token="<|im_end|>")
  path = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
  flags = [f"--flagfile={path}", *FAST, "--prompt_buckets=16", f"--tokenizer_path={d}"]
  run = tmp_path / "run"
  assert main(["prog", *flags, "--chat_template=model", f"--run_dir={run}"]) == 0
  records = [json.loads(line) for line in open(run / "metrics.jsonl")]
  sft = [r for r in records if "sft_prompt_truncated" in r]
  rl = [r for r in records if "prompt_truncated" in r]
  evals = [r for r in records if "eval/prompt_truncated" in r]
  assert sft and rl and evals
  assert sum(r["sft_prompt_truncated"] for r in sft) == 6 * 16  # every SFT prompt of the 6 steps
  assert all(r["prompt_truncated"] == 8 for r in rl)
  assert all(r["eval/prompt_truncated"] == 16 for r in evals)
  # The same prompts as plain text fit the bucket: the cut is the template's.
  cfg = parse_config(["prog", *flags, f"--run_dir={tmp_path / 'plain'}"])
  task, tokenizer = build_task(cfg.data, seed=0)
  assert not tokenizer.chat_prompts and max(len(tokenizer.encode_prompt(p.prompt)) for p in task.heldout()) <= 16
  chat_cfg = parse_config(["prog", *flags, "--chat_template=model", f"--run_dir={tmp_path / 'chat'}"])
  _, chat = build_task(chat_cfg.data, seed=0)
  p = task.heldout()[0].prompt
  assert chat.encode_prompt(p) == chat.encode_chat([{"role": "user", "content": p}]) != tokenizer.encode_prompt(p)
  # The export carries the tokenizer and its template: transformers reads it back as the run's.
  from mimo_jax import export

  transformers = pytest.importorskip("transformers")
  assert export.main(["--run_dir", str(run), "--out", str(tmp_path / "out")]) == 0
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  ids = hf.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
  assert list(ids if isinstance(ids, list) else ids["input_ids"]) == chat.encode_prompt(p)
  assert hf.eos_token == "<|im_end|>"
  assert load_tokenizer(tmp_path / "out").encode_prompt(p) == tokenizer.encode_prompt(p)
  # Refused before any compute.
  plain = tmp_path / "plain_tok"
  plain.mkdir()
  (plain / "tokenizer.json").write_text(open(os.path.join(d, "tokenizer.json")).read())
  (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  for extra, message in (
    ([f"--tokenizer_path={plain}"], "no chat template"),
    ([], "pass --tokenizer_path or --hf_checkpoint"),
  ):
    bad = tmp_path / f"bad{len(extra)}"
    base = [f for f in flags if not f.startswith("--tokenizer_path")]
    with pytest.raises(ConfigError, match=f"--chat_template=.?model.?: .*{message}"):
      cfg = parse_config(["prog", *base, *extra, "--chat_template=model", f"--run_dir={bad}"])
      validate(cfg, jax.device_count())
      build_task(cfg.data, seed=0)
    assert main(["prog", *base, *extra, "--chat_template=model", f"--run_dir={bad}"]) == 2
    assert not (bad / "metrics.jsonl").exists()


def test_the_phases_start_with_the_policys_first_update_not_during_the_critics_warm_up(tmp_path):
  """PPO with --value_warmup_steps=3 and --phase_schedule over 23 RL steps: the policy's 20 steps hold the
  phases' budgets (warm-up 2 of them), and its first update is the warm-up's first, at half the peak LR
  (the phase clock ran while the policy waited, and its first update came in the main phase at the peak)."""
  from mimo_jax.train.learner import Faults
  from mimo_jax.train.loop import RLRun

  cfg = _cfg(
    tmp_path, "--advantage=gae", "--use_value_model", "--value_warmup_steps=3", "--phase_schedule",
    "--max_steps=23", "--warmup_steps=0",
  )  # fmt: skip
  run = RLRun(cfg, str(tmp_path))
  run.open_logger(None)
  state = run.begin_rl(run.fresh_state("rl").params, {})
  exp = run.worker.produce(0, 0).experience
  phases, lr_mults = [], []
  for step in range(6):
    state, metrics = run.learner.learn(state, exp, jnp.int32(step), Faults.none())
    phases.append(int(metrics["controllers"].phase))
    lr_mults.append(float(metrics["coefs"].lr_mult))
  run.close()
  assert phases == [0, 0, 0, 0, 1, 1]  # after each step: warm-up through the policy's second update
  assert lr_mults[3:5] == pytest.approx([0.5, 1.0])  # the warm-up's ramp over its 2 steps
