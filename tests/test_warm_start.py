"""--warm_start_from: a run that takes another run's supervised warm start equals one that trains its own
(same final weights, same RL records), and a source it cannot take is refused before anything runs."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from mimo_jax.config import ConfigError
from mimo_jax.main import main, parse_config
from mimo_jax.testing import kill_resume
from mimo_jax.train.loop import RLRun
from mimo_jax.train.warm_start import warm_start_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
SMALL = [
  f"--flagfile={FLAGS}",
  "--model_preset=tiny",
  "--sft_steps=8",
  "--sft_batch_size=16",
  "--sft_curriculum_steps=4",
  "--max_steps=2",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--max_new_tokens=6",
  "--checkpoint_every=4",
  "--tensorboard=false",
  "--digit_reward_weight=0.5",  # partial credit: rewards that differ within a group, so RL moves the weights
]
# RL-only changes: the policy's optimizer, the KL term, the sampling temperature.
RL_ARM = ["--learning_rate=5e-4", "--kl_coef=0.01", "--temperature=0.9"]


@pytest.fixture(scope="module")
def trained_source(tmp_path_factory):
  """A run stopped right after its warm start (what the sweep runner trains once per seed), and the
  evaluations it ran."""
  run_dir = tmp_path_factory.mktemp("source") / "run"
  evaluated = []
  with pytest.MonkeyPatch.context() as mp:
    real = RLRun.evaluate
    mp.setattr(RLRun, "evaluate", lambda self, params, step: evaluated.append(1) or real(self, params, step))
    assert main(["prog", *SMALL, "--max_steps=0", f"--run_dir={run_dir}"]) == 0
  return run_dir, len(evaluated)


@pytest.fixture(scope="module")
def source(trained_source):
  return trained_source[0]


def test_a_run_stopped_after_its_warm_start_evaluates_it_once(trained_source):
  run_dir, evaluated = trained_source
  assert evaluated == 1
  summary = json.load(open(run_dir / "summary.json"))
  assert summary["final"] == summary["warm_start"] and "greedy_accuracy" in summary["final"]
  # The final record still comes, equal to RL step 0's evaluation.
  evals = [r for r in kill_resume.load_metrics(str(run_dir)) if any(k.startswith("eval/") for k in r)]
  assert [r["step"] for r in evals] == [0, 1] and {k: v for k, v in evals[0].items() if k != "step"} == {
    k: v for k, v in evals[1].items() if k != "step"
  }


def _rl_records(run_dir):
  return [r for r in kill_resume.load_metrics(str(run_dir)) if r["step"] >= 0]


def test_a_run_that_takes_the_warm_start_equals_one_that_trains_its_own(source, tmp_path, capsys):
  own, taken = tmp_path / "own", tmp_path / "taken"
  assert main(["prog", *SMALL, *RL_ARM, f"--run_dir={own}"]) == 0
  capsys.readouterr()
  assert main(["prog", *SMALL, *RL_ARM, f"--warm_start_from={source}", f"--run_dir={taken}"]) == 0
  out = capsys.readouterr().out
  assert f"warm start taken from {source} (its SFT step 8); no SFT of its own" in out
  # No SFT ran: no SFT records, no SFT checkpoints; the RL checkpoints follow on the same step axis.
  assert not any("sft_loss" in r for r in kill_resume.load_metrics(str(taken)))
  assert any("sft_loss" in r for r in kill_resume.load_metrics(str(own)))
  assert min(int(s) for s in os.listdir(taken / "checkpoints") if s.isdigit()) == 9  # RL step 0
  a, b = kill_resume.final_arrays(str(own)), kill_resume.final_arrays(str(taken))
  assert a.keys() == b.keys() and any("params" in k for k in a)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  assert _rl_records(own) == _rl_records(taken) and len(_rl_records(own)) >= 3  # warm eval, 2 steps, final
  assert all(r["adv_abs_mean"] > 0 for r in _rl_records(own) if "adv_abs_mean" in r)  # the updates did something
  s_own, s_taken = (json.load(open(d / "summary.json")) for d in (own, taken))
  assert s_own["warm_start"] == s_taken["warm_start"] and s_own["final"] == s_taken["final"]
  # Resumed, the run continues from its own checkpoints; the source is not read again.
  os.rename(source / "checkpoints", source / "moved")
  try:
    assert main(["prog", *SMALL, *RL_ARM, "--max_steps=3", f"--warm_start_from={source}", f"--run_dir={taken}"]) == 0
  finally:
    os.rename(source / "moved", source / "checkpoints")
  assert "resumed from rl step 2" in capsys.readouterr().out


def test_a_source_this_run_cannot_take_is_refused_naming_the_flag(source, tmp_path, capsys):
  def refused(*flags):
    capsys.readouterr()
    assert main(["prog", *SMALL, *flags, f"--run_dir={tmp_path / 'run'}"]) == 2
    assert not os.path.exists(tmp_path / "run")  # refused before anything was written
    return capsys.readouterr().err

  said = refused(f"--warm_start_from={source}", "--seed=1", "--sft_learning_rate=1e-3")
  assert f"--warm_start_from='{source}': its warm start is not this run's (there -> here):" in said
  assert "--seed: 0 -> 1" in said and "--sft_learning_rate: 0.002 -> 0.001" in said
  assert "--d_model" in refused(f"--warm_start_from={source}", "--d_model=32")
  assert "not a run directory" in refused(f"--warm_start_from={tmp_path / 'nowhere'}")
  # A source whose last SFT checkpoint newer ones displaced (--keep_last).
  displaced = tmp_path / "displaced"
  shutil.copytree(source, displaced)
  shutil.rmtree(displaced / "checkpoints" / "8")
  said = refused(f"--warm_start_from={displaced}")
  assert "no checkpoint of its last SFT step (8) there (checkpoints: [4, 9])" in said and "--max_steps=0" in said
  with pytest.raises(ConfigError, match="--warm_start_from=.*needs --sft_steps > 0"):
    parse_config(["prog", *SMALL, "--sft_steps=0", f"--warm_start_from={source}"])


def test_the_warm_start_key_follows_the_warm_start_settings_only():
  def key(*flags):
    return warm_start_key(parse_config(["prog", *SMALL, *flags]))

  assert key() == key(*RL_ARM) == key("--num_samples=8", "--max_steps=5", "--grad_clip=0.5")
  for changed in ("--seed=1", "--sft_steps=9", "--d_model=32", "--arith_levels=1", "--max_new_tokens=8"):
    assert key(changed) != key(), changed
  # Devices given to rollout are taken from the mesh the supervised steps run on.
  assert key("--rollout_devices=1", "--async_rollout") != key("--async_rollout")
