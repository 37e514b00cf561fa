"""Command-line entry point: ``python -m mimo_jax.main --flagfile=experiments/<name>.flags``.

This is the only module that reads absl flags.  Every field of the config dataclasses
in :mod:`mimo_jax.config` is a flat flag of the same name; the flags are parsed once,
turned into a frozen :class:`~mimo_jax.config.Config`, validated (before any compute),
and the config is passed down.  Later flags override earlier ones, so
``--flagfile=x.flags --seed=3`` overrides the flagfile's seed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence

from absl import flags

from mimo_jax.config import CONCERN_CLASSES, Config, ConfigError, validate


def define_flags(fv: flags.FlagValues) -> None:
  """Defines one flag per config field on ``fv``."""
  for concern, cls in CONCERN_CLASSES.items():
    for f in dataclasses.fields(cls):
      if not f.metadata.get("flag", True):
        continue
      help_text = f"[{concern}] {f.metadata.get('help', '')}"
      default, choices = f.default, f.metadata.get("choices")
      if choices and all(isinstance(c, str) for c in choices):
        flags.DEFINE_enum(f.name, default, list(choices), help_text, flag_values=fv)
      elif isinstance(default, bool):
        flags.DEFINE_bool(f.name, default, help_text, flag_values=fv)
      elif isinstance(default, int):
        flags.DEFINE_integer(f.name, default, help_text, flag_values=fv)
      elif isinstance(default, float):
        flags.DEFINE_float(f.name, default, help_text, flag_values=fv)
      elif isinstance(default, str):
        flags.DEFINE_string(f.name, default, help_text, flag_values=fv)
      else:  # pragma: no cover - a new field type needs a flag parser here
        raise TypeError(f"config field {concern}.{f.name} has no flag type for {type(default)}")


def config_from_flags(fv: flags.FlagValues) -> Config:
  """Builds the Config from parsed flag values (each concern validates itself)."""
  parts = {}
  for concern, cls in CONCERN_CLASSES.items():
    kwargs = {f.name: fv[f.name].value for f in dataclasses.fields(cls) if f.metadata.get("flag", True)}
    parts[concern] = cls(**kwargs)
  return Config(**parts)


def parse_config(argv: Sequence[str]) -> Config:
  """Parses a command line (``argv[0]`` is the program name) into a validated Config.

  Raises:
    ConfigError: unknown flag, malformed value or invalid combination; the message
      names the flag and what is allowed.
  """
  fv = flags.FlagValues()
  define_flags(fv)
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    raise ConfigError(str(e)) from None
  if len(rest) > 1:
    raise ConfigError(f"unexpected positional arguments: {rest[1:]}")
  return config_from_flags(fv)


def help_text() -> str:
  fv = flags.FlagValues()
  define_flags(fv)
  return fv.get_help()


# ----------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------


def run_smoke(cfg: Config) -> dict:
  """Builds the model sharded on the mesh and runs a jitted forward pass."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from mimo_jax import sharding
  from mimo_jax.models import Transformer, create_sharded, load_hf

  mesh = sharding.build_mesh(cfg.mesh)
  t0 = time.perf_counter()
  if cfg.model.hf_checkpoint:
    model = load_hf(cfg.model.hf_checkpoint, mesh=mesh, dtype=cfg.model.param_dtype or "float32")
  else:
    model_cfg = cfg.model.model_config()
    model = create_sharded(lambda: Transformer(model_cfg, rngs=nnx.Rngs(cfg.run.seed)), mesh)
  build_s = time.perf_counter() - t0
  mc = model.config
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  batch = mesh.shape["data"] * mesh.shape["fsdp"] * 2
  tokens = np.random.default_rng(cfg.run.seed).integers(0, mc.vocab_size, (batch, 32), dtype=np.int32)
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens):
    m = nnx.merge(graphdef, state)
    with sharding.use_rules(mesh, sharding.TRAIN_RULES):
      logits = m(tokens)
    return jax.nn.log_softmax(logits, -1).mean()

  t0 = time.perf_counter()
  mean_logp = float(forward(state, jnp.asarray(tokens)))
  fwd_s = time.perf_counter() - t0
  report = {
    "model": mc.name,
    "params": int(n_params),
    "mesh": dict(mesh.shape),
    "logits_shape": [batch, tokens.shape[1], mc.vocab_size],
    "mean_logprob": mean_logp,
    "uniform_logprob": float(-np.log(mc.vocab_size)),
    "build_s": round(build_s, 3),
    "first_forward_s": round(fwd_s, 3),
  }
  for k, v in report.items():
    print(f"{k:>16}: {v}")
  if not np.isfinite(mean_logp):
    raise RuntimeError("smoke run produced non-finite log-probs")
  return report


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
    print(help_text())
    return 0
  try:
    cfg = parse_config(argv)
    import jax

    from mimo_jax.sharding import initialize_distributed

    initialize_distributed(cfg.mesh)  # multi-host pods: before any device is touched
    validate(cfg, jax.device_count())
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if cfg.run.mode == "smoke":
    run_smoke(cfg)
    return 0
  if cfg.run.dry_run:
    from mimo_jax.train.dry_run import dry_run

    dry_run(cfg)
    return 0
  from mimo_jax.train.loop import train

  try:
    train(cfg)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
