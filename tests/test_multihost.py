"""Multi-process runs on one machine: 2 processes x 4 CPU devices against 1 process x 8 devices.

Real processes (``python -m mimo_jax.main`` started the way ``python -m mimo_jax.launch`` starts them),
real collectives between them (gloo), one shared run directory.  The oracle is the same run in one
process over the same 8-device mesh, through the same collectives implementation: every metric of
every step and every checkpoint's fingerprints (checksums of the global arrays' bits) must be equal.
(Against the default in-process collectives of a plain one-process run the floats differ in the last
bits: an all-reduce sums in another order.)

The interruption test (PPO with a critic) sends SIGTERM to process 1 (both must save at the same step),
resumes, kills process 0 with SIGKILL (process 1 must end on its own), resumes again, and must end
bit-identical to one uninterrupted process.  Timeouts here only guard against hangs; nothing depends on speed.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mimo_jax.launch import describe, free_port, process_command, process_env
from mimo_jax.testing import kill_resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_S = 900  # a run that has not ended by then is hung

SMALL = [
  "--model_preset=tiny",
  "--sft_steps=2",
  "--sft_batch_size=16",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=8",
  "--eval_samples=2",
  "--eval_every=0",
  "--checkpoint_every=2",
  "--max_new_tokens=6",
  "--tensorboard=false",
  "--heartbeat_timeout_s=10",
]
GRPO = ["--flagfile=" + os.path.join(ROOT, "experiments", "grpo_tiny.flags"), *SMALL, "--max_steps=4"]
PPO = ["--flagfile=" + os.path.join(ROOT, "experiments", "ppo_tiny.flags"), *SMALL, "--max_steps=6"]


def _start(run_dir, flags, num_processes: int, devices: int, log_tag: str) -> list[subprocess.Popen]:
  port = free_port()
  procs = []
  for i in range(num_processes):
    log = open(f"{run_dir}.{log_tag}.p{i}.log", "w")  # noqa: SIM115 - closed with the process
    procs.append(
      subprocess.Popen(
        process_command([*flags, f"--run_dir={run_dir}"], process_id=i, num_processes=num_processes, port=port),
        env=process_env(devices),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
      )
    )
  return procs


def _wait(procs) -> list[int]:
  codes = []
  deadline = time.monotonic() + HANG_S
  for p in procs:
    try:
      codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail(f"a process of the run did not end within {HANG_S} s (hung)")
  return codes


def _run(run_dir, flags, num_processes: int, devices: int, log_tag: str = "run") -> list[str]:
  codes = _wait(_start(run_dir, flags, num_processes, devices, log_tag))
  logs = [open(f"{run_dir}.{log_tag}.p{i}.log").read() for i in range(num_processes)]
  assert codes == [0] * num_processes, (describe(codes), logs[0][-3000:])
  return logs


def _records(run_dir) -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _without_timings(records):
  return [{k: v for k, v in r.items() if not k.startswith(kill_resume.VOLATILE_PREFIXES)} for r in records]


def _fingerprints(run_dir) -> dict[int, dict[str, int]]:
  out = {}
  for path in glob.glob(os.path.join(run_dir, "checkpoints", "*", "meta", "metadata")):
    out[int(path.split(os.sep)[-3])] = json.load(open(path))["fingerprint"]
  return out


def _rl_steps(run_dir) -> list[int]:
  try:
    return [r["step"] for r in _records(run_dir) if "reward_mean" in r]
  except (FileNotFoundError, json.JSONDecodeError):
    return []


def _wait_for_rl_step(run_dir, step: int, procs) -> None:
  deadline = time.monotonic() + HANG_S
  while max(_rl_steps(run_dir), default=-1) < step:
    assert all(p.poll() is None for p in procs), "a process ended before the step to interrupt at"
    assert time.monotonic() < deadline, f"RL step {step} was not reached within {HANG_S} s (hung)"
    time.sleep(0.1)


def _files(run_dir) -> set[str]:
  return {os.path.relpath(p, run_dir) for p in glob.glob(os.path.join(run_dir, "*"))}


@pytest.mark.slow
def test_grpo_in_two_processes_equals_one_process(tmp_path):
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _run(one, GRPO, 1, 8)
  logs = _run(two, GRPO, 2, 4)
  a, b = _records(one), _records(two)
  # Each step logged once, by process 0, with the global metrics: identical to one process's, step by step.
  assert [r["step"] for r in b] == [r["step"] for r in a] and len({r["step"] for r in b}) == len(b)
  assert _rl_steps(two) == [1, 2, 3, 4]
  assert _without_timings(b) == _without_timings(a)
  # Every checkpoint's global arrays are bit-identical (the fingerprints cover every process's shards).
  fa, fb = _fingerprints(one), _fingerprints(two)
  assert sorted(fb) == sorted(fa) and len(fb) == 3
  assert fb == fa
  # The sample replay is the global one too: the texts of rows another host scored are gathered.
  samples = [json.loads(line) for line in open(os.path.join(two, "samples.jsonl"))]
  assert samples == [json.loads(line) for line in open(os.path.join(one, "samples.jsonl"))]
  assert len(samples) == 4 * 6 and any(s["row"] >= 16 for s in samples)
  # One set of run-directory files, written once (process 0), summary included.
  assert (
    _files(two)
    == _files(one)
    >= {"config.json", "metrics.jsonl", "samples.jsonl", "summary.json", "checkpoints", "reference"}
  )
  assert (
    json.load(open(os.path.join(two, "summary.json")))["final"]
    == json.load(open(os.path.join(one, "summary.json")))["final"]
  )
  # Each host decodes and scores only its own rows (the rows on its devices).
  assert "process 0 of 2: decodes and scores 16 of the 32 rollout rows (rows 0-15)" in logs[0]
  assert "process 1 of 2: decodes and scores 16 of the 32 rollout rows (rows 16-31)" in logs[1]


@pytest.mark.slow
def test_async_rollout_in_two_processes_equals_one_process(tmp_path):
  """--async_rollout with a stale policy (K = 1) and a mid-run evaluation: two processes make every batch in
  the learner's thread (their collectives in one order), one process in a producer thread; the batches
  come from the same policy versions, so every metric, sample and checkpoint is the same."""
  flags = [*GRPO, "--async_rollout", "--max_staleness=1", "--eval_every=2"]
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _run(one, flags, 1, 8)
  _run(two, flags, 2, 4)
  # Timings (queue_len among them: where the producer thread happened to be) aside, the rest is the run.
  a, b = (_without_timings(_records(d)) for d in (one, two))
  assert [r["step"] for r in b] == [r["step"] for r in a] and _rl_steps(two) == [1, 2, 3, 4]
  assert b == a
  assert [r["staleness_max"] for r in b if "staleness_max" in r] == [0, 1, 1, 1]
  assert any("eval/greedy_accuracy" in r for r in b if r["step"] == 2)
  assert _fingerprints(two) == _fingerprints(one) and len(_fingerprints(one)) == 3
  # The in-line producer makes its batches between the learner's steps: it is idle for the whole of each
  # (it logged 0), and the learner's wait is what the rollout share counts.
  rl = [r for r in _records(two) if "reward_mean" in r]
  assert all(r["time_train_s"] > 0 and r["time_rollout_idle_s"] == pytest.approx(r["time_train_s"]) for r in rl)
  assert all(0 <= r["rollout_share"] <= 1 for r in rl)
  samples = [json.loads(line) for line in open(os.path.join(two, "samples.jsonl"))]
  assert samples == [json.loads(line) for line in open(os.path.join(one, "samples.jsonl"))]


@pytest.mark.slow
def test_ppo_in_two_processes_interrupted_twice_equals_one_uninterrupted_process(tmp_path):
  """PPO with a critic.  SIGTERM to process 1: both save at the same step and exit cleanly; resumed, then
  SIGKILL to process 0 (the coordinator's host): process 1 ends on its own; resumed again, the run ends
  bit-identical to one uninterrupted process."""
  one, run = str(tmp_path / "one"), str(tmp_path / "run")
  _run(one, PPO, 1, 8)
  procs = _start(run, PPO, 2, 4, "term")
  _wait_for_rl_step(run, 1, procs)
  procs[1].send_signal(signal.SIGTERM)
  assert _wait(procs) == [0, 0]
  logs = [open(f"{run}.term.p{i}.log").read() for i in range(2)]
  said = [[line for line in log.splitlines() if line.startswith("preempted: state saved at RL step")] for log in logs]
  assert len(said[0]) == 1 and said[0] == said[1], said
  saved = int(said[0][0].split("RL step ")[1].split(";")[0])
  assert 1 <= saved < 6
  procs = _start(run, PPO, 2, 4, "kill")
  _wait_for_rl_step(run, saved + 1, procs)
  procs[0].kill()
  codes = _wait(procs)
  assert codes[0] == -signal.SIGKILL and codes[1] != 0, describe(codes)
  logs = _run(run, PPO, 2, 4, "end")
  assert all("resumed from rl step" in log for log in logs)
  a, b = _records(one), _records(run)
  assert _without_timings(b) == _without_timings(a)
  assert all("value_loss" in r for r in b if "reward_mean" in r)
  final = max(_fingerprints(one))
  fa, fb = _fingerprints(one)[final], _fingerprints(run)[final]
  assert fb == fa and any(k.startswith("value/") for k in fb)


def test_a_ctrl_c_to_the_launcher_saves_every_process_at_one_step(tmp_path):
  """``python -m mimo_jax.launch``: a SIGINT to the launcher (a terminal's Ctrl-C) reaches both
  processes as SIGTERM, so each saves at the same step boundary and exits cleanly (a SIGINT passed on
  as itself raised KeyboardInterrupt wherever each was: no save).  The processes run in a session of
  their own, so the terminal's signal reaches them only through the launcher."""
  run = str(tmp_path / "run")
  flags = [*GRPO, "--max_steps=40", "--checkpoint_every=0", f"--run_dir={run}"]
  launcher = subprocess.Popen(
    [sys.executable, "-m", "mimo_jax.launch", "--num_processes=2", "--devices_per_process=4", "--", *flags],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  _wait_for_rl_step(run, 1, [launcher])
  assert os.getpgid(launcher.pid) == launcher.pid
  launcher.send_signal(signal.SIGINT)
  out, _ = launcher.communicate(timeout=HANG_S)
  assert launcher.returncode == 0, out
  said = sorted(line for line in out.splitlines() if "preempted: state saved at RL step" in line)
  assert len(said) == 2 and said[0] == "[p1] " + said[1], said  # both processes, the same step
  saved = int(said[1].split("RL step ")[1].split(";")[0])
  assert 1 <= saved < 40 and max(_rl_steps(run)) == saved
  assert "KeyboardInterrupt" not in out


@pytest.mark.slow
def test_a_ctrl_c_on_one_hosts_terminal_saves_every_process_and_a_second_ends_the_run_at_once(tmp_path):
  """Each host runs its own command (no launcher): a SIGINT to one process is a preemption, so both save
  at one step boundary and exit 0 (it raised KeyboardInterrupt in that process alone; the other waited in
  a collective, and JAX's shutdown barrier held both 300 s, whatever --heartbeat_timeout_s, then
  aborted them).  Two SIGINTs: the second ends that process at once, with its traceback, and the other
  sees it gone within the heartbeat timeout and ends too (no abort, no barrier wait)."""
  run = str(tmp_path / "run")
  flags = [*GRPO, "--max_steps=40", "--checkpoint_every=0"]
  procs = _start(run, flags, 2, 1, "once")
  _wait_for_rl_step(run, 1, procs)
  procs[1].send_signal(signal.SIGINT)
  codes = _wait(procs)
  logs = [open(f"{run}.once.p{i}.log").read() for i in range(2)]
  assert codes == [0, 0], (describe(codes), logs[1][-3000:])
  assert "interrupted: saving at the next step boundary" in logs[1]
  said = [line for log in logs for line in log.splitlines() if "preempted: state saved at RL step" in line]
  assert len(said) == 2 and said[0] == said[1], said
  assert "KeyboardInterrupt" not in logs[0] + logs[1]

  run = str(tmp_path / "twice")
  procs = _start(run, flags, 2, 1, "twice")
  _wait_for_rl_step(run, 1, procs)
  procs[1].send_signal(signal.SIGINT)
  deadline = time.monotonic() + HANG_S
  while "interrupted: saving" not in open(f"{run}.twice.p1.log").read() and procs[1].poll() is None:
    assert time.monotonic() < deadline, "the first SIGINT was not handled"
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGINT)
  codes = _wait(procs)
  logs = [open(f"{run}.twice.p{i}.log").read() for i in range(2)]
  if codes != [0, 0]:  # the second Ctrl-C came before the step boundary: that process ended at once
    assert codes[1] == 1 and "KeyboardInterrupt" in logs[1], (describe(codes), logs[1][-3000:])
    assert codes[0] != 0, (describe(codes), logs[0][-3000:])  # JAX's "another task died" ends it
  assert "Shutdown barrier" not in logs[0] + logs[1]


REWARD_PATH = [GRPO[0], "--model_preset=tiny", "--prompts_per_step=8", "--num_samples=4", "--max_new_tokens=6"]


def _reward_path(out: str, flags, num_processes: int, devices: int) -> list:
  """Runs tests/multihost_rewards.py in ``num_processes`` processes through the multi-process collectives
  (one process too); returns process 0's results."""
  script = os.path.join(ROOT, "tests", "multihost_rewards.py")
  port = free_port()
  procs = []
  for i in range(num_processes):
    log = open(f"{out}.p{i}.log", "w")  # noqa: SIM115 - closed with the process
    where = [f"--coordinator_address=localhost:{port}", f"--num_processes={num_processes}", f"--process_id={i}"]
    procs.append(
      subprocess.Popen(
        [sys.executable, script, out, *flags, *where],
        env=process_env(devices),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
      )
    )
  assert _wait(procs) == [0] * num_processes, open(f"{out}.p0.log").read()[-3000:]
  return json.load(open(out))


@pytest.mark.slow
def test_a_reward_model_and_a_judge_score_the_whole_batch_on_every_host(tmp_path):
  """A trained reward model and an LLM judge are programs of the global mesh: with 2 processes every host
  calls them with the whole batch, and the rewards, metrics, the judge's outputs and its key stream are
  those of 1 process over the same 8 devices."""
  from mimo_jax.main import main
  from mimo_jax.testing.hf_models import save_random_judge

  rm_dir, judge = str(tmp_path / "rm"), save_random_judge(str(tmp_path / "judge"))
  rm_flags = ["--mode=reward_model", "--rm_steps=30", "--rm_num_pairs=64", "--eval_prompts=8", f"--run_dir={rm_dir}"]
  assert main(["prog", *REWARD_PATH, *rm_flags]) == 0
  flags = [
    *REWARD_PATH,
    f"--reward_model={rm_dir}",
    "--reward_model_weight=0.5",
    f"--judge_checkpoint={judge}",
    "--judge_samples=2",
    "--judge_max_new_tokens=6",
    "--judge_weight=0.5",
  ]
  one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
  a = _reward_path(one, flags, 1, 8)
  b = _reward_path(two, flags, 2, 4)
  assert b == a
  for step in a[:2]:
    assert step["correct"] == step["expected_correct"] and 0 < sum(step["correct"]) < len(step["correct"])
    scores = step["components"]["reward_model"]
    assert len(scores) == 32 and len(set(scores)) > 8  # scored row by row, not a constant
    # A random judge never writes a valid score: every row is a failure of the judge (counted as 0).
    assert step["components"]["judge"] == [0.0] * 32
    assert step["metrics"]["reward/judge_fail_frac"] == 1.0 and step["metrics"]["reward/reward_model_fail_frac"] == 0.0
  judge_state = a[2]["reward_state"]["sources"]["judge"]
  assert judge_state["num_outputs"] == 2 * 32 * 2 and judge_state["generator"]["num_calls"] == 2
  # What the judge wrote: the same texts on both hosts, equal to the one process's (its samples on the
  # global mesh, from one key stream), and not all alike.
  judged = [json.load(open(f"{two}.p{i}.judge")) for i in range(2)]
  assert judged[0] == judged[1] == json.load(open(f"{one}.p0.judge"))
  assert len(judged[0]) == 2 and len(judged[0][0]) == 32 and len({t for outs in judged[0][0] for t in outs}) > 8


def test_each_host_scores_only_its_own_rows_and_every_host_gets_the_global_rewards(tmp_path):
  """The reward path on its own, with known completions (the tiny runs above rarely earn a reward):
  2 processes give what 1 process gives (raw, normalised and mixed rewards, metrics, the running
  normaliser's statistics, the failure messages of a source that fails on some rows of each host),
  and each process decoded exactly the rows on its devices."""
  script = os.path.join(ROOT, "tests", "multihost_rewards.py")
  flags = [*REWARD_PATH, "--reward_normalize=task_running"]
  one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
  single = subprocess.run(
    [sys.executable, script, one, "--probe", *flags], env=process_env(8), cwd=ROOT, capture_output=True
  )
  assert single.returncode == 0, single.stderr.decode()[-3000:]
  port = free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        script,
        two,
        "--probe",
        *flags,
        f"--coordinator_address=localhost:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ],
      env=process_env(4),
      cwd=ROOT,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
    )
    for i in range(2)
  ]
  assert _wait(procs) == [0, 0], procs[0].stderr.read().decode()[-3000:]
  a, b = json.load(open(one)), json.load(open(two))
  assert b == a
  for step in a[:2]:
    assert step["correct"] == step["expected_correct"] and 0 < sum(step["correct"]) < len(step["correct"])
  assert a[2]["reward_state"]["stats"]["arith"]["correct"]["updates"] == 2
  # The probe's failures: every host's messages reach the batch (in batch order, as one process gives).
  for step in a[:2]:
    rows = [int(m.split("[", 1)[1].split("]", 1)[0]) for m in step["errors"]]
    assert all(m.startswith("probe[") and "is a multiple of 3" in m for m in step["errors"])
    assert rows == sorted(rows) and min(rows) < 16 <= max(rows)  # rows of both hosts
    assert step["metrics"]["reward/probe_fail_frac"] > 0
  texts_one = json.load(open(one + ".p0"))
  mine = [json.load(open(f"{two}.p{i}")) for i in range(2)]
  for step in range(2):
    assert sorted(map(int, mine[0][step])) == list(range(16))
    assert sorted(map(int, mine[1][step])) == list(range(16, 32))
    assert {**mine[0][step], **mine[1][step]} == texts_one[step]


def test_the_launcher_refuses_bad_flags_and_describes_exits(capsys):
  from mimo_jax.launch import main

  for argv, message in [
    (["--num_processes=0"], "--num_processes=0: must be >= 1"),
    (["--devices_per_process=-1"], "--devices_per_process=-1: must be >= 0"),
    (["--port=70000"], "--port=70000: must be in"),
    (["--", "--process_id=1"], "--process_id is set by the launcher"),
  ]:
    with pytest.raises(SystemExit) as e:
      main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
  cmd = process_command(["--seed=3"], process_id=1, num_processes=2, port=1234)
  assert cmd[1:] == [
    "-m",
    "mimo_jax.main",
    "--seed=3",
    "--coordinator_address=localhost:1234",
    "--num_processes=2",
    "--process_id=1",
  ]
  # The launcher's processes die with it (mimo_jax.sweep.child asks the kernel to kill them).
  cmd = process_command(["--seed=3"], process_id=0, num_processes=2, port=1234, parent=4321)
  assert cmd[1:6] == ["-m", "mimo_jax.sweep.child", "--parent=4321", "--", "--seed=3"]
  env = process_env(4, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"})
  assert env["XLA_FLAGS"] == "--other --xla_force_host_platform_device_count=4" and env["JAX_PLATFORMS"] == "cpu"
  said = describe([-signal.SIGKILL, -signal.SIGABRT])
  assert "process 0 was killed by SIGKILL" in said and "process 1 was killed by SIGABRT" in said
  assert "rerun the same command to resume" in said
  assert describe([0, 3]) == "process 1 exited with status 3"
