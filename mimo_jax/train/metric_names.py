"""The naming convention of every key in ``metrics.jsonl`` (and TensorBoard): one table, in the README too.

Rules the names follow:

- ``reward_mean``, ``reward_std``, ``reward_hist`` and ``accuracy`` are always the **raw** reward (the
  mix of the reward sources, before any shaping); a derived value names its derivation in its key
  (``shaped_reward_mean``, ``reward_normalized_mean``, ``reward_ema_*``).
- ``reward/<component>_*`` are per reward component; ``eval/*`` are held-out evaluations.
- ``time_<what>_s`` are wall seconds of one step's part; ``mem_*_gib`` are GiB of device memory.
- ``*_now`` and ``*_coef`` are the value a controller set for this step.
- ``value_*`` / ``vf_*`` are the critic's (PPO with a value model).

A test checks that every key the trainer logs matches a row (:func:`describe`).
"""

from __future__ import annotations

import fnmatch

__all__ = ["METRICS", "describe"]

# (key or glob pattern, meaning).  Order matters only for reading; a key may match several rows.
METRICS: tuple[tuple[str, str], ...] = (
  (
    "step",
    "RL step (1-based; 0: the warm start's evaluation; max_steps + 1: the final evaluation); SFT steps log before RL step 0",
  ),
  ("sft_loss", "supervised warm-start loss (SFT steps)"),
  (
    "sft_*_truncated",
    "SFT examples cut since the last logged SFT step: `sft_prompt_truncated` (prompts longer than the largest "
    "bucket keep their end), `sft_target_truncated` (targets longer than `--max_new_tokens` lose their end)",
  ),
  ("reward_mean", "raw reward of the trained batch, mean (the sources' mix before any shaping)"),
  ("reward_std", "raw reward of the trained batch, standard deviation"),
  ("accuracy", "fraction of the batch's completions the verifier accepts"),
  ("reward/*", "per reward component: `reward/<name>_mean`, `reward/<name>_fail_frac`, `reward/failures`"),
  ("reward_normalized_mean", "with `--reward_normalize=task_running`: the per-task normalised mix that trains, mean"),
  ("shaped_reward_mean", "reward after shaping (quantile clip, EMA standardisation, KL-in-reward, overlong), mean"),
  (
    "reward_ema_*",
    "reward shaping's running (EMA) statistics of the clipped reward: `reward_ema_mean`, `reward_ema_std`",
  ),
  (
    "eval/*",
    "held-out evaluation: `greedy_accuracy`, `pass@k`, `maj@k`, `num_problems`, `prompt_truncated`; a mixture's also per task (`eval/<task>/...`); a task with several difficulty levels also per level (`eval/level<l>/...`, `eval/<task>/level<l>/...` in a mixture)",
  ),
  ("response_len", "completion length in tokens, batch mean"),
  ("truncated_frac", "fraction of completions that hit `--max_new_tokens`"),
  ("prompt_truncated", "prompts cut to the longest bucket this step"),
  ("overlong_penalty", "mean overlong-shaping penalty"),
  ("frac_rows_masked", "fraction of rows excluded from the loss (overlong masking)"),
  ("frac_groups_all_equal", "fraction of prompt groups whose rewards are all equal (no learning signal)"),
  ("adv_abs_mean", "mean absolute advantage over loss tokens"),
  ("loss", "total policy loss"),
  ("pg_loss", "policy-gradient term"),
  ("kl_loss", "KL-penalty term of the loss"),
  ("kl_k3", "k3 KL of the policy to the reference on the batch's tokens"),
  (
    "kl_prompt_*",
    "per-prompt KL to the reference: `_mean`, `_p95`, `_max` over prompts; `_max_id` the worst prompt's id",
  ),
  ("kl_coef", "KL coefficient in effect (loss + reward), set by the KL controller"),
  ("approx_kl", "approximate KL between the behaviour and the updated policy (PPO epochs)"),
  (
    "sampler_learner_kl",
    "KL between the sampler's and the learner's log-probs of the same tokens (where the sampler's own log-probs stand "
    "in for the learner's, `--behaviour_logprobs=sampler` and `auto` in synchronous runs: the gap its top-k / top-p "
    "truncation makes, 0 without one)",
  ),
  ("entropy", "policy entropy over loss tokens"),
  ("entropy_coef", "entropy-bonus coefficient in effect"),
  ("clipfrac", "fraction of tokens whose ratio was clipped"),
  ("clipfrac_low", "clipped below 1 - clip_low"),
  ("clipfrac_high", "clipped above 1 + clip_high"),
  ("dual_clip_frac", "fraction hit by the dual clip (negative advantages)"),
  ("ratio_mean", "policy ratio, mean"),
  ("ratio_max", "policy ratio, max"),
  ("is_*", "importance correction between sampler and learner: `is_ratio_mean`, `is_ratio_max`, `is_clipfrac`"),
  ("clip_low_now", "lower PPO clip in effect"),
  ("clip_high_now", "upper PPO clip in effect"),
  ("grad_clip_now", "gradient-norm clip in effect"),
  ("grad_norm", "gradient global norm before clipping"),
  ("update_norm", "global norm of the parameter update"),
  ("lr", "learning rate in effect"),
  ("phase", "phase of the reward-slope schedule (0 warm-up, 1 main, 2 fine-tune)"),
  (
    "reward_slope",
    "the smoothed reward's slope, its running average (the phase detector divides it by the average's weight so far)",
  ),
  ("skipped", "1 when this step's update was non-finite and skipped"),
  ("skipped_total", "non-finite updates skipped so far"),
  ("rollbacks", "rollbacks after non-finite steps so far"),
  ("alarm_rollbacks", "rollbacks by alarms so far (`--on_alarm=rollback`; the alarms are in `alarms.jsonl`)"),
  ("temperature", "sampling temperature of this step"),
  ("staleness_*", "policy versions between the sampler's weights and the learner's: `_mean`, `_max`"),
  ("queue_len", "async rollout: batches waiting in the queue"),
  ("rollout_share", "share of the step spent generating (with `--async_rollout`: waiting for a generated batch)"),
  ("ds_*", "dynamic sampling: `ds_rounds`, `ds_filled_groups`, `ds_kept_frac_first_round`"),
  ("curriculum/*", "pass-rate curriculum: pool statistics"),
  (
    "task/*",
    "a task mixture's batch per task: `task/<name>/share` (of the prompts), `task/<name>/reward_mean` (raw), `task/<name>/accuracy`",
  ),
  (
    "value_*",
    "critic: `value_loss`, `value_mean`, `value_pred_mean`, `value_grad_norm`, `value_update_norm`, `value_passes`, `value_skipped`, `value_lr_scale` (the critic's learning-rate scale: a value-loss alarm's rollback lowers it)",
  ),
  ("vf_clipfrac", "fraction of value predictions clipped"),
  ("explained_variance", "critic's explained variance of the returns (1 perfect, <= 0 useless)"),
  ("return_mean", "GAE return, mean"),
  (
    "flops_*",
    "compute ledger (matmul FLOPs from the shape and the real token counts): this step's `flops_generate`, `flops_score` (behaviour log-probs), `flops_reference`, `flops_value` (the critic's forward), `flops_learn` (policy and critic updates), `flops_step`; `flops_total` the run's so far",
  ),
  (
    "device_s_*",
    "device-seconds (a phase's wall time x its devices): `device_s_generate`, `device_s_train`; `device_s_total` the run's so far",
  ),
  ("samples_total", "completions trained on so far"),
  ("tokens_total", "prompt + completion tokens trained on so far"),
  (
    "time_*_s",
    "seconds of the step's parts: `generate`, `reward`, `train` (the learner, scoring included: `score` (behaviour and reference log-probs, critic values; a program timed alone) + `update` (the rest); on several emulated CPU devices, or with `--time_split=apportioned`, one program whose time is split by counted FLOPs), `checkpoint` (how long this step's own save held the loop; the last step's is `final_checkpoint_s` in summary.json), `produce`, `step`, and each side's idle time",
  ),
  (
    "mem_*_gib",
    "device memory (where the backend reports it): `mem_in_use_gib`, `mem_peak_gib` (largest over this process's devices), `mem_limit_gib`",
  ),
)


def describe(key: str) -> str | None:
  """The meaning of a metric key (None: it follows no documented name)."""
  for pattern, meaning in METRICS:
    if fnmatch.fnmatchcase(key, pattern):
      return meaning
  return None
