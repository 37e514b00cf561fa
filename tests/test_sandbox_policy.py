"""The sandbox policy: code tasks run only under kernel isolation unless --allow_weak_sandbox, and say which.

Guard mode is simulated by patching ``sandbox.isolation`` (where every caller looks it up):
with it patched, building the HumanEval task must fail before any compute unless the weak
mode is accepted; tasks that run no code must never probe; and a run records the isolation
in ``config.json`` and ``summary.json`` without making it part of the run's identity.
"""

import dataclasses
import json
import os
import pickle

import pytest

from mimo_jax.config import Config, ConfigError, DataConfig
from mimo_jax.main import main, parse_config
from mimo_jax.rewards import sandbox, sandbox_policy
from mimo_jax.tasks import registry
from mimo_jax.tasks.humaneval import HumanEvalTask
from mimo_jax.tasks.registry import build_task, check_sandbox
from mimo_jax.train import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD_REASON = "user namespaces unavailable (test)"


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
  """Each test sees the isolation line and the warning as a fresh process would (printed once)."""
  monkeypatch.setattr(sandbox_policy, "_announced", set())


@pytest.fixture
def guard(monkeypatch) -> sandbox.SandboxIsolation:
  """This process's sandbox reports guard mode (the module attribute every caller looks up)."""
  weak = dataclasses.replace(
    sandbox.isolation(), mode="guard", network="python-guard", filesystem="python-guard", reason=GUARD_REASON
  )
  monkeypatch.setattr(sandbox, "isolation", lambda: weak)
  return weak


@pytest.fixture
def no_probe(monkeypatch):
  """Any call of the probe fails the test."""

  def probe():
    raise AssertionError("the sandbox was probed")

  monkeypatch.setattr(sandbox, "isolation", probe)


def _namespace_or_skip() -> None:
  # Not a skip: this project's machines (and CI's) have kernel isolation, and losing it is the
  # regression these tests exist to catch.
  if sandbox.isolation().mode != "namespace":
    pytest.fail(f"no kernel isolation on this machine: {sandbox.isolation().reason}")


# ---- the flag -------------------------------------------------------------------------------


def test_flag_is_off_by_default_and_documented():
  assert Config().data.allow_weak_sandbox is False
  assert parse_config(["prog"]).data.allow_weak_sandbox is False
  assert parse_config(["prog", "--task=humaneval", "--allow_weak_sandbox"]).data.allow_weak_sandbox is True
  help_text = next(f for f in dataclasses.fields(DataConfig) if f.name == "allow_weak_sandbox").metadata["help"]
  assert "NOT containment" in help_text


# ---- (a) guard mode: refused without the flag, warned with it ---------------------------------


def test_guard_mode_refuses_humaneval_before_any_compute(guard, monkeypatch):
  def no_compute(*args, **kwargs):
    raise AssertionError("the task was built before the sandbox was checked")

  monkeypatch.setattr(registry, "HumanEvalTask", no_compute)
  monkeypatch.setattr(registry, "train_sentencepiece", no_compute)
  with pytest.raises(ConfigError) as e:
    build_task(DataConfig(task="humaneval"), seed=0)
  message = str(e.value)
  assert "no kernel isolation" in message and GUARD_REASON in message and "--allow_weak_sandbox" in message


def test_guard_mode_with_the_flag_builds_and_warns(guard, capsys):
  task, tokenizer = build_task(DataConfig(task="humaneval", allow_weak_sandbox=True), seed=0)
  assert isinstance(task, HumanEvalTask) and tokenizer.vocab_size > 0
  # Accepted: verifications in this (and every worker) process run in guard mode without refusal.
  assert task.require_kernel_isolation is False
  out = capsys.readouterr().out
  assert "sandbox isolation: mode=guard, network=python-guard, filesystem=python-guard" in out
  warning = next(line for line in out.splitlines() if line.startswith("warning:"))
  assert "WITHOUT kernel isolation" in warning and GUARD_REASON in warning and "--allow_weak_sandbox" in warning
  # The isolation line and the warning are printed once per process, however often the task is built.
  build_task(DataConfig(task="humaneval", allow_weak_sandbox=True), seed=0)
  assert capsys.readouterr().out == ""


def test_the_record_says_the_weak_mode_was_accepted(guard):
  record = check_sandbox(DataConfig(task="humaneval", allow_weak_sandbox=True))
  assert record == {**dataclasses.asdict(guard), "allow_weak_sandbox": True, "weak_accepted": True}


def test_main_refuses_training_and_dry_run_in_guard_mode_without_touching_the_run_dir(guard, tmp_path, capsys):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "metrics.jsonl").write_text("{}\n")
  for extra in ([], ["--dry_run"]):
    # --overwrite would clear the directory: the refusal comes first.
    assert main(["prog", "--task=humaneval", f"--run_dir={run_dir}", "--overwrite", *extra]) == 2
    err = capsys.readouterr().err
    assert "no kernel isolation" in err and "--allow_weak_sandbox" in err, extra
  assert sorted(os.listdir(run_dir)) == ["metrics.jsonl"]


def test_a_worker_without_kernel_isolation_refuses_to_run_code(guard):
  """Reward workers probe on their own: a task built without the flag refuses there too."""
  strict = HumanEvalTask(require_kernel_isolation=True)
  problem = strict.heldout()[0]
  copy = pickle.loads(pickle.dumps(strict))  # what a reward worker receives
  assert copy.require_kernel_isolation is True
  for run in (lambda: copy.reward(problem, problem.answer), lambda: copy.reward_components(problem, problem.answer)):
    with pytest.raises(sandbox.SandboxError, match="no kernel isolation.*--allow_weak_sandbox"):
      run()
  # Direct use (no policy) keeps running in whatever mode the sandbox found.
  assert HumanEvalTask().reward(problem, problem.prompt + problem.answer) == 1.0


# ---- (b) tasks that run no code never probe ---------------------------------------------------


def test_only_humaneval_runs_untrusted_code():
  assert {name for name, cls in registry.TASK_CLASSES.items() if cls.runs_untrusted_code} == {"humaneval"}


def test_arith_never_probes_the_sandbox(no_probe, capsys):
  cfg = DataConfig(task="arith")
  task, _ = build_task(cfg, seed=0)
  assert task.runs_untrusted_code is False
  assert check_sandbox(cfg) is None
  assert "sandbox isolation" not in capsys.readouterr().out


# ---- (c) this machine: kernel isolation, no flag needed -----------------------------------------


def test_humaneval_builds_without_the_flag_under_kernel_isolation(capsys):
  _namespace_or_skip()
  task, _ = build_task(DataConfig(task="humaneval"), seed=0)
  assert task.require_kernel_isolation is True
  out = capsys.readouterr().out
  assert "sandbox isolation: mode=namespace" in out and "warning:" not in out
  record = check_sandbox(DataConfig(task="humaneval"))
  assert record["mode"] == "namespace" and record["weak_accepted"] is False
  assert set(dataclasses.asdict(sandbox.isolation())) < set(record)
  problem = task.heldout()[0]
  assert task.reward(problem, problem.prompt + problem.answer) == 1.0


# ---- records: config.json and its readers -----------------------------------------------------


def test_config_json_carries_the_record_only_when_given():
  cfg = Config()
  assert rundir.config_json(cfg.to_dict()) == cfg.to_json()
  record = {"mode": "namespace", "network": "namespace"}
  assert json.loads(rundir.config_json(cfg.to_dict(), sandbox=record)) == {
    **json.loads(cfg.to_json()),
    "sandbox": record,
  }


def test_a_different_sandbox_record_is_neither_a_mismatch_nor_unreadable(tmp_path):
  from mimo_jax.eval.evaluator import load_run_config

  cfg = Config(data=DataConfig(task="humaneval"))
  (tmp_path / "config.json").write_text(rundir.config_json(cfg.to_dict(), sandbox={"mode": "guard"}))
  current = json.loads(rundir.config_json(cfg.to_dict(), sandbox={"mode": "namespace"}))
  assert rundir.identity_mismatches(rundir.read_config(str(tmp_path)), current) == []
  rundir.RunDir(str(tmp_path)).claim(cfg.to_dict(), overwrite=False)  # a resume on another machine is not refused
  assert load_run_config(str(tmp_path)) == cfg


# ---- (d) a short HumanEval run records the isolation; evaluation checks it again ----------------


def test_a_humaneval_run_records_the_sandbox_and_evaluation_rechecks(tmp_path, monkeypatch, capsys):
  _namespace_or_skip()
  from mimo_jax.eval.evaluator import evaluate_checkpoint
  from mimo_jax.testing import FakeRollout
  from mimo_jax.train.loop import train

  run_dir = tmp_path / "run"
  cfg = parse_config(
    [
      "prog",
      f"--flagfile={os.path.join(ROOT, 'experiments', 'grpo_code_small.flags')}",
      f"--run_dir={run_dir}",
      "--tfds_dir=",
      "--sft_steps=0",
      "--max_steps=1",
      "--eval_every=0",
      "--eval_prompts=1",
      "--eval_samples=1",
      "--reward_workers=0",
      "--reward_hacking_probe=false",
      "--max_new_tokens=4",
      "--tensorboard=false",
      "--async_save=false",
    ]
  )

  def fake(model, mesh):
    return FakeRollout(lambda prompt, i: [5, 6, 7], batch_shards=8)

  summary = train(cfg, rollout_factory=fake)
  expected = sandbox_policy.isolation_record(allow_weak=False)
  assert expected["mode"] == "namespace"
  assert summary["sandbox"] == expected
  assert json.loads((run_dir / "summary.json").read_text())["sandbox"] == expected
  on_disk = json.loads((run_dir / "config.json").read_text())
  # Besides the settings: the sandbox record and the provenance record (code version, libraries).
  assert set(on_disk["provenance"]) == {"code", "libraries", "python"}
  settings = {k: v for k, v in on_disk.items() if k not in ("sandbox", "provenance")}
  assert on_disk["sandbox"] == expected and settings == json.loads(cfg.to_json())
  assert "sandbox isolation: mode=namespace" in capsys.readouterr().out

  # Resuming where the machine's record differs is no config mismatch (the run is complete: no compute).
  on_disk["sandbox"] = {**expected, "mode": "guard", "reason": "another machine"}
  (run_dir / "config.json").write_text(json.dumps(on_disk))
  assert train(cfg, rollout_factory=fake)["rl_steps"] == 1
  assert json.loads((run_dir / "config.json").read_text())["sandbox"] == expected  # this machine's again

  # The evaluator reads that config.json, reports the isolation, and applies the policy itself.
  result = evaluate_checkpoint(str(run_dir), num_samples=1, rollout_factory=fake)
  assert result["sandbox"] == expected and result["num_problems"] == 1
  weak = dataclasses.replace(sandbox.isolation(), mode="guard", network="python-guard", reason=GUARD_REASON)
  monkeypatch.setattr(sandbox, "isolation", lambda: weak)
  with pytest.raises(ConfigError, match="no kernel isolation.*--allow_weak_sandbox"):
    evaluate_checkpoint(str(run_dir), num_samples=1, rollout_factory=fake)
