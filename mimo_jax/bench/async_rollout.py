"""Synchronous vs async rollout, side by side: samples per second and who waits for whom.

    python -m mimo_jax.bench.async_rollout [--shape default|large] [--repeats 3] [--steps 12] [--warmup 3]

Each measurement is one fresh process running the trainer's own RL step (``RLRun.step``: the
rollout worker, the sampler, the rewards and the one learn program) for ``--warmup`` untimed
steps and ``--steps`` timed ones, from a randomly initialised policy (no warm start: the shapes
and the work are a real step's, the rewards are mostly 0).  The modes run in turn, ``--repeats``
rounds, so a machine that drifts during the sitting drifts for every mode alike.

Shapes:

* ``default``: the embedded default's step (``experiments/grpo_tiny.flags``: the demo model,
  16 prompts x 8 samples, 8 new tokens) on one CPU device, as ``python -m mimo_jax.main`` runs it.
  Modes: ``sync``, ``async`` (``--max_staleness=1``, generation sharing the device).
* ``large``: 8 emulated CPU devices, the demo model, 32 prompts x 8 samples, 32 new tokens.  Modes:
  ``sync`` (one 8-device mesh), ``async_shared`` (staleness 1, every device shared),
  ``async_split`` (staleness 1, ``--rollout_devices=4``: four devices generate, four learn).

Per mode: median seconds per step, samples per second, the learner's idle share (waiting for a
batch) and the rollout's idle share (waiting for a policy version), and the synchronous run's
phase times (generate, reward, learn), from which ``projected_overlap_speedup`` is the step
speed-up a perfect overlap would give (``(rollout + learn) / max(rollout, learn)``): what async
pays where rollout and learning really run on separate devices.  Output: one JSON line per
measurement, then one summary line per mode with medians, spreads and ratios to ``sync``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGFILE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")

SHAPES = {
  "default": {
    "devices": 1,
    "flags": ["--prompts_per_step=16", "--num_samples=8", "--max_new_tokens=8", "--mesh_fsdp=-1"],
    "modes": {"sync": [], "async": ["--async_rollout", "--max_staleness=1"]},
  },
  "large": {
    "devices": 8,
    "flags": ["--prompts_per_step=32", "--num_samples=8", "--max_new_tokens=32", "--prompt_buckets=16"],
    "modes": {
      "sync": ["--mesh_fsdp=-1"],
      "async_shared": ["--mesh_fsdp=-1", "--async_rollout", "--max_staleness=1"],
      "async_split": ["--mesh_fsdp=-1", "--async_rollout", "--max_staleness=1", "--rollout_devices=4"],
    },
  },
}


def measure(flags: Sequence[str], warmup: int, steps: int) -> dict:
  """One measurement in this process: ``warmup`` untimed steps, then ``steps`` timed ones."""
  from mimo_jax.main import parse_config
  from mimo_jax.train.loop import RLRun

  with tempfile.TemporaryDirectory() as run_dir:
    total = warmup + steps
    cfg = parse_config(
      [
        "prog",
        f"--flagfile={FLAGFILE}",
        *flags,
        f"--run_dir={run_dir}",
        "--sft_steps=0",
        f"--max_steps={total}",
        "--eval_every=0",
        "--checkpoint_every=0",
        "--tensorboard=false",
      ]
    )
    run = RLRun(cfg, run_dir)
    run.open_logger(None)
    state = run.begin_rl(run.fresh_state("rl").params, {})
    for step in range(warmup):
      state, _ = run.step(state, step)
    records = []
    t0 = time.perf_counter()
    for step in range(warmup, total):
      state, (record, *_) = run.step(state, step)
      records.append(record)
    wall = time.perf_counter() - t0
    run.close()
  rows = cfg.data.prompts_per_step * cfg.rollout.num_samples

  def total_of(key: str) -> float:
    return sum(r[key] for r in records)

  step_times = [r["time_step_s"] for r in records]
  return {
    "step_s": wall / steps,
    "step_s_median": statistics.median(step_times),
    "samples_per_s": rows * steps / wall,
    "learner_idle_share": total_of("time_learner_idle_s") / wall,
    "rollout_idle_share": total_of("time_rollout_idle_s") / wall,
    "generate_s": total_of("time_generate_s") / steps,
    "reward_s": total_of("time_reward_s") / steps,
    "learn_s": total_of("time_train_s") / steps,
    "staleness_mean": total_of("staleness_mean") / steps,
  }


def _child(shape: str, mode: str, warmup: int, steps: int) -> dict:
  spec = SHAPES[shape]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={spec['devices']}"
  cmd = [sys.executable, "-m", "mimo_jax.bench.async_rollout", "--child", shape, mode, str(warmup), str(steps)]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise RuntimeError(f"{shape}/{mode} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> list[float]:
  return [round(min(values), 4), round(max(values), 4)]


def run(args: argparse.Namespace) -> list[dict]:
  spec = SHAPES[args.shape]
  results: dict[str, list[dict]] = {mode: [] for mode in spec["modes"]}
  for repeat in range(args.repeats):
    for mode in spec["modes"]:  # in turn, every round
      m = _child(args.shape, mode, args.warmup, args.steps)
      results[mode].append(m)
      print(json.dumps({"shape": args.shape, "mode": mode, "repeat": repeat, **{k: round(v, 4) for k, v in m.items()}}))
  summary = []
  base = statistics.median(m["samples_per_s"] for m in results["sync"])
  for mode, ms in results.items():
    sps = [m["samples_per_s"] for m in ms]
    row = {
      "shape": args.shape,
      "mode": mode,
      "runs": len(ms),
      "samples_per_s_median": round(statistics.median(sps), 2),
      "samples_per_s_spread": _spread(sps),
      "ratio_vs_sync": round(statistics.median(sps) / base, 3),
      "step_s_median": round(statistics.median(m["step_s"] for m in ms), 4),
      "learner_idle_share_median": round(statistics.median(m["learner_idle_share"] for m in ms), 3),
      "rollout_idle_share_median": round(statistics.median(m["rollout_idle_share"] for m in ms), 3),
    }
    if mode == "sync":
      rollout = statistics.median(m["generate_s"] + m["reward_s"] for m in ms)
      learn = statistics.median(m["learn_s"] for m in ms)
      row.update(
        rollout_s=round(rollout, 4),
        learn_s=round(learn, 4),
        projected_overlap_speedup=round((rollout + learn) / max(rollout, learn), 3),
      )
    summary.append(row)
    print(json.dumps(row))
  return summary


def main(argv: Sequence[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] == "--child":
    shape, mode, warmup, steps = argv[1], argv[2], int(argv[3]), int(argv[4])
    spec = SHAPES[shape]
    print(json.dumps(measure([*spec["flags"], *spec["modes"][mode]], warmup, steps)), flush=True)
    return
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="default", choices=tuple(SHAPES))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--warmup", type=int, default=3)
  run(parser.parse_args(argv))


if __name__ == "__main__":
  main()
