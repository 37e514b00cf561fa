"""The algorithm suite in the loop: PPO with a value model, controllers, shaping, dynamic sampling."""

import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax.ckpt import Checkpointer
from mimo_jax.config import OptimConfig
from mimo_jax.config_base import ConfigError
from mimo_jax.main import main, parse_config
from mimo_jax.models import Transformer, ValueModel
from mimo_jax.models.config import tiny
from mimo_jax.optim import TrainState, make_optimizer
from mimo_jax.tasks.arith import make_problem, parse_operands
from mimo_jax.testing import FakeRollout, count_compilations, kill_resume
from mimo_jax.train.metric_names import describe
from mimo_jax.train.steps import SequenceBatch, ValueBatch, ValueSettings, make_value_fn, make_value_update_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
FAST = [
  f"--flagfile={FLAGFILE}",
  "--model_preset=tiny",
  "--sft_steps=6",
  "--sft_batch_size=16",
  "--max_steps=4",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--max_new_tokens=6",
  "--mesh_fsdp=8",
  "--tensorboard=false",
]
# Every controller on: PPO with a critic, adaptive KL in the reward, adaptive entropy,
# reward shaping, overlong penalty, phases, LR-linked clipping.
PPO = [
  "--advantage=gae",
  "--use_value_model",
  "--value_warmup_steps=1",
  "--value_window=2",
  "--value_max_updates=3",
  "--kl_controller=adaptive",
  "--kl_coef=0.1",
  "--kl_in=reward",
  "--kl_horizon=100",
  "--entropy_controller=adaptive",
  "--entropy_coef=0.01",
  "--entropy_target=3.0",
  "--reward_clip_low=0.05",
  "--reward_clip_high=0.95",
  "--reward_ema=0.9",
  "--overlong=penalty",
  "--overlong_buffer=2",
  "--phase_schedule",
  "--warmup_steps=0",
  "--grad_clip_mode=lr_linked",
  "--curriculum",
  "--curriculum_pool=64",
]


def _cfg(tmp_path, *extra):
  return parse_config(["prog", *FAST, f"--run_dir={tmp_path}", *extra])


# ----------------------------------------------------------------------------
# Config-time validation of combinations
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--advantage=gae"], "--advantage='gae': gae needs a value model"),
    (["--use_value_model"], "--use_value_model=True: the value model is only used by --advantage=gae"),
    (["--advantage=grpo", "--num_samples=1"], "--num_samples=1: group advantages"),
    (["--advantage=gae", "--use_value_model", "--dynamic_sampling"], "--dynamic_sampling=True: drops all-equal"),
    (["--advantage=reinforce_baseline", "--num_samples=1"], "--num_samples=1: group advantages (reinforce_baseline)"),
    (["--kl_controller=adaptive", "--kl_coef=2"], "--kl_coef=2.0: a controlled coefficient starts inside"),
    (["--kl_controller=budget", "--kl_coef=0"], "--kl_controller='budget': needs a reference"),
    (["--phase_fracs=0.2,0.7,0.2"], "--phase_fracs='0.2,0.7,0.2': 3 fractions > 0 summing to 1"),
    (["--phase_smoothing=0.9,0.95"], "--phase_smoothing='0.9,0.95': expected exactly 3 comma-separated numbers"),
    (["--overlong=penalty", "--overlong_buffer=6"], "--overlong_buffer=6: must be smaller than --max_new_tokens=6"),
    (["--phase_schedule", "--warmup_steps=5"], "--warmup_steps=5: the phase schedule shapes the learning rate"),
    (["--value_updates=5"], "--value_updates=5: must be in [value_min_updates, value_max_updates]"),
    (["--reward_clip_high=0.4"], "--reward_clip_high=0.4: must be in (0.5, 1]"),
    (["--kl_controller=pid"], "--kl_controller=pid: value should be one of <fixed|adaptive|budget>"),
  ],
)
def test_invalid_combinations_fail_at_config_time(flags, message):
  with pytest.raises(ConfigError) as e:
    cfg = parse_config(["prog", *FAST, *flags])
    from mimo_jax.config import validate

    validate(cfg, 8)
  assert message in str(e.value)


# ----------------------------------------------------------------------------
# The value model
# ----------------------------------------------------------------------------


def test_value_passes_fit_the_returns():
  """Clipped value-loss passes drive the critic toward fixed returns (loss falls >10x)."""
  cfg = tiny()
  policy = Transformer(cfg, rngs=nnx.Rngs(0))
  value = ValueModel.from_policy(policy, rngs=nnx.Rngs(1))
  graphdef, params = nnx.split(value)
  rng = np.random.default_rng(0)
  B, P, M = 8, 5, 4
  prompt = jnp.asarray(rng.integers(4, 200, (B, P)), jnp.int32)
  completion = jnp.asarray(rng.integers(4, 200, (B, M)), jnp.int32)
  pmask = jnp.ones((B, P), bool)
  cmask = jnp.asarray(np.arange(M)[None] < rng.integers(1, M + 1, (B, 1)))
  seqs = SequenceBatch(prompt, pmask, completion, cmask)
  returns = jnp.where(cmask, jnp.asarray(rng.uniform(-1, 1, (B, 1)), jnp.float32), 0.0)
  tx, _ = make_optimizer(OptimConfig(learning_rate=3e-3, grad_clip=0.0), 100, constant=True)
  state = TrainState.create(value, tx, jax.random.key(0))
  value_fn = make_value_fn(graphdef, None)
  update = make_value_update_fn(None, ValueSettings(clip=10.0, num_minibatches=2, grad_accum=2))
  old = value_fn(params, seqs)
  assert float(jnp.max(jnp.abs(old))) == 0.0  # a zero head predicts 0 everywhere
  losses = []
  for _ in range(60):
    batch = ValueBatch(prompt, pmask, completion, cmask, value_fn(state.params, seqs), returns)
    state, metrics = update(state, batch)
    losses.append(float(metrics["value_loss"]))
  assert losses[-1] < losses[0] / 10, losses[::10]
  new = value_fn(state.params, seqs)
  assert float(jnp.max(jnp.where(cmask, 0.0, jnp.abs(new)))) == 0.0  # padding stays 0


# ----------------------------------------------------------------------------
# The loop with every controller on
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("ppo") / "run"
  assert main(["prog", *FAST, *PPO, f"--run_dir={run_dir}", "--checkpoint_every=1", "--keep_last=20"]) == 0
  return run_dir


def test_ppo_run_logs_controllers_and_checkpoints_their_state(ppo_run):
  rl = [r for r in kill_resume.load_metrics(str(ppo_run)) if "reward_mean" in r]
  assert [r["step"] for r in rl] == [1, 2, 3, 4]
  raw = [json.loads(line) for line in open(ppo_run / "metrics.jsonl")]
  assert sorted({k for r in raw for k in r if describe(k) is None}) == []  # the README's naming table
  assert "pg_loss" not in rl[0] and rl[0]["value_passes"] == 1  # step 0 trains only the critic
  for key in ("pg_loss", "value_loss", "explained_variance", "kl_prompt_max", "kl_prompt_p95", "phase"):
    assert key in rl[1], key
  assert [r["phase"] for r in rl] == sorted(r["phase"] for r in rl) and rl[-1]["phase"] == 2
  assert len({r["kl_coef"] for r in rl}) > 1  # the adaptive controller moved the coefficient
  ckpt = Checkpointer(str(ppo_run / "checkpoints"), async_save=False)
  last = ckpt.all_steps()[-1]
  tree = ckpt.restore_untyped(last)
  ckpt.close()
  assert {"controllers", "value"} <= set(tree)
  assert int(tree["controllers"]["phase"]) == 2
  assert float(tree["controllers"]["kl_coef"]) != pytest.approx(0.1)
  # The critic's passes follow the update-frequency rule on the logged value losses (--value_window=2,
  # --value_max_updates=3): a stalled or rising loss over the window adds one, a fast fall (20%) removes one
  # (not below 1), a decision starts a fresh window.  (Whether this short run's loss stalls depends on
  # its rollout keys.)
  passes, count, window, decisions = rl[0]["value_passes"], 0, [math.nan, math.nan], 0
  for r, after in zip(rl, rl[1:], strict=False):
    assert r["value_passes"] == passes, r["step"]
    if math.isfinite(r["value_loss"]):
      window, count = [window[1], r["value_loss"]], count + 1
    if count >= 2:
      decisions += 1
      older, newer = window
      new = min(passes + 1, 3) if newer >= older else max(passes - 1, 1) if newer < 0.8 * older else passes
      count, passes = (0, new) if new != passes else (count, passes)
    assert after["value_passes"] == passes, after["step"]
  assert decisions >= 1
  # The curriculum's pool and pass-rate estimates are in the metadata (and replayed by the rollback test).
  assert "curriculum/in_band" in rl[-1] and "curriculum/unseen" in rl[-1]
  ckpt = Checkpointer(str(ppo_run / "checkpoints"), async_save=False)
  sampler_state = ckpt.read_meta(last)["controllers"]
  ckpt.close()
  assert len(sampler_state["prompt_sampler"]["pool"]) == 64 and sampler_state["prompt_sampler"]["curriculum"]["entries"]


def test_ppo_rollback_replays_controllers_and_critic_identically(ppo_run, tmp_path, capsys):
  run_dir = tmp_path / "run"
  shutil.copytree(ppo_run, run_dir)
  args = ["prog", *FAST, *PPO, f"--run_dir={run_dir}", "--checkpoint_every=1", "--keep_last=20", "--rollback_to=2"]
  assert main(args) == 0
  assert "rolled back to rl step 2" in capsys.readouterr().out
  assert kill_resume.compare(str(ppo_run), str(run_dir)) == []


def test_ppo_and_dynamic_sampling_compile_nothing_after_warmup(tmp_path):
  from mimo_jax.train.loop import RLRun

  for extra in (PPO, ["--dynamic_sampling", "--dynamic_sampling_max_rounds=2", "--temperature=0.7"]):
    cfg = _cfg(tmp_path / extra[0].strip("-"), *extra)
    run = RLRun(cfg, str(tmp_path / extra[0].strip("-")))
    run.open_logger(None)
    state = run.begin_rl(run.fresh_state("rl").params, {})
    for step in range(2):
      state, _ = run.step(state, step)
    with count_compilations() as c:
      for step in range(2, 4):
        state, (record, *_) = run.step(state, step)
    assert c.count == 0, extra
    # Every key follows the documented naming convention (dynamic sampling's and the critic's included).
    assert [k for k in record if describe(k) is None] == [], extra
    run.close()


# ----------------------------------------------------------------------------
# Scripted rollouts: raw logging under shaping, dynamic sampling
# ----------------------------------------------------------------------------


def _parity_responder(run_holder):
  """Prompts whose operand sum is even: every sample correct (an all-equal group); odd: samples 0 and 1."""

  def respond(prompt_ids, g):
    tok = run_holder["run"].tokenizer
    operands = parse_operands(tok.decode(prompt_ids))
    answer = make_problem(operands, level=1, reverse_answer=True).answer
    correct = sum(operands) % 2 == 0 or g in (0, 1)
    return tok.encode(answer if correct else answer + "1") + [tok.eos_id]

  return respond


def _scripted_run(tmp_path, *flags):
  from mimo_jax.train.loop import RLRun

  holder = {}
  cfg = _cfg(tmp_path, "--kl_coef=0", *flags)
  run = RLRun(
    cfg, str(tmp_path), rollout_factory=lambda m, mesh: FakeRollout(_parity_responder(holder), batch_shards=8)
  )
  holder["run"] = run
  run.open_logger(None)
  return run, run.begin_rl(run.fresh_state("rl").params, {})


def test_logged_rewards_stay_raw_under_shaping(tmp_path):
  shaping = ["--reward_clip_low=0.2", "--reward_clip_high=0.8", "--reward_ema=0.9", "--advantage=reinforce_baseline"]
  run, state = _scripted_run(tmp_path, *shaping, "--overlong=penalty", "--overlong_buffer=5")
  for step in range(2):
    state, (record, hist, _) = run.step(state, step)
    raw = np.asarray(hist["reward_hist"])
    assert set(np.unique(raw)) <= {0.0, 1.0}  # the verifier's rewards, untouched
    assert record["reward_mean"] == pytest.approx(raw.mean()) and record["accuracy"] == pytest.approx(raw.mean())
    # The advantage path saw the shaped rewards: overlong penalty applied, EMA standardised.
    assert record["overlong_penalty"] < 0
    assert record["shaped_reward_mean"] != pytest.approx(record["reward_mean"])
    # --kl_coef=0: no reference, so no KL to it is measured (it would be against zero log-probs).
    assert not [k for k in record if k.startswith("kl_prompt")], record
  run.close()


def test_dynamic_sampling_replaces_all_equal_groups(tmp_path):
  run, state = _scripted_run(tmp_path / "plain")
  _, (plain, *_) = run.step(state, 0)
  run.close()
  assert plain["frac_groups_all_equal"] > 0.2  # about half the prompts have an even sum

  run, state = _scripted_run(tmp_path / "ds", "--dynamic_sampling", "--dynamic_sampling_max_rounds=4")
  for step in range(3):
    state, (record, hist, _) = run.step(state, step)
    assert record["ds_rounds"] >= 2
    assert record["frac_groups_all_equal"] == 0.0 and record["ds_filled_groups"] == 0
    # Every kept group is a mixed one: samples 0 and 1 right, 2 and 3 wrong.
    np.testing.assert_array_equal(np.asarray(hist["reward_hist"]).reshape(-1, 4), [[1, 1, 0, 0]] * 8)
    # The per-component metrics and histograms describe that batch, not the first round's.
    assert record["reward/correct_mean"] == 0.5
    np.testing.assert_array_equal(np.asarray(hist["reward/correct"]).reshape(-1, 4), [[1, 1, 0, 0]] * 8)
  run.close()

  # With no extra rounds allowed the batch is filled with the all-equal groups, and counted.
  run, state = _scripted_run(tmp_path / "bounded", "--dynamic_sampling", "--dynamic_sampling_max_rounds=0")
  _, (record, *_) = run.step(state, 0)
  assert record["frac_groups_all_equal"] == pytest.approx(plain["frac_groups_all_equal"])
  run.close()


def test_ppo_config_files_parse_and_validate():
  from mimo_jax.config import validate

  for name in ("ppo_tiny", "dapo_tiny"):
    path = os.path.join(ROOT, "experiments", f"{name}.flags")
    cfg = parse_config(["prog", f"--flagfile={path}"])
    validate(cfg, 8)
    assert cfg.run.experiment == name
  with open(os.path.join(ROOT, "experiments", "ppo_tiny.flags")) as f:
    assert "--use_value_model" in f.read()
  json.dumps(cfg.to_dict())


# ----------------------------------------------------------------------------
# Rewards and prompt data in the loop
# ----------------------------------------------------------------------------


def test_a_raising_reward_is_a_recorded_failure_and_the_run_goes_on(tmp_path, capsys):
  run, state = _scripted_run(tmp_path)
  verify = run.task.reward

  def flaky(problem, text):
    if sum(parse_operands(problem.prompt)) % 3 == 0:
      raise RuntimeError("verifier bug")
    return verify(problem, text)

  run.task.reward = flaky  # the composite reward calls the task's verifier in-process (--reward_workers=0)
  capsys.readouterr()
  state, (record, hist, _) = run.step(state, 0)
  assert record["reward/failures"] > 0 and record["reward/correct_fail_frac"] > 0
  assert np.isfinite(record["reward_mean"]) and np.isfinite(record["loss"])
  # The run says which source failed, on how many samples, and why (a failing sample's batch row).
  out = capsys.readouterr().out
  failures = int(record["reward/failures"])
  assert f"RL step 0: reward sources failed, each failure counted as 0: correct on {failures} of " in out, out
  assert re.search(r"correct\[\d+\]: RuntimeError: verifier bug", out), out
  # A source that keeps failing is not reported again at every step: its fail_frac is in every record.
  state, (record, *_) = run.step(state, 1)
  assert record["reward/correct_fail_frac"] > 0 and "reward sources failed" not in capsys.readouterr().out
  run.close()


def test_a_reward_model_is_a_logged_reward_component(tmp_path):
  """A Bradley-Terry reward model (trained for a few steps here) joins the task's verifier as a component."""
  from mimo_jax.rewards.reward_model import train_reward_model
  from mimo_jax.train.loop import RLRun

  cfg = _cfg(tmp_path / "probe")
  probe = RLRun(cfg, str(tmp_path / "probe"))
  problems = probe.task.sample(np.random.default_rng(0), 16)
  pairs = [(p.prompt, p.answer, p.answer + "1") for p in problems]
  train_reward_model(
    pairs,
    tokenizer=probe.tokenizer,
    model_cfg=probe.model_cfg,
    mesh=probe.mesh,
    steps=2,
    batch_size=8,
    buckets=probe.buckets,
    max_completion_len=cfg.rollout.max_new_tokens,
    run_dir=str(tmp_path / "rm"),
  )
  probe.close()
  run, state = _scripted_run(tmp_path / "run", f"--reward_model={tmp_path / 'rm'}", "--reward_model_weight=0.5")
  state, (record, hist, _) = run.step(state, 0)
  assert record["reward/failures"] == 0 and np.isfinite(record["reward/reward_model_mean"])
  assert "reward/reward_model" in hist and "reward/correct" in hist
  # The mix is verifier + 0.5 x reward model: the logged reward is not the verifier's alone.
  assert record["reward_mean"] == pytest.approx(
    record["reward/correct_mean"] + 0.5 * record["reward/reward_model_mean"], abs=1e-5
  )
  run.close()
