"""Tests for ``mimo_jax.tasks.arith``: generation, held-out split, SFT noise, verifier, tokenizer."""

from __future__ import annotations

import collections
import hashlib

import numpy as np
import pytest

from mimo_jax.tasks import arith
from mimo_jax.tasks.arith import (
  ArithTask,
  Problem,
  build_tokenizer,
  count_carries,
  make_problem,
  no_carry_sum,
  parse_operands,
)

# Documented operand shapes, restated here so a change in LEVELS has to be deliberate.
EXPECTED_LEVELS = {1: (2, 1, 2), 2: (2, 2, 3), 3: (2, 3, 4), 4: (3, 2, 3)}


def _operands(prompt: str) -> list[int]:
  """Independent, eval-free parse of ``"a+b+...="``."""
  assert prompt.endswith("=")
  parts = prompt[:-1].split("+")
  assert all(p.isascii() and p.isdigit() for p in parts), prompt
  return [int(p) for p in parts]


def _reference_columns(operands: list[int]) -> tuple[int, str]:
  """Schoolbook addition on digit strings: (number of carrying columns, carry-free digits)."""
  width = max(len(str(x)) for x in operands)
  padded = [str(x).zfill(width) for x in operands]
  carry, carries, digits = 0, 0, []
  for col in reversed(range(width)):
    column = sum(int(p[col]) for p in padded)
    digits.append(str(column % 10))
    carry = (column + carry) // 10
    carries += carry > 0
  return carries, "".join(reversed(digits)).lstrip("0") or "0"


# ---- held-out split -------------------------------------------------------------------


def test_heldout_is_deterministic() -> None:
  a = ArithTask(levels=(1, 2, 3, 4), seed=3, heldout_size=100).heldout()
  b = ArithTask(levels=(4, 3, 2, 1), seed=3, heldout_size=100).heldout()
  assert a == b
  assert len(a) == 100
  other = ArithTask(levels=(1, 2, 3, 4), seed=4, heldout_size=100).heldout()
  assert [p.prompt for p in a] != [p.prompt for p in other]


def test_heldout_returns_a_copy() -> None:
  task = ArithTask(seed=0, heldout_size=8)
  task.heldout().clear()
  assert len(task.heldout()) == 8


@pytest.mark.parametrize("levels,size", [((1, 2), 256), ((1, 2, 3, 4), 258), ((3,), 17)])
def test_heldout_is_balanced_and_unique(levels: tuple[int, ...], size: int) -> None:
  held = ArithTask(levels=levels, seed=0, heldout_size=size).heldout()
  assert len(held) == size
  assert len({p.prompt for p in held}) == size
  counts = collections.Counter(p.level for p in held)
  assert set(counts) == set(levels)
  assert max(counts.values()) - min(counts.values()) <= 1
  # Interleaved: any prefix is balanced as well.
  prefix = collections.Counter(p.level for p in held[: 2 * len(levels)])
  assert all(prefix[level] == 2 for level in levels)


@pytest.mark.parametrize("levels,size", [((1, 2), 256), ((1,), 2500)])
def test_heldout_disjoint_from_training(levels: tuple[int, ...], size: int) -> None:
  # The second case holds out a quarter of level 1, so without rejection thousands of
  # the 20k training draws would collide.
  task = ArithTask(levels=levels, seed=0, heldout_size=size)
  held = task.heldout()
  train = task.sample(np.random.default_rng(123), 20_000)
  assert len(train) == 20_000
  assert not {p.uid for p in held} & {p.uid for p in train}
  assert not {p.prompt for p in held} & {p.prompt for p in train}
  assert all(task.is_heldout(p) for p in held)
  assert not any(task.is_heldout(p) for p in train)
  # Held-out membership is by content, not by object or level: a level-2 problem with a
  # held-out level-1 prompt is held out too.
  two_digit = next(p for p in held if p.level == 1 and all(x >= 10 for x in _operands(p.prompt)))
  assert task.is_heldout(make_problem(_operands(two_digit.prompt), level=2))


def test_heldout_size_is_capped() -> None:
  with pytest.raises(ValueError, match="limit"):
    ArithTask(levels=(1,), heldout_size=2501)


@pytest.mark.parametrize(
  "kwargs",
  [{"levels": ()}, {"levels": (1, 1)}, {"levels": (5,)}, {"seed": -1}, {"heldout_size": -1}],
)
def test_invalid_configuration(kwargs: dict) -> None:
  with pytest.raises(ValueError):
    ArithTask(**kwargs)


# ---- training problems ------------------------------------------------------------------


def test_sample_uses_callers_rng() -> None:
  task = ArithTask(levels=(1, 2, 3, 4), seed=0, heldout_size=64)
  rng = np.random.default_rng(7)
  state = rng.bit_generator.state
  first = task.sample(rng, 50)
  assert rng.bit_generator.state != state
  rng.bit_generator.state = state
  assert task.sample(rng, 50) == first
  assert task.sample(np.random.default_rng(8), 50) != first
  assert task.sample(rng, 0) == []
  with pytest.raises(ValueError):
    task.sample(rng, -1)


def test_sample_mixes_levels_uniformly() -> None:
  task = ArithTask(levels=(1, 2, 3, 4), seed=0, heldout_size=64)
  counts = collections.Counter(p.level for p in task.sample(np.random.default_rng(0), 8000))
  assert all(abs(counts[level] - 2000) < 200 for level in (1, 2, 3, 4)), counts


@pytest.mark.parametrize("level", sorted(EXPECTED_LEVELS))
def test_answers_and_operand_sizes(level: int) -> None:
  num_operands, min_digits, max_digits = EXPECTED_LEVELS[level]
  spec = arith.LEVELS[level]
  assert (spec.num_operands, spec.min_digits, spec.max_digits) == EXPECTED_LEVELS[level]
  task = ArithTask(levels=(level,), seed=1, heldout_size=32)
  problems = task.sample(np.random.default_rng(level), 2000) + task.heldout()
  lengths_seen = set()
  for p in problems:
    ops = _operands(p.prompt)
    assert len(ops) == num_operands
    lengths = [len(str(x)) for x in ops]
    assert all(min_digits <= n <= max_digits for n in lengths), p
    lengths_seen.update(lengths)
    assert p.answer == str(sum(ops))
    assert len(p.prompt) <= 16
    assert len(p.prompt) <= task.max_prompt_len and len(p.answer) <= task.max_answer_len
    assert p.level == level and p.task == "arith"
    assert p.uid == hashlib.sha1(p.prompt.encode()).hexdigest()[:16]
  assert lengths_seen == set(range(min_digits, max_digits + 1))


def test_problem_uid_is_checked() -> None:
  p = Problem(prompt="1+2=", answer="3", level=1)
  assert p.uid == hashlib.sha1(b"1+2=").hexdigest()[:16]
  assert Problem(prompt="1+2=", answer="3", level=1, uid=p.uid) == p
  with pytest.raises(ValueError, match="uid"):
    Problem(prompt="1+2=", answer="3", level=1, uid="0" * 16)


@pytest.mark.parametrize("bad", ["1+2", "1++2=", "+2=", "a+2=", "1-2=", "1+²=", "="])
def test_parse_operands_rejects_malformed(bad: str) -> None:
  with pytest.raises(ValueError):
    parse_operands(bad)


def test_parse_operands() -> None:
  assert parse_operands("347+85=") == (347, 85)
  assert parse_operands("1+20+300=") == (1, 20, 300)


# ---- carries ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "operands,carries,no_carry",
  [
    ((47, 85), 2, 22),
    ((123, 456), 0, 579),
    ((347, 85), 2, 322),
    ((5, 95), 2, 90),
    ((95, 15), 2, 0),
    ((999, 1), 3, 990),
    ((99, 99, 99), 2, 77),
    ((0, 0), 0, 0),
    ((1009, 9), 1, 1008),
  ],
)
def test_carry_golden_cases(operands: tuple[int, ...], carries: int, no_carry: int) -> None:
  assert count_carries(operands) == carries
  assert no_carry_sum(operands) == no_carry


def test_carries_match_reference() -> None:
  rng = np.random.default_rng(0)
  for _ in range(2000):
    ops = rng.integers(0, 10 ** rng.integers(1, 6), size=rng.integers(2, 4)).tolist()
    carries, no_carry = _reference_columns(ops)
    assert count_carries(ops) == carries, ops
    assert str(no_carry_sum(ops)) == no_carry, ops
    # The mistake only shows on carry problems.
    assert (no_carry_sum(ops) == sum(ops)) == (carries == 0), ops


def test_carry_functions_reject_bad_operands() -> None:
  for fn in (count_carries, no_carry_sum):
    with pytest.raises(ValueError):
      fn([])
    with pytest.raises(ValueError):
      fn([3, -1])


def test_has_carry() -> None:
  task = ArithTask(seed=0, heldout_size=8)
  assert task.has_carry(make_problem([47, 85], level=1))
  assert not task.has_carry(make_problem([12, 34], level=1))


# ---- SFT demonstrations -------------------------------------------------------------------


def _split_sft(task: ArithTask, fraction: float, n: int = 3000) -> tuple[list[bool], list[bool]]:
  """Returns (is-correct flags for carry problems, is-correct flags for no-carry problems)."""
  carry, plain = [], []
  for prompt, completion in task.sft_examples(np.random.default_rng(5), n, wrong_carry_fraction=fraction):
    ops = _operands(prompt)
    carries, no_carry = _reference_columns(ops)
    correct = completion == str(sum(ops))
    if carries:
      assert correct or completion == no_carry, (prompt, completion)
      carry.append(correct)
    else:
      assert correct, (prompt, completion)
      plain.append(correct)
  assert len(carry) > 500 and len(plain) > 500
  return carry, plain


@pytest.fixture(scope="module")
def sft_task() -> ArithTask:
  return ArithTask(levels=(1, 2), seed=0, heldout_size=256)


def test_sft_all_correct(sft_task: ArithTask) -> None:
  carry, _ = _split_sft(sft_task, 0.0)
  assert all(carry)


def test_sft_all_carry_problems_wrong(sft_task: ArithTask) -> None:
  carry, _ = _split_sft(sft_task, 1.0)
  assert not any(carry)


def test_sft_half_wrong(sft_task: ArithTask) -> None:
  carry, _ = _split_sft(sft_task, 0.5)
  wrong = 1.0 - float(np.mean(carry))
  # >1000 carry problems: the standard error is < 0.016, so 0.07 is > 4 sigma.
  assert abs(wrong - 0.5) < 0.07, wrong


def test_sft_uses_training_problems_and_callers_rng(sft_task: ArithTask) -> None:
  a = sft_task.sft_examples(np.random.default_rng(9), 300, wrong_carry_fraction=0.3)
  assert a == sft_task.sft_examples(np.random.default_rng(9), 300, wrong_carry_fraction=0.3)
  held = {p.prompt for p in sft_task.heldout()}
  big = sft_task.sft_examples(np.random.default_rng(10), 5000, wrong_carry_fraction=0.3)
  assert not held & {prompt for prompt, _ in big}


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_sft_rejects_bad_fraction(sft_task: ArithTask, fraction: float) -> None:
  with pytest.raises(ValueError):
    sft_task.sft_examples(np.random.default_rng(0), 4, wrong_carry_fraction=fraction)


# ---- verifier ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "completion,expected",
  [
    ("432", 1.0),
    ("432 ", 1.0),
    (" 432\n", 1.0),
    ("0432", 0.0),
    ("43 2", 0.0),
    ("", 0.0),
    ("   ", 0.0),
    ("433", 0.0),
    ("43", 0.0),
    ("4320", 0.0),
    ("432\n5", 0.0),
    ("+432", 0.0),
    ("432.0", 0.0),
  ],
)
def test_reward_is_strict(completion: str, expected: float) -> None:
  task = ArithTask(seed=0, heldout_size=8)
  problem = make_problem([347, 85], level=2)
  assert task.reward(problem, completion) == expected


@pytest.mark.parametrize(
  "completion,reverse,expected",
  [
    # 347 + 85 = 432, compared from the units digit; divided by the longer length.
    ("432", False, 1.0),
    (" 432\n", False, 1.0),
    ("422", False, 2 / 3),  # tens wrong
    ("32", False, 2 / 3),  # hundreds missing
    ("0432", False, 3 / 4),  # an extra leading digit
    ("4320", False, 0.0),  # shifted: no column in place
    ("43 2", False, 1 / 4),  # only the units digit in place
    ("", False, 0.0),
    ("x", False, 0.0),
    # Reversed answers ("234") are already units-first.
    ("234", True, 1.0),
    ("235", True, 2 / 3),
    ("23", True, 2 / 3),
    ("2341", True, 3 / 4),
    ("432", True, 1 / 3),
  ],
)
def test_digit_credit_counts_digits_in_place(completion: str, reverse: bool, expected: float) -> None:
  task = ArithTask(seed=0, heldout_size=8, reverse_answer=reverse)
  problem = make_problem([347, 85], level=2, reverse_answer=reverse)
  assert task.digit_credit(problem, completion) == pytest.approx(expected)
  # Full credit exactly when the strict verifier passes.
  assert (task.digit_credit(problem, completion) == 1.0) == (task.reward(problem, completion) == 1.0)


# ---- tokenizer ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok_task() -> ArithTask:
  return ArithTask(levels=(1, 2, 3, 4), seed=0, heldout_size=64)


def test_build_tokenizer(tok_task: ArithTask) -> None:
  tok = build_tokenizer(tok_task)
  assert tok.vocab_size <= 128
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  for ch in arith.ALPHABET:
    assert len(tok.encode(ch)) == 1, ch
  # Each digit is its own token, even inside longer numbers.
  assert tok.encode("432") == [tok.encode("4")[0], tok.encode("3")[0], tok.encode("2")[0]]
  problems = tok_task.heldout() + tok_task.sample(np.random.default_rng(0), 500)
  for p in problems:
    text = p.prompt + p.answer
    ids = tok.encode(text, add_eos=True)
    assert tok.decode(ids) == text
    assert len(ids) == len(text) + 1
    # Prompt and completion can be encoded separately and concatenated.
    assert tok.encode(p.prompt) + tok.encode(p.answer) == ids[:-1]


def test_build_tokenizer_is_deterministic(tok_task: ArithTask) -> None:
  a = build_tokenizer(tok_task).model_proto_bytes()
  b = build_tokenizer(ArithTask(levels=(1, 2, 3, 4), seed=0, heldout_size=64)).model_proto_bytes()
  assert a == b


def test_tokenizer_corpus_covers_alphabet(tok_task: ArithTask) -> None:
  corpus = tok_task.tokenizer_corpus()
  assert set("".join(corpus)) == set(arith.ALPHABET)
  assert corpus == tok_task.tokenizer_corpus()


def test_build_tokenizer_rejects_tiny_vocab(tok_task: ArithTask) -> None:
  with pytest.raises(ValueError):
    build_tokenizer(tok_task, vocab_size=8)


def test_sample_can_draw_from_some_levels_only_without_changing_the_default_stream():
  task = ArithTask(levels=(1, 2), seed=3, heldout_size=16)
  default = task.sample(np.random.default_rng(5), 64)
  assert task.sample(np.random.default_rng(5), 64, levels=(1, 2)) == default
  easy = task.sample(np.random.default_rng(5), 64, levels=(1,))
  assert {p.level for p in easy} == {1} and {p.level for p in default} == {1, 2}
  examples = task.sft_examples(np.random.default_rng(5), 32, levels=(1,))
  assert all(len(prompt) <= arith.LEVELS[1].max_prompt_len for prompt, _ in examples)
  assert task.sft_examples(np.random.default_rng(5), 32, easiest=True) == examples
  with pytest.raises(ValueError, match="subset"):
    task.sample(np.random.default_rng(5), 4, levels=(3,))
