"""The compute ledger: FLOPs and device-seconds of every RL step, by phase, and their running totals.

FLOPs are counted from the model's shape and the step's actual token counts (each row's real prompt
length and completion length; padding is not counted), for what the trainer runs:

- ``generate``: the prefill over each prompt, once per group of rows that share it (causal attention
  over it, logits of its last position), then one decode step per further generated token (attention
  over the prompt and the tokens so far).
  With dynamic sampling every round generated counts (rounds are counted at the trained batch's
  token counts: an estimate).
- ``score``: the behaviour log-probs, one teacher-forced forward of the policy over prompt + completion
  (logits of the completion positions only, as the fused kernel computes them); none when the sampler's
  own log-probs stand in for them (``--behaviour_logprobs``).  With ``--share_prompts`` a group's prompt
  runs once and each completion after it, less its last token (which predicts nothing).
- ``reference``: the same forward of the frozen reference (when there is one).
- ``learn``: forward + backward of the policy per PPO epoch, and of the critic per value pass, plus the
  critic's forward for the values (the critic's passes share prompts as the policy's do).  The layers
  cost 3 forwards (the backward's two products per matmul), plus what ``--remat`` recomputes: with
  ``full`` each layer's forward but its last product (the MLP down-projection, whose output the
  backward does not need), with ``dots_no_batch`` the attention products, with ``dots`` no product.
  The output head, outside the rematerialised layers, costs 3 forwards, 4 with the fused log-prob
  kernel (``--logprob_impl=fused``), whose backward recomputes each block's logits.  Matched against
  XLA's cost analysis of the update in the tests.

A forward over ``T`` tokens with ``S`` attended keys in all (summed over the queries) and ``O``
output positions costs ``T * 2 * L * (D*N*H + 2*D*K*H + N*H*D + 3*D*F) + 4 * L * N * H * S + 2 * D * V * O``
(matmuls only: norms, softmax, RoPE and the optimizer are left out; they are a few percent at these
shapes).  Device-seconds are a phase's wall time times the devices it ran on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mimo_jax.models.config import ModelConfig

__all__ = ["FlopCounter", "Ledger", "causal_keys"]


def causal_keys(start: np.ndarray | int, n: np.ndarray | int) -> np.ndarray:
  """Keys attended in all by ``n`` queries at positions ``start+1 .. start+n`` of a causal sequence."""
  start, n = np.asarray(start, np.int64), np.asarray(n, np.int64)
  return n * start + n * (n + 1) // 2


@dataclasses.dataclass(frozen=True)
class FlopCounter:
  """Matmul FLOPs of a decoder's forward passes."""

  layers: int
  d_model: int
  heads: int
  kv_heads: int
  head_dim: int
  mlp_dim: int
  vocab: int

  @classmethod
  def of(cls, cfg: ModelConfig) -> FlopCounter:
    return cls(
      cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim, cfg.vocab_size
    )

  @property
  def per_token(self) -> int:
    """Projection and MLP FLOPs of one token through every layer."""
    D, N, K, H, F = self.d_model, self.heads, self.kv_heads, self.head_dim, self.mlp_dim
    return 2 * self.layers * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)

  def forward(self, tokens, keys, outputs, *, head: str = "logits") -> int:
    """A forward over ``tokens`` tokens attending ``keys`` keys in all, with ``outputs`` output positions
    (``head``: ``logits`` of the vocabulary, or a scalar ``value``)."""
    return sum(self._terms(tokens, keys, outputs, head=head)[:3])

  def _terms(self, tokens, keys, outputs, *, head: str = "logits") -> tuple[int, int, int, int]:
    """:meth:`forward`'s (projections and MLP, attention, output head) FLOPs, and the MLP
    down-projections' share of the first."""
    out_width = self.vocab if head == "logits" else 1
    n = int(np.sum(np.asarray(tokens, np.int64)))
    return (
      n * self.per_token,
      4 * self.layers * self.heads * self.head_dim * int(np.sum(np.asarray(keys, np.int64))),
      2 * self.d_model * out_width * int(np.sum(np.asarray(outputs, np.int64))),
      n * 2 * self.layers * self.d_model * self.mlp_dim,
    )

  def generate(self, prompt_len: np.ndarray, completion_len: np.ndarray, *, group: int = 1) -> int:
    """Prefill over each prompt (once per ``group`` contiguous rows sharing it) then one decode step
    per further token (per-row lengths)."""
    p, c = np.asarray(prompt_len, np.int64), np.asarray(completion_len, np.int64)
    p_g, c_g = _groups(p, group)[:, 0], np.max(_groups(c, group), axis=1)
    prefill = self.forward(p_g, causal_keys(0, p_g), np.minimum(c_g, 1))
    steps = np.maximum(c - 1, 0)
    return prefill + self.forward(steps, causal_keys(p, steps), steps)

  def score(self, prompt_len: np.ndarray, completion_len: np.ndarray, *, head: str = "logits", group: int = 1) -> int:
    """One teacher-forced forward over prompt + completion, outputs at the completion positions; with
    ``group`` > 1 each group's prompt once, then each completion less its last token
    (``models.logprobs.completion_hidden``)."""
    return sum(self._score_terms(prompt_len, completion_len, head=head, group=group)[:3])

  def update(
    self,
    prompt_len: np.ndarray,
    completion_len: np.ndarray,
    *,
    head: str = "logits",
    group: int = 1,
    remat: str = "none",
    fused_head: bool = False,
  ) -> int:
    """Forward + backward of :meth:`score`'s pass: 3 forwards of the layers plus what ``remat``
    recomputes (``full``: the forward but the MLP down-projections; ``dots_no_batch``: the attention
    products), and 3 of the output head (4 with ``fused_head``: the kernel recomputes the logits)."""
    proj, attn, out, down = self._score_terms(prompt_len, completion_len, head=head, group=group)
    recompute = {"full": proj - down + attn, "dots_no_batch": attn}.get(remat, 0)
    return 3 * (proj + attn) + recompute + (4 if fused_head and head == "logits" else 3) * out

  def _score_terms(self, prompt_len, completion_len, *, head: str, group: int) -> tuple[int, int, int, int]:
    p, c = np.asarray(prompt_len, np.int64), np.asarray(completion_len, np.int64)
    if group == 1:
      return self._terms(p + c, causal_keys(0, p + c), c, head=head)
    p_g, rest = _groups(p, group)[:, 0], np.maximum(c - 1, 0)
    return self._terms(
      np.sum(p_g) + np.sum(rest), np.sum(causal_keys(0, p_g)) + np.sum(causal_keys(p, rest)), c, head=head
    )


def _groups(x: np.ndarray, group: int) -> np.ndarray:
  """``[B] -> [B / group, group]`` (rows of a group are contiguous)."""
  if x.shape[0] % group:
    raise ValueError(f"{x.shape[0]} rows do not split into groups of {group}")
  return x.reshape(-1, group)


class Ledger:
  """Per-step FLOPs and device-seconds by phase, and the run's totals (checkpointed with the run).

  Args:
    policy: the policy's FLOP counter.
    use_reference: a reference forward runs each step.
    use_value: a critic is trained (its forward and update passes count).
    epochs: PPO epochs over each batch.
    remat: the model's ``--remat`` policy (what the backward recomputes).
    fused_head: the policy's log-probs come from the fused kernel (its backward recomputes the logits).
    rollout_devices: devices generation runs on.
    learner_devices: devices the learner program runs on.
    sample_group: rows per prompt in generation (``--num_samples``: the sampler prefills a prompt once).
    score_group, update_group: rows per shared prompt in the learner's score pass and update
      (``learner.prompt_group``; 1: every row runs its own prompt).
  """

  def __init__(
    self,
    policy: FlopCounter,
    *,
    use_reference: bool,
    use_value: bool,
    epochs: int,
    use_behaviour_pass: bool = True,
    remat: str = "none",
    fused_head: bool = False,
    rollout_devices: int,
    learner_devices: int,
    sample_group: int = 1,
    score_group: int = 1,
    update_group: int = 1,
  ):
    self.policy = policy
    self.sample_group, self.score_group, self.update_group = sample_group, score_group, update_group
    self.use_reference = use_reference
    self.use_value = use_value
    self.use_behaviour_pass = use_behaviour_pass
    self.epochs = epochs
    self.remat, self.fused_head = remat, fused_head
    self.rollout_devices = rollout_devices
    self.learner_devices = learner_devices
    self.totals = {"flops_total": 0, "samples_total": 0, "tokens_total": 0, "device_s_total": 0.0}

  def step(
    self,
    prompt_len: np.ndarray,
    completion_len: np.ndarray,
    *,
    rounds: int = 1,
    value_passes: int = 0,
    trained: bool = True,
    time_generate_s: float = 0.0,
    time_train_s: float = 0.0,
  ) -> dict[str, float]:
    """One RL step's ledger metrics (the totals advanced).

    Args:
      prompt_len, completion_len: int ``[B]`` real token counts of the trained batch's rows.
      rounds: generation rounds (dynamic sampling).
      value_passes: critic update passes this step.
      trained: whether the policy update ran (False during ``--value_warmup_steps``).
      time_generate_s, time_train_s: the phases' wall seconds.
    """
    pc = self.policy
    score = pc.score(prompt_len, completion_len, group=self.score_group)
    out = {
      "flops_generate": float(rounds * pc.generate(prompt_len, completion_len, group=self.sample_group)),
      "flops_score": float(score if self.use_behaviour_pass else 0),
      "flops_reference": float(score if self.use_reference else 0),
    }
    policy = pc.update(
      prompt_len, completion_len, group=self.update_group, remat=self.remat, fused_head=self.fused_head
    )
    learn = self.epochs * policy if trained else 0
    value = 0
    if self.use_value:
      # The critic's passes share prompts as the policy's do: its forward as the score pass, its updates as the update.
      value = pc.score(prompt_len, completion_len, head="value", group=self.score_group)
      value_update = pc.update(prompt_len, completion_len, head="value", group=self.update_group, remat=self.remat)
      learn += value_passes * value_update
    out["flops_value"] = float(value)
    out["flops_learn"] = float(learn)
    out["flops_step"] = sum(out.values())
    out["device_s_generate"] = time_generate_s * self.rollout_devices
    out["device_s_train"] = time_train_s * self.learner_devices
    self.totals["flops_total"] += int(out["flops_step"])
    self.totals["samples_total"] += int(np.asarray(completion_len).shape[0])
    self.totals["tokens_total"] += int(np.sum(prompt_len) + np.sum(completion_len))
    self.totals["device_s_total"] += out["device_s_generate"] + out["device_s_train"]
    return {**out, **{k: float(v) for k, v in self.totals.items()}}

  def state_dict(self) -> dict[str, Any]:
    return dict(self.totals)

  def load_state_dict(self, state: dict[str, Any] | None) -> None:
    """Restores the totals of a checkpoint (a checkpoint written before the ledger: from zero)."""
    self.totals = {"flops_total": 0, "samples_total": 0, "tokens_total": 0, "device_s_total": 0.0}
    for k, v in (state or {}).items():
      if k in self.totals:
        self.totals[k] = type(self.totals[k])(v)
