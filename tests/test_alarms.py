"""Failure-shape alarms: each detector provoked on a curve of its shape (and quiet on healthy ones), the
record it writes, and real runs whose reward collapse, KL blow-up, entropy collapse, length explosion,
value-loss spike or grad-norm collapse an alarm catches and rolls back, and whose periodic reward from a
fixed prompt order the alarm breaks by reshuffling."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from mimo_jax.train.alarms import ALARM_KINDS, DIAGNOSIS, Alarms, AlarmSettings, alarm_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 5
HEALTHY = {
  "reward_mean": 0.3,
  "entropy": 2.0,
  "kl_k3": 0.01,
  "value_loss": 0.1,
  "response_len": 5.0,
  "grad_norm": 1.0,
  "frac_groups_all_equal": 0.5,
}


def _feed(series: list[dict], settings=None) -> list:
  alarms = Alarms(settings or AlarmSettings(window=W))
  fired = []
  for step, changes in enumerate(series, start=1):
    fired += alarms.update(step, {**HEALTHY, **changes})
  return fired


def _ramp(n, key, start, end):
  return [{key: float(v)} for v in np.linspace(start, end, n)]


def test_reward_collapse_after_a_rise_fires_once_with_the_peak_as_onset():
  series = [{"reward_mean": 0.1}] * 10 + _ramp(20, "reward_mean", 0.1, 0.6) + _ramp(10, "reward_mean", 0.6, 0.1)
  fired = _feed(series)
  assert [a.kind for a in fired] == ["reward_collapse"]
  a = fired[0]
  # The smoothed (5-step) reward peaks at step 32 (the mean of steps 28..32) and the alarm fires when half
  # of the rise above the first window (0.1) is gone.
  assert 30 <= a.onset <= 33 and a.onset < a.step <= 40
  assert a.evidence["reward_smoothed"] <= a.evidence["peak"] - 0.5 * (a.evidence["peak"] - a.evidence["first"])
  row = a.record("logged")
  assert row["diagnosis"][0].startswith("value loss") and row["diagnosis"][1].startswith("entropy")
  assert row["diagnosis"][2].startswith("KL") and row["action"] == "logged"
  # A rise too small to matter (under --alarm_reward_min_rise) collapsing is noise, not an alarm.
  small = [{"reward_mean": 0.1}] * 10 + _ramp(10, "reward_mean", 0.1, 0.13) + _ramp(10, "reward_mean", 0.13, 0.1)
  assert _feed(small) == []


@pytest.mark.parametrize(
  "kind, series",
  [
    ("entropy_collapse", [{}] * 10 + _ramp(10, "entropy", 2.0, 0.01) + [{"entropy": 0.01}] * 10),
    ("kl_blowup", [{}] * 10 + [{"kl_k3": 5.0}] * 10),
    ("length_explosion", [{}] * 10 + _ramp(10, "response_len", 5.0, 40.0)),
    ("grad_norm_collapse", [{}] * 10 + [{"grad_norm": 1e-4}] * 10),
  ],
)
def test_each_shape_fires_its_own_alarm_and_nothing_else(kind, series):
  fired = _feed(series)
  assert [a.kind for a in fired] == [kind]
  assert fired[0].onset <= fired[0].step and set(DIAGNOSIS) == set(ALARM_KINDS)


def test_a_value_loss_spike_fires_per_spike_and_clears_between():
  series = [{}] * 8 + [{"value_loss": 5.0}] + [{}] * 8 + [{"value_loss": 3.0}] + [{}] * 3
  fired = _feed(series)
  assert [(a.kind, a.step) for a in fired] == [("value_loss_spike", 9), ("value_loss_spike", 18)]
  assert fired[0].evidence == {"value_loss": 5.0, "median_before": 0.1}


def test_a_value_hovering_at_the_threshold_is_one_episode():
  # The smoothed entropy (2.0 at first, floor 0.1 x) crosses 0.2 every few steps for 36 steps: one alarm;
  # a window of healthy steps clears it, and a new collapse after that is a new alarm.
  hover = ([{"entropy": 0.15}] * 3 + [{"entropy": 0.26}] * 3) * 6
  fired = _feed([{}] * 10 + hover + [{}] * 10 + [{"entropy": 0.01}] * 10)
  assert [(a.kind, a.step) for a in fired] == [("entropy_collapse", 15), ("entropy_collapse", 61)]
  # The clearing count is detector state: checkpointed, restored mid-episode, the same alarms.
  series = [{}] * 10 + hover
  first = Alarms(AlarmSettings(window=W))
  for step, changes in enumerate(series[:20], start=1):
    first.update(step, {**HEALTHY, **changes})
  second = Alarms(AlarmSettings(window=W))
  second.load_state_dict(json.loads(json.dumps(first.state_dict())))
  later = [a for step, c in enumerate(series[20:], start=21) for a in second.update(step, {**HEALTHY, **c})]
  assert later == [] and "entropy_collapse" in second.active


def test_a_solved_batch_is_not_a_grad_norm_collapse_but_a_stuck_one_is():
  # Every sample correct: nothing left to learn, no gradient expected; those steps are not evidence.
  solved = [{"grad_norm": 0.0, "frac_groups_all_equal": 1.0, "accuracy": 1.0}] * 20
  assert _feed([{}] * 10 + solved) == []
  # Every group alike but not solved (a saturated policy repeating its wrong answers): the shape itself.
  stuck = [{"grad_norm": 1e-6, "frac_groups_all_equal": 1.0, "accuracy": 0.25}] * 20
  fired = _feed([{}] * 10 + stuck)
  assert [a.kind for a in fired] == ["grad_norm_collapse"] and fired[0].evidence["first"] == 1.0


@pytest.mark.parametrize("seed", range(6))
def test_a_noisy_plateau_on_a_small_batch_is_not_a_reward_collapse(seed):
  """8 prompts x 8 samples a step (per-step reward noise ~0.1) over 800 steps: a rise, then a plateau whose
  highest and lowest 10-step means lie ~0.2 apart.  Without the noise margin this fired on most seeds
  (a rise of 0.05 losing half of it is two standard errors here); a real collapse on the same noise fires."""
  rng = np.random.default_rng(seed)
  t = np.arange(800)
  level = 0.45 + 0.3 * (1 - np.exp(-t / 60))
  noisy = np.clip(level + rng.normal(0, 0.1, 800), 0, 1)
  settings = AlarmSettings()  # the shipped thresholds, window 10
  assert _feed([{"reward_mean": float(r)} for r in noisy], settings) == []
  collapsed = np.where(t < 500, noisy, np.clip(0.25 + rng.normal(0, 0.1, 800), 0, 1))
  fired = _feed([{"reward_mean": float(r)} for r in collapsed], settings)
  assert [a.kind for a in fired] == ["reward_collapse"] and 500 < fired[0].step <= 515
  assert fired[0].evidence["noise_margin"] > 0.1


def test_periodic_reward_jitter_is_found_with_its_period():
  rng = np.random.default_rng(0)
  t = np.arange(60)
  reward = 0.3 + 0.004 * t + 0.1 * np.sin(2 * np.pi * t / 4) + rng.normal(0, 0.01, 60)
  fired = _feed([{"reward_mean": float(r)} for r in reward])
  assert [a.kind for a in fired] == ["reward_jitter"] and fired[0].evidence["period"] == 4


@pytest.mark.parametrize("seed", range(8))
def test_a_rising_noisy_reward_raises_nothing(seed):
  """A healthy learning curve (a saturating rise with batch noise, entropy slowly falling) on any seed."""
  rng = np.random.default_rng(seed)
  t = np.arange(200)
  reward = 0.1 + 0.5 * (1 - np.exp(-t / 60)) + rng.normal(0, 0.04, 200)
  entropy = 2.0 - 0.5 * t / 200 + rng.normal(0, 0.05, 200)
  kl = 0.002 * t / 20 + np.abs(rng.normal(0, 0.002, 200))
  series = [
    {"reward_mean": float(r), "entropy": float(e), "kl_k3": float(k), "grad_norm": float(abs(g))}
    for r, e, k, g in zip(reward, entropy, kl, rng.normal(1.0, 0.3, 200), strict=True)
  ]
  assert _feed(series, AlarmSettings()) == []


def test_the_detectors_resume_from_their_state_as_if_never_stopped():
  series = [{"reward_mean": 0.1}] * 10 + _ramp(20, "reward_mean", 0.1, 0.6) + _ramp(10, "reward_mean", 0.6, 0.1)
  whole = _feed(series)
  first, second = Alarms(AlarmSettings(window=W)), Alarms(AlarmSettings(window=W))
  fired = []
  for step, changes in enumerate(series[:25], start=1):
    fired += first.update(step, {**HEALTHY, **changes})
  second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through a checkpoint's JSON
  for step, changes in enumerate(series[25:], start=26):
    fired += second.update(step, {**HEALTHY, **changes})
  assert fired == whole


def _rollback_run(run_dir, *, sft_steps: int, max_steps: int, rollbacks: int) -> list[str]:
  """A short real run of the tiny model that checkpoints every step and acts on its alarms (a window of 2
  steps) with --on_alarm=rollback; the caller adds what provokes the shape."""
  return [
    "--flagfile=" + os.path.join(ROOT, "experiments", "grpo_tiny.flags"),
    "--model_preset=tiny",
    f"--sft_steps={sft_steps}",
    "--sft_batch_size=32",
    f"--max_steps={max_steps}",
    "--prompts_per_step=8",
    "--num_samples=4",
    "--eval_every=0",
    "--eval_prompts=8",
    "--eval_samples=2",
    "--checkpoint_every=1",
    "--keep_last=20",
    "--tensorboard=false",
    "--warmup_steps=0",
    "--alarm_window=2",
    "--on_alarm=rollback",
    f"--max_alarm_rollbacks={rollbacks}",
    f"--run_dir={run_dir}",
  ]


def test_a_huge_learning_rate_is_caught_rolled_back_and_damped(tmp_path, capsys):
  """Learning rate 0.5 and a strong entropy bonus on the tiny model (a gradient whatever the rewards): the
  KL to the reference blows up within a few steps.  With
  --on_alarm=rollback the alarm restores the policy from before the damage with the learning rate halved
  and the KL coefficient doubled, twice at most, and the run completes; every alarm is on record."""
  from mimo_jax.main import main

  run_dir = tmp_path / "run"
  flags = _rollback_run(run_dir, sft_steps=30, max_steps=12, rollbacks=2)
  assert main(["prog", *flags, "--learning_rate=0.5", "--entropy_coef=0.5"]) == 0
  out = capsys.readouterr().out
  rows = [json.loads(line) for line in open(run_dir / "alarms.jsonl")]
  rolled = [r for r in rows if r["action"].startswith("rolled back to RL step")]
  assert len(rolled) == 2 and rolled[0]["kind"] == "kl_blowup"
  for r in rolled:
    back = int(r["action"].split("RL step ")[1].split(";")[0])
    assert (
      back <= r["onset"] - 2 and r["evidence"]["kl_smoothed"] > 1.0 and r["diagnosis"] == list(DIAGNOSIS[r["kind"]])
    )
  assert all("spent" in r["action"] or "another alarm" in r["action"] for r in rows[rows.index(rolled[-1]) + 1 :])
  assert "alarm at RL step" in out and "action: rolled back to RL step" in out
  metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  rl = [m for m in metrics if "reward_mean" in m]
  # Every step logged once (the rolled-back ones redone), the interventions in effect and compounding.
  assert [m["step"] for m in rl] == list(range(1, 13)) and rl[-1]["alarm_rollbacks"] == 2
  assert rl[-1]["kl_coef"] == pytest.approx(0.001 * 2 * 2)
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["alarm_rollbacks"] == 2


def test_a_kl_or_critic_loss_that_is_no_longer_a_number_fires_its_alarm():
  """A value loss or a KL that became +inf or NaN (the logger writes them as "inf" / "nan") is the largest
  spike there is: its alarm fires, with evidence that is strict JSON.  They were dropped as gaps, so the
  worst blow-up raised nothing."""
  from mimo_jax.train.logger import MetricsLogger

  healthy = dict(reward_mean=0.3, entropy=2.0, kl_k3=0.01, value_loss=0.1, response_len=5.0, grad_norm=1.0)
  for key, kind, bad in (("value_loss", "value_loss_spike", 9), ("kl_k3", "kl_blowup", 11)):
    for value in (math.inf, math.nan):
      alarms, fired = Alarms(AlarmSettings(window=5)), []
      for step in range(1, 16):
        record = dict(healthy, **({key: value} if step >= bad else {}))
        fired += alarms.update(step, MetricsLogger.record(step, record))
      assert [(a.kind, a.step) for a in fired] == [(kind, bad)], (key, value)
      json.dumps(fired[0].evidence, allow_nan=False)


def test_an_alarms_kl_increase_stays_inside_the_controllers_bounds(tmp_path):
  """The huge learning rate again, under the adaptive KL controller bounded at --kl_coef_max: the
  rollback's doubled coefficient is clipped to the bound (it applied twice the bound on the redone step
  before the controller pulled it back)."""
  from mimo_jax.main import main

  run_dir = tmp_path / "run"
  flags = _rollback_run(run_dir, sft_steps=30, max_steps=8, rollbacks=1)
  adaptive = ["--kl_controller=adaptive", "--kl_coef=0.001", "--kl_coef_min=0.0005", "--kl_coef_max=0.0015"]
  assert main(["prog", *flags, "--learning_rate=0.5", "--entropy_coef=0.5", *adaptive]) == 0
  rows = [json.loads(line) for line in open(run_dir / "alarms.jsonl")]
  assert any(r["action"].startswith("rolled back to RL step") for r in rows)
  rl = [m for m in map(json.loads, open(run_dir / "metrics.jsonl")) if "reward_mean" in m]
  assert rl[-1]["alarm_rollbacks"] == 1
  assert max(m["kl_coef"] for m in rl) <= 0.0015 * (1 + 1e-6)


# Every other detector is switched off (its threshold out of reach), so the one under test, at its shipped
# threshold, is the only one that can fire and roll back.
SILENCE = {
  "reward_collapse": "--alarm_reward_min_rise=1e9",
  "entropy_collapse": "--alarm_entropy_floor=1e-9",
  "kl_blowup": "--alarm_kl_max=1e9",
  "value_loss_spike": "--alarm_value_spike=1e9",
  "length_explosion": "--alarm_length_growth=1e9",
  "grad_norm_collapse": "--alarm_grad_floor=1e-9",
  "reward_jitter": "--alarm_jitter_acf=0.999999",
}


def _silence_all_but(kind: str) -> list[str]:
  return [flag for k, flag in SILENCE.items() if k != kind]


# How each shape is provoked in a real run of the tiny model, the threshold its evidence crossed (the
# shipped one, but for the value-loss spike), and what the first step after the rollback shows instead.
PROVOKED = {
  # A learning rate 1000x the default on a dense reward (the digits in place): the policy sharpens onto
  # whatever it samples until every group's samples are alike (entropy 2.0 -> 0.03 nats in 3 steps; at
  # 250x it collapsed on some rollout keys and not on others).
  "entropy_collapse": (
    ["--learning_rate=0.2", "--digit_reward_weight=1"],
    lambda e: e["entropy_smoothed"] < 0.1 * e["first"],
    lambda r, e: r["entropy"] >= 0.1 * e["first"],
  ),
  # The same learning rate, reached over 4 warm-up steps, with room to ramble: the end-of-sequence token
  # loses its mass and answers of ~3 tokens run to the 16-token limit.
  "length_explosion": (
    ["--learning_rate=0.05", "--warmup_steps=4", "--digit_reward_weight=1", "--max_new_tokens=16"],
    lambda e: e["response_len_smoothed"] > 3.0 * e["first"],
    lambda r, e: r["response_len"] <= 3.0 * e["first"],
  ),
  # The same learning rate with nothing to damp it: the softmax saturates, every group's samples come out
  # alike while most answers are still wrong, and the gradient norm falls ~1000x in two steps.
  "grad_norm_collapse": (
    ["--learning_rate=0.2", "--digit_reward_weight=1"],
    lambda e: e["grad_norm_smoothed"] < 0.01 * e["first"],
    lambda r, e: r["grad_norm"] >= 0.01 * e["first"],
  ),
  # PPO's critic at 100x ppo_tiny's learning rate on a dense reward (returns that are not all 0): its loss
  # swings from step to step, ~7x in one step at step 6; caught with the threshold flag at 5x the median
  # of the window before (the first update's 1000x overshoot comes before the detector has a window to compare it with).
  "value_loss_spike": (
    [
      "--advantage=gae",
      "--use_value_model",
      "--value_learning_rate=0.1",
      "--digit_reward_weight=1",
      "--alarm_value_spike=5",
    ],
    lambda e: e["value_loss"] > 5.0 * e["median_before"],
    lambda r, e: r["value_loss"] <= 5.0 * e["median_before"],
  ),
}


@pytest.mark.parametrize("kind", sorted(PROVOKED))
def test_each_provoked_shape_is_caught_recorded_and_rolled_back(kind, tmp_path):
  """A real run per failure shape, provoked as the reports saw it happen, caught at its threshold with
  --on_alarm=rollback: the record (onset, evidence, diagnosis order, action), the rollback to a
  checkpoint from before the onset, the intervention in effect on the redone steps, a completed run."""
  from mimo_jax.main import main

  run_dir = tmp_path / "run"
  provoke, crossed, healthy = PROVOKED[kind]
  flags = _rollback_run(run_dir, sft_steps=40, max_steps=14, rollbacks=1)
  silence = _silence_all_but(kind)
  assert main(["prog", *flags, *silence, *provoke]) == 0
  rows = [json.loads(line) for line in open(run_dir / "alarms.jsonl")]
  assert rows and {r["kind"] for r in rows} == {kind}
  first = rows[0]
  assert first["action"].startswith("rolled back to RL step") and first["diagnosis"] == list(DIAGNOSIS[kind])
  assert crossed(first["evidence"]) and first["onset"] <= first["step"]
  back = int(first["action"].split("RL step ")[1].split(";")[0])
  assert back <= first["onset"] - 2
  assert all("spent" in r["action"] for r in rows[1:])  # one rollback allowed; later alarms are logged
  rl = [m for m in map(json.loads, open(run_dir / "metrics.jsonl")) if "reward_mean" in m]
  assert [m["step"] for m in rl] == list(range(1, 15))  # every step once: the rolled-back ones redone
  # The intervention is in effect from the first redone step on: KL coefficient x2, the learning-rate
  # scale x0.5 (the critic's too for a value-loss spike).
  assert [m["kl_coef"] for m in rl] == pytest.approx([0.001] * back + [0.002] * (14 - back))
  assert rl[-1]["alarm_rollbacks"] == 1
  # The run went on from a policy from before the shape: the first redone step does not show it.
  assert healthy(rl[back], first["evidence"])
  if kind == "value_loss_spike":
    assert [m["value_lr_scale"] for m in rl] == [1.0] * back + [0.5] * (14 - back)
    assert "critic learning rate x0.5" in first["action"]


def test_a_learning_rate_spike_after_a_rise_is_a_reward_collapse_caught_and_rolled_back(tmp_path):
  """The reports' first shape, live: the reward rises (16 prompts whose answer is 7, from a barely warmed
  start at learning rate 1e-2: ~0.05 -> ~0.55 in 10 steps), then one update at 1000x the learning rate
  (``--debug_lr_spike_steps``, the loss spike of a bad batch) wipes it out: the reward falls to 0 and, left
  alone, stays there.  At the shipped thresholds (the others silenced) the alarm fires once, its onset at
  the reward's peak, and rolls back to a checkpoint from before the peak with the learning rate halved and
  the KL coefficient doubled; the redone steps (the spike is one-shot) keep the reward that was reached."""
  from mimo_jax.main import main

  rows = [{"prompt": f"Easy question {i}: write the number seven.", "answer": "7"} for i in range(16)]
  heldout = [{"prompt": f"Held-out question {i}: write the number seven.", "answer": "7"} for i in range(4)]
  for name, data in (("train", rows), ("test", heldout)):
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
  run_dir = tmp_path / "run"
  flags = _rollback_run(run_dir, sft_steps=4, max_steps=24, rollbacks=1)
  provoke = [
    "--task=jsonl",
    f"--data_path={tmp_path / 'train.jsonl'}",
    f"--eval_data_path={tmp_path / 'test.jsonl'}",
    "--eval_prompts=4",
    "--learning_rate=1e-2",
    "--debug_lr_spike_steps=12",
  ]
  assert main(["prog", *flags, *_silence_all_but("reward_collapse"), *provoke]) == 0
  alarms = [json.loads(line) for line in open(run_dir / "alarms.jsonl")]
  assert [a["kind"] for a in alarms] == ["reward_collapse"]
  a, e = alarms[0], alarms[0]["evidence"]
  # The policy the spike made earns (next to) nothing: within two records of it the smoothed reward (a
  # window of 2, which may still hold the last good step) has fallen from the peak past the noise margin.
  assert e["reward_smoothed"] < 0.6 * e["peak"] and e["peak"] - e["reward_smoothed"] > e["noise_margin"]
  assert e["peak"] - e["first"] > max(0.05, e["noise_margin"])
  assert a["onset"] == e["peak_step"] <= 12 < a["step"] <= 14 and a["diagnosis"] == list(DIAGNOSIS["reward_collapse"])
  assert a["action"].startswith("rolled back to RL step") and "learning rate x0.5, KL coefficient x2" in a["action"]
  back = int(a["action"].split("RL step ")[1].split(";")[0])
  assert back <= a["onset"] - 2
  rl = [m for m in map(json.loads, open(run_dir / "metrics.jsonl")) if "reward_mean" in m]
  assert [m["step"] for m in rl] == list(range(1, 25)) and rl[-1]["alarm_rollbacks"] == 1
  assert [m["kl_coef"] for m in rl] == pytest.approx([0.001] * back + [0.002] * (24 - back))
  # The spike is not redone (one-shot) and the halved learning rate is in effect: every logged rate is at
  # most the base schedule's peak, and the redone steps' at most half of it.
  assert max(m["lr"] for m in rl) <= 1e-2 * (1 + 1e-6) and max(m["lr"] for m in rl[back:]) <= 0.5e-2 * (1 + 1e-6)
  # Recovered: no redone step earns nothing, and they hold the reward the rise reached.
  redone = [m["reward_mean"] for m in rl[back:]]
  assert min(redone) > 0.2 and np.mean(redone) > 0.8 * e["peak"]


def test_an_alarm_with_no_checkpoint_to_roll_back_to_leaves_the_async_run_as_it_was(tmp_path):
  """--on_alarm=rollback with no RL checkpoint before the onset (--keep_last=1) only logs the alarm: the
  run equals the --on_alarm=log run, metrics, samples and arrays (it stopped the async producer anyway,
  and its made batches' prompts were never trained on: the producer went on from where it had got)."""
  from mimo_jax.main import main
  from mimo_jax.testing import kill_resume

  flags = [
    *_rollback_run(tmp_path / "unused", sft_steps=4, max_steps=8, rollbacks=1)[:-1],
    "--keep_last=1",
    "--entropy_coef=0.01",  # moves the policy off the reference whatever the rewards
    "--alarm_kl_max=1e-4",
    *_silence_all_but("kl_blowup"),
    "--async_rollout",
    "--max_staleness=2",
  ]
  for mode in ("log", "rollback"):
    assert main(["prog", *flags, f"--on_alarm={mode}", f"--run_dir={tmp_path / mode}"]) == 0
  alarms = [json.loads(line) for line in open(tmp_path / "rollback" / "alarms.jsonl")]
  assert alarms and all(a["action"].startswith("logged (no RL checkpoint before the onset") for a in alarms)
  assert kill_resume.compare(str(tmp_path / "log"), str(tmp_path / "rollback")) == []


@pytest.mark.parametrize("async_rollout", [False, True], ids=["sync", "async"])
def test_a_fixed_prompt_order_jitters_and_the_alarm_reshuffles_it(async_rollout, tmp_path):
  """A repeating data pipeline, as the reports saw it: 16 prompts in file order (8 easy, then 8 the model
  cannot answer), 8 a step, so the reward alternates.  The jitter alarm finds period 2 and, with
  --on_alarm=rollback, breaks the order into shuffled epochs from the next batch made on, with no
  rollback (async: the batch the producer already made keeps the old order)."""
  from mimo_jax.main import main

  easy = [{"prompt": f"Easy question {i}: write the number seven.", "answer": "7"} for i in range(8)]
  codes = np.random.default_rng(0).integers(100_000, 1_000_000, 8)
  hard = [{"prompt": f"Hard question {i}: the secret code?", "answer": str(c)} for i, c in enumerate(codes)]
  heldout = [{"prompt": f"Held-out question {i}: write the number seven.", "answer": "7"} for i in range(4)]
  for name, rows in (("train", easy + hard), ("test", heldout)):
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  run_dir = tmp_path / "run"
  flags = _rollback_run(run_dir, sft_steps=40, max_steps=32, rollbacks=1)
  silence = _silence_all_but("reward_jitter")
  data = [
    "--task=jsonl",
    f"--data_path={tmp_path / 'train.jsonl'}",
    f"--eval_data_path={tmp_path / 'test.jsonl'}",
    "--eval_prompts=4",
    "--data_order=sequential",
    "--alarm_window=4",  # 6 windows of 4 steps: enough values for the autocorrelation at 2 and 4 steps
    "--log_samples=16",  # top 16 + bottom 16 of 32 rows: every row, so every step's prompts are on record
  ]
  assert main(["prog", *flags, *silence, *data, f"--async_rollout={str(async_rollout).lower()}"]) == 0
  rows = [json.loads(line) for line in open(run_dir / "alarms.jsonl")]
  assert rows and {r["kind"] for r in rows} == {"reward_jitter"}
  first = rows[0]
  s = first["step"]
  assert first["evidence"]["period"] == 2 and first["evidence"]["autocorrelation"] > 0.6
  assert first["diagnosis"][0].startswith("the data pipeline repeats")
  # The first batch made after the alarm: the next step's, or (async, staleness 1) the one after it.
  shuffled = s + 2 if async_rollout else s + 1
  assert (
    first["action"]
    == f"prompt order reshuffled every epoch from RL step {shuffled} on (--data_order=sequential); no rollback"
  )
  rl = [m for m in map(json.loads, open(run_dir / "metrics.jsonl")) if "reward_mean" in m]
  assert [m["step"] for m in rl] == list(range(1, 33)) and rl[-1]["alarm_rollbacks"] == 0

  def prompt_order(run_dir):
    """Each step's prompts in batch order, from the sample replay (every row of every step)."""
    by_step = {}
    for r in map(json.loads, open(run_dir / "samples.jsonl")):
      if r["kind"] != "kl_top":
        by_step.setdefault(r["step"], {})[r["row"] // 4] = r["prompt"]
    return {t: [p[g] for g in range(8)] for t, p in by_step.items()}

  order = prompt_order(run_dir)
  assert sorted(order) == list(range(1, 33))
  if async_rollout:
    # Stopped at the alarm's step and resumed: the batch the producer had made before the reshuffle is
    # pending in the checkpoint and made again in the old order, and the order breaks at the same batch
    # (the reshuffle was lost: the resumed run went back to the file's order for good).
    again = tmp_path / "again"
    async_flags = [*flags[:-1], f"--run_dir={again}", *silence, *data, "--async_rollout=true"]
    assert main(["prog", *async_flags, f"--stop_at_step={s}"]) == 0
    assert main(["prog", *async_flags]) == 0
    assert prompt_order(again) == order
  prompts = [r["prompt"] for r in easy + hard]
  # Up to the reshuffle: the file's order, easy and hard batches alternating, and the reward with them.
  for t in range(1, shuffled):
    assert order[t] == (prompts[:8] if t % 2 else prompts[8:])
  odd, even = (np.mean([m["reward_mean"] for m in rl[:s] if m["step"] % 2 == k]) for k in (1, 0))
  assert odd > even + 0.05
  # From it: epochs of 2 steps, each a fresh permutation of the 16 prompts, the halves mixed.
  after = [order[t] for t in range(shuffled, 33)]
  epochs = [after[i] + after[i + 1] for i in range(0, len(after) - 1, 2)]
  assert epochs and all(sorted(e) == sorted(prompts) for e in epochs)
  assert all(e != prompts for e in epochs) and any(set(b) not in (set(prompts[:8]), set(prompts[8:])) for b in after)


def test_a_small_batch_runs_recorded_curve_raises_nothing():
  """A healthy run at 8 prompts a step (the rollout-batch study's 8 x 800 point, 32.0% -> 89.1% held-out):
  before the noise margin its plateau raised five reward-collapse alarms (a 'rise' of 0.06 above the first
  window losing half of it is two standard errors of a 64-sample batch)."""
  curve = json.load(open(os.path.join(ROOT, "tests", "data", "grpo_tiny_8x800_seed2_curve.json")))
  keys = [k for k in curve if k not in ("source", "step")]
  alarms = Alarms(AlarmSettings())
  fired = [a for i, s in enumerate(curve["step"]) for a in alarms.update(s, {k: curve[k][i] for k in keys})]
  assert len(curve["step"]) == 800 and fired == []
  # Its reward cut to 0.3 after step 500 (~0.75 before) is a collapse, and is caught within a window.
  alarms = Alarms(AlarmSettings())
  fired = [
    a
    for i, s in enumerate(curve["step"])
    for a in alarms.update(s, {"reward_mean": curve["reward_mean"][i] if i < 500 else 0.3})
  ]
  assert [a.kind for a in fired] == ["reward_collapse"] and 500 < fired[0].step <= 510


def test_a_real_reward_collapse_in_a_recorded_run_is_caught_once_with_its_peak_as_onset():
  """A collapse that happened (the stabiliser study's adaptive-KL arm, seed 0): the controller drove the KL
  coefficient up 20x and pulled the policy back toward the reference, the batch reward fell from ~0.8 to
  ~0.7 and the held-out accuracy from 90.2% to 86.7%.  One alarm, onset at the reward's peak, found while
  the coefficient is still climbing; the noise margin that silences small-batch plateaus lets it through."""
  curve = json.load(open(os.path.join(ROOT, "tests", "data", "grpo_tiny_adaptive_kl_seed0_curve.json")))
  keys = [k for k in curve if k not in ("source", "step")]
  alarms = Alarms(AlarmSettings())
  fired = [a for i, s in enumerate(curve["step"]) for a in alarms.update(s, {k: curve[k][i] for k in keys})]
  assert len(curve["step"]) == 400 and [a.kind for a in fired] == ["reward_collapse"]
  a = fired[0]
  e = a.evidence
  assert a.onset == e["peak_step"] < a.step and e["peak"] - e["reward_smoothed"] > e["noise_margin"]
  at_peak, at_alarm = (curve["kl_coef"][curve["step"].index(s)] for s in (a.onset, a.step))
  assert at_alarm > 1.5 * at_peak and at_alarm > 10 * curve["kl_coef"][0]


def test_a_solved_tasks_low_entropy_is_convergence_but_a_stuck_policys_is_a_collapse():
  """A real run that solves its task (levels 1-3 of arithmetic, 25% -> 100% held-out, batch accuracy
  0.98-0.99 from step 290 on) ends with 10x less entropy than it started with. Replayed through the
  shipped thresholds it raises nothing; before the accuracy exemption the same curve raised
  entropy_collapse at steps 324 and 351 (the run's own alarms.jsonl), which a threshold of 1 still
  gives; and the same entropy with the policy stuck at half its answers right is a collapse."""
  curve = json.load(open(os.path.join(ROOT, "tests", "data", "grpo_tiny_levels123_seed1_curve.json")))
  keys = [k for k in curve if k not in ("source", "step")]

  def replay(settings, **override):
    alarms = Alarms(settings)
    out = []
    for i, step in enumerate(curve["step"]):
      out += alarms.update(step, {**{k: curve[k][i] for k in keys}, **override})
    return out

  assert replay(AlarmSettings()) == []
  old = replay(AlarmSettings(entropy_solved=1.0))
  assert [(a.kind, a.step, a.onset) for a in old] == [("entropy_collapse", 324, 315), ("entropy_collapse", 351, 342)]
  assert 0.95 < old[0].evidence["accuracy_smoothed"] < 1.0
  stuck = replay(AlarmSettings(), accuracy=0.5)
  assert [(a.kind, a.step) for a in stuck] == [("entropy_collapse", 324), ("entropy_collapse", 351)]
  # Synthetic: the same fall of the entropy at accuracy 0.99 (converged) and 0.6 (collapsed), and a run
  # that reports no accuracy (no verifier: no exemption).
  fall = [{}] * 10 + _ramp(10, "entropy", 2.0, 0.01) + [{"entropy": 0.01}] * 10
  assert _feed([{**r, "accuracy": 0.99} for r in fall]) == []
  assert [a.kind for a in _feed([{**r, "accuracy": 0.6} for r in fall])] == ["entropy_collapse"]
  assert [a.kind for a in _feed(fall)] == ["entropy_collapse"]


def test_the_embedded_defaults_recorded_learning_curve_raises_nothing():
  """The logged curve of `make run` (seed 0, 400 RL steps, 32.0% -> 89.5% held-out) replayed through the
  shipped thresholds: a healthy run of the embedded default raises no alarm."""
  from mimo_jax.main import parse_config

  assert alarm_settings(parse_config(["prog"]).logging) == AlarmSettings()  # the shipped thresholds
  curve = json.load(open(os.path.join(ROOT, "tests", "data", "grpo_tiny_seed0_curve.json")))
  keys = [k for k in curve if k not in ("source", "step")]
  alarms = Alarms(AlarmSettings())
  fired = []
  for i, step in enumerate(curve["step"]):
    fired += alarms.update(step, {k: curve[k][i] for k in keys})
  assert len(curve["step"]) == 400 and fired == []
  # The checkpointed state is bounded: the first window and the last 6, whatever the run's length.
  state = alarms.state_dict()
  assert all(len(v) <= 60 for v in state["recent"].values()) and all(len(v) == 10 for v in state["first"].values())
  assert state["count"]["reward_mean"] == 400
  # The same curve with its reward collapsing after step 200 does raise one (the detector is live on it).
  collapsed = [(curve["reward_mean"][i] if i < 200 else 0.3) for i in range(400)]
  alarms = Alarms(AlarmSettings())
  fired = [a for i, s in enumerate(curve["step"]) for a in alarms.update(s, {"reward_mean": collapsed[i]})]
  assert [a.kind for a in fired] == ["reward_collapse"] and 200 < fired[0].step <= 220
