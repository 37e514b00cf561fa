"""Model as judge: strict parsing, averaging and rescaling, position-debiased pairwise
verdicts, invalid-output accounting, and a real tiny model behind ``sampler_generate_fn``."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from mimo_jax.models import Transformer
from mimo_jax.models.config import tiny
from mimo_jax.rewards.base import CompositeReward, RewardSample, RewardSource
from mimo_jax.rewards.judge import (
  JudgeInvalid,
  JudgeReward,
  PairwiseJudge,
  parse_score,
  parse_verdict,
  sampler_generate_fn,
)
from mimo_jax.rollout import Sampler
from mimo_jax.tasks.arith import ArithTask, build_tokenizer

PAIR_TEMPLATE = "Q: {question}\nFirst: {answer_a}\nSecond: {answer_b}\n"


class Scripted:
  """A ``generate_fn`` that answers each prompt with ``respond(prompt, sample_index)`` and records calls."""

  def __init__(self, respond):
    self.respond = respond
    self.calls = []

  def __call__(self, prompts, num_samples):
    self.calls.append((list(prompts), num_samples))
    return [[self.respond(p, j) for j in range(num_samples)] for p in prompts]


# ----------------------------------------------------------------------------
# Strict parsing
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "text, expected",
  [
    ("Score: 7", 7.0),
    ("The answer is right.\nScore: 7.5\n", 7.5),
    ("  Score:10  ", 10.0),
    ("Score: 0", 0.0),
    ("Reasoning first.\n\nScore: 3\nThanks!", 3.0),
    ("", None),
    ("This answer deserves a seven.", None),
    ("Score: 7\nScore: 8", None),  # two scores
    ("Score: 7\nscore: 7", None),  # a second mention, any case
    ("Score: 11", None),  # out of range
    ("Score: -1", None),
    ("Score: 7/10", None),  # trailing garbage
    ("Score: 7 points", None),
    ("Score: 7.", None),
    ("Score: seven", None),
    ("Score:", None),
    ("score: 7", None),  # the label is case-sensitive
    ("My Score: 7", None),  # text before the label
    ("**Score: 7**", None),
  ],
)
def test_parse_score_is_strict(text, expected):
  assert parse_score(text, 0, 10) == expected


def test_parse_score_custom_range():
  assert parse_score("Score: 4", 1, 5) == 4.0
  assert parse_score("Score: 0.5", 1, 5) is None
  assert parse_score("Score: 5.0", 1, 5) == 5.0


@pytest.mark.parametrize(
  "text, expected",
  [
    ("Verdict: A", "A"),
    ("B is clearer.\nVerdict: B\n", "B"),
    ("Verdict:A", "A"),
    ("Verdict: C", None),
    ("Verdict: a", None),
    ("Verdict: A\nVerdict: B", None),
    ("Verdict: A or B", None),
    ("Final verdict: A", None),
    ("A", None),
  ],
)
def test_parse_verdict_is_strict(text, expected):
  assert parse_verdict(text) == expected


def test_templates_are_validated_at_construction():
  gen = Scripted(lambda p, j: "Score: 5")
  JudgeReward(gen, template="{question} -> {answer}")
  for bad in ("{question}", "{question} {answer} {extra}", "{question} {answer} {}", "{question {answer}"):
    with pytest.raises(ValueError, match="template"):
      JudgeReward(gen, template=bad)
  PairwiseJudge(gen, template=PAIR_TEMPLATE)
  with pytest.raises(ValueError, match="answer_b"):
    PairwiseJudge(gen, template="{question} {answer_a}")
  with pytest.raises(ValueError):
    JudgeReward(gen, template="{question} {answer}", min_score=5, max_score=5)


# ----------------------------------------------------------------------------
# Pointwise judge
# ----------------------------------------------------------------------------


def test_pointwise_averages_valid_scores_and_rescales():
  outputs = {
    "good": ["Score: 10", "Score: 5", "no score here", "Score: 2.5"],
    "bad": ["Score: 12", "garbage", "Score: 1\nScore: 2", "Score: 3 because"],
    "ok": ["Score: 6"] * 4,
  }

  def respond(prompt, j):
    answer = re.search(r"A=(\w+)", prompt).group(1)
    return outputs[answer][j]

  gen = Scripted(respond)
  judge = JudgeReward(gen, template="Q={question} A={answer}", num_samples=4)
  samples = [RewardSample("2+2=", a) for a in ("good", "bad", "ok")]
  rewards = judge(samples)
  # good: valid 10, 5, 2.5 -> (1 + 0.5 + 0.25) / 3; bad: nothing valid -> a failure, not a verdict; ok: 0.6.
  np.testing.assert_allclose([rewards[0], rewards[2]], [1.75 / 3, 0.6], atol=1e-9)
  assert isinstance(rewards[1], JudgeInvalid) and "'Score: <number>'" in str(rewards[1])
  assert gen.calls == [(["Q=2+2= A=good", "Q=2+2= A=bad", "Q=2+2= A=ok"], 4)]
  assert (judge.num_invalid, judge.num_all_invalid, judge.num_outputs, judge.num_scored) == (5, 1, 12, 3)
  m = judge.last_metrics()
  assert m["num_invalid"] == 5 and m["num_all_invalid"] == 1
  np.testing.assert_allclose(m["invalid_fraction"], 5 / 12)
  np.testing.assert_allclose(m["all_invalid_fraction"], 1 / 3)
  # Counters accumulate over calls; the metrics are per call.
  assert judge(samples[2:]) == [pytest.approx(0.6)]
  assert (judge.num_invalid, judge.num_all_invalid, judge.num_outputs) == (5, 1, 16)
  assert judge.last_metrics()["num_invalid"] == 0
  assert judge([]) == []
  # score(), the direct interface, gives the unjudged answer 0.
  np.testing.assert_allclose(judge.score(["2+2="] * 2, ["bad", "ok"]), [0.0, 0.6], atol=1e-9)


def test_a_sample_the_judge_gave_no_valid_score_is_a_failure_of_the_component_not_a_zero():
  """Through the composite reward: the unjudged sample adds 0 to the mix, but is counted in
  ``reward/judge_fail_frac`` with the judge's reason, and stays out of the normaliser's statistics (a
  judge that stops following the format would otherwise read as a reward collapse, fail_frac 0)."""
  outputs = {"good": "Score: 10", "bad": "I will not score this.", "ok": "Score: 6"}
  judge = JudgeReward(Scripted(lambda p, j: outputs[p.split("A=")[1]]), template="Q={question} A={answer}")
  reward = CompositeReward([RewardSource("judge", judge, batched=True)], normalize="task_running")
  batch = reward([RewardSample("2+2=", a) for a in ("good", "bad", "ok")])
  assert batch.failed["judge"].tolist() == [False, True, False]
  m = batch.metrics()
  assert m["reward/judge_fail_frac"] == pytest.approx(1 / 3) and m["reward/judge_mean"] == pytest.approx(0.8)
  assert batch.errors and batch.errors[0].startswith("judge[1]: JudgeInvalid: none of the judge's 4 outputs")
  # Standardised over the two judged samples only (1.0 and 0.6): +-1, and the failure enters as 0.
  np.testing.assert_allclose(batch.rewards, [1.0, 0.0, -1.0], atol=1e-5)


def test_pointwise_custom_range_and_question_field():
  gen = Scripted(lambda p, j: "Score: 3")
  judge = JudgeReward(gen, template="{question}|{answer}", num_samples=2, min_score=1, max_score=5, question_field="q")
  assert judge([RewardSample("long prompt", "x", row={"q": "short"})]) == [0.5]
  assert gen.calls[-1][0] == ["short|x"]
  judge([RewardSample("long prompt", "x")])  # no such field: the prompt is the question
  assert gen.calls[-1][0] == ["long prompt|x"]


def test_generate_fn_with_wrong_output_count_is_an_error():
  judge = JudgeReward(lambda prompts, n: [["Score: 1"]] * len(prompts), template="{question}{answer}", num_samples=2)
  with pytest.raises(ValueError, match="expected 2"):
    judge([RewardSample("q", "a")])


# ----------------------------------------------------------------------------
# Pairwise judge
# ----------------------------------------------------------------------------


def _shown(prompt):
  first = re.search(r"First: (.*)\n", prompt).group(1)
  second = re.search(r"Second: (.*)\n", prompt).group(1)
  return first, second


def test_swapping_cancels_position_bias():
  gen = Scripted(lambda p, j: "Both are fine.\nVerdict: A")  # always prefers the first answer shown
  judge = PairwiseJudge(gen, template=PAIR_TEMPLATE, num_samples=3)
  assert judge.compare("2+2=", "4", "four") == 0.5
  ((prompts, n),) = gen.calls
  assert n == 3 and [_shown(p) for p in prompts] == [("4", "four"), ("four", "4")]
  assert judge.num_invalid == 0 and judge.num_outputs == 6
  # Asked in the first order only, the same judge would prefer "4" every time.
  single_order = np.mean([parse_verdict(o) == "A" for o in gen([prompts[0]], 3)[0]])
  assert single_order == 1.0


def test_judge_that_prefers_the_correct_answer_gives_one_in_both_orders():
  def respond(prompt, j):
    first, second = _shown(prompt)
    return "Verdict: A" if first == "4" else "Verdict: B" if second == "4" else "Verdict: A"

  judge = PairwiseJudge(Scripted(respond), template=PAIR_TEMPLATE, num_samples=2)
  assert judge.compare("2+2=", "4", "5") == 1.0
  assert judge.compare("2+2=", "5", "4") == 0.0
  # The batched reward source compares each completion against row["reference"].
  samples = [
    RewardSample("2+2=", "5", row={"reference": "4"}),
    RewardSample("2+2=", "4", row={"reference": "4"}),  # a tie: the first-shown answer wins each order
    RewardSample("2+2=", "4", row={"reference": "7"}),
  ]
  assert judge(samples) == [0.0, 0.5, 1.0]
  assert judge.last_metrics()["num_comparisons"] == 3
  with pytest.raises(KeyError, match="reference"):
    judge([RewardSample("2+2=", "4")])


def test_pairwise_invalid_verdicts_are_counted_and_neutral():
  def respond(prompt, j):
    first, _ = _shown(prompt)
    if first == "a":  # order 0: one valid verdict for "a", one garbage
      return "Verdict: A" if j == 0 else "I refuse"
    return "Verdict: maybe"  # order 1: nothing valid

  judge = PairwiseJudge(Scripted(respond), template=PAIR_TEMPLATE, num_samples=2)
  # Order 0: 1.0 from its valid verdict; order 1: no valid verdict -> 0.5.
  assert judge.compare("q", "a", "b") == 0.75
  assert (judge.num_invalid, judge.num_order_invalid, judge.num_outputs) == (3, 1, 4)
  np.testing.assert_allclose(judge.last_metrics()["invalid_fraction"], 0.75)
  # As a reward source: one valid order still gives a preference; none in either order is a failure.
  samples = [RewardSample("q", "a", row={"reference": "b"}), RewardSample("q", "c", row={"reference": "b"})]
  prefs = judge(samples)
  assert prefs[0] == 0.75 and isinstance(prefs[1], JudgeInvalid) and "'Verdict: A|B'" in str(prefs[1])


# ----------------------------------------------------------------------------
# A real (random) model as the judge
# ----------------------------------------------------------------------------


def test_sampler_generate_fn_with_a_real_tiny_model():
  task = ArithTask(levels=(1,), seed=0, heldout_size=16)
  tokenizer = build_tokenizer(task)
  cfg = tiny().replace(vocab_size=tokenizer.vocab_size, max_seq_len=64)
  sampler = Sampler(Transformer(cfg, rngs=nnx.Rngs(0)))
  gen = sampler_generate_fn(
    sampler, tokenizer, buckets=(16,), max_new_tokens=8, temperature=1.0, key=jax.random.key(0), num_rows=4
  )
  outputs = gen(["1+2=", "30+4=", "7+7="], 3)
  assert len(outputs) == 3 and all(len(o) == 3 and all(isinstance(t, str) for t in o) for o in outputs)
  key1 = jax.random.key_data(gen.last_key)

  # The judge's outputs are digits and signs: never a score line, so every one is invalid.
  judge = JudgeReward(gen, template="{question}{answer}", num_samples=3)
  samples = [RewardSample(p.prompt, p.answer) for p in task.heldout()[:3]]
  assert all(isinstance(r, JudgeInvalid) for r in judge(samples))
  assert (judge.num_invalid, judge.num_all_invalid, judge.num_outputs) == (9, 3, 9)
  key2 = jax.random.key_data(gen.last_key)
  assert not np.array_equal(key1, key2) and gen.num_calls == 2

  # The same prompts again sample differently (a fresh key per call).
  again = gen(["1+2=", "30+4=", "7+7="], 3)
  assert again != outputs
  assert gen.last_cut_prompts == 0 and judge.last_metrics()["prompts_cut"] == 0


def test_an_over_long_judge_prompt_loses_its_middle_and_is_counted():
  """A judge prompt longer than the largest bucket keeps its head (BOS, the task and the question) and
  its tail (the answer's end and the closing instruction): cutting its head would hide the question
  (and BOS) from the judge.  The cut prompts are counted per call, as ``prompts_cut`` in the metrics."""
  from mimo_jax.rewards.judge import _encode_prompts

  task = ArithTask(levels=(1,), seed=0, heldout_size=16)
  tokenizer = build_tokenizer(task)
  long = "1+2=" + "9" * 40 + "=7"
  ids = tokenizer.encode(long, add_bos=True)
  tokens, mask, cut = _encode_prompts(tokenizer, [long, "1+2="], (16,), rows=2)
  assert cut == 1 and tokens.shape == (2, 16) and mask[0].all()
  assert tokens[0].tolist() == ids[:8] + ids[-8:] and tokens[0, 0] == tokenizer.bos_id
  cfg = tiny().replace(vocab_size=tokenizer.vocab_size, max_seq_len=64)
  gen = sampler_generate_fn(
    Sampler(Transformer(cfg, rngs=nnx.Rngs(0))), tokenizer, buckets=(16,), max_new_tokens=4, key=jax.random.key(0)
  )
  judge = JudgeReward(gen, template="{question}{answer}", num_samples=2)
  judge([RewardSample("1+2=", "9" * 40), RewardSample("1+2=", "3"), RewardSample("2+2=", "9" * 30)])
  assert gen.last_cut_prompts == 2 and judge.last_metrics()["prompts_cut"] == 2


def test_a_judge_output_cut_by_its_length_limit_loses_its_unfinished_line():
  """The sampler stops the judge at --judge_max_new_tokens: a score line cut there ("Score: 1" of
  "Score: 10") is not a verdict, so the output is invalid and counted, not a wrong score of 0.1 (its
  text is kept, the cut line marked); an output that ended (a stop token) within the limit keeps its
  score.  The judge's tokens are scripted (a tiny model cannot be made to write a score): what is
  tested is what the judge reads of them."""
  import types

  from mimo_jax.rollout.sampler import FINISH_LENGTH, FINISH_STOP

  class CharTok:  # one token per character: 0 pad, 1 EOS, 2 BOS, 3 + code point
    pad_id, eos_id, bos_id, vocab_size, stop_ids, adds_bos = 0, 1, 2, 3 + 256, (1,), True

    def encode(self, s, add_bos=False, add_eos=False):
      return ([2] if add_bos else []) + [3 + ord(c) for c in s] + ([1] if add_eos else [])

    def decode(self, ids):
      return "".join(chr(i - 3) for i in ids if i >= 3)

  written = CharTok().encode("Correct and clear.\nScore: 10", add_eos=True)

  class ScriptedSampler:
    batch_shards = 1

    def generate(self, tokens, mask, *, num_samples, max_len, sampling, temperature, key):
      rows, n = tokens.shape[0] * num_samples, min(len(written), max_len)
      comp = np.zeros((rows, max_len), np.int32)
      comp[:, :n] = written[:n]
      finish = FINISH_STOP if len(written) <= max_len else FINISH_LENGTH
      return types.SimpleNamespace(
        completion_tokens=comp, lengths=np.full((rows,), n, np.int32), finish_reason=np.full((rows,), finish)
      )

  for limit, reward, invalid in ((len(written), 1.0, 0), (len(written) - 2, 0.0, 1)):
    gen = sampler_generate_fn(ScriptedSampler(), CharTok(), buckets=(512,), max_new_tokens=limit, key=jax.random.key(0))
    judge = JudgeReward(gen, num_samples=1)
    assert judge.score(["q"], ["a"])[0] == pytest.approx(reward) and judge.num_invalid == invalid
  assert gen(["q"], 1) == [["Correct and clear.\nScore: 1\u2026"]]
