"""Export a checkpointed policy to Hugging Face format.

    python -m mimo_jax.export --run_dir=runs/<run> --out=/path/to/hf_dir [--step=N] [--dtype=bfloat16]

Reads the model configuration recorded in the checkpoint's metadata, restores the
policy parameters (verifying their fingerprints) and writes them with
:func:`mimo_jax.models.save_hf`, so ``transformers`` can load the directory.
"""

from __future__ import annotations

import argparse
import os
import sys

from flax import nnx

from mimo_jax.ckpt import Checkpointer
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


def export(run_dir: str, out: str, *, step: int | None = None, dtype: str | None = None) -> int:
  """Writes checkpoint ``step`` (default: the latest intact one) of ``run_dir`` to ``out``.

  Returns:
    The checkpoint step exported.
  """
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), async_save=False, read_only=True)
  try:
    step = ckpt.resolve_step(step)
    meta = ckpt.read_meta(step)
    cfg = model_config_from_meta(meta)
    graphdef, abs_params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    # Restore the checkpoint's own tree (optimizer included) and keep the policy.
    tree = ckpt.restore_untyped(step)
    nnx.replace_by_pure_dict(abs_params, _unwrap_variables(tree["params"]))
    model = nnx.merge(graphdef, abs_params)
    save_hf(model, out, dtype=dtype)
    return step
  finally:
    ckpt.close()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--run_dir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
  args = parser.parse_args(argv)
  try:
    step = export(args.run_dir, args.out, step=args.step, dtype=args.dtype)
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported checkpoint {step} of {args.run_dir} to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
