"""``python -m mimo_jax.sweep``: a scaling study from the command line.

    python -m mimo_jax.sweep --base=FLAGFILE --axis=NAME=v1,v2,... [--axis=...] [--seeds=N] [--grid]
        [--gate_steps=20] [--no_coupling] [--no_shared_warm_start] [--plan] --out=DIR [-- extra main flags]
    python -m mimo_jax.sweep --report_only --out=DIR

Every point is a normal run directory under ``DIR/runs/``; ``DIR/results.jsonl`` has one row per point
and seed; ``DIR/report.html`` is drawn at the end (and by ``--report_only``, from the runs as they are,
a live sweep included).  Rerunning the same command continues a killed or interrupted sweep.
Exit status: 0 done, 1 some runs failed (rerun to retry them), 2 invalid flags (nothing ran),
3 interrupted (rerun to continue).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mimo_jax.config import ConfigError


class _Parser(argparse.ArgumentParser):
  def error(self, message: str):  # exit 2 with the flag named, as the trainer does
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m mimo_jax.sweep", description=__doc__.split("\n\n")[0], allow_abbrev=False)
  p.add_argument("--base", help="The base flagfile every point starts from.")
  p.add_argument(
    "--axis",
    action="append",
    default=[],
    help="A swept flag and its values, NAME=v1,v2,... (several flags that move together: N1:N2=a1:b1,a2:b2). "
    "Repeatable: axes are swept one at a time around the base unless --grid.",
  )
  p.add_argument("--seeds", default="1", help="N seeds from the base's --seed, or the seeds s1,s2,... (default 1).")
  p.add_argument("--grid", action="store_true", help="Every combination of the axes instead of one axis at a time.")
  p.add_argument(
    "--gate_steps",
    type=int,
    default=20,
    help="RL steps of each point's short-run gate (NaN, no reward movement, KL/entropy alarm stop it; 0: no gate).",
  )
  p.add_argument(
    "--gate_min_reward_change",
    type=float,
    default=0.0,
    help="The gate's 'flat' verdict: the batch reward's range over the gate is at most this.",
  )
  p.add_argument(
    "--no_coupling", action="store_true", help="Do not adjust coupled settings (learning rate, KL, entropy, clip)."
  )
  p.add_argument(
    "--no_shared_warm_start",
    action="store_true",
    help="Each run trains its own supervised warm start (by default the runs of a seed whose warm-start settings "
    "agree take one, trained once into DIR/warm_starts/: the same weights, trained once).",
  )
  p.add_argument("--report_only", action="store_true", help="Only redraw DIR/report.html from the runs.")
  p.add_argument(
    "--plan", action="store_true", help="Validate every point and print its coupled settings and command; run nothing."
  )
  p.add_argument("--out", required=True, help="The sweep directory.")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra: list[str] = []
  if "--" in argv:
    i = argv.index("--")
    argv, extra = argv[:i], argv[i + 1 :]
  args = build_parser().parse_args(argv)
  if args.report_only:
    from mimo_jax.sweep.report import write_report

    try:
      path = write_report(args.out)
    except ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(f"report: {path}")
    return 0
  from mimo_jax.sweep.runner import Sweep, parse_axis, parse_seeds

  try:
    if not args.base:
      raise ConfigError("--base: the base flagfile is required (or --report_only)")
    sweep = Sweep(
      base=args.base,
      axes=[parse_axis(a) for a in args.axis],
      out=args.out,
      seeds=parse_seeds(args.seeds),
      grid=args.grid,
      coupling=not args.no_coupling,
      gate_steps=args.gate_steps,
      gate_min_reward_change=args.gate_min_reward_change,
      extra=extra,
      share_warm_start=not args.no_shared_warm_start,
    )
    if args.plan:
      runs = sweep.plan()
      shared = sweep.shared_warm_starts(runs) if sweep.share_warm_start else {}
      for run in runs:
        print(run.name)
        for c in run.changes:
          print(f"    coupled {c.describe()}")
        print("    python -m mimo_jax.main " + " ".join(run.argv))
        if run.name in shared:
          print(f"    takes the shared warm start {shared[run.name]} (--warm_start_from)")
      return 0
    rc = sweep.run()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if rc in (0, 1):
    from mimo_jax.sweep.report import write_report

    print(f"report: {write_report(args.out)}", flush=True)
  return rc


if __name__ == "__main__":
  sys.exit(main())
