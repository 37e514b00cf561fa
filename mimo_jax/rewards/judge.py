"""Model as judge: pointwise scores and position-debiased pairwise verdicts.

Both judges only need a ``generate_fn(prompts: list[str], num_samples: int) ->
list[list[str]]`` that returns ``num_samples`` judge outputs per prompt; any generator
fits (a remote API, a scripted fake in tests, or the repository's own
:class:`~mimo_jax.rollout.Sampler` through :func:`sampler_generate_fn`).

**Pointwise** (:class:`JudgeReward`): the judge reads a ``{question}``/``{answer}``
template and must end with exactly one ``Score: <number>`` line.  Parsing is strict
(:func:`parse_score`): a missing score, two score lines, an out-of-range value or any
other text on the score line makes the output invalid.  A sample's reward is the mean
of its valid outputs' scores rescaled to ``[0, 1]``.  A sample without any valid output
is counted (``num_all_invalid``), and as a reward source it is a *failure* of the judge
component rather than a verdict of 0: it adds 0 to the mix, stays out of the normaliser's
statistics, and shows in ``reward/judge_fail_frac`` and the trainer's failure report, so a
judge that stops following the format is seen rather than read as a reward collapse.

**Pairwise** (:class:`PairwiseJudge`): the judge sees two answers and must give exactly
one ``Verdict: A`` or ``Verdict: B`` line.  Every comparison is asked in both orders and
the verdicts of the swapped order are mapped back before averaging the two orders, so a
judge that always prefers whichever answer comes first scores two equal answers 0.5.
A comparison without a valid verdict in either order is, as a reward source, a failure.

Prompts longer than the judge's context lose their middle (:func:`_encode_prompts`): the
template's head (the task and the question) and its tail (the end of the answer and the
instruction to end with a score) both stay in view; the cut prompts are counted.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mimo_jax import multihost
from mimo_jax.rollout.sampler import FINISH_LENGTH, bucket_for, left_pad
from mimo_jax.rollout.sampling import SamplingParams

if TYPE_CHECKING:
  from mimo_jax.rewards.base import RewardSample
  from mimo_jax.rollout.sampler import Sampler
  from mimo_jax.tokenization import Tokenizer

__all__ = [
  "DEFAULT_JUDGE_TEMPLATE",
  "DEFAULT_PAIRWISE_TEMPLATE",
  "GenerateFn",
  "JudgeInvalid",
  "JudgeReward",
  "PairwiseJudge",
  "SamplerGenerateFn",
  "parse_score",
  "parse_verdict",
  "load_judge",
  "sampler_generate_fn",
]

GenerateFn = Callable[[list[str], int], list[list[str]]]

DEFAULT_JUDGE_TEMPLATE = (
  "Rate the answer to the question from 0 to 10 for correctness and helpfulness.\n\n"
  "Question:\n{question}\n\nAnswer:\n{answer}\n\n"
  "Explain briefly, then end with one line of the form 'Score: <number>'.\n"
)

DEFAULT_PAIRWISE_TEMPLATE = (
  "Which answer to the question is better?\n\n"
  "Question:\n{question}\n\nAnswer A:\n{answer_a}\n\nAnswer B:\n{answer_b}\n\n"
  "Explain briefly, then end with one line of the form 'Verdict: A' or 'Verdict: B'.\n"
)

# A line "mentions" a score / verdict when it contains the label anywhere (any case);
# a valid output has exactly one such line and that line is exactly the label and a value.
_SCORE_MENTION = re.compile(r"score\s*:", re.IGNORECASE)
_SCORE_LINE = re.compile(r"Score:[ \t]*([+-]?\d+(?:\.\d+)?)")
_VERDICT_MENTION = re.compile(r"verdict\s*:", re.IGNORECASE)
_VERDICT_LINE = re.compile(r"Verdict:[ \t]*([AB])")


def _check_template(template: str, fields: Sequence[str], what: str) -> str:
  """Validates a :meth:`str.format` template: exactly ``fields``, each present, no other field."""
  try:
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
  except ValueError as e:
    raise ValueError(f"{what} is not a valid format string ({e}): {template!r}") from e
  wanted = set(fields)
  other = sorted(set(names) - wanted)
  missing = sorted(wanted - set(names))
  if other or missing:
    wanted_text = ", ".join("{" + f + "}" for f in fields)
    raise ValueError(
      f"{what} must use exactly the fields {wanted_text}"
      + (f"; unknown: {other}" if other else "")
      + (f"; missing: {missing}" if missing else "")
      + f": {template!r}"
    )
  try:
    template.format(**{f: "" for f in fields})  # conversions/format specs that fail on strings
  except (ValueError, IndexError, KeyError) as e:
    raise ValueError(f"{what} cannot be filled: {e!r}: {template!r}") from e
  return template


def _only_line(text: str, mention: re.Pattern[str]) -> str | None:
  """The single line of ``text`` that mentions the label, stripped; None for zero or several."""
  lines = [line.strip() for line in text.splitlines() if mention.search(line)]
  return lines[0] if len(lines) == 1 else None


def parse_score(text: str, min_score: float = 0.0, max_score: float = 10.0) -> float | None:
  """The judge's score, or None when the output is invalid.

  Valid means: exactly one line of ``text`` mentions ``score:`` (any case), that line is
  exactly ``Score: <number>`` (surrounding whitespace allowed; an integer or decimal),
  and ``min_score <= number <= max_score``.

  Args:
    text: one judge output.
    min_score: lowest allowed score.
    max_score: highest allowed score.

  Returns:
    The score as a float, or None.
  """
  line = _only_line(text, _SCORE_MENTION)
  if line is None:
    return None
  m = _SCORE_LINE.fullmatch(line)
  if m is None:
    return None
  value = float(m.group(1))
  if not min_score <= value <= max_score:
    return None
  return value


def parse_verdict(text: str) -> str | None:
  """``"A"``, ``"B"``, or None unless exactly one line mentions ``verdict:`` and it is exactly ``Verdict: A|B``."""
  line = _only_line(text, _VERDICT_MENTION)
  if line is None:
    return None
  m = _VERDICT_LINE.fullmatch(line)
  return None if m is None else m.group(1)


class JudgeInvalid(ValueError):
  """A sample the judge gave no valid verdict on (returned per sample by the reward-source interface:
  the composite reward counts it as a failure of the judge component, with this message)."""


def _cut_middle(ids: list[int], limit: int) -> list[int]:
  """``ids`` without their middle, ``limit`` long: the first half (BOS, the template's head and the
  question) and the last half (the answer's end and the closing instruction)."""
  if len(ids) <= limit:
    return ids
  head = (limit + 1) // 2
  return ids[:head] + ids[len(ids) - (limit - head) :]


def _encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], buckets: Sequence[int], rows: int):
  """BOS + prompt ids, cut to ``max(buckets)`` tokens by dropping their middle, left-padded to a bucket,
  with one-token filler rows up to ``rows`` (the convention of :func:`mimo_jax.train.loop.encode_prompts`).

  Returns:
    ``(tokens, mask, cut)``: the padded batch and the number of prompts that lost their middle.
  """
  limit = max(buckets)
  ids = [tokenizer.encode(p, add_bos=tokenizer.adds_bos) for p in prompts]
  for i, x in enumerate(ids):
    if not x:
      raise ValueError(f"prompt {i} encodes to no tokens (and the tokenizer adds no BOS)")
  cut = sum(len(x) > limit for x in ids)
  ids = [_cut_middle(x, limit) for x in ids]
  ids += [[tokenizer.pad_id]] * (rows - len(ids))
  tokens, mask = left_pad(ids, bucket_for(max(len(x) for x in ids), buckets), tokenizer.pad_id)
  return tokens, mask, cut


def _generate(generate_fn: GenerateFn, prompts: list[str], num_samples: int) -> list[list[str]]:
  outputs = generate_fn(prompts, num_samples)
  if len(outputs) != len(prompts):
    raise ValueError(f"generate_fn returned {len(outputs)} output lists for {len(prompts)} prompts")
  for i, outs in enumerate(outputs):
    if len(outs) != num_samples:
      raise ValueError(f"generate_fn returned {len(outs)} outputs for prompt {i}, expected {num_samples}")
  return outputs


def _question(sample: Any, field: str | None) -> str:
  row = getattr(sample, "row", None) or {}
  if field is not None and field in row:
    return str(row[field])
  return sample.prompt


# ----------------------------------------------------------------------------
# Pointwise
# ----------------------------------------------------------------------------


class JudgeReward:
  """A batched reward source that asks a judge model to score each completion.

  Args:
    generate_fn: ``(prompts, num_samples) -> num_samples outputs per prompt``.
    template: :meth:`str.format` template with exactly the fields ``{question}`` and
      ``{answer}`` (checked here, not at the first call).
    num_samples: judge outputs per completion (their valid scores are averaged).
    min_score: lowest valid score (rescaled to 0).
    max_score: highest valid score (rescaled to 1).
    question_field: when set and present in ``sample.row``, the question shown to the
      judge is ``row[question_field]`` instead of the full ``sample.prompt``.

  Attributes:
    num_invalid: judge outputs that failed to parse, over all calls.
    num_all_invalid: samples without a single valid output (0 from :meth:`score`, a failure from
      :meth:`__call__`), over all calls.
    num_outputs: judge outputs requested, over all calls.
    num_scored: samples scored, over all calls.
  """

  def __init__(
    self,
    generate_fn: GenerateFn,
    *,
    template: str = DEFAULT_JUDGE_TEMPLATE,
    num_samples: int = 4,
    min_score: float = 0,
    max_score: float = 10,
    question_field: str | None = None,
  ):
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not max_score > min_score:
      raise ValueError(f"max_score ({max_score}) must be greater than min_score ({min_score})")
    self.generate_fn = generate_fn
    self.template = _check_template(template, ("question", "answer"), "template")
    self.num_samples = num_samples
    self.min_score = float(min_score)
    self.max_score = float(max_score)
    self.question_field = question_field
    self.num_invalid = 0
    self.num_all_invalid = 0
    self.num_outputs = 0
    self.num_scored = 0
    self._last: dict[str, float] = {}

  def judge_prompt(self, question: str, answer: str) -> str:
    return self.template.format(question=question, answer=answer)

  def rewards_from_outputs(self, outputs: Sequence[Sequence[str]]) -> tuple[list[float], list[int]]:
    """Rewards in ``[0, 1]`` (0 when nothing is valid) and valid-output counts, per sample."""
    span = self.max_score - self.min_score
    rewards, valid_counts = [], []
    for outs in outputs:
      scores = [s for s in (parse_score(o, self.min_score, self.max_score) for o in outs) if s is not None]
      valid_counts.append(len(scores))
      rewards.append(float(np.mean([(s - self.min_score) / span for s in scores])) if scores else 0.0)
    return rewards, valid_counts

  def score(self, questions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Rewards of ``answers`` to ``questions`` (one judge call for all of them); 0 for an answer without
    any valid judge output."""
    return self._score(questions, answers)[0]

  def _score(self, questions: Sequence[str], answers: Sequence[str]) -> tuple[list[float], list[int]]:
    """:meth:`score`'s rewards and each answer's count of valid judge outputs."""
    if len(questions) != len(answers):
      raise ValueError(f"{len(questions)} questions but {len(answers)} answers")
    if not questions:
      return [], []
    prompts = [self.judge_prompt(q, a) for q, a in zip(questions, answers, strict=True)]
    outputs = _generate(self.generate_fn, prompts, self.num_samples)
    rewards, valid = self.rewards_from_outputs(outputs)
    n, total = len(prompts), len(prompts) * self.num_samples
    invalid = total - sum(valid)
    all_invalid = sum(v == 0 for v in valid)
    self.num_invalid += invalid
    self.num_all_invalid += all_invalid
    self.num_outputs += total
    self.num_scored += n
    self._last = {
      "num_samples": float(n),
      "num_outputs": float(total),
      "num_invalid": float(invalid),
      "num_all_invalid": float(all_invalid),
      "invalid_fraction": invalid / total,
      "all_invalid_fraction": all_invalid / n,
      "reward_mean": float(np.mean(rewards)),
      **_cut_metric(self.generate_fn),
    }
    return rewards, valid

  def __call__(self, samples: Sequence[RewardSample]) -> list[float | JudgeInvalid]:
    """The batched reward-source interface: one reward in ``[0, 1]`` per sample, or a
    :class:`JudgeInvalid` (a failure of the component) where none of its judge outputs was valid."""
    samples = list(samples)
    rewards, valid = self._score([_question(s, self.question_field) for s in samples], [s.completion for s in samples])
    invalid = JudgeInvalid(
      f"none of the judge's {self.num_samples} outputs ends with one valid 'Score: <number>' line "
      f"(a number in [{self.min_score:g}, {self.max_score:g}])"
    )
    return [r if v else invalid for r, v in zip(rewards, valid, strict=True)]

  def last_metrics(self) -> dict[str, float]:
    """Counts and rates of the last call (empty before the first)."""
    return dict(self._last)

  _COUNTERS = ("num_invalid", "num_all_invalid", "num_outputs", "num_scored")

  def state_dict(self) -> dict[str, Any]:
    """Counters and, when the generator keeps one (a sampler's key stream), its state."""
    return _judge_state(self)

  def load_state_dict(self, state: dict[str, Any]) -> None:
    _load_judge_state(self, state)


# ----------------------------------------------------------------------------
# Pairwise
# ----------------------------------------------------------------------------


class PairwiseJudge:
  """Position-debiased pairwise preferences from a judge model.

  Each comparison of ``a`` with ``b`` asks the judge ``num_samples`` times with ``a``
  shown first and ``num_samples`` times with ``b`` shown first.  Within an order, the
  preference for ``a`` is the fraction of valid verdicts that pick it (0.5 when that
  order has no valid verdict); the result is the mean of the two orders, so a pure
  position bias cancels.

  Args:
    generate_fn: ``(prompts, num_samples) -> num_samples outputs per prompt``.
    template: :meth:`str.format` template with exactly ``{question}``, ``{answer_a}``
      and ``{answer_b}``.
    num_samples: judge outputs per order.
    reference_field: the ``sample.row`` key holding the reference answer that
      :meth:`__call__` compares each completion against.
    question_field: as in :class:`JudgeReward`.

  Attributes:
    num_invalid: verdicts that failed to parse, over all calls.
    num_order_invalid: (comparison, order) pairs without a valid verdict, over all calls.
    num_outputs: verdicts requested, over all calls.
  """

  def __init__(
    self,
    generate_fn: GenerateFn,
    *,
    template: str = DEFAULT_PAIRWISE_TEMPLATE,
    num_samples: int = 2,
    reference_field: str = "reference",
    question_field: str | None = None,
  ):
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    self.generate_fn = generate_fn
    self.template = _check_template(template, ("question", "answer_a", "answer_b"), "template")
    self.num_samples = num_samples
    self.reference_field = reference_field
    self.question_field = question_field
    self.num_invalid = 0
    self.num_order_invalid = 0
    self.num_outputs = 0
    self._last: dict[str, float] = {}

  def compare_batch(self, questions: Sequence[str], answers_a: Sequence[str], answers_b: Sequence[str]) -> list[float]:
    """Preference for each ``a`` over its ``b`` in ``[0, 1]`` (one judge call for all)."""
    return self._compare(questions, answers_a, answers_b)[0]

  def _compare(
    self, questions: Sequence[str], answers_a: Sequence[str], answers_b: Sequence[str]
  ) -> tuple[list[float], list[int]]:
    """:meth:`compare_batch`'s preferences and each comparison's count of orders with a valid verdict."""
    if not len(questions) == len(answers_a) == len(answers_b):
      raise ValueError(f"lengths differ: {len(questions)} questions, {len(answers_a)} a, {len(answers_b)} b")
    n = len(questions)
    if n == 0:
      return [], []
    prompts = [
      self.template.format(question=q, answer_a=a, answer_b=b)
      for q, a, b in zip(questions, answers_a, answers_b, strict=True)
    ]
    prompts += [
      self.template.format(question=q, answer_a=b, answer_b=a)
      for q, a, b in zip(questions, answers_a, answers_b, strict=True)
    ]
    outputs = _generate(self.generate_fn, prompts, self.num_samples)
    invalid = order_invalid = 0
    prefs, valid_orders = [], []
    for i in range(n):
      per_order = []
      valid_here = 0
      # Order 0 shows a as "A"; order 1 shows a as "B".
      for order, outs in enumerate((outputs[i], outputs[n + i])):
        a_label = "A" if order == 0 else "B"
        verdicts = [v for v in (parse_verdict(o) for o in outs) if v is not None]
        invalid += len(outs) - len(verdicts)
        if verdicts:
          valid_here += 1
          per_order.append(float(np.mean([v == a_label for v in verdicts])))
        else:
          order_invalid += 1
          per_order.append(0.5)
      prefs.append(float(np.mean(per_order)))
      valid_orders.append(valid_here)
    total = 2 * n * self.num_samples
    self.num_invalid += invalid
    self.num_order_invalid += order_invalid
    self.num_outputs += total
    self._last = {
      "num_comparisons": float(n),
      "num_outputs": float(total),
      "num_invalid": float(invalid),
      "num_order_invalid": float(order_invalid),
      "invalid_fraction": invalid / total,
      "preference_mean": float(np.mean(prefs)),
      **_cut_metric(self.generate_fn),
    }
    return prefs, valid_orders

  def compare(self, question: str, a: str, b: str) -> float:
    """Probability-like preference for ``a`` over ``b``: 1 = ``a`` always wins, 0.5 = no preference."""
    return self.compare_batch([question], [a], [b])[0]

  def __call__(self, samples: Sequence[RewardSample]) -> list[float | JudgeInvalid]:
    """The batched reward-source interface: each completion's preference over ``row[reference_field]``,
    or a :class:`JudgeInvalid` (a failure of the component) where neither order got a valid verdict."""
    samples = list(samples)
    references = []
    for i, s in enumerate(samples):
      row = getattr(s, "row", None) or {}
      if self.reference_field not in row:
        raise KeyError(f"sample {i} has no {self.reference_field!r} in its row (keys: {sorted(row)})")
      references.append(str(row[self.reference_field]))
    prefs, valid = self._compare(
      [_question(s, self.question_field) for s in samples], [s.completion for s in samples], references
    )
    invalid = JudgeInvalid(
      f"none of the judge's {2 * self.num_samples} outputs (both orders) has one valid 'Verdict: A|B' line"
    )
    return [p if v else invalid for p, v in zip(prefs, valid, strict=True)]

  def last_metrics(self) -> dict[str, float]:
    """Counts and rates of the last call (empty before the first)."""
    return dict(self._last)

  _COUNTERS = ("num_invalid", "num_order_invalid", "num_outputs")

  def state_dict(self) -> dict[str, Any]:
    """Counters and, when the generator keeps one (a sampler's key stream), its state."""
    return _judge_state(self)

  def load_state_dict(self, state: dict[str, Any]) -> None:
    _load_judge_state(self, state)


def _cut_metric(generate_fn: Any) -> dict[str, float]:
  """``prompts_cut``: the judge prompts of the last call that lost their middle to the judge's context
  (when the generator counts them, as :class:`SamplerGenerateFn` does)."""
  cut = getattr(generate_fn, "last_cut_prompts", None)
  return {} if cut is None else {"prompts_cut": float(cut)}


def _judge_state(judge: Any) -> dict[str, Any]:
  state: dict[str, Any] = {name: getattr(judge, name) for name in judge._COUNTERS}
  if hasattr(judge.generate_fn, "state_dict"):
    state["generator"] = judge.generate_fn.state_dict()
  return state


def _load_judge_state(judge: Any, state: dict[str, Any]) -> None:
  for name in judge._COUNTERS:
    setattr(judge, name, int(state.get(name, 0)))
  if "generator" in state and hasattr(judge.generate_fn, "load_state_dict"):
    judge.generate_fn.load_state_dict(state["generator"])


# ----------------------------------------------------------------------------
# The repository's sampler as a judge
# ----------------------------------------------------------------------------


class SamplerGenerateFn:
  """A ``generate_fn`` backed by a :class:`~mimo_jax.rollout.Sampler` (see :func:`sampler_generate_fn`).

  Attributes:
    key: the PRNG key the next call splits from (advanced on every call).
    last_key: the key the last call sampled with (None before the first call).
    num_calls: calls so far.
    last_cut_prompts: prompts of the last call longer than the largest bucket (they lost their middle).
  """

  def __init__(
    self,
    sampler: Sampler,
    tokenizer: Tokenizer,
    *,
    buckets: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    key: jax.Array,
    stop_ids: Sequence[int] | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    num_rows: int | None = None,
  ):
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    self.sampler = sampler
    self.tokenizer = tokenizer
    self.buckets = tuple(sorted(buckets))
    self.max_new_tokens = max_new_tokens
    self.temperature = float(temperature)
    self.key = key
    self.last_key: jax.Array | None = None
    self.num_calls = 0
    stops = tokenizer.stop_ids if stop_ids is None else tuple(stop_ids)
    self.sampling = SamplingParams(
      top_k=top_k, top_p=top_p, stop_ids=stops, pad_id=tokenizer.pad_id, vocab_limit=tokenizer.vocab_size
    )
    self.num_rows = num_rows
    self.last_cut_prompts = 0

  def state_dict(self) -> dict[str, Any]:
    """The key stream's position (the next call's key and the call count), for checkpoints: a resumed run's
    judge samples exactly what an uninterrupted one would."""
    return {"key": np.asarray(jax.random.key_data(self.key)).tolist(), "num_calls": self.num_calls}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores :meth:`state_dict`'s key and call count."""
    data = np.asarray(state["key"], np.uint32)
    self.key = jax.random.wrap_key_data(data.reshape(np.shape(jax.random.key_data(self.key))))
    self.num_calls = int(state["num_calls"])

  def _rows(self, n: int, num_samples: int) -> int:
    """Prompt rows per device call: ``num_rows`` if set, else a power of two >= n; rounded up so that
    ``rows * num_samples`` is a multiple of the sampler's batch shards."""
    shards = self.sampler.batch_shards
    rows = self.num_rows or 1 << max(n - 1, 0).bit_length()
    step = shards // math.gcd(shards, num_samples)  # rows * num_samples must divide into the shards
    return -(-rows // step) * step

  def __call__(self, prompts: list[str], num_samples: int) -> list[list[str]]:
    prompts = list(prompts)
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    self.key, call_key = jax.random.split(self.key)
    self.last_key = call_key
    self.num_calls += 1
    self.last_cut_prompts = 0
    if not prompts:
      return []
    rows = self._rows(len(prompts), num_samples)
    vocab = self.tokenizer.vocab_size
    results: list[list[str]] = []
    for chunk_index, start in enumerate(range(0, len(prompts), rows)):
      chunk = prompts[start : start + rows]
      tokens, mask, cut = _encode_prompts(self.tokenizer, chunk, self.buckets, rows)
      self.last_cut_prompts += cut
      out = self.sampler.generate(
        tokens,
        mask,
        num_samples=num_samples,
        max_len=self.max_new_tokens,
        sampling=self.sampling,
        temperature=self.temperature,
        key=jax.random.fold_in(call_key, chunk_index),
      )
      # Whole on every host.
      comp, lengths, finish = multihost.to_host((out.completion_tokens, out.lengths, out.finish_reason))
      for i in range(len(chunk)):
        texts = []
        for j in range(num_samples):
          r = i * num_samples + j
          # Ids past the tokenizer's vocabulary (a padded embedding table) cannot be rendered.
          ids = [t for t in comp[r, : lengths[r]].tolist() if 0 <= t < vocab]
          texts.append(_finished_lines(self.tokenizer.decode(ids), cut=finish[r] == FINISH_LENGTH))
        results.append(texts)
    return results


# Appended to the unfinished last line of a judge output cut by its length limit.
CUT_MARK = "\u2026"


def _finished_lines(text: str, *, cut: bool) -> str:
  """A judge output cut by its length limit keeps its text, its unfinished last line marked with
  :data:`CUT_MARK` so it cannot parse: a score cut mid-number ("Score: 1" of "Score: 10") would
  otherwise read as a finished, wrong verdict (a line cut right at its end is refused too: the judge
  did not finish within the limit)."""
  return text + CUT_MARK if cut and not text.endswith("\n") else text


def sampler_generate_fn(
  sampler: Sampler,
  tokenizer: Tokenizer,
  *,
  buckets: Sequence[int],
  max_new_tokens: int,
  temperature: float = 1.0,
  key: jax.Array,
  stop_ids: Sequence[int] | None = None,
  top_k: int = 0,
  top_p: float = 1.0,
  num_rows: int | None = None,
) -> SamplerGenerateFn:
  """Adapts a :class:`~mimo_jax.rollout.Sampler` into a judge ``generate_fn``.

  Prompts are encoded like the trainer's (as :func:`mimo_jax.train.loop.encode_prompts` does:
  BOS, left-padded to the smallest fitting bucket) but over-long prompts lose their middle, not
  their head (:func:`_encode_prompts`; counted in ``last_cut_prompts``), and the prompt count is padded with filler rows, so shapes come from a small
  set; completions are decoded without special tokens.  Every call splits a fresh key
  from the one stored in the object, so repeated calls sample differently.

  Args:
    sampler: the judge model's sampler.
    tokenizer: the judge model's tokenizer.
    buckets: allowed padded prompt lengths.
    max_new_tokens: the completion buffer length.
    temperature: sampling temperature (0: greedy).
    key: the initial PRNG key.
    stop_ids: tokens that end an output (default: the tokenizer's stop ids).
    top_k: top-k truncation (0: off).
    top_p: nucleus truncation (1: off).
    num_rows: prompts per device call (default: the next power of two of each call's count).

  Returns:
    A callable ``(prompts, num_samples) -> list[list[str]]``.
  """
  return SamplerGenerateFn(
    sampler,
    tokenizer,
    buckets=buckets,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    key=key,
    stop_ids=stop_ids,
    top_k=top_k,
    top_p=top_p,
    num_rows=num_rows,
  )


def load_judge(
  checkpoint: str,
  *,
  mode: str,
  num_samples: int,
  max_new_tokens: int,
  temperature: float,
  key: jax.Array,
  mesh: Any = None,
) -> JudgeReward | PairwiseJudge:
  """A judge model from a Hugging Face checkpoint directory (``--judge_checkpoint``), sampled with the
  repository's own :class:`~mimo_jax.rollout.Sampler` on ``mesh``.

  ``mode="score"`` gives a :class:`JudgeReward`; ``"pairwise"`` a :class:`PairwiseJudge` comparing each
  completion with the problem's gold answer (``row["answer"]``).  Judge prompts are left-padded to
  powers of two up to what the judge's context leaves after ``max_new_tokens`` (longer prompts lose
  their middle: the task and question at the head and the closing instruction at the tail stay).
  """
  from mimo_jax.models import load_hf
  from mimo_jax.rollout.sampler import Sampler
  from mimo_jax.tokenization import load_tokenizer

  tokenizer = load_tokenizer(checkpoint)
  model = load_hf(checkpoint, mesh=mesh)
  room = model.config.max_seq_len - max_new_tokens
  if room < 16:
    raise ValueError(
      f"{checkpoint}: the judge's context ({model.config.max_seq_len}) leaves no room for prompts after "
      f"{max_new_tokens} new tokens"
    )
  buckets = [b for b in (64, 128, 256, 512, 1024, 2048) if b <= room] or [room]
  generate_fn = sampler_generate_fn(
    Sampler(model, mesh=mesh),
    tokenizer,
    buckets=buckets,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    key=key,
  )
  if mode == "pairwise":
    return PairwiseJudge(generate_fn, num_samples=num_samples, reference_field="answer")
  if mode != "score":
    raise ValueError(f"judge mode must be 'score' or 'pairwise', got {mode!r}")
  return JudgeReward(generate_fn, num_samples=num_samples)
