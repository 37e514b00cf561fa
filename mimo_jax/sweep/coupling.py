"""Coupling rules: the hyper-parameters that move together with a swept dimension.

A scaling comparison is unfair when only one thing changes: a model twice as large trained at the small
model's learning rate and KL coefficient is a worse run, not a measurement of size.  The field reports
adjust coupled settings in groups, by rules of thumb; each rule here is one of them, a small pure
function of the base point's config and the swept point's, with its source beside it.

Each rule returns the changes it makes; :func:`couple` applies them in order (model size, then rollout
batch, then the gradient clip, which follows the learning rate the earlier rules chose) and never
touches a flag that the point's own axes set.  The changes are printed by the sweep and recorded in
``results.jsonl``; ``--no_coupling`` turns them all off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection

from mimo_jax.config import Config

__all__ = ["RULES", "Change", "couple", "model_size_ratio", "non_embedding_params", "rollout_batch_ratio"]


@dataclasses.dataclass(frozen=True)
class Change:
  """One coupled setting: which rule moved which flag, from what to what, and why."""

  rule: str
  flag: str
  before: float
  after: float
  why: str

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def describe(self) -> str:
    return f"{self.rule}: --{self.flag} {self.before:.4g} -> {self.after:.4g} ({self.why})"


def non_embedding_params(cfg: Config) -> int:
  """The parameters outside the token embedding and unembedding, the size scaling laws count: the
  vocabulary of a preset is set from the task's tokenizer only when the run starts, and a swept width
  should not look larger because of it."""
  m = cfg.model.model_config()
  return m.num_params() - m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)


def model_size_ratio(base: Config, point: Config) -> float:
  """The point's non-embedding parameter count over the base's (1 for Hugging Face checkpoints, whose
  size the flags do not set)."""
  if base.model.hf_checkpoint or point.model.hf_checkpoint:
    return 1.0
  return non_embedding_params(point) / non_embedding_params(base)


def rollout_batch_ratio(base: Config, point: Config) -> float:
  """The point's completions per step (prompts x samples) over the base's."""
  b0 = base.data.prompts_per_step * base.rollout.num_samples
  return point.data.prompts_per_step * point.rollout.num_samples / b0


# --- the rules: (base, point) -> {flag: new value}, each reading the point's current values ---------------


def lr_with_model_size(base: Config, point: Config) -> dict[str, float]:
  """Learning rate with the inverse square root of the (non-embedding) parameter count.

  Source: field report 001 (learning rate): "scaled with the square root of the model size: from 7B to
  13B the learning rate goes down about 30%" (sqrt(7/13) = 0.73); report 000, section 5: doubling the
  model took the learning rate from 1.5e-5 to 1.0e-5 (x0.67; the rule gives x0.71).
  """
  r = model_size_ratio(base, point)
  return {} if r == 1.0 else {"learning_rate": point.optim.learning_rate * r**-0.5}


def kl_with_model_size(base: Config, point: Config) -> dict[str, float]:
  """Initial KL coefficient inversely with the parameter count.

  Source: field report 000, section 2: larger models are more sensitive to the KL penalty (the same
  coefficient makes them update less), so they get a smaller initial coefficient; section 5: doubling
  the model took it from 0.02 to 0.01 (x0.5 per doubling, i.e. exponent -1).
  """
  r = model_size_ratio(base, point)
  if r == 1.0 or point.algo.kl_coef == 0:
    return {}
  kl = point.algo.kl_coef / r
  if point.algo.kl_controller != "fixed":  # the controller's bounds hold the coefficient it starts from
    kl = min(max(kl, point.algo.kl_coef_min), point.algo.kl_coef_max)
  return {"kl_coef": kl}


def entropy_with_model_size(base: Config, point: Config) -> dict[str, float]:
  """Entropy coefficient up by 30% per doubling of the parameter count (exponent log2 1.3 = 0.38).

  Source: field report 000, section 2: larger models start with a lower policy entropy and converge
  early unless the entropy regularisation is stronger; section 5: doubling the model took the entropy
  coefficient from 0.01 to 0.013.  A base without an entropy bonus (0) keeps none.
  """
  r = model_size_ratio(base, point)
  if r == 1.0 or point.algo.entropy_coef == 0:
    return {}
  coef = point.algo.entropy_coef * r ** math.log2(1.3)
  if point.algo.entropy_controller != "fixed":  # the controller's bounds hold the coefficient it starts from
    coef = min(coef, point.algo.entropy_coef_max)
  return {"entropy_coef": coef}


def lr_with_rollout_batch(base: Config, point: Config) -> dict[str, float]:
  """Learning rate up only about 20% per doubling of the rollout batch (prompts x samples).

  Source: field report 000, section 3.4: the linear scaling rule of supervised learning (double the
  batch, double the learning rate) tends to diverge in RL, whose gradient noise is structured
  differently; the conservative version they used raises it about 20%.
  """
  r = rollout_batch_ratio(base, point)
  return {} if r == 1.0 else {"learning_rate": point.optim.learning_rate * 1.2 ** math.log2(r)}


def grad_clip_with_learning_rate(base: Config, point: Config) -> dict[str, float]:
  """Gradient-norm clip scaled with the point's learning rate relative to the base's.

  Source: SPEC section 3 and field report 001: the clip threshold is linked to the learning rate
  (looser when it is high, tighter when it is low) and adjusted with model scale; following the
  learning rate the size and batch rules chose carries both.  No clip in the base (0) stays off.
  """
  r = point.optim.learning_rate / base.optim.learning_rate
  if point.optim.grad_clip == 0 or math.isclose(r, 1.0):
    return {}
  return {"grad_clip": point.optim.grad_clip * r}


# In order: the size rules, the batch rule, then the clip (it reads the learning rate the others chose).
RULES: tuple[tuple[str, Callable[[Config, Config], dict[str, float]], str], ...] = (
  ("lr_with_model_size", lr_with_model_size, "params"),
  ("kl_with_model_size", kl_with_model_size, "params"),
  ("entropy_with_model_size", entropy_with_model_size, "params"),
  ("lr_with_rollout_batch", lr_with_rollout_batch, "batch"),
  ("grad_clip_with_learning_rate", grad_clip_with_learning_rate, "lr"),
)

_CONCERN = {"learning_rate": "optim", "grad_clip": "optim", "kl_coef": "algo", "entropy_coef": "algo"}


def _round(x: float) -> float:
  """Four significant digits: what the flag on the point's command line says."""
  return float(f"{x:.4g}")


def couple(base: Config, point: Config, fixed: Collection[str] = ()) -> tuple[Config, list[Change]]:
  """Applies every rule to ``point`` (a config built from ``base`` plus the point's axis values).

  Args:
    base: the sweep's base config (the flagfile and the extra flags).
    point: the point's config before coupling.
    fixed: the flags the point's axes set; no rule changes them.

  Returns:
    The coupled config and the changes made, in order.
  """
  changes: list[Change] = []
  for name, rule, _ in RULES:
    for flag, value in rule(base, point).items():
      if flag in fixed:
        continue
      concern = _CONCERN[flag]
      before = getattr(getattr(point, concern), flag)
      after = _round(value)
      if after == before:
        continue
      point = dataclasses.replace(point, **{concern: dataclasses.replace(getattr(point, concern), **{flag: after})})
      changes.append(Change(name, flag, before, after, _why(name, base, point)))
  return point, changes


def _why(rule: str, base: Config, point: Config) -> str:
  kind = dict((n, k) for n, _, k in RULES)[rule]
  if kind == "params":
    return f"parameters x{model_size_ratio(base, point):.3g}"
  if kind == "batch":
    return f"rollout batch x{rollout_batch_ratio(base, point):.3g}"
  return f"learning rate x{point.optim.learning_rate / base.optim.learning_rate:.3g}"
