"""The RL outer loop: sample -> generate -> decode -> reward -> Experience -> learn -> sync -> log -> checkpoint.

Generation is the sampler's jitted program (``rollout/``); the host samples prompts, decodes
completions and computes rewards, and packs one :class:`~mimo_jax.train.learner.Experience`;
everything after that is the learner's one jitted program (``train/learner.py``).  The loop
itself is :func:`train`, and one RL step is :meth:`RLRun.step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import logging
from flax import nnx

from mimo_jax import multihost, sharding
from mimo_jax.ckpt.manager import CheckpointMismatch, abstract_like
from mimo_jax.config import Config, OptimConfig
from mimo_jax.config_base import ConfigError
from mimo_jax.eval.evaluator import default_ks, eval_rows, evaluate_policy
from mimo_jax.models import Transformer, ValueModel, create_sharded, load_hf
from mimo_jax.models.reference import HOST, abstract_reference, make_reference
from mimo_jax.optim import (
  OPTIMIZER_LAYOUT,
  TrainState,
  commit_like_params,
  init_opt_state,
  legacy_abstract_opt_state,
  make_optimizer,
  upgrade_opt_state,
)
from mimo_jax.provenance import provenance
from mimo_jax.rewards.base import CompositeReward, RewardSource
from mimo_jax.rewards.task_rewards import build_task_reward, check_reward_flags, load_json_schema
from mimo_jax.rollout import FINISH_LENGTH, Sampler
from mimo_jax.rollout.encoding import encode_prompts, encode_targets
from mimo_jax.tasks.registry import build_task, check_sandbox, data_counts
from mimo_jax.train import rundir
from mimo_jax.train.alarms import Alarms, alarm_settings
from mimo_jax.train.async_rollout import AsyncRollout
from mimo_jax.train.learner import (
  Experience,
  Faults,
  LearnerState,
  abstract_experience,
  build_learner,
  build_ledger,
  compile_ahead,
  init_controller_state,
  place_experience,
  prompt_sharing_note,
  uses_kl,
)
from mimo_jax.train.logger import MetricsLogger, device_memory, format_progress, histogram_quantiles
from mimo_jax.train.rollout_worker import RolloutWorker, digest, train_pool
from mimo_jax.train.samples import select_samples
from mimo_jax.train.steps import SequenceBatch, make_sft_step
from mimo_jax.train.warm_start import check_source, restore_warm_start, starts_afresh

# A reward source that keeps failing is reported (console and log) at most once in this many RL steps; its
# failures are in every step's reward/<name>_fail_frac.
REWARD_FAILURES_EVERY = 100

PROGRESS_KEYS = ("reward_mean", "accuracy", "kl_k3", "entropy", "clipfrac", "grad_norm", "response_len", "value_loss")


@jax.jit
def _device_copy(params: Any) -> Any:
  """The rollout side's own copy of published weights (the learner donates its buffers into the next step)."""
  return jax.tree.map(jnp.copy, params)


def task_metrics(problems: list[Any], rewards: Any, group_size: int) -> dict[str, float]:
  """A mixture's batch per task: ``task/<name>/share`` (of the prompts), ``/reward_mean`` (raw), ``/accuracy``."""
  names = np.repeat(np.array([p.task for p in problems], dtype=object), group_size)
  out = {}
  for name in dict.fromkeys(names.tolist()):
    rows = names == name
    out[f"task/{name}/share"] = float(rows.mean())
    out[f"task/{name}/reward_mean"] = float(rewards.logged[rows].mean())
    out[f"task/{name}/accuracy"] = float(rewards.correct[rows].mean())
  return out


def sft_optimizer_config(cfg: Config) -> OptimConfig:
  """The supervised warm start's optimizer: ``--sft_learning_rate`` and ``--sft_grad_clip`` on a
  short warm-up and a cosine decay, everything else at its default but the master dtype. It takes
  none of the RL policy's optimizer flags, so a run (or a sweep's coupled point) that changes
  ``--grad_clip``, ``--weight_decay`` or the schedule starts RL from the same warm start."""
  return OptimConfig(
    learning_rate=cfg.optim.sft_learning_rate,
    warmup_steps=min(10, cfg.run.sft_steps // 10),
    grad_clip=cfg.optim.sft_grad_clip,
    master_dtype=cfg.optim.master_dtype,
  )


def resolve_time_split(setting: str, platform: str, devices: int) -> str:
  """``--time_split`` as it runs: ``auto`` is ``measured`` (the score pass its own program, timed alone)
  except on several CPU devices.  There the update program alone starts with collectives that do not
  depend on each other (the policy's parameter gathers, the batch's reward statistics), which XLA:CPU's
  thunk executor may start in different orders on different devices and then deadlock in
  (BUILD_NOTES, the intermittent abort); the one learn program is split by counted FLOPs instead."""
  if setting != "auto":
    return setting
  return "apportioned" if platform == "cpu" and devices > 1 else "measured"


# The evaluation's key stream, apart from the loop's (``RLRun.evaluate``).
_EVAL_STREAM = 0x4556414C


def apportioned_score_time(record: Mapping[str, Any]) -> float:
  """The share of a step's learner time (``time_train_s``) that its counted FLOPs give the score pass
  (behaviour, reference and critic forwards, as in ``Learner.score``): ``--time_split=apportioned``'s
  ``time_score_s``."""
  scored = record["flops_score"] + record["flops_reference"] + record["flops_value"]
  return record["time_train_s"] * scored / max(scored + record["flops_learn"], 1.0)


def _mismatch(run_dir: str, e: CheckpointMismatch) -> CheckpointMismatch:
  """A resume's refusal of an intact checkpoint of another state, with the settings that shape it."""
  return CheckpointMismatch(
    f"--run_dir={run_dir}: {e}. A setting that shapes the trainer's state differs from the run's (its "
    "config.json): --use_value_model, --value_window, --master_dtype (with --param_dtype=bfloat16) or "
    "--reference_dtype. Resume with the run's settings, or start afresh with --overwrite or another --run_dir"
  )


def resolve_run_dir(cfg: Config) -> str:
  if cfg.logging.run_dir:
    return cfg.logging.run_dir
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  return os.path.join("runs", f"{cfg.run.experiment}-{stamp}")


def _reset_optimizer(policy: TrainState) -> TrainState:
  """Fresh Adam moments (and their bias correction); the schedule's position (the count of applied
  updates) and the count of skipped updates carry over.  The learning rate goes on from where it was,
  so the logged one and the LR-linked clip are the one applied (a schedule restarted at 0 ran its
  warm-up again, up to the peak, after a rollback meant to lower it), and the policy's step counter,
  which the logged rate is read at, agrees with it."""
  fresh = init_opt_state(policy.tx, policy.params if policy.master is None else policy.master)
  old = policy.opt_state.inner_state
  inner = fresh.inner_state._replace(
    count=jnp.copy(old.count), hyperparams_states=jax.tree.map(jnp.copy, old.hyperparams_states)
  )
  return policy.replace(opt_state=fresh._replace(inner_state=inner, total_notfinite=policy.opt_state.total_notfinite))


# ----------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Restored:
  """What a resume found: the phase and step to continue from, and the state."""

  phase: str
  step: int
  state: TrainState
  meta: dict[str, Any]


class Preempted(Exception):
  """Raised at a step boundary after SIGTERM (or at ``--stop_at_step``), once the state is checkpointed."""


class RunAborted(RuntimeError):
  """The run cannot go on (e.g. non-finite steps beyond ``--max_rollbacks``); its committed state is intact."""


def build_run_reward(cfg: Config, task: Any, tokenizer: Any, mesh: Any) -> CompositeReward:
  """The run's composite reward: the task's verifier and the components its flags add (format, digits,
  JSON, the hacking probe), with a trained reward model and an LLM judge scoring on ``mesh``.

  The reward model and the judge are collective sources: each runs one program over the mesh's devices,
  so with several processes every host scores the whole batch with them (see
  :meth:`RolloutWorker.reward`). The judge samples from its own key stream, derived from the seed apart
  from the run's other keys.
  """
  d = cfg.data
  extra_sources = []
  if d.reward_model:
    from mimo_jax.rewards.reward_model import RewardModelScorer, load_reward_model

    rm_graphdef, rm_params, rm_cfg = load_reward_model(d.reward_model, mesh)
    if rm_cfg.vocab_size < tokenizer.vocab_size:
      raise ConfigError(
        f"--reward_model={d.reward_model}: its vocabulary ({rm_cfg.vocab_size}) is smaller than this run's "
        f"tokenizer ({tokenizer.vocab_size}); train it with this run's task and tokenizer flags"
      )
    scorer = RewardModelScorer(
      rm_graphdef,
      rm_params,
      tokenizer,
      mesh=mesh,
      buckets=cfg.rollout.buckets,
      max_completion_len=cfg.rollout.max_new_tokens,
      batch_rows=cfg.data.prompts_per_step * cfg.rollout.num_samples,
    )
    extra_sources.append(
      RewardSource("reward_model", scorer, weight=d.reward_model_weight, batched=True, collective=True)
    )
  if d.judge_checkpoint:
    from mimo_jax.rewards.judge import load_judge

    judge = load_judge(
      d.judge_checkpoint,
      mode=d.judge_mode,
      num_samples=d.judge_samples,
      max_new_tokens=d.judge_max_new_tokens,
      temperature=d.judge_temperature,
      key=jax.random.fold_in(jax.random.key(cfg.run.seed), 0x4A554447),
      mesh=mesh,
    )
    extra_sources.append(RewardSource("judge", judge, weight=d.judge_weight, batched=True, collective=True))
  json_on = d.json_reward_weight > 0 or bool(d.json_schema)
  return build_task_reward(
    task,
    extra_sources=extra_sources,
    workers=d.reward_workers,
    timeout_s=d.reward_timeout_s,
    normalize=d.reward_normalization,
    format_weight=d.format_reward_weight,
    digit_weight=d.digit_reward_weight,
    hacking_probe=d.reward_hacking_probe,
    json_weight=d.json_reward_weight if json_on else None,
    json_schema=load_json_schema(d.json_schema),
  )


class RLRun:
  """Holds the mesh, model, sampler, jitted steps, data streams and checkpoints of one run.

  Every piece of state that a step reads or writes lives either in the ``LearnerState``
  (arrays) or in the rollout worker's host state (the loop key's data, the data RNG, the
  curriculum, the batch records), and all of it goes into each checkpoint, so a resumed run
  is bit-identical to an uninterrupted one.
  """

  def __init__(self, cfg: Config, run_dir: str, *, rollout_factory=None):
    """Args:
    cfg: the configuration.
    run_dir: the run directory.
    rollout_factory: ``(model, mesh) -> rollout`` to replace the :class:`Sampler`
      (e.g. ``mimo_jax.testing.FakeRollout`` in tests).
    """
    self.cfg = cfg
    self.run_dir = run_dir
    self.dir = rundir.RunDir(run_dir, writer=multihost.is_primary())  # every file of the run goes through it
    # One global mesh; with --rollout_devices its first K devices form the rollout sub-mesh and the
    # learner's mesh (the mesh flags) spans the rest.
    self.mesh, self.rollout_mesh = sharding.run_meshes(cfg.mesh, cfg.rollout.rollout_devices)
    check_reward_flags(cfg.data)
    self.task, self.tokenizer = build_task(cfg.data, seed=cfg.run.seed, hf_checkpoint=cfg.model.hf_checkpoint)
    # The isolation untrusted code runs under (build_task enforced the policy; None: the task runs no
    # code), recorded in config.json and summary.json.
    self.sandbox = check_sandbox(cfg.data)
    # The finite prompt set of --train_prompts / --data_order (checked against the task before any compute).
    pool = train_pool(self.task, cfg.data, cfg.run.seed)
    self.buckets = cfg.rollout.buckets
    loop_key, init_key, self._sft_key, self._rl_key = jax.random.split(jax.random.key(cfg.run.seed), 4)
    if cfg.model.hf_checkpoint:
      overrides = {"remat": cfg.model.remat} if cfg.model.remat else {}
      model = load_hf(
        cfg.model.hf_checkpoint,
        mesh=self.mesh,
        dtype=cfg.model.param_dtype or "float32",
        compute_dtype=cfg.model.compute_dtype or None,
        config_overrides=overrides,
      )
      if model.config.vocab_size < self.tokenizer.vocab_size:
        raise ConfigError(
          f"--tokenizer_path: the tokenizer has {self.tokenizer.vocab_size} tokens but the checkpoint's "
          f"vocabulary is {model.config.vocab_size}"
        )
    else:
      vocab = cfg.model.vocab_for(self.tokenizer.vocab_size)
      model_cfg = cfg.model.model_config().replace(vocab_size=vocab)
      seed = int(jax.random.randint(init_key, (), 0, 2**31 - 1))
      model = create_sharded(lambda: Transformer(model_cfg, rngs=nnx.Rngs(seed)), self.mesh)
    self.model_cfg = model.config
    self.graphdef, self._init_params = nnx.split(model)
    rewarder = build_run_reward(cfg, self.task, self.tokenizer, self.mesh)
    self.heldout = self.task.heldout()[: cfg.data.eval_prompts]
    unrolled, shared = cfg.rollout.unrolled_decode, cfg.rollout.share_prompt_cache
    factory = rollout_factory or (
      lambda model, mesh: Sampler(model, mesh=mesh, unrolled_decode=unrolled, share_prompt_cache=shared)
    )
    self._generation_shardings = None
    if self.rollout_mesh is not None:
      self._generation_shardings = sharding.generation_shardings(self._init_params, self.rollout_mesh)
    sampler = factory(nnx.merge(self.graphdef, self.rollout_params(self._init_params)), self.rollout_mesh or self.mesh)
    # ---- the rollout side: prompts -> generation -> rewards -> Experience (host state only)
    self.worker = RolloutWorker(cfg, self.task, self.tokenizer, sampler, rewarder, loop_key, pool=pool)
    # Async rollout: a producer owns the worker and runs up to --max_staleness versions ahead; a thread of
    # its own in one process, the learner's thread with several (every host issues its programs, and so
    # its collectives, in one order).
    self.rollout: AsyncRollout | None = None
    if cfg.rollout.async_rollout:
      self.rollout = AsyncRollout(
        self.worker,
        max_staleness=cfg.rollout.staleness,
        to_rollout=_device_copy if self.rollout_mesh is None else self.rollout_params,
        end=cfg.run.max_steps,
        threaded=not multihost.multi_process(),
      )
    shards = sampler.batch_shards
    # Evaluation batches: a fixed number of prompts per call, a multiple of the batch shards.
    self.eval_rows = eval_rows(len(self.heldout), shards)

    # ---- optimizers and jitted steps
    self.sft_tx, self.sft_schedule = make_optimizer(sft_optimizer_config(cfg), max(cfg.run.sft_steps, 1))
    self.sft_step_fn = make_sft_step(self.mesh)
    self.master = cfg.optim.master_dtype
    # ---- the learner: score, advantages, policy and critic updates, controllers in one program
    self.use_kl = uses_kl(cfg)
    self.use_value = cfg.algo.use_value_model
    self.value_graphdef = None
    if self.use_value:
      value_model = create_sharded(lambda: ValueModel(self.model_cfg, rngs=nnx.Rngs(0)), self.mesh)
      self.value_graphdef, self._value_init_params = nnx.split(value_model)
    self.learner = build_learner(cfg, self.mesh, self.graphdef, self.value_graphdef)
    if note := prompt_sharing_note(cfg, self.mesh):
      logging.warning(note)
    self.rl_tx, self.lr_schedule = self.learner.tx, self.learner.schedule
    # ---- failure-shape alarms over the logged records (state checkpointed with the run)
    self.alarms = Alarms(alarm_settings(cfg.logging))
    self.alarm_rollbacks = 0
    # ---- the compute ledger: FLOPs and device-seconds by phase, totals checkpointed with the run
    self.ledger = build_ledger(
      cfg, self.mesh, self.model_cfg, rollout_devices=(self.rollout_mesh or self.mesh).devices.size
    )

    # ---- checkpoints, logs, host-side bookkeeping
    ck = cfg.checkpoint
    self.ckpt = self.dir.checkpointer(
      keep_last=ck.keep_last,
      keep_every=ck.keep_every,
      rl_start=self.global_step("rl", 0),
      async_save=ck.async_save,
    )
    self.ref_ckpt = self.dir.reference_checkpointer()
    self.logger: MetricsLogger | None = None
    self.bad_steps = 0
    self.rollbacks = 0
    self.reward_failures_reported: dict[str, int] = {}  # source -> the RL step it was last reported at
    self.nonfinite_steps = 0
    self.last_good_step = 0
    self.preempt_requested = False
    self.last_checkpoint_s = 0.0
    self.best_value: float | None = None  # --keep_best: read from best/ when first needed
    self.best_ckpt = None
    self.nan_steps = set(cfg.run.debug_nan_steps)
    self.spike_steps = set(cfg.run.debug_lr_spike_steps)
    self.time_split = resolve_time_split(cfg.logging.time_split, sharding.mesh_platform(self.mesh), self.mesh.size)
    # --compile_ahead: the learner's programs compile in a thread while this process's first rollout
    # generates (set up by the first RL step; joined before the first learner call).
    self._ahead_pending = cfg.run.compile_ahead
    self._ahead: threading.Thread | None = None
    self._ahead_error: BaseException | None = None

  def rollout_params(self, params: Any) -> Any:
    """``params`` where the sampler reads them: the live learner weights on a shared mesh, or their copy on
    the rollout sub-mesh in the generation layout (moved device to device, never through the host)."""
    if self._generation_shardings is None:
      return params
    return jax.device_put(params, self._generation_shardings)

  def to_learner(self, exp: Experience) -> Experience:
    """An Experience in the learner's input layout (rows over the learner mesh's batch shards), wherever
    the rollout left it: on a rollout sub-mesh, or on the shared mesh in its generate program's layout."""
    return place_experience(exp, self.mesh)

  def _start_compile_ahead(self, state: LearnerState) -> None:
    """Arms the worker: once the first rollout's prompts are padded (the batch's shapes are known), the
    learner's programs for them compile in a thread, beside the generate program's own compilation and
    run.  What it compiles lands in the programs' jit caches; a batch of other shapes (a wider dynamic-
    sampling round) just compiles at its call, as without it."""
    abstract = abstract_like(state)
    G, M = self.cfg.rollout.num_samples, self.cfg.rollout.max_new_tokens
    names = self.worker.rewarder.names

    def work(prompt_len: int) -> None:
      try:
        exp = abstract_experience(
          self.mesh, rows=self.worker.rows * G, prompt_len=prompt_len, completion_len=M, reward_names=names
        )
        compile_ahead(self.learner, abstract, exp, split=self.time_split == "measured")
      except BaseException as e:  # the call compiles (and raises) it again
        self._ahead_error = e

    def start(prompt_len: int) -> None:
      self._ahead = threading.Thread(target=work, args=(prompt_len,), name="compile-ahead", daemon=True)
      self._ahead.start()

    self.worker.on_prompt_length = start

  def _join_compile_ahead(self) -> None:
    """Waits for the ahead compilation (a second compilation of the same program would only add to it)."""
    self.worker.on_prompt_length = None
    if self._ahead is not None:
      self._ahead.join()
      self._ahead = None
      if self._ahead_error is not None:
        logging.warning("compiling the learner ahead failed (it compiles at its first call): %r", self._ahead_error)
        self._ahead_error = None

  @property
  def sampler(self) -> Any:
    """The rollout side's generator (also used for evaluation)."""
    return self.worker.sampler

  @property
  def data_rng(self) -> np.random.Generator:
    """The training prompts' RNG (rollout-side host state)."""
    return self.worker.data_rng

  # ------------------------------------------------------------------ states and checkpoints

  def fresh_state(self, phase: str, params=None) -> TrainState | LearnerState:
    """A new state for ``phase`` from ``params`` (initial weights by default): the SFT ``TrainState``,
    or the RL ``LearnerState`` (policy, controllers, critic; the reference is set by :meth:`begin_rl`)."""
    params = self._init_params if params is None else params
    if phase == "sft":
      return TrainState.create(nnx.merge(self.graphdef, params), self.sft_tx, self._sft_key, master_dtype=self.master)
    policy = TrainState.create(nnx.merge(self.graphdef, params), self.rl_tx, self._rl_key, master_dtype=self.master)
    controllers = commit_like_params(init_controller_state(self.cfg), params)
    value = self.fresh_value_state(params) if self.use_value else None
    return LearnerState(policy=policy, controllers=controllers, value=value)

  def fresh_value_state(self, policy_params) -> TrainState:
    """The value model's state at RL step 0: the policy's backbone, a zero head, a fresh optimizer."""
    value_params = jax.tree.map(jnp.copy, self._value_init_params)
    value_params["decoder"] = jax.tree.map(jnp.copy, policy_params["decoder"])
    key = jax.random.fold_in(self._rl_key, 1)
    return TrainState.create(
      nnx.merge(self.value_graphdef, value_params), self.learner.value_tx, key, master_dtype=self.master
    )

  @staticmethod
  def _state_tree(state: TrainState) -> dict[str, Any]:
    tree = {
      "params": state.params,
      "opt_state": state.opt_state,
      "step": state.step,
      "lr_scale": state.lr_scale,
      "rng": jax.random.key_data(state.rng),
    }
    if state.master is not None:
      tree["master"] = state.master
    return tree

  @staticmethod
  def _state_from_tree(template: TrainState, tree: dict[str, Any]) -> TrainState:
    opt_state = tree["opt_state"]
    if "skipped" in tree:  # optimizer layout 1 (see _legacy_target)
      target = tree.get("master", tree["params"])
      opt_state = upgrade_opt_state(template.tx, target, opt_state, tree["skipped"])
    return template.replace(
      params=tree["params"],
      opt_state=opt_state,
      step=tree["step"],
      lr_scale=tree["lr_scale"],
      rng=jax.random.wrap_key_data(tree["rng"]),
      master=tree.get("master"),
    )

  def _target(self, template: TrainState | LearnerState, meta: dict[str, Any]) -> dict[str, Any]:
    """The restore target of a checkpoint with metadata ``meta``, in the optimizer layout it was written in."""
    tree = self._tree(template)
    if meta.get("optimizer_layout", 1) == 1:
      tree = self._legacy_target(template, tree, meta["phase"])
    return abstract_like(tree, self.mesh)

  def _legacy_target(self, template: TrainState | LearnerState, tree: dict[str, Any], phase: str) -> dict[str, Any]:
    """Optimizer layout 1 (checkpoints of earlier releases): each optimizer state is the bare optax chain's,
    with the skip counter beside it; ``_state_from_tree`` upgrades it."""

    def legacy(state: TrainState, sub: dict[str, Any], clip: bool) -> dict[str, Any]:
      target = state.params if state.master is None else state.master
      return {**sub, "opt_state": legacy_abstract_opt_state(target, clip=clip), "skipped": state.step}

    clip = self.cfg.optim.grad_clip > 0
    if not isinstance(template, LearnerState):
      return legacy(template, tree, clip=clip and phase == "sft")
    tree = legacy(template.policy, tree, clip=False)  # the RL policy's clip was applied outside its chain
    if "value" in tree:
      tree["value"] = legacy(template.value, tree["value"], clip=clip)
    return tree

  def _tree(self, state: TrainState | LearnerState, loop_key: np.ndarray | None = None) -> dict[str, Any]:
    """The checkpointed arrays: the policy state, the controllers and the critic's state (RL), the loop key
    (``loop_key``, default the worker's own).

    The frozen reference is saved once, beside (``<run_dir>/reference``)."""
    if isinstance(state, LearnerState):
      tree = {**self._state_tree(state.policy), "controllers": state.controllers}
      if state.value is not None:
        tree["value"] = self._state_tree(state.value)
    else:
      tree = self._state_tree(state)
    return {**tree, "loop_key": self.worker.key_data if loop_key is None else loop_key}

  def _from_tree(self, template: TrainState | LearnerState, tree: dict[str, Any]) -> TrainState | LearnerState:
    self.worker.load_host_state(loop_key=np.asarray(tree["loop_key"]))
    if not isinstance(template, LearnerState):
      return self._state_from_tree(template, tree)
    value = template.value
    if "value" in tree:
      value = self._state_from_tree(template.value, tree["value"])
    policy = self._state_from_tree(template.policy, tree)
    return template.replace(policy=policy, controllers=tree["controllers"], value=value)

  def _rollout_state(self, phase: str, step: int) -> dict[str, Any]:
    """The rollout side's host state a checkpoint of ``(phase, step)`` keeps.

    While the async producer runs it is ahead of the learner: the state is its record from before
    batch ``step`` (the oldest one not yet trained on), and later batches are pending.
    """
    if self.rollout is not None and self.rollout.running and phase == "rl":
      return self.rollout.record_before(step)
    return self.worker.host_state(with_data=True)

  def _meta(
    self, phase: str, step: int, log_step: int, *, policy_version: int, rollout: dict[str, Any] | None
  ) -> dict[str, Any]:
    """Checkpoint metadata (``checkpoints_schema/checkpoint_meta.v2.json``); ``rollout`` None: without the
    rollout side's data state (the reference's metadata)."""
    with_data = rollout is not None
    rollout = rollout if rollout is not None else self.worker.host_state(with_data=False)
    pending = []
    if with_data and phase == "rl" and self.rollout is not None and self.rollout.running:
      pending = self.rollout.pending(step)
    return {
      "phase": phase,
      "step": step,
      "log_step": log_step,
      "optimizer_layout": OPTIMIZER_LAYOUT,
      "created_unix": time.time(),
      "config_digest": self._config_digest(),
      "model_config": json.loads(json.dumps(dataclasses.asdict(self.model_cfg))),
      "data_rng": rollout["data_rng"],
      "controllers": {
        "bad_steps": self.bad_steps,
        "rollbacks": self.rollbacks,
        "nonfinite_steps": self.nonfinite_steps,
        "last_good_step": self.last_good_step,
        "prompt_sampler": rollout["prompt_sampler"],
        "prompt_stream": rollout["prompt_stream"],
        "reward": rollout["reward"],
        "ledger": self.ledger.state_dict(),
        "alarms": self.alarms.state_dict(),
        "alarm_rollbacks": self.alarm_rollbacks,
        # The batch from which a reward-jitter alarm broke the fixed prompt order (None: never).
        "reshuffle_at": self.worker.reshuffle_at,
      },
      "buffer": {
        "next_batch_id": step if phase == "rl" else 0,
        "policy_version": policy_version,
        "sampling_params_version": self.worker.sampling_version,
        "batches": (rollout["batches"] + [self._pending_record(b) for b in pending]) if phase == "rl" else [],
        # Generated (or being generated) but not trained on: regenerated from this checkpoint's rollout
        # state on a resume (``train/async_rollout.py``). Always empty for a synchronous run.
        "pending": pending,
      },
    }

  def _config_digest(self) -> str:
    """The digest of the settings a resume warns about when they changed: all but where this command runs
    or stops (``rundir.NOT_SETTINGS``: the sweep's gate stops every point's run with ``--stop_at_step``,
    then goes on without it, and each resume warned of a changed configuration; so did a run directory
    moved elsewhere)."""
    settings = self.cfg.to_dict()
    for section, values in settings.items():
      settings[section] = {k: v for k, v in values.items() if k not in rundir.NOT_SETTINGS}
    return digest(settings)

  def _pending_record(self, batch_id: int) -> dict[str, Any]:
    return {
      "batch_id": batch_id,
      "policy_version": self.rollout.version_for(batch_id),
      "sampling_params_version": self.worker.sampling_version,
      "status": "pending",
    }

  def save(
    self,
    phase: str,
    step: int,
    state: TrainState,
    log_step: int,
    warm: dict | None = None,
    log_record: dict[str, Any] | None = None,
  ) -> None:
    """Commits the whole run state as checkpoint ``global_step(phase, step)``; ``log_record``: the
    record and samples of step ``log_step`` when they are logged after the save."""
    t0 = time.perf_counter()
    rollout = self._rollout_state(phase, step)
    meta = self._meta(phase, step, log_step, policy_version=int(state.step) if phase == "rl" else 0, rollout=rollout)
    if warm is not None:
      meta["warm_start"] = warm
    if log_record is not None:
      meta["log_record"] = log_record
    self.ckpt.save(self.global_step(phase, step), self._tree(state, rollout["loop_key"]), meta)
    self.last_checkpoint_s = time.perf_counter() - t0

  def keep_if_best(self, step: int, state: LearnerState, log_step: int, evaluation: dict[str, float], warm) -> None:
    """``--keep_best``: saves the state into ``best/`` when this evaluation's metric beats every earlier one
    (the value travels in that checkpoint's metadata, so a resume compares against it)."""
    metric = self.cfg.checkpoint.keep_best
    if not metric or metric not in evaluation:
      return
    value = float(evaluation[metric])
    if self.best_value is None:
      self.best_ckpt = self.dir.best_checkpointer()
      steps = self.best_ckpt.all_steps()
      self.best_value = self.best_ckpt.read_meta(steps[-1])["best"]["value"] if steps else -float("inf")
    if not value > self.best_value:
      return
    rollout = self._rollout_state("rl", step)
    meta = self._meta("rl", step, log_step, policy_version=int(state.step), rollout=rollout)
    meta.update(warm_start=warm, best={"metric": metric, "value": value})
    self.best_ckpt.save(self.global_step("rl", step), self._tree(state, rollout["loop_key"]), meta)
    self.best_value = value
    print(f"best {metric} so far: {value:.4g} at RL step {step}; kept in {self.dir.file(self.dir.BEST)}", flush=True)

  def global_step(self, phase: str, step: int) -> int:
    """One increasing step axis for checkpoints: SFT steps first, then RL steps."""
    return step if phase == "sft" else self.cfg.run.sft_steps + 1 + step

  def restore(self) -> Restored | None:
    """Finds the checkpoint to continue from (``--rollback_to`` or the latest intact one)."""
    ck = self.cfg.checkpoint
    if not (ck.resume or ck.rollback_to >= 0) or not self.ckpt.all_steps():
      return None
    at_most = None if ck.rollback_to < 0 else self.global_step("rl", ck.rollback_to)
    templates = {}

    def target(meta):
      phase = meta["phase"]
      if phase not in templates:
        templates[phase] = self.fresh_state(phase)
      return self._target(templates[phase], meta)

    try:
      found = self.ckpt.restore_latest(target, at_most=at_most)
    except CheckpointMismatch as e:
      raise _mismatch(self.run_dir, e) from None
    if found is None:
      # Starting afresh in place would overwrite the run's logs and its checkpoints' step numbers.
      raise ConfigError(
        f"--run_dir={self.run_dir}: checkpoints exist (steps {self.ckpt.all_steps()}) but none restores "
        "(corrupted, or written by another model); pass --overwrite to start afresh in this directory, or "
        "choose another --run_dir"
      )
    gstep, tree, meta = found
    if ck.rollback_to >= 0:
      if meta["phase"] != "rl" or meta["step"] != ck.rollback_to:
        raise ConfigError(
          f"--rollback_to={ck.rollback_to}: no intact RL checkpoint at that step (available RL steps: "
          f"{[s - self.cfg.run.sft_steps - 1 for s in self.ckpt.all_steps() if s > self.cfg.run.sft_steps]})"
        )
      self.ckpt.delete_after(gstep)
    if meta["config_digest"] != self._config_digest():
      # The run's config.json is still the last start's here (rewritten once the resume is settled).
      previous = self.dir.read_config() if multihost.is_primary() else None
      changes = rundir.setting_changes(previous, self.cfg.to_dict()) if previous else []
      print(
        "warning: resuming with a configuration that differs from the checkpoint's"
        + (f": {'; '.join(changes)}" if changes else ""),
        flush=True,
      )
    state = self._from_tree(templates[meta["phase"]], tree)
    ctl = meta.get("controllers", {})
    self.bad_steps, self.rollbacks = ctl.get("bad_steps", 0), ctl.get("rollbacks", 0)
    self.nonfinite_steps = ctl.get("nonfinite_steps", 0)
    self.last_good_step = ctl.get("last_good_step", meta["step"])
    self.ledger.load_state_dict(ctl.get("ledger"))
    self.alarms.load_state_dict(ctl.get("alarms"))
    self.alarm_rollbacks = ctl.get("alarm_rollbacks", 0)
    self._restore_rollout_side(meta)
    # A resumed run breaks the fixed order at the very batch the run did (async: a batch the checkpoint
    # keeps as pending, made again after the resume, may still come before it).
    self.worker.reshuffle_at = ctl.get("reshuffle_at")
    if meta["phase"] == "rl":
      state = self._restore_reference(state)
      if ck.rollback_to >= 0 and ck.rollback_reset_optimizer:
        state = state.replace(policy=_reset_optimizer(state.policy))
    self.worker.update_params(self.rollout_params(state.params))
    what = "rolled back to" if ck.rollback_to >= 0 else "resumed from"
    print(f"{what} {meta['phase']} step {meta['step']} (checkpoint {gstep})", flush=True)
    return Restored(phase=meta["phase"], step=meta["step"], state=state, meta=meta)

  def _restore_rollout_side(self, meta: dict[str, Any]) -> None:
    """The rollout side's host state saved in the metadata: the data RNG, the curriculum's pool and
    estimates, the prompt order's position, the reward normaliser, the batch records (the key came back
    with the arrays)."""
    ctl = meta.get("controllers", {})
    self.worker.load_host_state(
      data_rng=meta["data_rng"],
      prompt_sampler=ctl.get("prompt_sampler"),
      prompt_stream=ctl.get("prompt_stream"),
      reward=ctl.get("reward"),
      # Pending batches (async rollout) are regenerated; only the consumed ones are history.
      batches=[b for b in meta["buffer"]["batches"] if b.get("status", "consumed") == "consumed"],
    )
    at = self.worker.reshuffle_at
    if at is not None:  # a reward-jitter intervention stays in effect through any later rollback: from now on
      self.worker.reshuffle_at = min(at, meta["buffer"]["next_batch_id"])
      self.worker.reshuffle()

  def _restore_reference(self, state: LearnerState) -> LearnerState:
    if not self.use_kl:
      return state
    target = abstract_reference(abstract_like(state.params, self.mesh), dtype=self.cfg.algo.reference_dtype)
    try:
      found = self.ref_ckpt.restore_latest({"params": target})
    except CheckpointMismatch as e:
      raise _mismatch(self.run_dir, e) from None
    if found is None:
      raise RuntimeError(f"{self.run_dir}/reference: the frozen reference policy is missing or corrupted")
    return state.replace(reference=self._place_reference(found[1]["params"]))

  def _place_reference(self, reference: Any) -> Any:
    """The reference where it lives between score passes: device memory, or host with --reference_offload."""
    if self.cfg.algo.reference_offload != "host":
      return reference
    return jax.device_put(reference, jax.tree.map(lambda x: x.sharding.with_memory_kind(HOST), reference))

  def open_logger(self, restored: Restored | None) -> None:
    keep = None if restored is None else restored.meta["log_step"]
    if restored is not None and restored.phase == "rl" and restored.step < self.cfg.run.max_steps:
      # A finished run's final checkpoint, continued to a larger --max_steps: its final evaluation's
      # record (log step old max_steps + 1) gives way to the next RL step's.
      keep = min(keep, restored.step)
    sink = None
    lg = self.cfg.logging
    if lg.wandb_project and multihost.is_primary():
      from mimo_jax.train.wandb_sink import open_wandb

      sink = open_wandb(
        self.run_dir,
        project=lg.wandb_project,
        mode=lg.wandb_mode,
        config=self.cfg.to_dict(),
        name=os.path.basename(os.path.normpath(self.run_dir)),
      )
    self.logger = self.dir.logger(tensorboard=lg.tensorboard, keep_through=keep, wandb=sink)
    pending = (restored.meta.get("log_record") if restored is not None else None) or {}
    if pending and self.logger.last_step < pending["record"]["step"] <= keep:
      # Killed after the save and before its step was logged: the checkpoint holds the record (the
      # save's own time is unknown there).
      record = {**pending["record"], "time_checkpoint_s": None}
      self.logger.write_record(record, None, pending["samples"])
      self.logger.write_quantiles(record["step"], pending.get("histograms") or {})

  def request_preemption(self, *_):
    self.preempt_requested = True

  def request_interrupt(self, *_):
    """A multi-process run's first Ctrl-C on one host: a preemption, so every process saves at the same
    step boundary (a KeyboardInterrupt in one process left the others waiting in a collective); a
    second one interrupts at once."""
    self.preempt_requested = True
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("interrupted: saving at the next step boundary (Ctrl-C again to stop at once)", flush=True)

  def should_stop(self) -> bool:
    """Whether every host saw SIGTERM-driven preemption (all hosts agree on the step)."""
    return multihost.any_process(self.preempt_requested)

  def close(self) -> None:
    if self.rollout is not None:
      self.rollout.stop()
    self._join_compile_ahead()
    self.worker.rewarder.close()
    self.ckpt.close()
    self.ref_ckpt.close()
    if self.best_ckpt is not None:
      self.best_ckpt.close()
    if self.logger is not None:
      self.logger.close()

  # ------------------------------------------------------------------ SFT

  def sft(self, state: TrainState, start: int) -> TrainState:
    """Supervised warm start from SFT step ``start``; checkpointed; returns the final state."""
    cfg = self.cfg
    n = cfg.run.sft_steps
    M = cfg.rollout.max_new_tokens
    bar = tqdm.trange(
      start, n, desc="sft", leave=False, mininterval=1.0, initial=start, total=n, disable=not multihost.is_primary()
    )
    cut = np.zeros(2, np.int64)  # prompts and targets cut since the last logged step
    warned = False
    for i in bar:
      easiest = i < cfg.run.sft_curriculum_steps  # the easiest difficulty level first
      examples = self.task.sft_examples(self.data_rng, cfg.data.sft_batch_size, easiest=easiest)
      p_tok, p_mask, p_cut = encode_prompts(self.tokenizer, [e[0] for e in examples], self.buckets)
      c_tok, c_mask, c_cut = encode_targets(self.tokenizer, [e[1] for e in examples], M)
      cut += (p_cut, c_cut)
      if c_cut and not warned and multihost.is_primary():
        warned = True
        print(
          f"warning: {c_cut} of {len(examples)} supervised targets at SFT step {i + 1} are longer than "
          f"--max_new_tokens={M} tokens and are cut: their end (the final answer) is not learned; a larger "
          "--max_new_tokens keeps them whole (sft_target_truncated counts them)",
          flush=True,
        )
      batch = SequenceBatch(*(jnp.asarray(x) for x in (p_tok, p_mask, c_tok, c_mask)))
      state, metrics = self.sft_step_fn(state, batch)
      done = i + 1
      log_step = done - n - 1
      if done % 25 == 0 or done == n:
        m = multihost.to_host(metrics)
        bar.set_postfix(loss=f"{float(m['sft_loss']):.3f}")
        record = {"sft_loss": m["sft_loss"], "lr": self.sft_schedule(i)}
        record.update(sft_prompt_truncated=int(cut[0]), sft_target_truncated=int(cut[1]))
        self.logger.log(log_step, record)
        cut[:] = 0
      every = cfg.checkpoint.checkpoint_every
      stop = self.should_stop()
      if done == n or (every and done % every == 0) or stop:
        self.save("sft", done, state, log_step)
      if stop and done < n:
        raise Preempted(f"sft step {done}")
    return state

  def take_warm_start(self) -> Any:
    """``--warm_start_from``: the weights of the source run's last SFT step, with the loop key and the data
    order it left (what this run's own warm start would have left: the settings were checked equal);
    returns the weights."""
    src, n = self.cfg.run.warm_start_from, self.cfg.run.sft_steps
    target = abstract_like({"params": self._init_params, "loop_key": self.worker.key_data}, self.mesh)
    tree, meta = restore_warm_start(self.cfg, target)
    self.worker.load_host_state(loop_key=np.asarray(tree["loop_key"]), data_rng=meta["data_rng"])
    print(f"warm start taken from {src} (its SFT step {n}); no SFT of its own", flush=True)
    return tree["params"]

  # ------------------------------------------------------------------ evaluation

  def evaluate(self, params, step: int) -> dict[str, float]:
    """Greedy accuracy, unbiased pass@k (k = 1, 8, ..., ``--eval_samples``) and maj@k on the held-out prompts,
    at the logged RL ``step``.

    Its key is the run seed's evaluation key folded with ``step``, never a draw from the loop's stream:
    how often a run evaluates changes nothing it trains on (drawn from the loop stream, every evaluation
    moved every later rollout's keys)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.run.seed), _EVAL_STREAM), step)
    producer = self.rollout is not None and self.rollout.running
    with self.rollout.paused() if producer else contextlib.nullcontext():  # the producer shares the sampler
      return self._evaluate(self.rollout_params(params), key)

  def _evaluate(self, params, eval_key: jax.Array) -> dict[str, float]:
    cfg = self.cfg
    return evaluate_policy(
      self.sampler,
      params,
      self.task,
      self.tokenizer,
      self.heldout,
      buckets=self.buckets,
      rows=self.eval_rows,
      max_new_tokens=cfg.rollout.max_new_tokens,
      sampling=self.worker.sampling,
      num_samples=cfg.run.eval_samples,
      ks=default_ks(cfg.run.eval_samples),
      temperature=cfg.run.eval_temperature,
      key=eval_key,
    )

  # ------------------------------------------------------------------ RL

  def begin_rl(self, params, warm: dict[str, float]) -> LearnerState:
    """The SFT -> RL transition: freeze the reference, build the RL state, checkpoint step 0."""
    state = self.fresh_state("rl", params)
    if self.use_kl:
      # The frozen reference: a copy of the warm-started weights, never updated (in device memory as
      # --reference_dtype stores it; moved to host memory after the save with --reference_offload=host).
      a = self.cfg.algo
      if a.reference_dtype:
        reference = make_reference(state.params, dtype=a.reference_dtype)
      else:
        reference = jax.tree.map(jnp.copy, state.params)
      # A reference left by a transition that was killed before RL step 0 committed is
      # rewritten (it is the same warm-started weights).
      self.ref_ckpt.delete_after(-1)
      self.ref_ckpt.save(0, {"params": reference}, self._meta("rl", 0, 0, policy_version=0, rollout=None))
      self.ref_ckpt.wait()
      state = state.replace(reference=self._place_reference(reference))
    self.worker.update_params(self.rollout_params(state.params))
    self.save("rl", 0, state, 0, warm)
    return state

  def step(self, state: LearnerState, step: int) -> tuple[LearnerState, tuple[dict[str, Any], dict[str, Any]]]:
    """One RL step: rollout (generate -> decode -> reward) -> Experience -> learn (one program) -> sync.

    Returns the new state, the metrics record, the histograms and the sample-replay rows.
    """
    cfg = self.cfg
    t0 = time.perf_counter()
    if self._ahead_pending:
      self._ahead_pending = False
      self._start_compile_ahead(state)
    # ---- rollout: generate -> decode -> reward (host), with dynamic sampling when on. Versions count
    # RL steps: the policy entering step ``step`` is version ``step``.
    if self.rollout is None:
      batch = self.worker.produce(step, step)
    else:
      if self.rollout.running:
        self.rollout.publish(step, state.params)
      else:  # the first RL step of this process, or the first after a rollback
        self.rollout.start(step, step, state.params)
      idle0 = self.rollout.rollout_idle_s
      batch = self.rollout.get(step)
    rollout, rewards, gen_stats, temperature = batch.rollout, batch.rewards, batch.stats, batch.temperature
    self.report_reward_failures(step, rewards.batch)
    jax.block_until_ready(rollout)
    t1 = time.perf_counter()
    # ---- learn: score -> advantages -> policy update -> critic passes -> controllers (state donated)
    # Fault injection (--debug_nan_steps: NaN advantages on row 0; --debug_lr_spike_steps: the learning rate
    # times --debug_lr_spike_factor), once per listed step: a step redone after a rollback runs normally.
    faults = Faults.of(
      nan_advantages=step in self.nan_steps,
      lr_mult=self.cfg.run.debug_lr_spike_factor if step + 1 in self.spike_steps else 1.0,  # logged steps
    )
    self.nan_steps.discard(step)
    self.spike_steps.discard(step + 1)
    exp = self.to_learner(batch.experience)
    self._join_compile_ahead()
    if self.time_split == "measured":  # two programs, the score pass timed alone
      scores = jax.block_until_ready(self.learner.score(state, exp))
      t_scored = time.perf_counter()
      state, metrics = self.learner.update(state, exp, scores, jnp.int32(step), faults)
    else:
      state, metrics = self.learner.learn(state, exp, jnp.int32(step), faults)
    if self.rollout is None:
      self.worker.update_params(state.params)
    metrics, lengths, finish, prompt_mask = multihost.to_host(
      (metrics, rollout.lengths, rollout.finish_reason, rollout.prompt_mask)
    )
    t2 = time.perf_counter()
    if self.rollout is not None:
      # An in-line producer (several processes) makes the batches the published versions admit now, after
      # the step's own timing: their time is theirs (time_produce_s travels with each batch).
      self.rollout.produce_ahead()
    kl_per_seq = metrics.pop("kl_per_seq", None)
    samples = select_samples(
      batch,
      cfg.logging.log_samples,
      step=step + 1,
      group_size=cfg.rollout.num_samples,
      lengths=lengths,
      finish=finish,
      tokenizer=self.tokenizer,
      kl_per_seq=kl_per_seq,
    )
    if self.rollout is None or not self.rollout.threaded:
      # Each side waits for the other the whole time the other runs (the in-line producer of several
      # processes makes its batches between the learner's steps).
      queue = 0.0 if self.rollout is None else float(self.rollout.queue_len())
      idle = {"time_learner_idle_s": t1 - t0, "time_rollout_idle_s": t2 - t1, "queue_len": queue}
    else:
      idle = {
        "time_learner_idle_s": t1 - t0,
        "time_rollout_idle_s": self.rollout.rollout_idle_s - idle0,
        "queue_len": float(self.rollout.queue_len()),
      }
    coefs, ctl = metrics["coefs"], metrics["controllers"]
    train_metrics = {} if step < cfg.algo.value_warmup_steps else metrics["train"]
    value_metrics = dict(metrics["value"])
    if "value_passes" in value_metrics:
      value_metrics["value_passes"] = int(value_metrics["value_passes"])
    record = {
      # Always the raw reward; what trained, when normalised per task, has its own key below.
      "reward_mean": float(rewards.logged.mean()),
      "reward_std": float(rewards.logged.std()),
      "accuracy": float(rewards.correct.mean()),
      "response_len": float(np.mean(lengths)),
      "truncated_frac": float(np.mean(finish == FINISH_LENGTH)),
      "temperature": temperature,
      "lr": float(metrics["base_lr"] * metrics["lr_scale"] * coefs.lr_mult),
      "kl_coef": float(coefs.kl_coef + coefs.kl_reward_coef),
      "entropy_coef": float(coefs.entropy_coef),
      "clip_low_now": float(coefs.clip_low),
      "clip_high_now": float(coefs.clip_high),
      "grad_clip_now": float(coefs.clip_norm),
      "phase": int(ctl.phase),
      "reward_slope": float(ctl.slope),
      "skipped": 0.0,
      **gen_stats,
      **rewards.metrics,
      **{k: float(v) for k, v in train_metrics.items()},
      **{k: float(v) for k, v in metrics["advantage"].items()},
      **{k: float(v) for k, v in value_metrics.items()},
      **{k: float(v) for k, v in metrics["rollout"].items()},
      **idle,
      "time_generate_s": gen_stats["time_produce_s"] - gen_stats["time_reward_s"],
      "time_train_s": t2 - t1,  # the learner program: scoring, advantages, policy and critic updates
      "time_step_s": t2 - t0,
    }
    # The share of the learner's step that generation took: in the synchronous loop its generate phase; with
    # async rollout the time it waited for a batch (the producer's generating overlapped earlier steps).
    starved = record["time_generate_s"] if self.rollout is None else record["time_learner_idle_s"]
    record["rollout_share"] = min(starved / max(record["time_step_s"], 1e-9), 1.0)
    if cfg.data.reward_normalization != "none":
      record["reward_normalized_mean"] = float(rewards.values.mean())
    if cfg.data.is_mixture:
      record.update(task_metrics(batch.problems, rewards, cfg.rollout.num_samples))
    record.update(device_memory())  # where the backend reports it (not on CPU)
    record.update(
      self.ledger.step(
        np.sum(prompt_mask, axis=1),
        lengths,
        rounds=int(gen_stats.get("ds_rounds", 1)),
        value_passes=int(value_metrics.get("value_passes", 0)),
        trained=step >= cfg.algo.value_warmup_steps,
        time_generate_s=record["time_generate_s"],
        time_train_s=record["time_train_s"],
      )
    )
    if self.time_split == "measured":
      record["time_score_s"] = t_scored - t1
    else:
      # One program (score -> advantages -> update -> critic -> controllers): its measured time split by
      # counted FLOPs (against the measured split: BUILD_NOTES, "The learner's time split").
      record["time_score_s"] = apportioned_score_time(record)
    record["time_update_s"] = record["time_train_s"] - record["time_score_s"]
    if kl_per_seq is not None:  # the prompt with the largest KL to the reference, by id
      worst = int(np.argmax(np.asarray(kl_per_seq).reshape(-1, cfg.rollout.num_samples).mean(axis=1)))
      record["kl_prompt_max_id"] = int(batch.experience.prompt_id[worst * cfg.rollout.num_samples])
    hist = {"reward_hist": rewards.logged, "response_len_hist": lengths, **rewards.histograms}
    return state, (record, hist, samples)

  def rollback(self, state: LearnerState, step: int) -> tuple[LearnerState, int]:
    """After ``max_bad_steps`` non-finite steps: restore the last good checkpoint."""
    ck = self.cfg.checkpoint
    if self.rollout is not None:
      self.rollout.stop()  # its batches came from the policy being rolled back; restarted at the next step
    self.ckpt.wait()
    found = self.ckpt.restore_latest(
      lambda meta: self._target(state, meta), at_most=self.global_step("rl", self.last_good_step)
    )
    if found is None:
      raise RuntimeError(f"{self.bad_steps} consecutive non-finite steps and no checkpoint to roll back to")
    gstep, tree, meta = found
    self.ckpt.delete_after(gstep)  # the run continues from here; later steps will be redone
    lr_scale = state.lr_scale * ck.rollback_lr_factor
    restored = self._from_tree(state, tree)
    policy = restored.policy.replace(lr_scale=lr_scale)
    restored = restored.replace(policy=_reset_optimizer(policy) if ck.rollback_reset_optimizer else policy)
    self._restore_rollout_side(meta)
    self.ledger.load_state_dict(meta.get("controllers", {}).get("ledger"))
    self.alarms.load_state_dict(meta.get("controllers", {}).get("alarms"))
    self.rollbacks += 1
    message = (
      f"rolled back from RL step {step} to step {meta['step']} after {self.bad_steps} consecutive non-finite "
      f"steps (optimizer reset: {'yes' if ck.rollback_reset_optimizer else 'no'}, "
      f"lr scale now {float(lr_scale):.3g})"
    )
    print(message, flush=True)
    logging.warning(message)
    self.bad_steps = 0
    self.logger.truncate(meta["log_step"])
    self.worker.update_params(self.rollout_params(restored.params))
    return restored, meta["step"]

  def report_reward_failures(self, step: int, batch: Any) -> None:
    """Says which reward sources failed on RL step ``step``'s batch (a :class:`RewardBatch`; each failure
    counts as 0), on how many samples, and why (the batch's first messages, from whichever process scored
    the row): at a source's
    first failing step, then at most once every ``REWARD_FAILURES_EVERY`` steps while it keeps failing."""
    if batch is None:
      return
    due = [
      name
      for name, failed in batch.failed.items()
      if failed.any()
      and step - self.reward_failures_reported.get(name, step - REWARD_FAILURES_EVERY) >= REWARD_FAILURES_EVERY
    ]
    if not due:
      return
    self.reward_failures_reported.update(dict.fromkeys(due, step))
    counts = ", ".join(
      f"{name} on {int(np.count_nonzero(batch.failed[name]))} of "
      f"{int(np.count_nonzero(~np.isnan(batch.components[name])))} samples"
      for name in due
    )
    why = [m for m in batch.errors if m.split("[", 1)[0] in due][:3]
    message = (
      f"RL step {step}: reward sources failed, each failure counted as 0: {counts}; "
      + ("; ".join(why) if why else "no message of theirs kept (a batch keeps its first 10)")
      + f" (reported again at most every {REWARD_FAILURES_EVERY} steps; reward/<name>_fail_frac logs every step)"
    )
    if multihost.is_primary():
      print(message, flush=True)
    logging.warning(message)

  def on_alarms(self, state: LearnerState, step: int, record: dict[str, Any]) -> tuple[LearnerState, int] | None:
    """Feeds RL step ``step``'s record to the detectors; writes every alarm that fires (``alarms.jsonl``
    and the log) with the action taken.  Returns the rolled-back ``(state, step)`` when an alarm rolled
    the run back (``--on_alarm=rollback``, within ``--max_alarm_rollbacks``), else None."""
    lg = self.cfg.logging
    rolled = None
    for alarm in self.alarms.update(step, MetricsLogger.record(step, record)):
      action = "logged"
      if lg.on_alarm == "rollback" and rolled is not None:
        action = "logged (the run rolled back for another alarm of this step)"
      elif lg.on_alarm == "rollback" and alarm.kind == "reward_jitter":
        # A period in the reward does not damage the policy, and a rollback would replay it: the
        # intervention is on the data pipeline, a fixed prompt order broken into shuffled epochs.
        first = self._reshuffle(step)
        if first is not None:
          action = f"prompt order reshuffled every epoch from RL step {first} on (--data_order=sequential); no rollback"
        else:
          action = "logged (no rollback: the prompts are not in a fixed order; see the diagnosis)"
      elif lg.on_alarm == "rollback":
        if self.alarm_rollbacks >= lg.max_alarm_rollbacks:
          action = f"logged (--max_alarm_rollbacks={lg.max_alarm_rollbacks} spent)"
        else:
          critic = alarm.kind == "value_loss_spike" and state.value is not None
          rolled = self._alarm_rollback(state, alarm.onset, critic=critic)
          if rolled is None:
            action = f"logged (no RL checkpoint before the onset at step {alarm.onset})"
          else:
            action = (
              f"rolled back to RL step {rolled[1]}; learning rate x{lg.alarm_lr_factor:g}, "
              + (f"critic learning rate x{lg.alarm_lr_factor:g}, " if critic else "")
              + f"KL coefficient x{lg.alarm_kl_factor:g} (alarm rollback {self.alarm_rollbacks} of "
              f"{lg.max_alarm_rollbacks})"
            )
      row = alarm.record(action)
      self.logger.write_alarm(row)
      message = (
        f"alarm at RL step {step}: {alarm.kind} (onset step {alarm.onset}) {json.dumps(alarm.evidence)}; "
        f"look first at: {row['diagnosis'][0]}; action: {action}"
      )
      if multihost.is_primary():
        print(message, flush=True)
      logging.warning(message)
    return rolled

  def _reshuffle(self, step: int) -> int | None:
    """Breaks a fixed prompt order into shuffled epochs from the next batch made on (async: the producer
    paused while it changes; the batches it already made keep theirs).  Returns that batch's RL step,
    None when there is no fixed order to break."""
    first = step + 1  # the logged RL step of batch id ``step`` (ids count from 0), the next one trained
    if self.rollout is not None and self.rollout.running:
      with self.rollout.paused() as worker:
        first += len(self.rollout.pending(step))
        done = worker.reshuffle()
    else:
      done = self.worker.reshuffle()
    if done:
      self.worker.reshuffle_at = first - 1  # checkpointed: a resumed run breaks the order at that batch too
    return first if done else None

  def _alarm_rollback(
    self, state: LearnerState, onset: int, *, critic: bool = False
  ) -> tuple[LearnerState, int] | None:
    """Restores the last RL checkpoint of step ``onset - 2`` or earlier with the alarm's intervention applied
    to the current values (so interventions compound: the learning-rate scale times ``alarm_lr_factor``,
    the KL coefficient times ``alarm_kl_factor``; with ``critic`` (a value-loss spike) the critic's
    learning-rate scale too).  None when there is no such checkpoint."""
    lg = self.cfg.logging
    self.ckpt.wait()
    # The record of RL step s measures the policy after s - 1 updates: restore the policy from before the
    # update that the onset's record shows.
    at_most = self.global_step("rl", max(onset - 2, 0))
    if not any(self.cfg.run.sft_steps < s <= at_most for s in self.ckpt.all_steps()):
      return None
    found = self.ckpt.restore_latest(lambda meta: self._target(state, meta), at_most=at_most)
    if found is None or found[2]["phase"] != "rl":
      return None  # the run goes on as it was, the producer's batches with it
    if self.rollout is not None:
      self.rollout.stop()  # its batches came from the policy being rolled back; restarted at the next step
    gstep, tree, meta = found
    self.ckpt.delete_after(gstep)  # the run continues from here; later steps will be redone
    self.alarm_rollbacks += 1
    restored = self._from_tree(state, tree)
    policy = restored.policy.replace(lr_scale=state.lr_scale * lg.alarm_lr_factor)
    kl = state.controllers.kl_coef * lg.alarm_kl_factor
    if self.cfg.algo.kl_controller != "fixed":  # a controlled coefficient stays inside its bounds
      kl = jnp.clip(kl, self.cfg.algo.kl_coef_min, self.cfg.algo.kl_coef_max)
    restored = restored.replace(policy=policy, controllers=restored.controllers.replace(kl_coef=kl))
    if critic:
      restored = restored.replace(value=restored.value.replace(lr_scale=state.value.lr_scale * lg.alarm_lr_factor))
    self._restore_rollout_side(meta)
    ctl = meta.get("controllers", {})
    self.ledger.load_state_dict(ctl.get("ledger"))
    self.alarms.load_state_dict(ctl.get("alarms"))
    self.bad_steps = 0
    self.logger.truncate(meta["log_step"])
    self.worker.update_params(self.rollout_params(restored.params))
    return restored, meta["step"]


def train(cfg: Config, *, rollout_factory=None) -> dict[str, Any]:
  """SFT warm start then GRPO, every step a transaction; returns the summary.

  Resumes from the run directory's latest intact checkpoint (``--resume``), or from
  ``--rollback_to``; SIGTERM saves at the next step boundary and returns with
  ``summary["preempted"] = True``.
  """
  t_start = time.perf_counter()
  run_dir = resolve_run_dir(cfg)
  # A task that runs untrusted code without kernel isolation is refused before the run directory is
  # touched (--overwrite would clear it first); building the task checks again, silently.
  check_sandbox(cfg.data)
  if cfg.run.warm_start_from and starts_afresh(cfg, run_dir):
    check_source(cfg, run_dir)
  directory = rundir.RunDir(run_dir, writer=multihost.is_primary())
  with contextlib.ExitStack() as owned:
    _claim(directory, cfg, owned)
    try:
      run = RLRun(cfg, run_dir, rollout_factory=rollout_factory)
    except BaseException:
      if cfg.checkpoint.overwrite:  # refused (or failed) before it started: the old run is put back
        directory.settle_overwrite(started=False)
      raise
    if cfg.checkpoint.overwrite:
      directory.settle_overwrite(started=True)
    try:
      restored = run.restore()  # refuses checkpoints none of which restores: nothing is written before
      # Rewritten on every start, resumes included: the sandbox record is this machine's.
      directory.write_config(cfg.to_dict(), sandbox=run.sandbox, provenance=provenance())
      run.open_logger(restored)
      handlers = {signal.SIGTERM: run.request_preemption}
      if multihost.multi_process():
        handlers[signal.SIGINT] = run.request_interrupt
      previous = {s: signal.signal(s, handler) for s, handler in handlers.items()}
      try:
        return _train(run, restored, t_start)
      except Preempted as e:
        if run.preempt_requested or not cfg.run.stop_at_step:
          print(f"preempted: state saved at {e}; rerun the same command to resume", flush=True)
        else:
          print(
            f"stopped at --stop_at_step={cfg.run.stop_at_step}: state saved at {e}; rerun without it to go on",
            flush=True,
          )
        return {"preempted": True, "run_dir": run_dir}
      finally:
        for s, handler in previous.items():
          signal.signal(s, handler)
    finally:
      run.close()


def _claim(directory: rundir.RunDir, cfg: Config, owned: contextlib.ExitStack) -> None:
  """Takes the run directory for this run (one trainer per directory, for the whole run): its writer
  (process 0) locks and claims it; every process learns whether it did before anything else happens."""
  error = None
  try:
    owned.enter_context(directory.lock())
    directory.claim(cfg.to_dict(), overwrite=cfg.checkpoint.overwrite)
  except ConfigError as e:
    error = e
  if multihost.any_process(error is not None):
    raise error or ConfigError(f"--run_dir={directory.path}: process 0 refused the run directory (see its output)")


def _train(run: RLRun, restored: Restored | None, t_start: float) -> dict[str, Any]:
  """The whole run: supervised warm start -> RL steps -> final evaluation and summary."""
  if restored is not None and restored.meta["log_step"] > run.cfg.run.max_steps:
    done = run.dir.read_summary()
    if done is not None:
      print(f"the run in {run.run_dir} is already complete", flush=True)
      return done
  t0 = time.perf_counter()
  state, step, warm = _warm_start(run, restored)
  sft_s = time.perf_counter() - t0
  print(f"warm-start held-out: {json.dumps(warm)}", flush=True)
  state, step = _rl_phase(run, state, step, warm)
  return _finish(run, state, step, warm, restored=restored, t_start=t_start, sft_s=sft_s)


def _warm_start(run: RLRun, restored: Restored | None) -> tuple[LearnerState, int, dict[str, float]]:
  """SFT (skipped when resuming in the RL phase), the warm start's evaluation, and the RL state at step 0."""
  if restored is not None and restored.phase == "rl":
    return restored.state, restored.step, restored.meta["warm_start"]
  if restored is None and run.cfg.run.warm_start_from:
    params = run.take_warm_start()
  else:
    state = restored.state if restored else run.fresh_state("sft")
    params = (run.sft(state, restored.step if restored else 0) if run.cfg.run.sft_steps else state).params
  warm = run.evaluate(params, 0)
  run.logger.log(0, {f"eval/{k}": v for k, v in warm.items()})
  return run.begin_rl(params, warm), 0, warm


def _rl_phase(run: RLRun, state: LearnerState, step: int, warm: dict[str, float]) -> tuple[LearnerState, int]:
  """RL steps ``step .. max_steps``: step, guard against non-finite updates, evaluate, log, checkpoint."""
  cfg = run.cfg
  every = cfg.checkpoint.checkpoint_every
  bar = tqdm.tqdm(
    total=cfg.run.max_steps, initial=step, desc="grpo", mininterval=1.0, disable=not multihost.is_primary()
  )
  while step < cfg.run.max_steps:
    state, (record, hist, samples) = run.step(state, step)
    step += 1
    bar.update(1)
    if _count_bad_step(run, record, step, bar):
      state, step = run.rollback(state, step)
      bar.reset(total=cfg.run.max_steps)
      bar.update(step)
      continue
    if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < cfg.run.max_steps:
      evaluation = run.evaluate(state.params, step)
      record.update({f"eval/{k}": v for k, v in evaluation.items()})
      run.keep_if_best(step, state, step, evaluation, warm)
    record.update(rollbacks=run.rollbacks, skipped_total=int(state.skipped), time_checkpoint_s=0.0)
    record["alarm_rollbacks"] = run.alarm_rollbacks
    rolled = run.on_alarms(state, step, record)
    if rolled is not None:  # an alarm rolled the run back: its later steps are redone
      state, step = rolled
      bar.reset(total=cfg.run.max_steps)
      bar.update(step)
      continue
    stop = run.should_stop() or 0 < cfg.run.stop_at_step <= step
    # The last step is saved after the final evaluation. A step whose update was non-finite is
    # never saved: with --keep_last it would evict the last good checkpoint a rollback needs.
    saved = run.bad_steps == 0
    if ((every and step % every == 0) or stop) and step < cfg.run.max_steps and saved:
      # Saved before the step is logged, so that its record holds the save's own time; the record and
      # its samples travel in the checkpoint (a resume writes them if a kill came in between).
      run.save(
        "rl",
        step,
        state,
        step,
        warm,
        log_record={
          "record": run.logger.record(step, record),
          "samples": samples,
          "histograms": {k: histogram_quantiles(v) for k, v in hist.items()},
        },
      )
      record["time_checkpoint_s"] = run.last_checkpoint_s
    logged = run.logger.log(step, record, hist, samples)
    if step % cfg.logging.log_every == 0:
      bar.set_postfix_str(format_progress(logged, PROGRESS_KEYS))
    if stop and step < cfg.run.max_steps:
      bar.close()
      raise Preempted(f"RL step {step}" if saved else f"RL step {run.last_good_step} (the last good step)")
  bar.close()
  if run.rollout is not None:
    run.rollout.stop()  # every batch is trained on; the worker's state is the run's again
  return state, step


def _count_bad_step(run: RLRun, record: dict[str, Any], step: int, bar: Any) -> bool:
  """Counts a step whose every update was non-finite; True when it is time to roll back.

  Raises:
    RunAborted: past ``--max_rollbacks`` (the last good checkpoint is intact).
  """
  cfg = run.cfg.checkpoint
  bad = record["skipped"] >= 1.0
  run.bad_steps = run.bad_steps + 1 if bad else 0
  run.nonfinite_steps += int(bad)
  if run.bad_steps == 0:
    run.last_good_step = step
  if run.bad_steps < cfg.max_bad_steps:
    return False
  if run.rollbacks >= cfg.max_rollbacks:
    bar.close()
    raise RunAborted(
      f"{run.bad_steps} consecutive non-finite steps at RL step {step} after {run.rollbacks} rollbacks "
      f"(--max_rollbacks={cfg.max_rollbacks}): stopping. The last good checkpoint (RL step "
      f"{run.last_good_step}) is intact; lower --learning_rate or raise --max_rollbacks and rerun to resume"
    )
  return True


def _finish(
  run: RLRun,
  state: LearnerState,
  step: int,
  warm: dict[str, float],
  *,
  restored: Restored | None,
  t_start: float,
  sft_s: float,
) -> dict[str, Any]:
  """The final evaluation, the last checkpoint and ``summary.json``."""
  cfg = run.cfg
  final_step = cfg.run.max_steps + 1  # the final evaluation's log step
  committed = restored is not None and restored.phase == "rl" and restored.meta["log_step"] == final_step
  pending = restored.meta.get("log_record") if committed and restored.step == step else None
  if pending:
    # Killed after the final checkpoint and before the summary: the final record travels in that
    # checkpoint (the logger wrote it if the kill came before its line); nothing is evaluated or saved
    # again, so the run ends as the uninterrupted one did, loop key included.
    final = {k.removeprefix("eval/"): v for k, v in pending["record"].items() if k.startswith("eval/")}
  else:
    # --max_steps=0 (a warm-start source): the final policy is the warm start, evaluated already.
    final = dict(warm) if step == 0 else run.evaluate(state.params, step + 1)
    record = {f"eval/{k}": v for k, v in final.items()}
    if run.global_step("rl", step) in run.ckpt.all_steps():
      # Committed already: RL step 0 by the SFT -> RL transition (--max_steps=0, a run stopped after its
      # warm start), or the final checkpoint of an earlier release's run killed before its summary.  It
      # is written again with the final record.
      run.ckpt.delete_after(run.global_step("rl", step) - 1)
    # Saved before it is logged, as every step is: the record travels in the checkpoint.
    run.save(
      "rl", step, state, final_step, warm, log_record={"record": run.logger.record(final_step, record), "samples": []}
    )
    run.logger.log(final_step, record)
  run.keep_if_best(step, state, final_step, final, warm)
  summary = {
    "experiment": cfg.run.experiment,
    "seed": cfg.run.seed,
    "sft_steps": cfg.run.sft_steps,
    "rl_steps": cfg.run.max_steps,
    "wall_time_s": round(time.perf_counter() - t_start, 1),
    "sft_time_s": round(sft_s, 1),
    # The last step's save comes after the final evaluation, so no step record can hold its time.
    "final_checkpoint_s": round(run.last_checkpoint_s, 3),
    "resumed_from": None if restored is None else {"phase": restored.phase, "step": restored.step},
    "warm_start": warm,
    "final": final,
    "skipped_updates": int(state.skipped),
    "rollbacks": run.rollbacks,
    "alarm_rollbacks": run.alarm_rollbacks,
    "nonfinite_steps": run.nonfinite_steps,
    "run_dir": run.run_dir,
    # The compute ledger's totals over the RL steps, and what code and stack produced the run.
    "compute": run.ledger.state_dict(),
    "best": None if run.best_value is None else {"metric": cfg.checkpoint.keep_best, "value": run.best_value},
    # What reading the prompt files kept and dropped (malformed rows, repeats, held-out overlap).
    "data": data_counts(run.task),
    **provenance(),
  }
  if run.sandbox is not None:
    summary["sandbox"] = run.sandbox
  run.dir.write_summary(summary)
  gain = 100 * (final["greedy_accuracy"] - warm["greedy_accuracy"])
  print(
    f"held-out greedy accuracy: warm-start {100 * warm['greedy_accuracy']:.1f}% -> "
    f"final {100 * final['greedy_accuracy']:.1f}% ({gain:+.1f} points)\nrun directory: {run.run_dir}",
    flush=True,
  )
  if multihost.is_primary():
    _write_report(run.run_dir)
  return summary


def _write_report(run_dir: str) -> None:
  """The run report (``RUN_DIR/report.html``); a report that cannot be drawn never fails the run."""
  try:
    from mimo_jax.report import write_run_report

    print(f"report: {write_run_report(run_dir)}", flush=True)
  except ImportError as e:
    print(f"no report ({e}): pip install 'mimo-jax[report]', then python -m mimo_jax.report {run_dir}", flush=True)
  except Exception as e:  # noqa: BLE001 - the run is complete and saved; the report is a view of it
    print(f"warning: the report could not be written ({type(e).__name__}: {e}); the run is complete", flush=True)
