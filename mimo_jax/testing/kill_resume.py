"""Kill-and-resume check: a run killed with SIGKILL at points spread over its RL phase and
resumed must equal an uninterrupted run, step for step and bit for bit.

    python -m mimo_jax.testing.kill_resume --workdir=/tmp/kr --kills=4 --seed=0 -- \\
        --flagfile=experiments/grpo_tiny.flags --model_preset=tiny --sft_steps=20 --max_steps=24 \\
        --checkpoint_every=1

Runs the command once uninterrupted (``<workdir>/reference``), then again
(``<workdir>/killed``), killing the process ``--kills`` times and relaunching it until it
finishes.  Then compares every ``metrics.jsonl`` record (timing fields excluded) and every
array of the final checkpoint.  Exit status 0 means identical.

Kills trigger on *progress*, never on wall-clock delays (a delay that lands mid-RL on one
machine lands before the first checkpoint on a machine twice as slow).  Each kill has a
target RL step, one per equal stratum of the RL phase (drawn with ``--seed``, strictly
increasing), and a kind, in turn:

* ``mid_save``: as soon as an uncommitted save (``<step>.orbax-checkpoint-tmp*``) of the
  target step or a later one exists; the kill is proven to have landed mid-save when that
  temporary directory is still there after the process is dead;
* ``logged``: as soon as ``metrics.jsonl`` holds the target step (between the metrics
  write and the step's checkpoint);
* ``committed``: as soon as the checkpoint of the target step is committed (the kill
  lands in the work of the next step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mimo_jax.launch import process_env

# Observations of wall-clock time and memory (and what is made of them), not results: they differ
# between any two runs of the same configuration (``queue_len``: the batches an async producer had
# ready when the step was logged); everything else must not.
VOLATILE_PREFIXES = ("time_", "rollout_share", "device_s_", "mem_", "queue_len")
KINDS = ("mid_save", "logged", "committed")
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
_RESUMED = re.compile(r"resumed from (sft|rl) step (\d+)")
_POLL_S = 0.005  # saves of a tiny model last tens of milliseconds


@dataclasses.dataclass(frozen=True)
class KillPoint:
  """Where one kill lands: the RL step it waits for, and which moment of that step."""

  rl_step: int
  kind: str


def plan_kills(max_steps: int, kills: int, seed: int) -> list[KillPoint]:
  """One kill per equal stratum of RL steps ``1 .. max_steps - 1``, strictly increasing, kinds in turn."""
  if max_steps < 2 or kills < 1:
    return []
  edges = np.linspace(1, max_steps, min(kills, max_steps - 1) + 1)
  rng = np.random.default_rng(seed)
  points, last = [], 0
  for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
    lo_i, hi_i = max(int(np.ceil(lo)), last + 1), max(int(np.ceil(hi)), last + 2)
    step = int(rng.integers(lo_i, min(hi_i, max_steps)))
    points.append(KillPoint(step, KINDS[i % len(KINDS)]))
    last = step
  return points


class _Progress:
  """What a run directory shows of its progress: logged RL steps, committed and partial saves."""

  def __init__(self, run_dir: str):
    self.metrics = os.path.join(run_dir, "metrics.jsonl")
    self.checkpoints = os.path.join(run_dir, "checkpoints")
    self._size = -1
    self._logged = 0

  def logged_rl_step(self) -> int:
    """The largest RL step in ``metrics.jsonl`` (0 when none); reread only when the file changed."""
    try:
      size = os.path.getsize(self.metrics)
    except OSError:
      return 0
    if size != self._size:
      self._size = size
      steps = [0]
      with open(self.metrics) as f:
        for line in f:
          try:
            r = json.loads(line)
          except json.JSONDecodeError:  # a line being written
            continue
          if "reward_mean" in r:
            steps.append(int(r["step"]))
      self._logged = max(steps)
    return self._logged

  def saves(self) -> tuple[set[int], dict[int, str]]:
    """(committed checkpoint steps, {step: path of an uncommitted save})."""
    try:
      names = os.listdir(self.checkpoints)
    except OSError:
      return set(), {}
    committed = {int(n) for n in names if n.isdigit()}
    partial = {int(m.group(1)): os.path.join(self.checkpoints, n) for n in names if (m := _TMP.match(n))}
    return committed, partial


def _launch(flags: Sequence[str], run_dir: str, env: dict[str, str], log) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "mimo_jax.main", *flags, f"--run_dir={run_dir}"]
  return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_uninterrupted(flags, run_dir, env, timeout_s=3600) -> None:
  """Runs the command to the end (``timeout_s`` is a ceiling against hangs)."""
  with open(run_dir + ".log", "w") as log:
    p = _launch(flags, run_dir, env, log)
    if p.wait(timeout=timeout_s) != 0:
      raise RuntimeError(f"reference run failed; see {run_dir}.log")


def _rl_steps_of(flags: Sequence[str]) -> tuple[int, int]:
  """``(sft_steps, max_steps)`` of the command, read with the trainer's own flag parser."""
  from mimo_jax.main import parse_config

  cfg = parse_config(["prog", *flags])
  return cfg.run.sft_steps, cfg.run.max_steps


def _wait_for_point(
  p: subprocess.Popen, progress: _Progress, kind: str, rl_step: int, first_rl_ckpt: int
) -> str | None:
  """Polls until the process reaches ``rl_step`` in the way ``kind`` says; returns the partial-save path
  for ``mid_save`` (``""`` otherwise), or None when the process exited first."""
  target = first_rl_ckpt + rl_step  # checkpoint numbering: SFT steps first, then RL steps
  while p.poll() is None:
    if kind == "logged" and progress.logged_rl_step() >= rl_step:
      return ""
    if kind in ("mid_save", "committed"):
      committed, partial = progress.saves()
      if kind == "mid_save":
        hits = [path for step, path in partial.items() if step >= target]
        if hits:
          return hits[0]
      elif any(step >= target for step in committed):
        return ""
    time.sleep(_POLL_S)
  return None


def run_with_kills(flags, run_dir, env, *, kills: int, seed: int, timeout_s=3600) -> list[dict[str, Any]]:
  """Runs the command to the end, killing it with SIGKILL at the planned progress points.

  Returns one record per kill delivered: ``attempt``, ``kind``, ``rl_step`` (the planned
  target), ``waited_for_rl_step`` (the target, or later when an earlier attempt had already
  passed it), ``logged_rl_step`` (the last RL step in ``metrics.jsonl`` at the kill) and ``mid_save``
  (True when an uncommitted save was still on disk after the process died).
  ``timeout_s`` is a ceiling against hangs, never a trigger.
  """
  sft_steps, max_steps = _rl_steps_of(flags)
  plan = plan_kills(max_steps, kills, seed)
  progress = _Progress(run_dir)
  delivered: list[dict[str, Any]] = []
  deadline = time.monotonic() + timeout_s
  with open(run_dir + ".log", "w") as log:
    attempt = 0
    while True:
      attempt += 1
      if time.monotonic() > deadline:
        raise TimeoutError(f"the killed run did not finish within {timeout_s} s; see {run_dir}.log")
      p = _launch(flags, run_dir, env, log)
      point = plan[len(delivered)] if len(delivered) < len(plan) else None
      hit, rl_step = None, None
      if point is not None:
        # Only progress made by this attempt counts: what an earlier attempt left on disk (metrics
        # lines, checkpoints, partial saves) must not trigger the kill before this one resumed.
        committed, partial = progress.saves()
        left = max([progress.logged_rl_step(), *(s - sft_steps - 1 for s in committed | set(partial))])
        rl_step = max(point.rl_step, left + 1)
        hit = _wait_for_point(p, progress, point.kind, rl_step, sft_steps + 1)
      if hit is not None:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        record = {
          "attempt": attempt,
          "kind": point.kind,
          "rl_step": point.rl_step,
          "waited_for_rl_step": rl_step,
          "logged_rl_step": progress.logged_rl_step(),
          "mid_save": bool(hit) and os.path.exists(hit),
        }
        delivered.append(record)
        log.write(f"\n=== killed attempt {attempt}: {json.dumps(record)} ===\n")
        log.flush()
        continue
      rc = p.wait(timeout=max(deadline - time.monotonic(), 1))
      if rc != 0:
        raise RuntimeError(f"attempt {attempt} exited with {rc}; see {run_dir}.log")
      if os.path.exists(os.path.join(run_dir, "summary.json")):
        return delivered


def resumes(log_text: str) -> list[tuple[str, int]]:
  """The ``(phase, step)`` of every "resumed from" message in a run log."""
  return [(m.group(1), int(m.group(2))) for m in _RESUMED.finditer(log_text)]


def load_metrics(run_dir: str) -> list[dict[str, Any]]:
  records = []
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      records.append({k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES)})
  return records


def load_samples(run_dir: str, name: str = "samples.jsonl") -> list[dict[str, Any]]:
  """The sample replay's rows (none when the run wrote no ``samples.jsonl``); ``name``: another
  JSON-lines file of the run (``histograms.jsonl``)."""
  path = os.path.join(run_dir, name)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f]


def final_arrays(run_dir: str) -> dict[str, np.ndarray]:
  import jax

  from mimo_jax.ckpt import Checkpointer

  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), async_save=False, read_only=True)
  try:
    tree = ckpt.restore_untyped(ckpt.all_steps()[-1])
  finally:
    ckpt.close()
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def compare(ref_dir: str, other_dir: str) -> list[str]:
  """Differences between two finished runs (empty when identical)."""
  problems = []
  a, b = load_metrics(ref_dir), load_metrics(other_dir)
  steps_a, steps_b = [r["step"] for r in a], [r["step"] for r in b]
  if steps_b != steps_a:
    problems.append(f"metrics steps differ: {steps_a} vs {steps_b}")
  for ra, rb in zip(a, b, strict=False):
    if ra != rb:
      keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
      problems.append(f"step {ra.get('step')}: {', '.join(keys[:6])} differ")
  sa, sb = load_samples(ref_dir), load_samples(other_dir)
  if sa != sb:
    steps = sorted({r["step"] for r in sa} ^ {r["step"] for r in sb}) or sorted(
      {ra["step"] for ra, rb in zip(sa, sb, strict=False) if ra != rb}
    )
    problems.append(f"samples.jsonl differs ({len(sa)} vs {len(sb)} rows; steps {steps[:6]})")
  ha, hb = load_samples(ref_dir, "histograms.jsonl"), load_samples(other_dir, "histograms.jsonl")
  if ha != hb:
    steps = sorted({r["step"] for r in ha} ^ {r["step"] for r in hb}) or sorted(
      {ra["step"] for ra, rb in zip(ha, hb, strict=False) if ra != rb}
    )
    problems.append(f"histograms.jsonl differs ({len(ha)} vs {len(hb)} rows; steps {steps[:6]})")
  pa, pb = final_arrays(ref_dir), final_arrays(other_dir)
  if set(pa) != set(pb):
    problems.append("final checkpoints hold different arrays")
  for k in sorted(set(pa) & set(pb)):
    if pa[k].shape != pb[k].shape or not np.array_equal(pa[k], pb[k]):
      problems.append(f"final array {k} differs")
  return problems


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" in argv:
    i = argv.index("--")
    own, flags = argv[:i], argv[i + 1 :]
  else:
    own, flags = argv, []
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--kills", type=int, default=4, help="kills, one per stratum of the RL phase")
  parser.add_argument("--seed", type=int, default=0, help="draws the RL step of each kill within its stratum")
  parser.add_argument("--devices", type=int, default=2, help="emulated CPU devices per process")
  args = parser.parse_args(own)
  os.makedirs(args.workdir, exist_ok=True)
  env = process_env(args.devices)
  ref, killed = os.path.join(args.workdir, "reference"), os.path.join(args.workdir, "killed")
  run_uninterrupted(flags, ref, env)
  delivered = run_with_kills(flags, killed, env, kills=args.kills, seed=args.seed)
  with open(killed + ".log") as f:
    resumed = resumes(f.read())
  problems = compare(ref, killed)
  print(json.dumps({"kills": delivered, "resumed": resumed, "identical": not problems, "problems": problems[:20]}))
  return 0 if not problems else 1


if __name__ == "__main__":
  sys.exit(main())
