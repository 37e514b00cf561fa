"""Evaluate a checkpointed policy on its run's held-out prompts.

    python -m mimo_jax.eval --checkpoint=runs/<run>[/checkpoints/<step>] [--eval_samples=64] [--ks=1,8,64]
        [--eval_prompts=N] [--eval_temperature=1.0] [--max_batch_rows=R] [--eval_seed=0] [--output=path.json]
        [--allow_weak_sandbox]
    python -m mimo_jax.eval --run_dir=runs/<run> --all [the same settings]

``--all`` evaluates every kept checkpoint of the run, oldest first, and writes
``<run_dir>/eval_curve.jsonl`` (one row per checkpoint, rewritten after each; rerun with the same
settings, it skips what is done), so the held-out curve can be set beside the reward curve.

A run directory evaluates its latest intact checkpoint; ``<run_dir>/checkpoints/<step>``
evaluates that one (SFT or RL phase).  The run is rebuilt from ``<run_dir>/config.json``.
Prints one JSON line: the checkpoint step and phase, the settings, ``greedy_accuracy``,
``pass@k`` and (for tasks with a final answer) ``maj@k`` for each k, and ``num_problems``.
Exits with status 2 and an ``error:`` line for a bad flag or a missing or corrupted
checkpoint.  A task that runs model-written code (humaneval) is refused where the sandbox
has no kernel isolation unless ``--allow_weak_sandbox`` is given here (the training run's
own setting does not carry over: it is a decision about this machine).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from absl import flags

from mimo_jax.config import parse_int_list
from mimo_jax.config_base import ConfigError


def define_flags(fv: flags.FlagValues) -> None:
  """Defines the evaluation flags on ``fv``."""
  flags.DEFINE_string(
    "checkpoint", None, "A run directory (latest checkpoint) or <run_dir>/checkpoints/<step>.", flag_values=fv
  )
  flags.DEFINE_string("run_dir", None, "With --all: the run directory whose checkpoints to evaluate.", flag_values=fv)
  flags.DEFINE_bool("all", False, "Evaluate every kept checkpoint of --run_dir into eval_curve.jsonl.", flag_values=fv)
  flags.DEFINE_integer("eval_samples", None, "Samples per prompt (default: the run's --eval_samples).", flag_values=fv)
  flags.DEFINE_integer(
    "eval_prompts",
    None,
    "Held-out prompts to evaluate (default: the run's --eval_prompts; for arith a larger number draws a larger "
    "held-out split, whose extra prompts the run may have trained on).",
    flag_values=fv,
  )
  flags.DEFINE_float(
    "eval_temperature", None, "Sampling temperature (default: the run's --eval_temperature).", flag_values=fv
  )
  flags.DEFINE_string("ks", "", "Comma-separated k of pass@k and maj@k (default: 1, powers of 8, n).", flag_values=fv)
  flags.DEFINE_integer(
    "max_batch_rows",
    None,
    "Most completion rows per generation call; samples are drawn in equal parts "
    "(default: the larger of one evaluation chunk and one training rollout batch).",
    flag_values=fv,
  )
  flags.DEFINE_integer("eval_seed", 0, "Seed of the sampling key.", flag_values=fv)
  flags.DEFINE_string("output", "", "Also write the results to this JSON file.", flag_values=fv)
  flags.DEFINE_bool(
    "allow_weak_sandbox",
    False,
    "Tasks that run model-written code (humaneval): go on where the sandbox has no kernel isolation, with "
    "Python-level guards only. Guard mode is NOT containment: determined code escapes it.",
    flag_values=fv,
  )


def _write_json(path: str, obj: dict) -> None:
  from mimo_jax.files import write_atomic

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  write_atomic(path, json.dumps(obj, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line (``argv[0]`` is the program name); returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  fv = flags.FlagValues()
  define_flags(fv)
  if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
    print(__doc__ + "\n" + fv.get_help())
    return 0
  try:
    rest = fv(argv)
    if len(rest) > 1:
      raise ConfigError(f"unexpected positional arguments: {rest[1:]}")
    if fv.all and not fv.run_dir:
      raise ConfigError("--all needs --run_dir=<the run directory>")
    if fv.run_dir and not fv.all:
      raise ConfigError("--run_dir is the run of --all; for one checkpoint use --checkpoint")
    if fv.all and fv.checkpoint:
      raise ConfigError("--all evaluates every checkpoint of --run_dir; leave out --checkpoint")
    if not fv.checkpoint and not fv.all:
      raise ConfigError(
        "--checkpoint is required: a run directory or <run_dir>/checkpoints/<step> (or --run_dir --all)"
      )
    ks = parse_int_list("ks", fv.ks) if fv.ks else None
    if not -(2**63) <= fv.eval_seed < 2**63:
      raise ConfigError(f"--eval_seed={fv.eval_seed}: must fit in 64 bits")
    if fv.output and os.path.isdir(fv.output):
      raise ConfigError(f"--output={fv.output}: is a directory; name the JSON file to write")
  except (flags.Error, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  # Imported after the flags are checked: a bad command line fails before the trainer is loaded.
  from mimo_jax.ckpt.manager import CheckpointCorrupted
  from mimo_jax.eval.evaluator import evaluate_all, evaluate_checkpoint

  settings = dict(
    eval_prompts=fv.eval_prompts,
    num_samples=fv.eval_samples,
    ks=ks,
    temperature=fv.eval_temperature,
    max_batch_rows=fv.max_batch_rows,
    seed=fv.eval_seed,
    allow_weak_sandbox=fv.allow_weak_sandbox,
  )
  flag = f"--run_dir={fv.run_dir}" if fv.all else f"--checkpoint={fv.checkpoint}"
  try:
    if fv.all:
      rows = evaluate_all(fv.run_dir, on_result=lambda row: print(json.dumps(row), flush=True), **settings)
      result = {
        "run_dir": fv.run_dir,
        "eval_curve": [{k: r[k] for k in ("checkpoint_step", "phase", "step", "greedy_accuracy")} for r in rows],
      }
    else:
      result = evaluate_checkpoint(fv.checkpoint, **settings)
  except FileNotFoundError as e:
    print(f"error: {flag.split('=')[0]}: {e}", file=sys.stderr)
    return 2
  except CheckpointCorrupted as e:
    print(f"error: {flag}: the checkpoint is corrupted: {e}", file=sys.stderr)
    return 2
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result), flush=True)
  if fv.output:
    try:
      _write_json(fv.output, result)
    except OSError as e:
      print(f"error: --output={fv.output}: {e.strerror or e} (the results are printed above)", file=sys.stderr)
      return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
