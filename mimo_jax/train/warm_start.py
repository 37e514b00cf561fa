"""Taking another run's supervised warm start (``--warm_start_from``).

Runs that differ only in RL settings (a learning-rate sweep, a KL sweep, the points of a scaling study
at one seed) would each train the same supervised warm start. One of them (or a run stopped right
after it, ``--max_steps=0``) trains it; the others take its last SFT step: the weights, the loop key
and the data order, the state their own warm start would have left. RL then starts as it would have.

:data:`WARM_START` lists what decides a warm start; a source whose settings differ in any of them is
refused, naming the flags. The RL-only settings (the policy optimizer, the algorithm, sampling, the
rewards, evaluation, logging, checkpoints) may differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from mimo_jax.ckpt import Checkpointer
from mimo_jax.config import Config, DataConfig, ModelSpec
from mimo_jax.config_base import ConfigError
from mimo_jax.train import rundir

__all__ = ["WARM_START", "check_source", "restore_warm_start", "starts_afresh", "warm_start_key"]

# The data settings a warm start does not read: RL prompts per step, reward-model training, the rewards.
_RL_ONLY_DATA = ("prompts_per_step", "rm_batch_size", "rm_pairs", "rm_num_pairs", "allow_weak_sandbox")
_RL_ONLY_DATA_PREFIXES = ("reward_", "judge_", "format_reward", "digit_reward", "json_")

# What decides a warm start (section -> settings): the model and its layout, the seed, the task and its
# data, the SFT flags, and the shapes its batches are padded to.
WARM_START: dict[str, tuple[str, ...]] = {
  "model": tuple(f.name for f in dataclasses.fields(ModelSpec)),
  "mesh": ("mesh_data", "mesh_fsdp", "mesh_tensor", "num_processes"),
  "run": ("seed", "sft_steps", "sft_curriculum_steps"),
  "optim": ("sft_learning_rate", "sft_grad_clip", "master_dtype"),
  # rollout_devices: the devices left to the learner make the mesh the supervised steps run on.
  "rollout": ("max_new_tokens", "prompt_buckets", "rollout_devices"),
  "data": tuple(
    f.name
    for f in dataclasses.fields(DataConfig)
    if f.name not in _RL_ONLY_DATA and not f.name.startswith(_RL_ONLY_DATA_PREFIXES)
  ),
}


def warm_start_key(cfg: Config) -> str:
  """A short digest of ``cfg``'s warm-start settings: runs with equal keys train the same warm start."""
  values = {s: {n: getattr(getattr(cfg, s), n) for n in names} for s, names in WARM_START.items()}
  return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:10]


def starts_afresh(cfg: Config, run_dir: str) -> bool:
  """Whether the run in ``run_dir`` begins from nothing (no committed checkpoint to resume, or
  ``--overwrite``): the only case in which ``--warm_start_from`` is read."""
  ck = cfg.checkpoint
  directory = os.path.join(run_dir, rundir.RunDir.CHECKPOINTS)
  committed = os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))
  return ck.overwrite or not (ck.resume or ck.rollback_to >= 0) or not committed


def check_source(cfg: Config, run_dir: str) -> None:
  """Refuses a ``--warm_start_from`` this run cannot take, before anything is computed.

  Raises:
    ConfigError: naming the flag: not a run directory, this run's own directory, warm-start settings
      that differ (each named, there -> here), or no intact checkpoint of the source's last SFT step.
  """
  src = cfg.run.warm_start_from
  flag = f"--warm_start_from={src!r}"
  if os.path.abspath(src) == os.path.abspath(run_dir):
    raise ConfigError(f"{flag}: that is this run's own directory")
  theirs = rundir.read_config(src) if os.path.isdir(src) else None
  if theirs is None:
    raise ConfigError(f"{flag}: not a run directory (no config.json there)")
  differs = rundir.identity_mismatches(theirs, cfg.to_dict(), WARM_START)
  if differs:
    raise ConfigError(f"{flag}: its warm start is not this run's (there -> here): {'; '.join(differs)}")
  n = cfg.run.sft_steps
  try:
    reader = Checkpointer(os.path.join(src, rundir.RunDir.CHECKPOINTS), read_only=True)
  except FileNotFoundError:
    raise ConfigError(f"{flag}: it holds no checkpoints") from None
  try:
    steps = reader.all_steps()
    meta = reader.read_meta(n) if n in steps else None
  finally:
    reader.close()
  if meta is None or meta["phase"] != "sft" or meta["step"] != n:
    raise ConfigError(
      f"{flag}: no checkpoint of its last SFT step ({n}) there (checkpoints: {steps}); a run keeps it only "
      "until newer ones displace it (--keep_last): take it from a run stopped after its warm start "
      "(--max_steps=0), as the sweep runner does"
    )


def restore_warm_start(cfg: Config, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """The arrays of ``target`` (``params``, ``loop_key``) at the source's last SFT step, and that
  checkpoint's metadata (its data order)."""
  reader = Checkpointer(os.path.join(cfg.run.warm_start_from, rundir.RunDir.CHECKPOINTS), read_only=True)
  try:
    return reader.restore_part(cfg.run.sft_steps, target)
  finally:
    reader.close()
