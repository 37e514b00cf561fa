"""Command-line entry point: ``python -m mimo_jax.main --flagfile=experiments/<name>.flags``.

This is the only module that reads absl flags.  Every field of the config dataclasses
in :mod:`mimo_jax.config` is a flat flag of the same name; the flags are parsed once,
turned into a frozen :class:`~mimo_jax.config.Config`, validated (before any compute),
and the config is passed down.  Later flags override earlier ones, so
``--flagfile=x.flags --seed=3`` overrides the flagfile's seed.

Flagfiles (and the flagfiles they name on ``--flagfile=`` lines) are read and checked here
before absl parses them: a file that is not valid UTF-8 is refused with its name and the
byte position of the first bad byte, rather than a decoding traceback from inside absl.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Sequence

from absl import flags, logging

from mimo_jax.config import CONCERN_CLASSES, Config, ConfigError, validate
from mimo_jax.config_base import coerce_value, field_range, format_list

_UTF8_BOM = b"\xef\xbb\xbf"


def define_flags(fv: flags.FlagValues) -> None:
  """Defines one flag per config field on ``fv``."""
  for concern, cls in CONCERN_CLASSES.items():
    for f in dataclasses.fields(cls):
      if not f.metadata.get("flag", True):
        continue
      help_text = f"[{concern}] {f.metadata.get('help', '')}"
      allowed = field_range(f)
      if f.metadata.get("items") is not None:
        count = f.metadata.get("length")
        kind = "integers" if f.metadata["items"] is int else "numbers"
        help_text += f" {count or 'Comma-separated'} {kind}" + (" (comma-separated)" if count else "")
        help_text += f", each {allowed.describe()}." if allowed is not None else "."
      elif allowed is not None:
        help_text += f" Allowed: {allowed.describe()}."
      default, choices = f.default, f.metadata.get("choices")
      if f.metadata.get("items") is not None:  # a tuple; parsed once, in config_from_flags
        flags.DEFINE_string(f.name, format_list(default), help_text, flag_values=fv)
      elif choices and all(isinstance(c, str) for c in choices):
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
  """Builds the Config from parsed flag values (each concern validates itself).

  List-valued flags (``--prompt_buckets=32,64``) become tuples here, once; nothing below
  ``main.py`` parses a setting's text.
  """
  parts = {}
  for concern, cls in CONCERN_CLASSES.items():
    kwargs = {
      f.name: coerce_value(f, fv[f.name].value) for f in dataclasses.fields(cls) if f.metadata.get("flag", True)
    }
    parts[concern] = cls(**kwargs)
  return Config(**parts)


def _flagfile_directive(arg: str) -> str | None:
  """The file named by a ``--flagfile=<path>`` directive (absl's spellings), else None."""
  for prefix in ("--flagfile=", "-flagfile="):
    if arg.startswith(prefix):
      return os.path.expanduser(arg[len(prefix) :].strip())
  return None


def check_flagfile(path: str, stack: tuple[str, ...] = ()) -> None:
  """Checks that a flagfile, and every flagfile it names, is valid UTF-8 text.

  absl decodes flagfiles with the locale's encoding and raises a bare
  ``UnicodeDecodeError`` on bad bytes; reading them here first turns that into a named
  error.  Files are found exactly as absl finds them (the same directive spellings,
  comment lines skipped, ``~`` expanded, circular inclusion ignored); a file that cannot
  be opened is left for absl to report.

  Args:
    path: the flagfile.
    stack: the flagfiles that include this one (for the message and cycle detection).

  Raises:
    ConfigError: naming the flagfile (and its includers), the byte offset, line and
      column of the first byte that is not UTF-8, or a leading byte-order mark.
  """
  if not path or path in stack:
    return
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    return  # absl reports unreadable flagfiles itself
  where = f"--flagfile={path}" + "".join(f" (included from {p})" for p in reversed(stack))
  if data.startswith(_UTF8_BOM):
    raise ConfigError(f"{where}: starts with a UTF-8 byte-order mark; save the file as UTF-8 without BOM")
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
    bad = data[e.start : e.end].hex(" ")
    raise ConfigError(
      f"{where}: not valid UTF-8 at byte {e.start} (line {line}, column {column}: byte(s) 0x{bad}, {e.reason}); "
      "flagfiles must be UTF-8 text"
    ) from None
  # absl reads the file with universal newlines and tests each line as read.
  for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
    if line.startswith(("#", "//")):
      continue
    nested = _flagfile_directive(line)
    if nested is not None:
      check_flagfile(nested, (*stack, path))


def check_flagfiles(argv: Sequence[str]) -> None:
  """Runs :func:`check_flagfile` on every flagfile a command line names (``argv[0]`` is the program).

  Both ``--flagfile=<path>`` and ``--flagfile <path>`` are followed, up to a ``--``.
  """
  args = list(argv[1:])
  i = 0
  while i < len(args):
    arg = args[i]
    if arg == "--":
      break
    if arg in ("--flagfile", "-flagfile") and i + 1 < len(args):
      check_flagfile(os.path.expanduser(args[i + 1]))
      i += 2
      continue
    path = _flagfile_directive(arg)
    if path is not None:
      check_flagfile(path)
    i += 1


def parse_config(argv: Sequence[str]) -> Config:
  """Parses a command line (``argv[0]`` is the program name) into a validated Config.

  Raises:
    ConfigError: unknown flag, malformed value or invalid combination, or a flagfile
      that is not UTF-8; the message names the flag (or file) and what is allowed.
  """
  check_flagfiles(argv)
  fv = flags.FlagValues()
  define_flags(fv)
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    raise ConfigError(str(e)) from None
  except UnicodeDecodeError as e:  # a flagfile that changed after check_flagfiles, or a non-UTF-8 locale
    raise ConfigError(f"a flagfile could not be decoded: {e}") from None
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
    if cfg.run.dry_run_topology:  # compiled for a named pod or node, not for this host's devices
      from mimo_jax.topology import parse_topology

      topo = parse_topology(cfg.run.dry_run_topology)
      # The node's GPUs, stood in for by CPU devices: set before the CPU backend starts (the device count
      # below would start it with the host's own count).
      if topo.platform == "gpu" and jax.config.jax_num_cpu_devices < topo.devices:
        jax.config.update("jax_num_cpu_devices", topo.devices)
      num_devices = topo.devices
    else:
      num_devices = jax.device_count()
    validate(cfg, num_devices)
    from mimo_jax.rewards.task_rewards import check_reward_flags

    check_reward_flags(cfg.data)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return _failed(2)  # a flag one host alone got wrong ends the run now, on every host
  if cfg.run.mode == "smoke":
    run_smoke(cfg)
    return 0
  if cfg.run.mode == "reward_model":
    from mimo_jax.train.loop import resolve_run_dir
    from mimo_jax.train_rm import run_reward_model

    try:
      run_reward_model(cfg, resolve_run_dir(cfg))
    except ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    return 0
  if cfg.run.dry_run:
    from mimo_jax.train.dry_run import dry_run

    try:
      dry_run(cfg)
    except ConfigError as e:  # e.g. a code task without kernel isolation, as the trainer would refuse
      print(f"error: {e}", file=sys.stderr)
      return 2
    return 0
  from mimo_jax.ckpt.manager import CheckpointWriteFailed
  from mimo_jax.train.loop import RunAborted, train

  try:
    train(cfg)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return _failed(2)
  except RunAborted as e:
    print(f"error: {e}", file=sys.stderr)
    return _failed(3)
  except (CheckpointWriteFailed, OSError) as e:  # a full disk, a read-only run directory: the machine's, one line
    print(f"error: {e}", file=sys.stderr)
    return _failed(1)
  except BaseException:
    if not _multi_process():
      raise
    traceback.print_exc()
    return _failed(1)
  return 0


def _multi_process() -> bool:
  """Whether this process is one of a multi-process run (without starting JAX's backend)."""
  jax = sys.modules.get("jax")
  return jax is not None and jax.distributed.is_initialized()


def _failed(code: int) -> int:
  """A failed run's exit code.  A process of a multi-process run that fails ends here and now: on a normal
  exit JAX's shutdown barrier holds it (and with it the others, waiting for it in a collective) for 300 s
  whatever ``--heartbeat_timeout_s``, and then aborts; ended, it is seen gone by the others within that
  timeout."""
  if _multi_process():
    sys.stdout.flush()
    sys.stderr.flush()
    logging.flush()
    os._exit(code)
  return code


if __name__ == "__main__":
  sys.exit(main())
