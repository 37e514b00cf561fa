"""A whole GRPO step, side by side with a peer: first step (compilation included) and steady step time.

    python -m mimo_jax.bench.grpo_step [--shape tunix|default|demo] [--steps 8] [--repeats 3]
                                       [--peer_script PATH/peer_tunix_grpo.sh] [--json_out FILE]
                                       [-- extra trainer flags, e.g. --tokenizer_path=...]

Each measurement is one fresh process running the trainer's own RL step (``RLRun.step``: prompts ->
the sampler's generate program -> decode -> rewards -> the learner's programs) from a randomly
initialised policy, ``--steps`` steps: ``first_step_s`` is step 1 (every compilation included),
``steady_step_s`` the median over steps 3..N (the peer script's own definition), with the phases of the
step (``generate``, ``reward``, ``learn``) and the learner's split as the trainer logs it (``score_s``: the
score pass, behaviour and reference log-probs, a program of its own timed alone under the default
``--time_split=measured``; ``update_s``: the rest) beside ``score_apportioned_s``, what splitting the
learner's time by counted FLOPs (``--time_split=apportioned``) gives for the same steps.

With ``--peer_script`` the peer (Google Tunix's GRPO loop, ``peer_tunix_grpo.sh`` from the project's
peers) runs at the same shape in its own process, alternating with mimo-jax, ``--repeats`` rounds each;
the summary gives each side's medians and spreads and the ratios mimo-jax / peer (below 1: mimo-jax is
faster).  Unless a ``--tokenizer_path`` is passed through, mimo-jax then uses the SentencePiece model the
peer trained (``$PEER_HOME/tunix-work/arith_bpe_<vocabulary>.model``), so both sample from the same vocabulary.  Numbers are only comparable inside one sitting: run both here, never against remembered ones.

Shapes:

* ``tunix``: the peer's benchmark shape: 4 layers, d_model 256, MLP 1024, 8 query / 4 KV heads of 32,
  vocabulary 512; 8 prompts x 8 samples x 64 new tokens, prompts left-padded to 32; the peer's
  settings (AdamW 1e-4 constant, no gradient clip, KL 0.04 in the loss, clip 0.2, temperature 0.9).
* ``default``: the embedded default's RL step (``experiments/grpo_tiny.flags``) as ``make run`` runs it.
* ``demo``: the embedded default's model and batch (the demo preset; 16 prompts x 8 samples x 6 new
  tokens) at the smallest vocabulary (64) and prompt length (16) the peer takes, so that it can run beside.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from mimo_jax import xla_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGFILE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")

TUNIX_SHAPE = dict(
  layers=4, d_model=256, mlp=1024, heads=8, kv_heads=4, head_dim=32, vocab=512, prompts=8, group=8, new=64, prompt=32
)
DEMO_SHAPE = dict(
  layers=3, d_model=128, mlp=384, heads=4, kv_heads=2, head_dim=32, vocab=64, prompts=16, group=8, new=6, prompt=16
)
SHAPES = {
  "tunix": [
    f"--num_layers={TUNIX_SHAPE['layers']}",
    f"--d_model={TUNIX_SHAPE['d_model']}",
    f"--mlp_dim={TUNIX_SHAPE['mlp']}",
    f"--num_heads={TUNIX_SHAPE['heads']}",
    f"--num_kv_heads={TUNIX_SHAPE['kv_heads']}",
    f"--head_dim={TUNIX_SHAPE['head_dim']}",
    f"--vocab_size={TUNIX_SHAPE['vocab']}",
    f"--prompts_per_step={TUNIX_SHAPE['prompts']}",
    f"--num_samples={TUNIX_SHAPE['group']}",
    f"--max_new_tokens={TUNIX_SHAPE['new']}",
    f"--prompt_buckets={TUNIX_SHAPE['prompt']}",
    "--learning_rate=1e-4",
    "--lr_schedule=constant",
    "--warmup_steps=0",
    "--grad_clip=0",
    "--kl_coef=0.04",
    "--clip_low=0.2",
    "--clip_high=0.2",
    "--temperature=0.9",
  ],
  "default": [],
  # The embedded default's model (the demo preset: 3 layers, d_model 128, MLP 384, 4 query / 2 KV heads
  # of 32) and batch (16 prompts x 8 samples x 6 new tokens) at the smallest vocabulary (64) and prompt
  # length (16) the peer takes; everything else as in experiments/grpo_tiny.flags.
  "demo": [f"--prompt_buckets={DEMO_SHAPE['prompt']}", f"--vocab_size={DEMO_SHAPE['vocab']}"],
}


def _peer_flags(shape: dict, *extra: str) -> list[str]:
  return [
    f"--layers={shape['layers']}",
    f"--d_model={shape['d_model']}",
    f"--mlp={shape['mlp']}",
    f"--heads={shape['heads']}",
    f"--kv_heads={shape['kv_heads']}",
    f"--head_dim={shape['head_dim']}",
    f"--vocab={shape['vocab']}",
    f"--prompts={shape['prompts']}",
    f"--group={shape['group']}",
    f"--max_new_tokens={shape['new']}",
    f"--max_prompt_len={shape['prompt']}",
    *extra,
  ]


PEER_FLAGS = {"tunix": _peer_flags(TUNIX_SHAPE), "demo": _peer_flags(DEMO_SHAPE, "--temperature=1.0")}
PEER_VOCAB = {"tunix": TUNIX_SHAPE["vocab"], "demo": DEMO_SHAPE["vocab"]}


def measure(flags: Sequence[str], steps: int) -> dict:
  """One measurement in this process: ``steps`` RL steps of the trainer, each split as it logs it."""
  import jax

  from mimo_jax.main import parse_config
  from mimo_jax.train.loop import RLRun, apportioned_score_time

  with tempfile.TemporaryDirectory() as run_dir:
    cfg = parse_config(
      [
        "prog",
        f"--flagfile={FLAGFILE}",
        *flags,
        f"--run_dir={run_dir}",
        "--sft_steps=0",
        f"--max_steps={steps}",
        "--eval_every=0",
        "--checkpoint_every=0",
        "--tensorboard=false",
        "--log_samples=0",
      ]
    )
    run = RLRun(cfg, run_dir)
    run.open_logger(None)
    state = run.begin_rl(run.fresh_state("rl").params, {})
    walls, records = [], []
    for step in range(steps):
      t0 = time.perf_counter()
      state, (record, *_) = run.step(state, step)
      walls.append(time.perf_counter() - t0)
      records.append(record)
    run.close()
  steady = records[2:] or records

  def median(key: str) -> float:
    return statistics.median(r[key] for r in steady)

  return {
    "first_step_s": walls[0],
    "steady_step_s": statistics.median(walls[2:] or walls),
    "generate_s": median("time_generate_s"),
    "reward_s": median("time_reward_s"),
    "learn_s": median("time_train_s"),
    # The trainer's own split (--time_split=measured unless the flags say otherwise) and, beside it,
    # what apportioning the learner's time by counted FLOPs would have logged.
    "score_s": median("time_score_s"),
    "update_s": median("time_update_s"),
    "score_apportioned_s": statistics.median(apportioned_score_time(r) for r in steady),
    "completion_tokens_mean": median("response_len"),
    "devices": jax.device_count(),
  }


def _child(shape: str, steps: int, extra: Sequence[str]) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  cmd = [sys.executable, "-m", "mimo_jax.bench.grpo_step", "--child", shape, str(steps), *extra]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise RuntimeError(f"mimo-jax {shape} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _peer(script: str, shape: str, steps: int) -> dict:
  cmd = ["bash", script, *PEER_FLAGS[shape], f"--steps={steps}"]
  # The peer runs on its own XLA defaults, not on the ones importing mimo_jax added.
  out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=xla_defaults.user_environ())
  lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  if not lines:
    raise RuntimeError(f"peer {script} printed no RESULT line (exit {out.returncode}):\n{out.stderr[-4000:]}")
  result = json.loads(lines[-1][len("RESULT ") :])
  if not result.get("ok", False):
    raise RuntimeError(f"peer {script} failed: {result.get('error')}")
  return result


def _spread(values: list[float]) -> list[float]:
  return [round(min(values), 4), round(max(values), 4)]


def run(args: argparse.Namespace, extra: Sequence[str]) -> dict:
  if args.peer_script and args.shape not in PEER_FLAGS:
    raise SystemExit(f"--shape={args.shape}: the peer runs only at the shapes {sorted(PEER_FLAGS)}")
  ours, peers = [], []
  for repeat in range(args.repeats):  # alternating: a machine that drifts drifts for both sides alike
    if args.peer_script:
      p = _peer(args.peer_script, args.shape, args.steps)
      peers.append(p)
      keep = {k: p[k] for k in ("first_step_s", "steady_step_s", "steady_phases_s") if k in p}
      print(json.dumps({"side": "peer", "repeat": repeat, **keep}), flush=True)
      if not any(f.startswith("--tokenizer_path") for f in extra):
        # The peer's own tokenizer (its script saves it under $PEER_HOME): the same vocabulary, so the
        # sampler draws from as many ids as the peer's and stops at EOS as rarely.
        home = os.environ.get("PEER_HOME", os.path.join(tempfile.gettempdir(), "mimo-peers"))
        model = os.path.join(home, "tunix-work", f"arith_bpe_{PEER_VOCAB[args.shape]}.model")
        if os.path.isfile(model):
          extra = [*extra, f"--tokenizer_path={model}"]
    m = _child(args.shape, args.steps, extra)
    ours.append(m)
    print(json.dumps({"side": "mimo-jax", "repeat": repeat, **{k: round(v, 4) for k, v in m.items()}}), flush=True)
  summary: dict = {
    "benchmark": "grpo_step",
    "shape": args.shape,
    "steps": args.steps,
    "repeats": args.repeats,
    "date": datetime.date.today().isoformat(),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    "extra_flags": list(extra),
  }
  keys = ("first_step_s", "steady_step_s", "generate_s", "reward_s", "learn_s", "score_s", "update_s")
  for key in (*keys, "score_apportioned_s"):
    values = [m[key] for m in ours]
    summary[f"mimo_{key}_median"] = round(statistics.median(values), 4)
    summary[f"mimo_{key}_spread"] = _spread(values)
  if peers:
    for key in ("first_step_s", "steady_step_s"):
      values = [p[key] for p in peers]
      summary[f"peer_{key}_median"] = round(statistics.median(values), 4)
      summary[f"peer_{key}_spread"] = _spread(values)
      summary[f"ratio_{key}"] = round(summary[f"mimo_{key}_median"] / summary[f"peer_{key}_median"], 3)
    phases = [p.get("steady_phases_s", {}) for p in peers]
    for name in sorted({k for ph in phases for k in ph}):
      summary[f"peer_{name}_s_median"] = round(statistics.median(ph.get(name, 0.0) for ph in phases), 4)
  print(json.dumps(summary), flush=True)
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump({"summary": summary, "mimo": ours, "peer": peers}, f, indent=1)
  return summary


def main(argv: Sequence[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] == "--child":
    shape, steps, extra = argv[1], int(argv[2]), argv[3:]
    print(json.dumps(measure([*SHAPES[shape], *extra], steps)), flush=True)
    return
  extra: list[str] = []
  if "--" in argv:
    extra = argv[argv.index("--") + 1 :]
    argv = argv[: argv.index("--")]
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="tunix", choices=tuple(SHAPES))
  parser.add_argument("--steps", type=int, default=8, help="RL steps per measurement (steady = median of 3..N)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--peer_script", default="", help="the peer's wrapper (peer_tunix_grpo.sh); empty: no peer")
  parser.add_argument("--json_out", default="", help="also write the measurements and the summary here")
  args = parser.parse_args(argv)
  if args.steps < 3:
    parser.error("--steps must be at least 3 (the steady median starts at step 3)")
  run(args, extra)


if __name__ == "__main__":
  main()
