"""Kill-and-resume check: a run killed with SIGKILL at random moments and resumed must equal
an uninterrupted run, step for step and bit for bit.

    python -m mimo_jax.testing.kill_resume --workdir=/tmp/kr --kills=4 --seed=0 -- \\
        --flagfile=experiments/grpo_tiny.flags --model_preset=tiny --sft_steps=20 --max_steps=24 \\
        --checkpoint_every=1

Runs the command once uninterrupted (``<workdir>/reference``), then again
(``<workdir>/killed``) killing the process ``--kills`` times after random delays
(checkpoints are saved asynchronously, so many kills land in the middle of a save) and
relaunching it until it finishes.  Then compares every ``metrics.jsonl`` record
(timing fields excluded) and every array of the final checkpoint.  Exit status 0 means
identical.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# Wall-clock measurements differ between any two runs; everything else must not.
VOLATILE_PREFIXES = ("time_", "rollout_share")


def _launch(flags: Sequence[str], run_dir: str, env: dict[str, str], log) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "mimo_jax.main", *flags, f"--run_dir={run_dir}"]
  return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_uninterrupted(flags, run_dir, env, timeout_s=900) -> None:
  with open(run_dir + ".log", "w") as log:
    p = _launch(flags, run_dir, env, log)
    if p.wait(timeout=timeout_s) != 0:
      raise RuntimeError(f"reference run failed; see {run_dir}.log")


def run_with_kills(flags, run_dir, env, *, kills: int, seed: int, min_s: float, max_s: float, timeout_s=1800):
  """Returns the list of (attempt, delay seconds) of the kills actually delivered."""
  rng = np.random.default_rng(seed)
  delivered = []
  deadline = time.time() + timeout_s
  with open(run_dir + ".log", "w") as log:
    attempt = 0
    while True:
      attempt += 1
      p = _launch(flags, run_dir, env, log)
      if len(delivered) < kills:
        delay = float(rng.uniform(min_s, max_s))
        try:
          p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
          os.kill(p.pid, signal.SIGKILL)
          p.wait()
          delivered.append((attempt, round(delay, 2)))
          log.write(f"\n=== killed attempt {attempt} after {delay:.2f}s ===\n")
          log.flush()
          continue
      rc = p.wait(timeout=max(deadline - time.time(), 1))
      if rc != 0:
        raise RuntimeError(f"attempt {attempt} exited with {rc}; see {run_dir}.log")
      if os.path.exists(os.path.join(run_dir, "summary.json")):
        return delivered
      if time.time() > deadline:
        raise TimeoutError("the killed run did not finish in time")


def load_metrics(run_dir: str) -> list[dict[str, Any]]:
  records = []
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      records.append({k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES)})
  return records


def final_arrays(run_dir: str) -> dict[str, np.ndarray]:
  import jax

  from mimo_jax.ckpt import Checkpointer

  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), async_save=False)
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
  parser.add_argument("--kills", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--min_s", type=float, default=6.0, help="shortest delay before a kill")
  parser.add_argument("--max_s", type=float, default=20.0, help="longest delay before a kill")
  parser.add_argument("--devices", type=int, default=2, help="emulated CPU devices per process")
  args = parser.parse_args(own)
  os.makedirs(args.workdir, exist_ok=True)
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  env.setdefault("JAX_PLATFORMS", "cpu")
  ref, killed = os.path.join(args.workdir, "reference"), os.path.join(args.workdir, "killed")
  run_uninterrupted(flags, ref, env)
  delivered = run_with_kills(flags, killed, env, kills=args.kills, seed=args.seed, min_s=args.min_s, max_s=args.max_s)
  problems = compare(ref, killed)
  print(json.dumps({"kills": delivered, "identical": not problems, "problems": problems[:20]}))
  return 0 if not problems else 1


if __name__ == "__main__":
  sys.exit(main())
