"""Sampling-based evaluation metrics."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, HumanEval).

  The probability that at least one of ``k`` samples drawn without replacement from
  ``n`` samples, ``c`` of them correct, is correct.  Computed as a product to stay
  exact for large ``n``.

  Args:
    n: samples drawn per problem.
    c: correct samples among them.
    k: the k of pass@k (``1 <= k <= n``).

  Returns:
    pass@k in [0, 1].
  """
  if not 0 <= c <= n:
    raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
  if not 1 <= k <= n:
    raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
  if n - c < k:
    return 1.0
  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def majority_at_k(answers: Sequence[str | None], gold_correct: Sequence[bool]) -> float:
  """maj@k: 1.0 if the most frequent non-empty answer among the samples is a correct one.

  Args:
    answers: the extracted answer of each sample (None when there is none).
    gold_correct: whether each sample is correct.

  Returns:
    1.0 or 0.0 (ties are broken by first occurrence).
  """
  counts = collections.Counter(a for a in answers if a is not None)
  if not counts:
    return 0.0
  top = counts.most_common(1)[0][0]
  for a, ok in zip(answers, gold_correct, strict=True):
    if a == top:
      return float(ok)
  return 0.0
