"""The GRPO outer loop: sample -> generate -> reward -> advantages -> update -> sync -> log -> checkpoint.

Everything heavy is a jitted function on one mesh (``steps.py``, ``rollout/``); the host
samples prompts, decodes completions, computes rule rewards and writes logs.  The loop
itself is :func:`train`, and one RL step is :meth:`RLRun.step`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import json
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import logging
from flax import nnx

from mimo_jax import sharding
from mimo_jax.ckpt import Checkpointer
from mimo_jax.ckpt.manager import abstract_like
from mimo_jax.config import Config, parse_int_list
from mimo_jax.config_base import ConfigError
from mimo_jax.eval import pass_at_k
from mimo_jax.models import Transformer, create_sharded, load_hf
from mimo_jax.rollout import RolloutOutput, Sampler, SamplingParams, bucket_for, left_pad
from mimo_jax.tasks.registry import build_task
from mimo_jax.tokenization import Tokenizer
from mimo_jax.train.logger import MetricsLogger, format_progress
from mimo_jax.train.state import TrainState, init_opt_state, make_optimizer
from mimo_jax.train.steps import (
  LossCoefs,
  PolicyBatch,
  SequenceBatch,
  UpdateSettings,
  make_advantage_fn,
  make_score_fn,
  make_sft_step,
  make_update_fn,
)

PROGRESS_KEYS = ("reward_mean", "accuracy", "kl_k3", "entropy", "clipfrac", "grad_norm", "response_len")

# ----------------------------------------------------------------------------
# Small typed stage outputs
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rewards:
  """Host-side rewards of one rollout batch.

  Attributes:
    values: float32 ``[B]`` raw rewards (what is logged).
    correct: bool ``[B]``, the verifier's verdict.
    texts: the decoded completions.
  """

  values: np.ndarray
  correct: np.ndarray
  texts: list[str]


def resolve_run_dir(cfg: Config) -> str:
  if cfg.logging.run_dir:
    return cfg.logging.run_dir
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  return os.path.join("runs", f"{cfg.run.experiment}-{stamp}")


def encode_prompts(
  tokenizer: Tokenizer, prompts: Sequence[str], buckets: Sequence[int], num_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
  """Tokenizes (with BOS), left-pads to a bucket, and pads the row count with 1-token fillers.

  A prompt longer than the largest bucket keeps its last tokens (where the question
  ends and the answer cue sits), so shapes stay static.

  Returns:
    ``(tokens [rows, P], mask [rows, P], number of prompts that were cut)``.
  """
  limit = max(buckets)
  full = [tokenizer.encode(p, add_bos=tokenizer.bos_id is not None) for p in prompts]
  truncated = sum(len(i) > limit for i in full)
  ids = [i[-limit:] for i in full]
  rows = num_rows or len(ids)
  ids += [[tokenizer.pad_id]] * (rows - len(ids))
  tokens, mask = left_pad(ids, bucket_for(max(len(i) for i in ids), buckets), tokenizer.pad_id)
  return tokens, mask, truncated


def encode_targets(tokenizer: Tokenizer, completions: Sequence[str], length: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads completion tokens (+ EOS) to ``length``; over-long targets are truncated."""
  tokens = np.full((len(completions), length), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(completions), length), bool)
  for i, c in enumerate(completions):
    ids = tokenizer.encode(c, add_eos=True)[:length]
    tokens[i, : len(ids)] = ids
    mask[i, : len(ids)] = True
  return tokens, mask


def decode_completions(tokenizer: Tokenizer, rollout: RolloutOutput) -> list[str]:
  tokens, lengths = np.asarray(rollout.completion_tokens), np.asarray(rollout.lengths)
  return [tokenizer.decode(tokens[i, : lengths[i]].tolist()) for i in range(tokens.shape[0])]


def _digest(obj: Any) -> str:
  return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


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
  """Raised at a step boundary after SIGTERM, once the state is checkpointed."""


class RLRun:
  """Holds the mesh, model, sampler, jitted steps, data streams and checkpoints of one run.

  Every piece of state that a step reads or writes lives either in the ``TrainState``
  (arrays) or in ``self.key`` / ``self.data_rng`` / the buffer records (host), and all of
  it goes into each checkpoint, so a resumed run is bit-identical to an uninterrupted one.
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
    self.mesh = sharding.build_mesh(cfg.mesh)
    self.task, self.tokenizer = build_task(cfg.data, seed=cfg.run.seed, hf_checkpoint=cfg.model.hf_checkpoint)
    self.buckets = cfg.rollout.buckets
    self.stop_ids = (self.tokenizer.eos_id,)
    self.sampling = SamplingParams(
      top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p, stop_ids=self.stop_ids, pad_id=self.tokenizer.pad_id
    )
    self.sampling_version = _digest([dataclasses.asdict(self.sampling), dataclasses.asdict(cfg.rollout)])
    self.key = jax.random.key(cfg.run.seed)
    self.key, init_key, self._sft_key, self._rl_key = jax.random.split(self.key, 4)
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
      vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
      model_cfg = cfg.model.model_config().replace(vocab_size=vocab)
      seed = int(jax.random.randint(init_key, (), 0, 2**31 - 1))
      model = create_sharded(lambda: Transformer(model_cfg, rngs=nnx.Rngs(seed)), self.mesh)
    self.model_cfg = model.config
    self.graphdef, self._init_params = nnx.split(model)
    self.data_rng = np.random.default_rng(cfg.run.seed)
    self.heldout = self.task.heldout()[: cfg.data.eval_prompts]
    factory = rollout_factory or (lambda model, mesh: Sampler(model, mesh=mesh))
    self.sampler = factory(nnx.merge(self.graphdef, self._init_params), self.mesh)
    self.rows = cfg.data.prompts_per_step
    shards = self.sampler.batch_shards
    # Evaluation batches: a fixed number of prompts per call, a multiple of the batch shards.
    self.eval_rows = max(shards, min(64, -(-len(self.heldout) // shards) * shards))

    # ---- optimizers and jitted steps
    sft_optim = dataclasses.replace(cfg.optim, warmup_steps=min(10, cfg.run.sft_steps // 10))
    self.sft_tx, self.sft_schedule = make_optimizer(
      sft_optim, max(cfg.run.sft_steps, 1), peak=cfg.optim.sft_learning_rate
    )
    self.rl_tx, self.lr_schedule = make_optimizer(cfg.optim, max(cfg.run.max_steps, 1))
    self.sft_step_fn = make_sft_step(self.mesh)
    self.use_kl = cfg.algo.kl_coef > 0
    self.ref_params = None
    self.score_fn = make_score_fn(
      self.graphdef, self.mesh, use_reference=self.use_kl, logprob_impl=cfg.algo.logprob_impl
    )
    self.adv_fn = make_advantage_fn(cfg.rollout.num_samples, cfg.algo.advantage)
    settings = UpdateSettings(
      policy_loss=cfg.algo.policy_loss,
      clip_low=cfg.algo.clip_low,
      clip_high=cfg.algo.clip_high,
      clip_c=cfg.algo.clip_c if cfg.algo.policy_loss == "ppo" else None,
      loss_agg=cfg.algo.loss_agg,
      agg_norm=float(cfg.rollout.max_new_tokens),
      kl_estimator=cfg.algo.kl_estimator,
      use_kl=self.use_kl,
      epochs=cfg.algo.ppo_epochs,
      num_minibatches=cfg.algo.num_minibatches,
      grad_accum=cfg.algo.grad_accum,
      logprob_impl=cfg.algo.logprob_impl,
    )
    self.update_fn = make_update_fn(self.mesh, settings)
    self.coefs = LossCoefs(kl_coef=jnp.float32(cfg.algo.kl_coef), entropy_coef=jnp.float32(cfg.algo.entropy_coef))

    # ---- checkpoints, logs, host-side bookkeeping
    ck = cfg.checkpoint
    self.ckpt = Checkpointer(
      os.path.join(run_dir, "checkpoints"), keep_last=ck.keep_last, keep_every=ck.keep_every, async_save=ck.async_save
    )
    self.ref_ckpt = Checkpointer(os.path.join(run_dir, "reference"), keep_last=1, async_save=False)
    self.logger: MetricsLogger | None = None
    self.batches: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)
    self.bad_steps = 0
    self.rollbacks = 0
    self.nonfinite_steps = 0
    self.last_good_step = 0
    self.preempt_requested = False
    self.last_checkpoint_s = 0.0
    self.nan_steps = (
      set(parse_int_list("debug_nan_steps", cfg.run.debug_nan_steps)) if cfg.run.debug_nan_steps else set()
    )

  # ------------------------------------------------------------------ states and checkpoints

  def fresh_state(self, phase: str, params=None) -> TrainState:
    """A new train state for ``phase`` (``sft`` or ``rl``) from ``params`` (initial weights by default)."""
    params = self._init_params if params is None else params
    tx, key = (self.sft_tx, self._sft_key) if phase == "sft" else (self.rl_tx, self._rl_key)
    return TrainState.create(nnx.merge(self.graphdef, params), tx, key)

  def _tree(self, state: TrainState) -> dict[str, Any]:
    return {
      "params": state.params,
      "opt_state": state.opt_state,
      "step": state.step,
      "skipped": state.skipped,
      "lr_scale": state.lr_scale,
      "rng": jax.random.key_data(state.rng),
      "loop_key": jax.random.key_data(self.key),
    }

  def _from_tree(self, template: TrainState, tree: dict[str, Any]) -> TrainState:
    self.key = jax.random.wrap_key_data(tree["loop_key"])
    return template.replace(
      params=tree["params"],
      opt_state=tree["opt_state"],
      step=tree["step"],
      skipped=tree["skipped"],
      lr_scale=tree["lr_scale"],
      rng=jax.random.wrap_key_data(tree["rng"]),
    )

  def _meta(self, phase: str, step: int, log_step: int, *, policy_version: int, with_data: bool) -> dict[str, Any]:
    """Checkpoint metadata (``checkpoints_schema/checkpoint_meta.v1.json``)."""
    return {
      "phase": phase,
      "step": step,
      "log_step": log_step,
      "created_unix": time.time(),
      "config_digest": _digest(self.cfg.to_dict()),
      "model_config": json.loads(json.dumps(dataclasses.asdict(self.model_cfg))),
      "data_rng": json.loads(json.dumps(self.data_rng.bit_generator.state)) if with_data else {},
      "controllers": {
        "bad_steps": self.bad_steps,
        "rollbacks": self.rollbacks,
        "nonfinite_steps": self.nonfinite_steps,
        "last_good_step": self.last_good_step,
      },
      "buffer": {
        "next_batch_id": step if phase == "rl" else 0,
        "policy_version": policy_version,
        "sampling_params_version": self.sampling_version,
        "batches": list(self.batches) if phase == "rl" and with_data else [],
        "pending": [],  # synchronous loop: every generated batch is trained on within its step
      },
    }

  def save(self, phase: str, step: int, state: TrainState, log_step: int, warm: dict | None = None) -> None:
    """Commits the whole run state as checkpoint ``global_step(phase, step)``."""
    t0 = time.perf_counter()
    meta = self._meta(phase, step, log_step, policy_version=int(state.step) if phase == "rl" else 0, with_data=True)
    if warm is not None:
      meta["warm_start"] = warm
    self.ckpt.save(self.global_step(phase, step), self._tree(state), meta)
    self.last_checkpoint_s = time.perf_counter() - t0

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
      return abstract_like(self._tree(templates[phase]), self.mesh)

    found = self.ckpt.restore_latest(target, at_most=at_most)
    if found is None:
      print("warning: no intact checkpoint found; starting from scratch", flush=True)
      return None
    gstep, tree, meta = found
    if ck.rollback_to >= 0:
      if meta["phase"] != "rl" or meta["step"] != ck.rollback_to:
        raise ConfigError(
          f"--rollback_to={ck.rollback_to}: no intact RL checkpoint at that step (available RL steps: "
          f"{[s - self.cfg.run.sft_steps - 1 for s in self.ckpt.all_steps() if s > self.cfg.run.sft_steps]})"
        )
      self.ckpt.delete_after(gstep)
    if meta["config_digest"] != _digest(self.cfg.to_dict()):
      print("warning: resuming with a configuration that differs from the checkpoint's", flush=True)
    state = self._from_tree(templates[meta["phase"]], tree)
    self.data_rng.bit_generator.state = meta["data_rng"]
    ctl = meta.get("controllers", {})
    self.bad_steps, self.rollbacks = ctl.get("bad_steps", 0), ctl.get("rollbacks", 0)
    self.nonfinite_steps = ctl.get("nonfinite_steps", 0)
    self.last_good_step = ctl.get("last_good_step", meta["step"])
    self.batches.extend(meta["buffer"]["batches"])
    if meta["phase"] == "rl":
      self._restore_reference(state)
      if ck.rollback_to >= 0 and ck.rollback_reset_optimizer:
        state = state.replace(opt_state=init_opt_state(state.tx, state.params))
    self.sampler.update_params(state.params)
    what = "rolled back to" if ck.rollback_to >= 0 else "resumed from"
    print(f"{what} {meta['phase']} step {meta['step']} (checkpoint {gstep})", flush=True)
    return Restored(phase=meta["phase"], step=meta["step"], state=state, meta=meta)

  def _restore_reference(self, state: TrainState) -> None:
    if not self.use_kl:
      return
    found = self.ref_ckpt.restore_latest(abstract_like({"params": state.params}, self.mesh))
    if found is None:
      raise RuntimeError(f"{self.run_dir}/reference: the frozen reference policy is missing or corrupted")
    self.ref_params = found[1]["params"]

  def open_logger(self, restored: Restored | None) -> None:
    keep = None if restored is None else restored.meta["log_step"]
    self.logger = MetricsLogger(self.run_dir, tensorboard=self.cfg.logging.tensorboard, keep_through=keep)

  def request_preemption(self, *_):
    self.preempt_requested = True

  def should_stop(self) -> bool:
    """Whether every host saw SIGTERM-driven preemption (all hosts agree on the step)."""
    flag = self.preempt_requested
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      flag = bool(np.any(multihost_utils.process_allgather(np.array([flag]))))
    return flag

  def close(self) -> None:
    self.ckpt.close()
    self.ref_ckpt.close()
    if self.logger is not None:
      self.logger.close()

  # ------------------------------------------------------------------ SFT

  def sft(self, state: TrainState, start: int) -> TrainState:
    """Supervised warm start from SFT step ``start``; checkpointed; returns the final state."""
    cfg = self.cfg
    n = cfg.run.sft_steps
    M = cfg.rollout.max_new_tokens
    bar = tqdm.trange(start, n, desc="sft", leave=False, mininterval=1.0, initial=start, total=n)
    for i in bar:
      examples = self.task.sft_examples(self.data_rng, cfg.data.sft_batch_size)
      p_tok, p_mask, _ = encode_prompts(self.tokenizer, [e[0] for e in examples], self.buckets)
      c_tok, c_mask = encode_targets(self.tokenizer, [e[1] for e in examples], M)
      batch = SequenceBatch(*(jnp.asarray(x) for x in (p_tok, p_mask, c_tok, c_mask)))
      state, metrics = self.sft_step_fn(state, batch)
      done = i + 1
      log_step = done - n - 1
      if done % 25 == 0 or done == n:
        m = jax.device_get(metrics)
        bar.set_postfix(loss=f"{float(m['sft_loss']):.3f}")
        self.logger.log(log_step, {"sft_loss": m["sft_loss"], "lr": self.sft_schedule(i)})
      every = cfg.checkpoint.checkpoint_every
      stop = self.should_stop()
      if done == n or (every and done % every == 0) or stop:
        self.save("sft", done, state, log_step)
      if stop and done < n:
        raise Preempted(f"sft step {done}")
    return state

  # ------------------------------------------------------------------ evaluation

  def evaluate(self, params) -> dict[str, float]:
    """Greedy accuracy and unbiased pass@1 / pass@k on the held-out prompts."""
    cfg = self.cfg
    self.sampler.update_params(params)
    problems = self.heldout
    k = cfg.run.eval_samples
    greedy_correct, sample_correct = [], []
    for start in range(0, len(problems), self.eval_rows):
      chunk = problems[start : start + self.eval_rows]
      tokens, mask, _ = encode_prompts(self.tokenizer, [p.prompt for p in chunk], self.buckets, self.eval_rows)
      self.key, greedy_key, sample_key = jax.random.split(self.key, 3)
      for temp, G, key, sink in (
        (0.0, 1, greedy_key, greedy_correct),
        (cfg.run.eval_temperature, k, sample_key, sample_correct),
      ):
        out = self.sampler.generate(
          tokens,
          mask,
          num_samples=G,
          max_len=cfg.rollout.max_new_tokens,
          sampling=self.sampling,
          temperature=temp,
          key=key,
        )
        texts = decode_completions(self.tokenizer, out)
        for j, prob in enumerate(chunk):
          sink.append([self.task.reward(prob, texts[j * G + g]) > 0 for g in range(G)])
    n = len(problems)
    return {
      "greedy_accuracy": float(np.mean([c[0] for c in greedy_correct])) if n else float("nan"),
      "pass@1": float(np.mean([pass_at_k(k, sum(c), 1) for c in sample_correct])) if n else float("nan"),
      f"pass@{k}": float(np.mean([pass_at_k(k, sum(c), k) for c in sample_correct])) if n else float("nan"),
    }

  # ------------------------------------------------------------------ RL

  def begin_rl(self, params, warm: dict[str, float]) -> TrainState:
    """The SFT -> RL transition: freeze the reference, build the RL state, checkpoint step 0."""
    state = self.fresh_state("rl", params)
    if self.use_kl:
      # The frozen reference: a copy of the warm-started weights, never updated or donated.
      self.ref_params = jax.tree.map(jnp.copy, state.params)
      # A reference left by a transition that was killed before RL step 0 committed is
      # rewritten (it is the same warm-started weights).
      self.ref_ckpt.delete_after(-1)
      self.ref_ckpt.save(0, {"params": self.ref_params}, self._meta("rl", 0, 0, policy_version=0, with_data=False))
      self.ref_ckpt.wait()
    self.sampler.update_params(state.params)
    self.save("rl", 0, state, 0, warm)
    return state

  def temperature(self, step: int) -> float:
    r = self.cfg.rollout
    if r.temperature_final < 0 or self.cfg.run.max_steps <= 1:
      return r.temperature
    frac = step / (self.cfg.run.max_steps - 1)
    return r.temperature + frac * (r.temperature_final - r.temperature)

  def reward(self, problems, rollout: RolloutOutput) -> Rewards:
    G = self.cfg.rollout.num_samples
    texts = decode_completions(self.tokenizer, rollout)
    values = np.array([self.task.reward(problems[i // G], t) for i, t in enumerate(texts)], np.float32)
    return Rewards(values=values, correct=values > 0, texts=texts)

  def step(self, state: TrainState, step: int) -> tuple[TrainState, dict[str, Any]]:
    """One RL step: sample -> generate -> reward -> advantages -> update -> sync."""
    cfg = self.cfg
    t0 = time.perf_counter()
    # ---- sample prompts
    problems = self.task.sample(self.data_rng, self.rows)
    tokens, mask, truncated = encode_prompts(self.tokenizer, [p.prompt for p in problems], self.buckets)
    # ---- generate
    self.key, gen_key = jax.random.split(self.key)
    temperature = self.temperature(step)
    rollout = self.sampler.generate(
      tokens,
      mask,
      num_samples=cfg.rollout.num_samples,
      max_len=cfg.rollout.max_new_tokens,
      sampling=self.sampling,
      temperature=temperature,
      key=gen_key,
    )
    jax.block_until_ready(rollout)
    t1 = time.perf_counter()
    # ---- rewards (host)
    rewards = self.reward(problems, rollout)
    t2 = time.perf_counter()
    # ---- old/reference log-probs and advantages (jitted)
    seqs = SequenceBatch(rollout.prompt_tokens, rollout.prompt_mask, rollout.completion_tokens, rollout.completion_mask)
    old_logp, ref_logp = self.score_fn(state.params, self.ref_params, seqs, rollout.temperature)
    advantages, adv_metrics = self.adv_fn(jnp.asarray(rewards.values))
    if step in self.nan_steps:
      # Fault injection (--debug_nan_steps): a NaN advantage poisons every gradient of the step.
      self.nan_steps.discard(step)
      advantages = advantages.at[0].set(jnp.nan)
    batch = PolicyBatch(
      prompt_tokens=rollout.prompt_tokens,
      prompt_mask=rollout.prompt_mask,
      completion_tokens=rollout.completion_tokens,
      completion_mask=rollout.completion_mask,
      advantages=advantages,
      old_logprobs=old_logp,
      ref_logprobs=ref_logp,
      temperature=rollout.temperature,
    )
    # ---- update (state donated), then point the sampler at the new weights
    lr = self.lr_schedule(state.step) * state.lr_scale
    self.batches.append(
      {
        "batch_id": step,
        "policy_version": int(state.step),
        "sampling_params_version": self.sampling_version,
        "status": "consumed",
        "num_rows": int(rewards.values.shape[0]),
        "temperature": float(temperature),
      }
    )
    state, train_metrics = self.update_fn(state, batch, self.coefs)
    self.sampler.update_params(state.params)
    train_metrics, adv_metrics, lengths, finish, lr = jax.device_get(
      (train_metrics, adv_metrics, rollout.lengths, rollout.finish_reason, lr)
    )
    t3 = time.perf_counter()
    record = {
      "reward_mean": float(rewards.values.mean()),
      "reward_std": float(rewards.values.std()),
      "accuracy": float(rewards.correct.mean()),
      "response_len": float(np.mean(lengths)),
      "truncated_frac": float(np.mean(finish == 1)),
      "prompt_truncated": int(truncated),
      "temperature": temperature,
      "lr": float(lr),
      **{k: float(v) for k, v in train_metrics.items()},
      **{k: float(v) for k, v in adv_metrics.items()},
      "time_generate_s": t1 - t0,
      "time_reward_s": t2 - t1,
      "time_train_s": t3 - t2,
      "time_step_s": t3 - t0,
    }
    record["rollout_share"] = record["time_generate_s"] / max(record["time_step_s"], 1e-9)
    hist = {"reward_hist": rewards.values, "response_len_hist": lengths}
    return state, (record, hist)

  def rollback(self, state: TrainState, step: int) -> tuple[TrainState, int]:
    """After ``max_bad_steps`` non-finite steps: restore the last good checkpoint."""
    ck = self.cfg.checkpoint
    self.ckpt.wait()
    found = self.ckpt.restore_latest(
      lambda meta: abstract_like(self._tree(state), self.mesh), at_most=self.global_step("rl", self.last_good_step)
    )
    if found is None:
      raise RuntimeError(f"{self.bad_steps} consecutive non-finite steps and no checkpoint to roll back to")
    gstep, tree, meta = found
    self.ckpt.delete_after(gstep)  # the run continues from here; later steps will be redone
    lr_scale = state.lr_scale * ck.rollback_lr_factor
    restored = self._from_tree(state, tree).replace(lr_scale=lr_scale)
    if ck.rollback_reset_optimizer:
      restored = restored.replace(opt_state=init_opt_state(restored.tx, restored.params))
    self.data_rng.bit_generator.state = meta["data_rng"]
    self.batches.clear()
    self.batches.extend(meta["buffer"]["batches"])
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
    self.sampler.update_params(restored.params)
    return restored, meta["step"]


def train(cfg: Config, *, rollout_factory=None) -> dict[str, Any]:
  """SFT warm start then GRPO, every step a transaction; returns the summary.

  Resumes from the run directory's latest intact checkpoint (``--resume``), or from
  ``--rollback_to``; SIGTERM saves at the next step boundary and returns with
  ``summary["preempted"] = True``.
  """
  t_start = time.perf_counter()
  run_dir = resolve_run_dir(cfg)
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    f.write(cfg.to_json())
  run = RLRun(cfg, run_dir, rollout_factory=rollout_factory)
  restored = run.restore()
  run.open_logger(restored)
  previous = signal.signal(signal.SIGTERM, run.request_preemption)
  try:
    return _train(run, restored, t_start)
  except Preempted as e:
    print(f"preempted: state saved at {e}; rerun the same command to resume", flush=True)
    return {"preempted": True, "run_dir": run_dir}
  finally:
    signal.signal(signal.SIGTERM, previous)
    run.close()


def _train(run: RLRun, restored: Restored | None, t_start: float) -> dict[str, Any]:
  cfg = run.cfg
  summary_path = os.path.join(run.run_dir, "summary.json")
  if restored is not None and restored.meta["log_step"] > cfg.run.max_steps and os.path.exists(summary_path):
    print(f"the run in {run.run_dir} is already complete", flush=True)
    with open(summary_path) as f:
      return json.load(f)
  # ---- supervised warm start (skipped when resuming in the RL phase)
  t0 = time.perf_counter()
  if restored is None or restored.phase == "sft":
    state = restored.state if restored else run.fresh_state("sft")
    state = run.sft(state, restored.step if restored else 0) if cfg.run.sft_steps else state
    warm = run.evaluate(state.params)
    run.logger.log(0, {f"eval/{k}": v for k, v in warm.items()})
    state = run.begin_rl(state.params, warm)
    step = 0
  else:
    state, step, warm = restored.state, restored.step, restored.meta["warm_start"]
  sft_s = time.perf_counter() - t0
  print(f"warm-start held-out: {json.dumps(warm)}", flush=True)

  # ---- GRPO
  every = cfg.checkpoint.checkpoint_every
  bar = tqdm.tqdm(total=cfg.run.max_steps, initial=step, desc="grpo", mininterval=1.0)
  while step < cfg.run.max_steps:
    state, (record, hist) = run.step(state, step)
    step += 1
    bar.update(1)
    bad = record["skipped"] >= 1.0  # every update of the step had a non-finite loss or gradient
    run.bad_steps = run.bad_steps + 1 if bad else 0
    run.nonfinite_steps += int(bad)
    if run.bad_steps >= cfg.checkpoint.max_bad_steps:
      state, step = run.rollback(state, step)
      bar.reset(total=cfg.run.max_steps)
      bar.update(step)
      continue
    if run.bad_steps == 0:
      run.last_good_step = step
    if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < cfg.run.max_steps:
      record.update({f"eval/{k}": v for k, v in run.evaluate(state.params).items()})
    record.update(time_checkpoint_s=run.last_checkpoint_s, rollbacks=run.rollbacks, skipped_total=int(state.skipped))
    logged = run.logger.log(step, record, hist)
    if step % cfg.logging.log_every == 0:
      bar.set_postfix_str(format_progress(logged, PROGRESS_KEYS))
    stop = run.should_stop()
    # The last step is saved after the final evaluation, below.
    if ((every and step % every == 0) or stop) and step < cfg.run.max_steps:
      run.save("rl", step, state, step, warm)
    if stop and step < cfg.run.max_steps:
      bar.close()
      raise Preempted(f"RL step {step}")
  bar.close()

  final = run.evaluate(state.params)
  run.logger.log(cfg.run.max_steps + 1, {f"eval/{k}": v for k, v in final.items()})
  run.save("rl", step, state, cfg.run.max_steps + 1, warm)
  summary = {
    "experiment": cfg.run.experiment,
    "seed": cfg.run.seed,
    "sft_steps": cfg.run.sft_steps,
    "rl_steps": cfg.run.max_steps,
    "wall_time_s": round(time.perf_counter() - t_start, 1),
    "sft_time_s": round(sft_s, 1),
    "resumed_from": None if restored is None else {"phase": restored.phase, "step": restored.step},
    "warm_start": warm,
    "final": final,
    "skipped_updates": int(state.skipped),
    "rollbacks": run.rollbacks,
    "nonfinite_steps": run.nonfinite_steps,
    "run_dir": run.run_dir,
  }
  tmp = summary_path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=2)
  os.replace(tmp, summary_path)
  gain = 100 * (final["greedy_accuracy"] - warm["greedy_accuracy"])
  print(
    f"held-out greedy accuracy: warm-start {100 * warm['greedy_accuracy']:.1f}% -> "
    f"final {100 * final['greedy_accuracy']:.1f}% ({gain:+.1f} points)\nrun directory: {run.run_dir}",
    flush=True,
  )
  return summary
