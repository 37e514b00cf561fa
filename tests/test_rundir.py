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
