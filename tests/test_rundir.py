"""One owner per run directory, readers that never delete, and bad steps that never cost the last good state."""

import json
import os
import shutil

import numpy as np
import pytest

from mimo_jax.ckpt import Checkpointer
from mimo_jax.eval.evaluator import evaluate_checkpoint
from mimo_jax.export import export
from mimo_jax.main import main
from mimo_jax.testing import kill_resume
from mimo_jax.train.rundir import RunDirLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
SMALL = [
  f"--flagfile={FLAGFILE}",
  "--model_preset=tiny",
  "--sft_steps=4",
  "--sft_batch_size=16",
  "--max_steps=5",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--eval_every=0",
  "--max_new_tokens=6",
  "--checkpoint_every=1",
  "--keep_last=50",
  "--mesh_fsdp=8",
  "--tensorboard=false",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("owned") / "run"
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 0
  return run_dir


def _copy(run_dir, tmp_path):
  dst = tmp_path / "run"
  shutil.copytree(run_dir, dst)
  return dst


def _snapshot(run_dir):
  return {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "config.json")}


def test_a_second_trainer_on_a_live_run_directory_is_refused(finished_run, tmp_path, capsys):
  run_dir = _copy(finished_run, tmp_path)
  before = _snapshot(run_dir)
  with RunDirLock(str(run_dir)):  # a live trainer holds it
    assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 2
  err = capsys.readouterr().err
  assert "in use by another trainer" in err and f"pid {os.getpid()}" in err
  assert _snapshot(run_dir) == before
  # The lock dies with its holder: the directory is usable again.
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 0
  assert "already complete" in capsys.readouterr().out


def test_another_configuration_is_refused_unless_overwrite(finished_run, tmp_path, capsys):
  run_dir = _copy(finished_run, tmp_path)
  before = _snapshot(run_dir)
  steps = sorted(os.listdir(run_dir / "checkpoints"))
  assert main(["prog", *SMALL, "--model_preset=demo", f"--run_dir={run_dir}"]) == 2
  err = capsys.readouterr().err
  assert "another configuration's run" in err and "--model_preset: 'tiny' -> 'demo'" in err and "--overwrite" in err
  assert _snapshot(run_dir) == before and sorted(os.listdir(run_dir / "checkpoints")) == steps


def test_another_sft_step_count_is_refused(finished_run, tmp_path, capsys):
  # Checkpoints are numbered SFT steps first: resumed with another count, the RL checkpoints would move.
  run_dir = _copy(finished_run, tmp_path)
  before = _snapshot(run_dir)
  assert main(["prog", *SMALL, "--sft_steps=2", "--max_steps=7", f"--run_dir={run_dir}"]) == 2
  assert "--sft_steps: 4 -> 2" in capsys.readouterr().err
  assert _snapshot(run_dir) == before


@pytest.mark.parametrize("text", ['{"model": {"model_preset": "ti', "[]", '{"model": 5}', "null"])
def test_a_config_json_that_is_no_runs_configuration_is_refused_by_name(tmp_path, text):
  from mimo_jax.config_base import ConfigError
  from mimo_jax.train.rundir import RunDir

  (tmp_path / "config.json").write_text(text)
  with pytest.raises(ConfigError, match=r"config.json: (unreadable|not a run's configuration).*--overwrite"):
    RunDir(str(tmp_path)).claim({"model": {}}, overwrite=False)


def test_overwrite_replaces_a_broken_config_json(finished_run, tmp_path, capsys):
  """The refusal of an unreadable config.json says to pass --overwrite; that works (the old file is not
  read) and gives the same run as a new directory."""
  run_dir = _copy(finished_run, tmp_path)
  text = (run_dir / "config.json").read_text()
  (run_dir / "config.json").write_text(text[: len(text) // 2])
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 2
  assert "config.json: unreadable" in capsys.readouterr().err
  # The old run's held-out curve (`python -m mimo_jax.eval --all`) goes with it: kept, `--all` would
  # report the old run's rows for the new run's checkpoints of the same numbers.
  (run_dir / "eval_curve.jsonl").write_text('{"checkpoint_step": 9, "greedy_accuracy": 0.777}\n')
  assert main(["prog", *SMALL, f"--run_dir={run_dir}", "--overwrite"]) == 0
  assert kill_resume.compare(str(finished_run), str(run_dir)) == []
  assert not (run_dir / "eval_curve.jsonl").exists()


def test_an_overwrite_refused_before_it_starts_keeps_the_old_run(finished_run, tmp_path, capsys):
  """--overwrite sets the old run aside until the new one is built: a setting refused only then (here
  more distinct problems than level 1 has) puts it back, whole."""
  run_dir = _copy(finished_run, tmp_path)
  before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
  argv = ["prog", *SMALL, f"--run_dir={run_dir}", "--overwrite", "--arith_levels=1", "--train_prompts=20000"]
  assert main(argv) == 2
  assert "--train_prompts=20000" in capsys.readouterr().err
  after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
  assert after == before
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 0
  assert "already complete" in capsys.readouterr().out


def test_checkpoints_that_do_not_restore_are_refused_unless_overwrite(finished_run, tmp_path, capsys):
  run_dir = _copy(finished_run, tmp_path)
  for path in (run_dir / "checkpoints").rglob("*"):
    if path.is_file() and path.stat().st_size > 1024:
      path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  before = _snapshot(run_dir)
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 2
  assert "none restores" in capsys.readouterr().err
  assert _snapshot(run_dir) == before  # nothing emptied, nothing overwritten
  # --overwrite starts afresh and gives the same run as a new directory.
  assert main(["prog", *SMALL, f"--run_dir={run_dir}", "--overwrite"]) == 0
  assert kill_resume.compare(str(finished_run), str(run_dir)) == []


def test_readers_never_delete_a_save_in_progress(finished_run, tmp_path):
  run_dir = _copy(finished_run, tmp_path)
  partial = run_dir / "checkpoints" / "99.orbax-checkpoint-tmp-1234"
  (partial / "state").mkdir(parents=True)
  evaluate_checkpoint(str(run_dir), eval_prompts=8, num_samples=1, ks=(1,))
  export(str(run_dir), str(tmp_path / "hf"))
  assert partial.is_dir()
  ckpt = Checkpointer(str(run_dir / "checkpoints"), async_save=False, read_only=True)
  with pytest.raises(PermissionError, match="read-only"):
    ckpt.delete_after(0)
  ckpt.close()
  assert partial.is_dir()


def test_non_finite_steps_beyond_the_rollback_cap_end_the_run_with_the_state_intact(tmp_path, capsys):
  # Every bad step rolls back (max_bad_steps=1); RL steps 3, 4, 5 (0-based 2, 3, 4) are NaN one after
  # another, so the third needs a third rollback.
  run_dir = tmp_path / "run"
  flags = [*SMALL, f"--run_dir={run_dir}", "--debug_nan_steps=2,3,4", "--max_bad_steps=1", "--max_rollbacks=2"]
  assert main(["prog", *flags]) == 3
  err = capsys.readouterr().err
  assert "after 2 rollbacks (--max_rollbacks=2): stopping" in err and "last good checkpoint (RL step 4)" in err
  assert not (run_dir / "summary.json").exists()
  ckpt = Checkpointer(str(run_dir / "checkpoints"), async_save=False, read_only=True)
  meta = ckpt.read_meta(ckpt.all_steps()[-1])
  tree = ckpt.restore_untyped(ckpt.all_steps()[-1])
  ckpt.close()
  assert meta["phase"] == "rl" and meta["step"] == 4 and meta["controllers"]["rollbacks"] == 2
  assert all(np.all(np.isfinite(np.asarray(x))) for x in __import__("jax").tree.leaves(tree["params"]))


def test_bad_steps_never_evict_the_last_good_checkpoint(tmp_path, capsys):
  # keep_last=1: had the two non-finite steps been saved, the good checkpoint before them would be gone
  # and the rollback would have nothing to restore.
  run_dir = tmp_path / "run"
  flags = [*SMALL, f"--run_dir={run_dir}", "--keep_last=1", "--debug_nan_steps=2,3", "--max_bad_steps=2"]
  assert main(["prog", *flags]) == 0
  assert "rolled back from RL step 4 to step 2" in capsys.readouterr().out
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["rollbacks"] == 1 and summary["nonfinite_steps"] == 2


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line_and_a_rerun_loses_nothing(finished_run, tmp_path):
  """A write the machine refuses (a file-size limit here, as a full disk would; no root needed): the run
  ends with one ``error:`` line naming the checkpoint directory, exit 1, nothing half-written is taken for
  a checkpoint, and the same command rerun with room completes as the uninterrupted run."""
  import resource
  import signal
  import subprocess
  import sys

  def limited():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # under one checkpoint's largest file

  run_dir = tmp_path / "run"
  cmd = [sys.executable, "-m", "mimo_jax.main", *SMALL, f"--run_dir={run_dir}"]
  env = dict(os.environ)  # the suite's XLA flags, as the in-process run had them
  proc = subprocess.run(cmd, env=env, preexec_fn=limited, capture_output=True, text=True, timeout=900)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert len(errors) == 1 and f"{run_dir}/checkpoints: a checkpoint could not be written" in errors[0]
  assert "rerun the same command" in errors[0]
  # What was committed before the refused write reads back intact (fingerprints verified); the step
  # being written is not among them.
  committed = sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())
  reader = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
  try:
    for step in committed:
      reader.restore_untyped_part(step, ["params"])
  finally:
    reader.close()
  assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(run_dir / "checkpoints"))  # the refused one
  again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
  assert again.returncode == 0, again.stderr[-3000:]
  assert kill_resume.compare(str(finished_run), str(run_dir)) == []


def test_a_non_writer_run_directory_writes_nothing(tmp_path):
  """The processes of a multi-process run other than process 0: no lock, no claim, no files."""
  from mimo_jax.train.rundir import RunDir

  path = tmp_path / "run"
  d = RunDir(str(path), writer=False)
  with d.lock():
    d.claim({"run": {}}, overwrite=True)
    d.write_config({"run": {}})
    d.write_summary({"done": True})
    logger = d.logger(tensorboard=True, keep_through=None)
    record = logger.log(3, {"reward_mean": np.float32(0.5)})
    logger.close()
  assert record == {"step": 3, "reward_mean": 0.5}
  assert not path.exists()
  # The writer of the same directory does write, and holds the lock.
  w = RunDir(str(path))
  with w.lock():
    w.write_config({"run": {}})
    with pytest.raises(Exception, match="in use by another trainer"):
      RunDirLock(str(path))
  assert (path / "config.json").exists()


def test_the_sample_replay_is_cut_back_with_the_metrics_on_a_resume(tmp_path):
  """samples.jsonl follows metrics.jsonl: a resume from step 2 drops the rows of later steps (they will be
  written again) and a row cut by a kill; TensorBoard gets each step's rows as text."""
  import glob

  from mimo_jax.train.logger import MetricsLogger

  def rows(step):
    row = {"step": step, "kind": "reward_top", "row": 0, "prompt_id": 7, "prompt": "1+1=", "completion": "2"}
    return [{**row, "reward": 1.0, "length": 2, "finish_reason": "stop"}]

  logger = MetricsLogger(str(tmp_path), tensorboard=True)
  for step in (1, 2, 3):
    logger.log(step, {"reward_mean": 0.5}, None, rows(step))
  logger.close()
  with open(tmp_path / "samples.jsonl", "a") as f:
    f.write('{"step": 4, "kind": "rew')  # a line cut by a kill
  events = b"".join(open(p, "rb").read() for p in glob.glob(str(tmp_path / "tensorboard" / "*")))
  assert b"samples" in events and b"1+1=" in events
  logger = MetricsLogger(str(tmp_path), tensorboard=False, keep_through=2)
  logger.log(3, {"reward_mean": 0.25}, None, rows(3) * 2)
  logger.close()
  samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  assert [s["step"] for s in samples] == [1, 2, 3, 3]
  assert [json.loads(line)["reward_mean"] for line in open(tmp_path / "metrics.jsonl")] == [0.5, 0.5, 0.25]
  # A process that does not write (not process 0 of a multi-process run) writes no rows.
  other = MetricsLogger(str(tmp_path / "other"), write=False)
  other.log(1, {"reward_mean": 0.5}, None, rows(1))
  assert not (tmp_path / "other").exists()


def test_device_memory_metrics_from_the_allocator_statistics():
  from mimo_jax.train.logger import GIB, device_memory, memory_metrics

  # The fields an accelerator's memory_stats() reports (GPU and TPU name them alike).
  stats = [
    {"bytes_in_use": 3 * GIB, "peak_bytes_in_use": 5 * GIB, "bytes_limit": 80 * GIB},
    {"bytes_in_use": 4 * GIB, "peak_bytes_in_use": 4.5 * GIB, "bytes_limit": 79 * GIB},
  ]
  assert memory_metrics(stats) == {"mem_in_use_gib": 4.0, "mem_peak_gib": 5.0, "mem_limit_gib": 79.0}
  assert memory_metrics([None, {}]) == {}
  assert device_memory() == {}  # the CPU backend reports no allocator statistics: no metric, not a zero
