"""Every step a transaction: kill -9 and resume, corrupted checkpoints, SIGTERM, NaN
rollback, --rollback_to, schema validation, export to Hugging Face."""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import torch
import transformers

from mimo_jax.ckpt import Checkpointer
from mimo_jax.ckpt import schema as ckpt_schema
from mimo_jax.main import main, parse_config
from mimo_jax.testing import kill_resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
SMALL = [
  f"--flagfile={FLAGFILE}",
  "--model_preset=tiny",
  "--sft_steps=6",
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
]


def _metrics(run_dir):
  return kill_resume.load_metrics(str(run_dir))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """One uninterrupted run, checkpointed at every step (copied by the tests that modify it)."""
  run_dir = tmp_path_factory.mktemp("ref") / "run"
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 0
  return run_dir


def _copy(run_dir, tmp_path):
  dst = tmp_path / "run"
  shutil.copytree(run_dir, dst)
  return dst


def _checksum_oracle(a: np.ndarray) -> int:
  """The fingerprint's definition in plain numpy on the whole global array: the sum over elements of
  bits * ((position * 2654435761 mod 2^32) | 1), mod 2^32 (uint64 products are exact; their sum wraps
  mod 2^64, a multiple of 2^32)."""
  a = np.asarray(a)
  if a.dtype == bool:
    a = a.astype(np.uint8)
  bits = np.ascontiguousarray(a).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.itemsize]).astype(np.uint64).ravel()
  position = np.arange(bits.size, dtype=np.uint64)
  weights = ((position * np.uint64(2654435761)) % np.uint64(1 << 32)) | np.uint64(1)
  return int((bits * weights).sum() % np.uint64(1 << 32))


def test_fingerprints_equal_their_definition_in_every_layout_and_earlier_releases_values(monkeypatch):
  """Each array's fingerprint is its numpy definition on the global array, whatever its layout (split on
  one or two mesh axes, replicated in part or whole, on one device, on a mesh of one device, uncommitted, a
  host value: each block counted once, at its global positions); and the values of checkpoints written by
  earlier releases (computed then) are unchanged, so those checkpoints still verify."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from mimo_jax.ckpt import manager

  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  one_device = Mesh(np.array(jax.devices()[5:6]).reshape(1, 1), ("a", "b"))  # a second mesh, its block whole
  r = np.random.default_rng(0)
  values = {
    "f32": r.normal(size=(8, 12)).astype(np.float32),
    "bf16": np.asarray(r.normal(size=(4, 8)), jax.numpy.bfloat16),
    "i8": r.integers(-128, 128, size=(2, 4, 8)).astype(np.int8),
    "bool": r.integers(0, 2, size=(8,)).astype(bool),
    "u32": r.integers(0, 1 << 32, size=(4, 4), dtype=np.uint64).astype(np.uint32),
  }
  layouts = {
    "f32": [P("a", None), P(None, "b"), P("a", "b"), P(("a", "b"), None), P()],
    "bf16": [P(None, "b"), P("a", None)],
    "i8": [P(None, "a", "b"), P("a", None, None)],
    "bool": [P("b"), P(("a", "b"))],
    "u32": [P("b", None), P()],
  }
  tree = {}
  for name, a in values.items():
    for i, spec in enumerate(layouts[name]):
      tree[f"{name}/{i}"] = jax.device_put(a, NamedSharding(mesh, spec))
    tree[f"{name}/device3"] = jax.device_put(a, jax.devices()[3])
    tree[f"{name}/mesh_of_one"] = jax.device_put(a, NamedSharding(one_device, layouts[name][0]))
    tree[f"{name}/uncommitted"] = jax.numpy.asarray(a)
    tree[f"{name}/host"] = a
  expected = {key: _checksum_oracle(values[key.split("/")[0]]) for key in tree}
  assert manager.fingerprint(tree) == expected
  monkeypatch.setattr(manager, "_FETCH_BYTES", 100)  # the sums fetched every few arrays, not once
  assert manager.fingerprint(tree) == expected
  key = jax.random.key(7)
  assert manager.fingerprint({"k": key})["k"] == _checksum_oracle(jax.random.key_data(key))
  # Values computed by the release before the fingerprint moved on the device (written into its checkpoints).
  a = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
  earlier = {
    "f32": (a, 1265006238),
    "bf16": (np.asarray(a, jax.numpy.bfloat16), 512938660),
    "i8": (np.arange(-12, 12, dtype=np.int8).reshape(2, 3, 4), 3232544680),
    "bool": (np.arange(10) % 3 == 0, 535203444),
    "key": (jax.random.key(7), 1401181143),
    "scalar": (np.float32(-2.5), 3223322624),
  }
  assert manager.fingerprint({k: jax.numpy.asarray(v) for k, (v, _) in earlier.items()}) == {
    k: v for k, (_, v) in earlier.items()
  }


def test_checkpoint_metadata_matches_the_schema(finished_run):
  ckpt = Checkpointer(str(finished_run / "checkpoints"), async_save=False)
  steps = ckpt.all_steps()
  # SFT steps 1..6, RL steps 0..6 at 7..13.
  assert steps == list(range(1, 14))
  meta = ckpt.read_meta(steps[-1])
  ckpt.close()
  ckpt_schema.validate(meta)
  assert meta["phase"] == "rl" and meta["step"] == 6 and meta["buffer"]["pending"] == []
  batches = meta["buffer"]["batches"]
  assert [b["batch_id"] for b in batches] == list(range(6))
  assert [b["policy_version"] for b in batches] == list(range(6))  # one update per step
  assert all(b["status"] == "consumed" for b in batches)
  assert {"greedy_accuracy", "pass@1"} <= set(meta["warm_start"])
  assert "params/decoder/embed_vd/value" in meta["fingerprint"]
  assert meta["schema_version"] == 2 and meta["optimizer_layout"] == 2
  with pytest.raises(ckpt_schema.SchemaError, match="schema version 3 is not readable"):
    ckpt_schema.validate({**meta, "schema_version": 3})
  broken = dict(meta)
  del broken["buffer"]
  with pytest.raises(ckpt_schema.SchemaError, match="missing required field 'buffer'"):
    ckpt_schema.validate(broken)
  with pytest.raises(ckpt_schema.SchemaError, match=r"meta\.phase: 'ppo' is not one of"):
    ckpt_schema.validate({**meta, "phase": "ppo"})


def test_metrics_hold_each_step_once(finished_run):
  steps = [r["step"] for r in _metrics(finished_run)]
  assert len(steps) == len(set(steps))
  assert [s for s in steps if s >= 1] == [1, 2, 3, 4, 5, 6, 7]  # 7 = the final evaluation


# Orbax's failed read of the truncated file leaves coroutines of its other reads behind; collected,
# they report "Exception ignored" (into whichever test runs then). They are collected in this test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, capsys):
  from mimo_jax.train.loop import RLRun

  run_dir = _copy(finished_run, tmp_path)
  latest = run_dir / "checkpoints" / "13" / "state"
  files = sorted((p for p in latest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  victim = files[-1]
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  cfg = parse_config(["prog", *SMALL, f"--run_dir={run_dir}"])
  run = RLRun(cfg, str(run_dir))
  restored = run.restore()
  run.close()
  out = capsys.readouterr().out
  assert "checkpoint 13" in out and "falling back" in out
  assert restored.phase == "rl" and restored.step == 5  # checkpoint 12
  del restored
  gc.collect()


def test_a_run_resumed_past_a_truncated_checkpoint_sets_it_aside_and_ends_as_the_uninterrupted_one(
  finished_run, tmp_path
):
  """The resumed run writes the unreadable step's number again (Orbax refused: "Checkpoint for step 13
  already exists", and the run died): the unreadable step moves to checkpoints.unreadable/ (kept for a
  look), the run redoes its last step to the uninterrupted run's very arrays, and Orbax's reads left
  behind by the failed restore print no tracebacks into the output."""
  run_dir = _copy(finished_run, tmp_path)
  latest = run_dir / "checkpoints" / "13" / "state"
  victim = max((p for p in latest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  truncated = victim.read_bytes()
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
    [sys.executable, "-m", "mimo_jax.main", *SMALL, f"--run_dir={run_dir}"],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-4000:]
  assert "checkpoint 13 could not be read" in out and "resumed from rl step 5 (checkpoint 12)" in out
  assert f"unreadable checkpoint 13 moved to {run_dir}/checkpoints.unreadable/13" in out
  assert "Traceback" not in out and "Exception ignored" not in out and "TensorStore" not in out
  assert (run_dir / "checkpoints.unreadable" / "13" / victim.relative_to(latest.parent)).read_bytes() == truncated
  again = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
  first = Checkpointer(str(finished_run / "checkpoints"), read_only=True)
  assert again.all_steps() == first.all_steps()
  assert again.read_meta(13)["fingerprint"] == first.read_meta(13)["fingerprint"]  # the same arrays, bit for bit
  again.close(), first.close()
  assert [r["step"] for r in _metrics(run_dir)] == [r["step"] for r in _metrics(finished_run)]


@pytest.mark.parametrize(
  ("flag", "named"),
  [
    ("--value_window=16", "controllers/value_history: stored shape (8,), built (16,)"),
    ("--reference_dtype=bfloat16", "stored float32, built bfloat16"),
  ],
)
def test_a_resume_with_another_state_shape_is_refused_and_nothing_is_set_aside(finished_run, tmp_path, flag, named):
  """A setting that reshapes the trainer's state (a controller's history, the reference's dtype) makes
  every intact checkpoint of the run "unreadable" to Orbax: the resume set the RL checkpoints aside and
  started RL again from the last SFT step (exit 0), or blamed corruption.  It is refused, naming the
  entry and the settings that shape it, and every checkpoint stays where it was."""
  from mimo_jax.ckpt.manager import CheckpointMismatch
  from mimo_jax.train.loop import RLRun

  run_dir = _copy(finished_run, tmp_path)
  before = sorted(os.listdir(run_dir))
  run = RLRun(parse_config(["prog", *SMALL, f"--run_dir={run_dir}", flag]), str(run_dir))
  try:
    with pytest.raises(CheckpointMismatch, match="holds another state") as e:
      run.restore()
  finally:
    run.close()
  assert named in str(e.value) and flag.split("=")[0] in str(e.value)
  assert sorted(os.listdir(run_dir)) == before  # no checkpoints.unreadable
  assert sorted(os.listdir(run_dir / "checkpoints")) == sorted(os.listdir(finished_run / "checkpoints"))


def test_a_resume_names_the_settings_that_changed_and_a_moved_run_has_none(finished_run, tmp_path, capsys):
  from mimo_jax.train.loop import RLRun

  run_dir = _copy(finished_run, tmp_path)  # another directory: where the run is is no setting
  for extra, warning in (
    ([], None),
    (["--learning_rate=0.002", "--stop_at_step=9"], "differs from the checkpoint's: --learning_rate: "),
  ):
    run = RLRun(parse_config(["prog", *SMALL, f"--run_dir={run_dir}", *extra]), str(run_dir))
    try:
      assert run.restore().step == 6
    finally:
      run.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "differs from the checkpoint" in line]
    if warning is None:
      assert lines == []
    else:
      (line,) = lines
      assert warning in line and "stop_at_step" not in line and "run_dir" not in line


def test_after_a_failed_read_only_orbaxs_leftover_reads_are_kept_quiet(monkeypatch):
  """Orbax's reads left behind by a failed restore print an "Exception ignored" traceback each when
  collected, and TensorStore's callbacks into the closed loop print "Event loop is closed" through
  ``sys.excepthook``: after a failed read those two, and only those, are dropped."""
  import types

  from mimo_jax.ckpt import manager

  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(("unraisable", u.object)))
  monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(("except", str(value))))
  manager._quiet_failed_reads.cache_clear()
  manager._unreadable(3, RuntimeError("a read failed. See full TensorStore details: {...}"))

  def coroutine(filename):
    namespace = {}
    exec(compile("async def read():\n  pass\n", filename, "exec"), namespace)
    return namespace["read"]()

  orbax, ours = coroutine(f"{os.sep}site{os.sep}orbax{os.sep}serialization.py"), coroutine("mimo.py")
  for c in (orbax, ours):
    sys.unraisablehook(types.SimpleNamespace(object=c))
    c.close()

  def raised(error, frame_file):
    code = compile("raise error\n", frame_file, "exec")
    try:
      exec(code, {"error": error})
    except RuntimeError as e:
      return e.__traceback__.tb_next  # the frame of frame_file

  closed = os.path.join("lib", "asyncio", "base_events.py")
  for error, where in ((RuntimeError("Event loop is closed"), closed), (RuntimeError("Event loop is closed"), "x.py")):
    sys.excepthook(RuntimeError, error, raised(error, where))
  sys.excepthook(RuntimeError, RuntimeError("other"), raised(RuntimeError("other"), closed))
  # TensorStore's callbacks into the closed loop also arrive as unraisables of no object.
  for error, where in ((RuntimeError("Event loop is closed"), closed), (RuntimeError("other"), closed)):
    tb = raised(error, where)
    sys.unraisablehook(types.SimpleNamespace(object=None, exc_type=RuntimeError, exc_value=error, exc_traceback=tb))
  assert seen == [
    ("unraisable", ours),
    ("except", "Event loop is closed"),
    ("except", "other"),
    ("unraisable", None),  # the "other" one
  ]
  manager._quiet_failed_reads.cache_clear()


# A run written by the release before the guarded optimizer (checkpoint metadata version 1: each
# optimizer state the bare optax chain's, the skip counter beside it): PPO with a critic, these flags,
# checkpoints every 3 steps; kept are RL step 3 (checkpoint 10), the reference and the run's own
# uninterrupted metrics (steps -1..7).
LAYOUT1_DIR = os.path.join(ROOT, "tests", "data", "layout1_ppo")
LAYOUT1 = [
  *[f for f in SMALL if not f.startswith("--checkpoint_every")],
  "--checkpoint_every=3",
  "--advantage=gae",
  "--use_value_model",
  "--value_warmup_steps=1",
  "--value_learning_rate=1e-3",
  "--learning_rate=2e-4",
]


def test_a_checkpoint_of_optimizer_layout_1_resumes_with_its_optimizer_state(tmp_path, capsys):
  from mimo_jax.train.loop import RLRun

  run_dir = tmp_path / "layout1_ppo"
  shutil.copytree(LAYOUT1_DIR, run_dir)
  ckpt = Checkpointer(str(run_dir / "checkpoints"), async_save=False)
  meta, old = ckpt.read_meta(10), ckpt.restore_untyped(10)
  ckpt.close()
  assert meta["schema_version"] == 2 and meta["optimizer_layout"] == 1  # upgraded from version 1 on reading
  run = RLRun(parse_config(["prog", *LAYOUT1, f"--run_dir={run_dir}"]), str(run_dir))
  restored = run.restore()
  run.close()
  assert restored.phase == "rl" and restored.step == 3
  # Every array carries over: Adam's moments and count, the schedule's count, the skip counter, the weights.
  for state, legacy, adam_at in ((restored.state.policy, old, 0), (restored.state.value, old["value"], 1)):
    adam_old, _, schedule_old = legacy["opt_state"][adam_at]
    opt = state.opt_state
    adam = opt.inner_state.inner_state[1][0]
    assert int(adam.count) == int(adam_old["count"]) == int(legacy["step"])
    for new, before in ((adam.mu, adam_old["mu"]), (adam.nu, adam_old["nu"]), (state.params, legacy["params"])):
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(opt.inner_state.count) == int(schedule_old["count"])
    assert [int(h.count) for h in opt.inner_state.hyperparams_states.values()] == [int(schedule_old["count"])]
    assert int(state.skipped) == int(legacy["skipped"])
  # The run continues from it, under the new layout, as the release that wrote it continued (the same
  # updates up to float rounding: the learning rate now multiplies once, not twice).  That release's
  # schedule spanned all --max_steps; today's leaves the critic's warm-up steps out of it, so the run
  # goes on with no warm-up flag (its one warm-up step is long over): the writer's schedule.
  assert main(["prog", *LAYOUT1, f"--run_dir={run_dir}", "--value_warmup_steps=0"]) == 0
  assert "resumed from rl step 3" in capsys.readouterr().out
  before = {r["step"]: r for r in kill_resume.load_metrics(LAYOUT1_DIR)}
  after = {r["step"]: r for r in _metrics(run_dir)}
  assert sorted(after) == sorted(before)
  for step in (4, 5, 6):
    for key in ("lr", "loss", "pg_loss", "value_loss", "grad_norm", "reward_mean", "entropy"):
      np.testing.assert_allclose(after[step][key], before[step][key], rtol=2e-3, atol=1e-6, err_msg=f"{key} at {step}")
  ckpt = Checkpointer(str(run_dir / "checkpoints"), async_save=False)
  assert ckpt.read_meta(ckpt.all_steps()[-1])["optimizer_layout"] == 2
  ckpt.close()


def test_rollback_to_replays_identically(finished_run, tmp_path, capsys):
  run_dir = _copy(finished_run, tmp_path)
  assert main(["prog", *SMALL, f"--run_dir={run_dir}", "--rollback_to=3"]) == 0
  assert "rolled back to rl step 3" in capsys.readouterr().out
  assert kill_resume.compare(str(finished_run), str(run_dir)) == []


def test_keep_every_keeps_the_multiples_of_each_phases_own_step(tmp_path):
  """--keep_every=2 with --keep_last=1: SFT steps 2, 4, 6 and RL steps 0, 2, 4, 6 (checkpoints 7, 9, 11,
  13 after 6 SFT steps) stay.  Orbax's rule on the checkpoint step kept checkpoints 8, 10, 12 instead, RL
  steps 1, 3, 5: beside --checkpoint_every on RL steps, at the usual settings no RL checkpoint at all."""
  flags = [*SMALL, "--eval_every=0", "--keep_last=1", "--keep_every=2"]
  assert main(["prog", *flags, f"--run_dir={tmp_path}"]) == 0
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), read_only=True)
  assert ckpt.all_steps() == [2, 4, 6, 7, 9, 11, 13]
  assert [ckpt.read_meta(s)["step"] for s in (7, 9, 11, 13)] == [0, 2, 4, 6]
  ckpt.close()


def test_an_epoch_prompt_order_resumes_where_it_stopped(tmp_path, capsys):
  """--data_order=shuffle over 12 prompts, 8 a step: 6 steps are 4 epochs, the stop at step 3 falls mid-epoch.
  Stopped and resumed, the run draws the same prompts in the same order as the uninterrupted one.  The
  resume without --stop_at_step is the same configuration (it warned that the configuration differed)."""
  flags = [*SMALL, "--eval_every=0", "--data_order=shuffle", "--train_prompts=12", "--log_samples=16"]
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  assert main(["prog", *flags, f"--run_dir={whole}"]) == 0
  assert main(["prog", *flags, f"--run_dir={parts}", "--stop_at_step=3"]) == 0
  capsys.readouterr()
  assert main(["prog", *flags, f"--run_dir={parts}"]) == 0
  out = capsys.readouterr().out
  assert "resumed from rl step 3" in out and "configuration that differs" not in out
  assert kill_resume.compare(str(whole), str(parts)) == []
  # Every row of every step is in the replay (top 16 + bottom 16 of 32): the prompt of each group in order.
  groups = {}
  for r in kill_resume.load_samples(str(whole)):
    if r["kind"] != "kl_top":
      groups[(r["step"], r["row"] // 4)] = r["uid"]
  drawn = [groups[key] for key in sorted(groups)]
  epochs = [drawn[i : i + 12] for i in range(0, 48, 12)]
  assert len(drawn) == 48 and len(set(drawn)) == 12
  assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and len({tuple(e) for e in epochs}) == 4


def test_resume_of_a_finished_run_changes_nothing(finished_run, tmp_path, capsys):
  run_dir = _copy(finished_run, tmp_path)
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 0
  assert "already complete" in capsys.readouterr().out
  assert kill_resume.compare(str(finished_run), str(run_dir)) == []


def test_a_kill_after_the_final_save_before_the_summary_resumes_to_the_same_run(finished_run, tmp_path, capsys):
  """The final checkpoint is written, then the summary: killed in between, the resume finds the final
  record committed and no summary.  It writes both again, each record once, and completes as the
  uninterrupted run (the final checkpoint is not saved twice)."""
  run_dir = _copy(finished_run, tmp_path)
  (run_dir / "summary.json").unlink()
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 0
  assert "already complete" not in capsys.readouterr().out
  assert (run_dir / "summary.json").exists()
  assert kill_resume.compare(str(finished_run), str(run_dir)) == []
  steps = [r["step"] for r in _metrics(run_dir)]
  assert len(steps) == len(set(steps)) and max(steps) == 7
  assert main(["prog", *SMALL, f"--run_dir={run_dir}"]) == 0
  assert "already complete" in capsys.readouterr().out


def test_a_finished_run_continued_to_more_steps_logs_each_step_once(finished_run, tmp_path):
  """A larger --max_steps on a finished run goes on from its final checkpoint: the old final
  evaluation's record (step 7) gives way to RL step 7's, and the new final evaluation is step 9."""
  run_dir = _copy(finished_run, tmp_path)
  flags = [f for f in SMALL if not f.startswith("--max_steps")]
  assert main(["prog", *flags, "--max_steps=8", f"--run_dir={run_dir}"]) == 0
  rows = _metrics(run_dir)
  steps = [r["step"] for r in rows]
  assert len(steps) == len(set(steps)) and [s for s in steps if s >= 1] == list(range(1, 10))
  by_step = {r["step"]: r for r in rows}
  assert "reward_mean" in by_step[7] and "reward_mean" in by_step[8] and "eval/greedy_accuracy" in by_step[9]


def test_export_loads_in_transformers(finished_run, tmp_path):
  from flax import nnx

  from mimo_jax.export import export, model_config_from_meta
  from mimo_jax.models import Transformer

  out = tmp_path / "hf"
  assert export(str(finished_run), str(out)) == 13
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
  hf.eval()
  ckpt = Checkpointer(str(finished_run / "checkpoints"), async_save=False)
  meta, tree = ckpt.read_meta(13), ckpt.restore_untyped(13)
  ckpt.close()
  model = nnx.eval_shape(lambda: Transformer(model_config_from_meta(meta), rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  from mimo_jax.export import _unwrap_variables

  nnx.replace_by_pure_dict(state, _unwrap_variables(tree["params"]))
  ours = nnx.merge(graphdef, state)
  tokens = np.random.default_rng(0).integers(0, ours.config.vocab_size, (2, 9))
  with torch.no_grad():
    ref = hf(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours(jax.numpy.asarray(tokens))), ref, atol=1e-4)
  # The run's tokenizer goes with it: its special ids (transformers' generate ends at its end of
  # sequence; without them it ran to its length limit) and its SentencePiece model.
  from mimo_jax.main import parse_config
  from mimo_jax.tasks.registry import build_task
  from mimo_jax.tokenization import load_tokenizer

  cfg = parse_config(["prog", *SMALL, f"--run_dir={finished_run}"])
  _, run_tokenizer = build_task(cfg.data, seed=0)
  generation = transformers.GenerationConfig.from_pretrained(str(out))
  assert generation.eos_token_id == run_tokenizer.eos_id == hf.config.eos_token_id
  assert (generation.bos_token_id, generation.pad_token_id) == (run_tokenizer.bos_id, run_tokenizer.pad_id)
  exported = load_tokenizer(str(out))
  text = "12+345=357 and 9*8=72"
  assert exported.encode(text, add_bos=True, add_eos=True) == run_tokenizer.encode(text, add_bos=True, add_eos=True)


def test_export_verifies_the_policy_and_passes_over_a_corrupted_checkpoint(finished_run, tmp_path, capsys):
  """Export checks the parameters against their fingerprints before writing: the latest checkpoint's
  recorded fingerprint of one weight no longer matches (as after a flipped bit), so the default exports
  the checkpoint before it, with a warning, and naming that step is an error that writes nothing."""
  from mimo_jax.ckpt.manager import CheckpointCorrupted
  from mimo_jax.export import export
  from mimo_jax.export import main as export_main

  run_dir = _copy(finished_run, tmp_path)
  path = run_dir / "checkpoints" / "13" / "meta" / "metadata"
  meta = json.loads(path.read_text())
  name = next(k for k in sorted(meta["fingerprint"]) if k.startswith("params/"))
  meta["fingerprint"][name] = (meta["fingerprint"][name] + 1) % (1 << 32)
  path.write_text(json.dumps(meta))
  assert export(str(run_dir), str(tmp_path / "hf")) == 12
  assert f"checkpoint 13: contents do not match their fingerprints ({name})" in capsys.readouterr().err
  assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")) is not None
  with pytest.raises(CheckpointCorrupted, match="checkpoint 13"):
    export(str(run_dir), str(tmp_path / "hf13"), step=13)
  assert export_main(["--run_dir", str(run_dir), "--out", str(tmp_path / "hf13"), "--step", "13"]) == 2
  assert "error: checkpoint 13" in capsys.readouterr().err and not (tmp_path / "hf13").exists()


def test_nan_updates_are_skipped_then_rolled_back(tmp_path, capsys):
  from mimo_jax.train.loop import train

  # RL steps 4, 5, 6 (0-based 3, 4, 5) get NaN advantages: three skipped updates in a row.
  cfg = parse_config(
    [
      "prog",
      *SMALL,
      f"--run_dir={tmp_path}",
      "--debug_nan_steps=3,4,5",
      "--max_bad_steps=3",
      "--rollback_lr_factor=0.5",
      "--rollback_reset_optimizer",
    ]
  )
  summary = train(cfg)
  out = capsys.readouterr().out
  assert "rolled back from RL step 6 to step 3 after 3 consecutive non-finite steps" in out
  assert "optimizer reset: yes, lr scale now 0.5" in out
  assert summary["rollbacks"] == 1 and summary["nonfinite_steps"] == 3
  steps = [r["step"] for r in _metrics(tmp_path)]
  assert len(steps) == len(set(steps)) and [s for s in steps if s >= 1] == [1, 2, 3, 4, 5, 6, 7]
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
  tree = ckpt.restore_untyped(ckpt.all_steps()[-1])
  ckpt.close()
  assert float(tree["lr_scale"]) == 0.5
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree["params"]))


def _wait_for(predicate, timeout_s):
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    if predicate():
      return True
    time.sleep(0.2)
  return False


def _rl_steps_logged(run_dir):
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  steps = []
  for line in open(path):
    try:
      r = json.loads(line)
    except json.JSONDecodeError:
      continue
    if "reward_mean" in r:
      steps.append(r["step"])
  return steps


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_exits_cleanly(tmp_path):
  run_dir = str(tmp_path / "run")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  flags = [*SMALL, "--mesh_fsdp=2", "--max_steps=40", "--checkpoint_every=0", f"--run_dir={run_dir}"]
  proc = subprocess.Popen(
    [sys.executable, "-m", "mimo_jax.main", *flags],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  assert _wait_for(lambda: len(_rl_steps_logged(run_dir)) >= 2, 300)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  assert "preempted: state saved at RL step" in out
  last = _rl_steps_logged(run_dir)[-1]
  assert last < 40
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), async_save=False)
  meta = ckpt.read_meta(ckpt.all_steps()[-1])
  ckpt.close()
  assert meta["phase"] == "rl" and meta["step"] == last and meta["log_step"] == last


@pytest.mark.slow
def test_kill_9_at_progress_points_then_resume_is_bit_identical(tmp_path):
  """Four kills spread over the RL phase (mid-save, after a metrics line, after a commit, mid-save),
  each triggered by progress on disk, so a slower machine kills at the same steps."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  max_steps = 20
  flags = [
    f"--flagfile={FLAGFILE}",
    "--model_preset=tiny",
    "--sft_steps=10",
    "--sft_batch_size=16",
    f"--max_steps={max_steps}",
    "--prompts_per_step=8",
    "--num_samples=4",
    "--eval_prompts=16",
    "--eval_samples=2",
    "--eval_every=8",
    "--checkpoint_every=1",
    "--mesh_fsdp=2",
    "--tensorboard=false",
  ]
  ref, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
  kill_resume.run_uninterrupted(flags, ref, env)
  kills = kill_resume.run_with_kills(flags, killed, env, kills=4, seed=0)
  plan = kill_resume.plan_kills(max_steps, 4, seed=0)
  assert [(k["rl_step"], k["kind"]) for k in kills] == [(p.rl_step, p.kind) for p in plan], kills
  # Every kill landed at or after its target, inside the RL phase.
  assert all(k["rl_step"] <= k["waited_for_rl_step"] < max_steps for k in kills), kills
  assert all(k["kind"] != "logged" or k["waited_for_rl_step"] <= k["logged_rl_step"] for k in kills), kills
  assert any(k["mid_save"] for k in kills), f"no kill landed while a save was uncommitted: {kills}"
  resumed = kill_resume.resumes(open(killed + ".log").read())
  mid_rl = [s for phase, s in resumed if phase == "rl" and 0 < s < max_steps]
  assert len(mid_rl) == len(kills), resumed  # each relaunch resumed from a mid-RL checkpoint
  assert mid_rl == sorted(mid_rl) and len(set(mid_rl)) >= 3, resumed
  assert kill_resume.compare(ref, killed) == []


def test_a_kill_between_a_save_and_its_log_line_loses_no_record(finished_run, tmp_path, capsys):
  """A step is saved before it is logged (its record holds the save's own time).  Killed in between, the
  record, its samples and its histograms are missing from the files; the checkpoint carries them, and the
  resume writes them."""
  rl = [r for r in _metrics(finished_run) if "reward_mean" in r]
  raw = [json.loads(line) for line in open(finished_run / "metrics.jsonl")]
  saved = {r["step"]: r["time_checkpoint_s"] for r in raw if "reward_mean" in r}
  # Every RL step but the last is saved at --checkpoint_every=1 (the last after the final evaluation).
  assert all(saved[s] > 0 for s in range(1, 6)) and saved[6] == 0.0 and [r["step"] for r in rl] == list(range(1, 7))
  run_dir = _copy(finished_run, tmp_path)
  for name in ("metrics.jsonl", "samples.jsonl", "histograms.jsonl"):
    lines = open(run_dir / name).readlines()
    with open(run_dir / name, "w") as f:
      f.writelines(line for line in lines if json.loads(line)["step"] < 3)
  assert main(["prog", *SMALL, f"--run_dir={run_dir}", "--rollback_to=3"]) == 0
  assert "rolled back to rl step 3" in capsys.readouterr().out
  assert kill_resume.compare(str(finished_run), str(run_dir)) == []  # samples and histograms included
  again = {r["step"]: r for r in (json.loads(line) for line in open(run_dir / "metrics.jsonl"))}
  assert again[3]["time_checkpoint_s"] is None and again[4]["time_checkpoint_s"] > 0
