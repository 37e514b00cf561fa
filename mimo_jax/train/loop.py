"""The GRPO outer loop: sample -> generate -> reward -> advantages -> update -> sync -> log.

Everything heavy is a jitted function on one mesh (``steps.py``, ``rollout/``); the host
samples prompts, decodes completions, computes rule rewards and writes logs.  The loop
itself is :func:`train`, and one RL step is :meth:`RLRun.step`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from mimo_jax import sharding
from mimo_jax.ckpt import Checkpointer
from mimo_jax.config import Config
from mimo_jax.config_base import ConfigError
from mimo_jax.eval import pass_at_k
from mimo_jax.models import Transformer, create_sharded, load_hf
from mimo_jax.rollout import RolloutOutput, Sampler, SamplingParams, bucket_for, left_pad
from mimo_jax.tasks.registry import build_task
from mimo_jax.tokenization import Tokenizer
from mimo_jax.train.logger import MetricsLogger, format_progress
from mimo_jax.train.state import TrainState, make_optimizer
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
) -> tuple[np.ndarray, np.ndarray]:
  """Tokenizes (with BOS), left-pads to a bucket, and pads the row count with 1-token fillers.

  A prompt longer than the largest bucket keeps its last tokens (where the question
  ends and the answer cue sits): shapes stay static, and the cut is visible in the
  ``prompt_truncated`` count that :class:`RLRun` logs.
  """
  limit = max(buckets)
  ids = [tokenizer.encode(p, add_bos=tokenizer.bos_id is not None)[-limit:] for p in prompts]
  rows = num_rows or len(ids)
  ids += [[tokenizer.pad_id]] * (rows - len(ids))
  return left_pad(ids, bucket_for(max(len(i) for i in ids), buckets), tokenizer.pad_id)


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


class RLRun:
  """Holds the mesh, model, sampler, jitted steps and data streams of one training run."""

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
    self.key = jax.random.key(cfg.run.seed)
    self.key, init_key, sft_key, rl_key = jax.random.split(self.key, 4)
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
    self.graphdef, params = nnx.split(model)
    self.data_rng = np.random.default_rng(cfg.run.seed)
    self.heldout = self.task.heldout()[: cfg.data.eval_prompts]
    self.logger = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard)
    self.ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep_last=cfg.checkpoint.keep_last)
    self._sft_key, self._rl_key = sft_key, rl_key
    self._params = params
    factory = rollout_factory or (lambda model, mesh: Sampler(model, mesh=mesh))
    self.sampler = factory(nnx.merge(self.graphdef, params), self.mesh)
    self.rows = cfg.data.prompts_per_step
    shards = self.sampler.batch_shards
    # Evaluation batches: a fixed number of prompts per call, a multiple of the batch shards.
    self.eval_rows = max(shards, min(64, -(-len(self.heldout) // shards) * shards))

  # ------------------------------------------------------------------ SFT

  def sft(self) -> None:
    cfg = self.cfg
    if cfg.run.sft_steps == 0:
      return
    tx, schedule = make_optimizer(
      dataclasses.replace(cfg.optim, warmup_steps=min(10, cfg.run.sft_steps // 10)),
      cfg.run.sft_steps,
      peak=cfg.optim.sft_learning_rate,
    )
    state = TrainState.create(nnx.merge(self.graphdef, self._params), tx, self._sft_key)
    step_fn = make_sft_step(self.mesh)
    M = cfg.rollout.max_new_tokens
    bar = tqdm.trange(cfg.run.sft_steps, desc="sft", leave=False, mininterval=1.0)
    for i in bar:
      examples = self.task.sft_examples(self.data_rng, cfg.data.sft_batch_size)
      p_tok, p_mask = encode_prompts(self.tokenizer, [e[0] for e in examples], self.buckets)
      c_tok, c_mask = encode_targets(self.tokenizer, [e[1] for e in examples], M)
      batch = SequenceBatch(*(jnp.asarray(x) for x in (p_tok, p_mask, c_tok, c_mask)))
      state, metrics = step_fn(state, batch)
      if (i + 1) % 25 == 0 or i + 1 == cfg.run.sft_steps:
        m = jax.device_get(metrics)
        bar.set_postfix(loss=f"{float(m['sft_loss']):.3f}")
        self.logger.log(i - cfg.run.sft_steps, {"sft_loss": m["sft_loss"], "lr": schedule(i)})
    self._params = state.params
    self.sampler.update_params(self._params)

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
      tokens, mask = encode_prompts(self.tokenizer, [p.prompt for p in chunk], self.buckets, self.eval_rows)
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

  def setup_rl(self) -> TrainState:
    cfg = self.cfg
    tx, self.lr_schedule = make_optimizer(cfg.optim, max(cfg.run.max_steps, 1))
    state = TrainState.create(nnx.merge(self.graphdef, self._params), tx, self._rl_key)
    self.use_kl = cfg.algo.kl_coef > 0
    # The frozen reference: a copy of the warm-started weights, never updated or donated.
    self.ref_params = jax.tree.map(jnp.copy, state.params) if self.use_kl else None
    self.score_fn = make_score_fn(self.graphdef, self.mesh, use_reference=self.use_kl)
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
    )
    self.update_fn = make_update_fn(self.mesh, settings)
    self.coefs = LossCoefs(kl_coef=jnp.float32(cfg.algo.kl_coef), entropy_coef=jnp.float32(cfg.algo.entropy_coef))
    self.sampler.update_params(state.params)
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
    tokens, mask = encode_prompts(self.tokenizer, [p.prompt for p in problems], self.buckets)
    truncated = sum(len(self.tokenizer.encode(p.prompt)) + 1 > max(self.buckets) for p in problems)
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
    lr = self.lr_schedule(state.step)
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

  def checkpoint(self, step: int, state: TrainState, phase: str) -> None:
    tree = {
      "params": state.params,
      "opt_state": state.opt_state,
      "step": state.step,
      "skipped": state.skipped,
      "rng": jax.random.key_data(state.rng),
    }
    meta = {
      "step": step,
      "phase": phase,
      "config_digest": _digest(self.cfg.to_dict()),
      "data_rng": self.data_rng.bit_generator.state,
    }
    self.ckpt.save(step, tree, json.loads(json.dumps(meta, default=str)))


def train(cfg: Config) -> dict[str, Any]:
  """Runs SFT warm-start then GRPO; writes the run directory; returns the summary."""
  t_start = time.perf_counter()
  run_dir = resolve_run_dir(cfg)
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    f.write(cfg.to_json())
  run = RLRun(cfg, run_dir)

  # ---- supervised warm start
  t0 = time.perf_counter()
  run.sft()
  sft_s = time.perf_counter() - t0
  warm = run.evaluate(run._params)
  run.logger.log(0, {f"eval/{k}": v for k, v in warm.items()})
  print(f"warm-start held-out: {json.dumps(warm)}  (sft {sft_s:.0f}s)")

  # ---- GRPO
  state = run.setup_rl()
  history = []
  bar = tqdm.trange(cfg.run.max_steps, desc="grpo", mininterval=1.0)
  for step in bar:
    state, (record, hist) = run.step(state, step)
    if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and step + 1 < cfg.run.max_steps:
      record.update({f"eval/{k}": v for k, v in run.evaluate(state.params).items()})
    if cfg.checkpoint.checkpoint_every and (step + 1) % cfg.checkpoint.checkpoint_every == 0:
      t_ck = time.perf_counter()
      run.checkpoint(step + 1, state, "rl")
      record["time_checkpoint_s"] = time.perf_counter() - t_ck
    logged = run.logger.log(step + 1, record, hist)
    history.append(logged)
    if (step + 1) % cfg.logging.log_every == 0:
      bar.set_postfix_str(format_progress(logged, PROGRESS_KEYS))

  final = run.evaluate(state.params)
  run.logger.log(cfg.run.max_steps, {f"eval/{k}": v for k, v in final.items()})
  run.checkpoint(cfg.run.max_steps, state, "rl")
  run.ckpt.close()
  run.logger.close()
  summary = {
    "experiment": cfg.run.experiment,
    "seed": cfg.run.seed,
    "sft_steps": cfg.run.sft_steps,
    "rl_steps": cfg.run.max_steps,
    "wall_time_s": round(time.perf_counter() - t_start, 1),
    "sft_time_s": round(sft_s, 1),
    "warm_start": warm,
    "final": final,
    "skipped_updates": int(state.skipped),
    "run_dir": run_dir,
  }
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  gain = 100 * (final["greedy_accuracy"] - warm["greedy_accuracy"])
  print(
    f"held-out greedy accuracy: warm-start {100 * warm['greedy_accuracy']:.1f}% -> "
    f"final {100 * final['greedy_accuracy']:.1f}% ({gain:+.1f} points)\nrun directory: {run_dir}"
  )
  return summary
