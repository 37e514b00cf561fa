"""Export a checkpointed policy to Hugging Face format.

    python -m mimo_jax.export --run_dir=runs/<run> --out=/path/to/hf_dir [--step=N] [--dtype=bfloat16]

Reads the model configuration recorded in the checkpoint's metadata, restores the
policy parameters (verifying their fingerprints) and writes them with
:func:`mimo_jax.models.save_hf`, so ``transformers`` can load the directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

from flax import nnx

from mimo_jax.ckpt import Checkpointer
from mimo_jax.ckpt.manager import CheckpointCorrupted
from mimo_jax.models import ModelConfig, Transformer, save_hf


def model_config_from_meta(meta: dict) -> ModelConfig:
  return ModelConfig.from_dict(meta["model_config"])


def _unwrap_variables(tree):
  """Saved ``nnx.State`` trees keep each Variable as ``{"value": array}``; drop that level."""
  if isinstance(tree, dict):
    if set(tree) == {"value"} and not isinstance(tree["value"], dict):
      return tree["value"]
    return {k: _unwrap_variables(v) for k, v in tree.items()}
  return tree


def export(run_dir: str, out: str, *, step: int | None = None, dtype: str | None = None, best: bool = False) -> int:
  """Writes checkpoint ``step`` (default: the latest intact one) of ``run_dir`` to ``out``; with ``best``,
  of the best evaluated policy the run kept (``--keep_best``: ``<run_dir>/best``).

  The policy's parameters are verified against their fingerprints before anything is written.  Without
  ``step``, a corrupted checkpoint is passed over (with a warning) for the one before it.

  Returns:
    The checkpoint step exported.

  Raises:
    FileNotFoundError: no checkpoints, or not ``step``.
    CheckpointCorrupted: ``step`` (or, without it, every checkpoint) is unreadable or does not match its
      fingerprints.
  """
  if best and not os.path.isdir(os.path.join(run_dir, "best")):
    raise FileNotFoundError(f"{run_dir}: no best checkpoint (a run keeps one with --keep_best=METRIC)")
  ckpt = Checkpointer(os.path.join(run_dir, "best" if best else "checkpoints"), async_save=False, read_only=True)
  try:
    steps = [ckpt.resolve_step(step)] if step is not None else list(reversed(ckpt.all_steps()))
    if not steps:
      ckpt.resolve_step(None)  # raises: no checkpoints
    for i, step in enumerate(steps):  # noqa: B007 - the step found is the one exported
      try:
        tree, meta = ckpt.restore_untyped_part(step, ["params"])
        break
      except CheckpointCorrupted as e:
        if i + 1 == len(steps):
          raise
        print(f"warning: {e}; exporting an earlier checkpoint", file=sys.stderr, flush=True)
    cfg = model_config_from_meta(meta)
    graphdef, abs_params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(abs_params, _unwrap_variables(tree["params"]))
    save_hf(nnx.merge(graphdef, abs_params), out, dtype=dtype, tokenizer=_run_tokenizer(run_dir))
    return step
  finally:
    ckpt.close()


def _run_tokenizer(run_dir: str):
  """The run's tokenizer, rebuilt from its ``config.json`` as the trainer built it (its ids and stop ids
  go into the export); None, with a warning, where it cannot be."""
  from mimo_jax.eval.evaluator import load_run_config
  from mimo_jax.tasks.registry import build_task

  try:
    cfg = load_run_config(run_dir)
    # Nothing runs model-written code here: the sandbox decision is not this command's to make.
    data = dataclasses.replace(cfg.data, allow_weak_sandbox=True)
    with contextlib.redirect_stdout(sys.stderr):
      return build_task(data, seed=cfg.run.seed, hf_checkpoint=cfg.model.hf_checkpoint)[1]
  except (OSError, ValueError) as e:
    print(f"warning: the run's tokenizer could not be rebuilt ({e}); the export has no token ids", file=sys.stderr)
    return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--run_dir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest intact one)")
  parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
  parser.add_argument(
    "--best", action="store_true", help="the best evaluated policy the run kept (--keep_best), not its latest"
  )
  args = parser.parse_args(argv)
  try:
    step = export(args.run_dir, args.out, step=args.step, dtype=args.dtype, best=args.best)
  except (FileNotFoundError, CheckpointCorrupted) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported checkpoint {step} of {args.run_dir} to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
