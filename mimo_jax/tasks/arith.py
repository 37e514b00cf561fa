"""Multi-digit addition: the trainer's built-in synthetic task for the CPU demo.

A problem is a compact prompt such as ``"347+85="`` whose gold completion is the sum
written in decimal (``"432"``), followed by EOS when tokenized.  Prompts and answers use
only the twelve characters of :data:`ALPHABET`, so a tokenizer with one token per
character (see :func:`build_tokenizer`) keeps sequences short for a tiny model.

Difficulty levels (see :data:`LEVELS`):

* level 1: ``a+b`` with 1-2 digit operands;
* level 2: ``a+b`` with 2-3 digit operands (carries common);
* level 3: ``a+b`` with 3-4 digit operands;
* level 4: ``a+b+c`` with three 2-3 digit operands.

Each operand's digit count is drawn uniformly from the level's range first, then its
value uniformly among numbers with exactly that many digits (``0`` counts as one digit).
Drawing the length first keeps short operands from being swamped by long ones (a
uniform draw over ``0..99`` would be 90% two-digit numbers).  All results are
non-negative and every prompt is at most 12 characters long.

The held-out split is drawn from the same distribution with its own seed and is
disjoint from training by prompt content: :meth:`ArithTask.sample` rejects and redraws
any problem whose uid (a hash of the prompt) belongs to the held-out set, whichever
level produced it (levels overlap: ``"12+34="`` is both a level 1 and a level 2 prompt).

Supervised warm-start data is deliberately imperfect: :meth:`ArithTask.sft_examples`
can answer carry problems with the classic mistake of adding column by column without
propagating carries (:func:`no_carry_sum`), so SFT teaches a mixture of a right and a
wrong procedure and RL against the exact verifier (:meth:`ArithTask.reward`) has
something real to fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections.abc import Iterable, Sequence
from types import MappingProxyType

import numpy as np

from mimo_jax.tokenization import SentencePieceTokenizer, train_sentencepiece

__all__ = [
  "ALPHABET",
  "LEVELS",
  "TASK_NAME",
  "ArithTask",
  "LevelSpec",
  "Problem",
  "build_tokenizer",
  "count_carries",
  "make_problem",
  "no_carry_sum",
  "parse_operands",
  "prompt_uid",
]

TASK_NAME = "arith"

# Every character a prompt or an answer can contain.
ALPHABET = "0123456789+="

# Seed-sequence tags keep the held-out and tokenizer-corpus streams independent of each
# other and of any stream a caller builds from the same integer seed.
_HELDOUT_TAG = 0x48454C44  # "HELD"
_CORPUS_TAG = 0x434F5250  # "CORP"

# Held-out problems are drawn in fixed-size batches, so a level's held-out draws do not
# depend on how many are requested: a smaller held-out set is (up to cross-level
# de-duplication) a prefix of a larger one.
_HELDOUT_BATCH = 256
# Rejection sampling loops stop after this many rounds.  The held-out cap in
# ArithTask.__init__ keeps the rejection rate well below one, so hitting this means a bug.
_MAX_ROUNDS = 1000
# A level's held-out share may use at most this fraction of its distinct prompts, so
# training keeps most of the problem space and rejection sampling stays cheap.
_MAX_HELDOUT_FRACTION = 0.25
# Sampled lines in the tokenizer corpus; the vocabulary is fixed by ALPHABET, so this
# only has to be large enough for SentencePiece to train at all.
_CORPUS_SIZE = 512


@dataclasses.dataclass(frozen=True)
class LevelSpec:
  """Operand shape of one difficulty level.

  Attributes:
    num_operands: how many numbers are added.
    min_digits: fewest digits an operand may have.
    max_digits: most digits an operand may have.
  """

  num_operands: int
  min_digits: int
  max_digits: int

  @property
  def max_prompt_len(self) -> int:
    """Length of the longest prompt, in characters (operands, ``+`` signs and ``=``)."""
    return self.num_operands * self.max_digits + self.num_operands

  @property
  def max_answer_len(self) -> int:
    """Number of digits of the largest possible answer."""
    return len(str(self.num_operands * (10**self.max_digits - 1)))

  @property
  def num_prompts(self) -> int:
    """Number of distinct prompts this level can produce."""
    low = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
    return (10**self.max_digits - low) ** self.num_operands


LEVELS: MappingProxyType[int, LevelSpec] = MappingProxyType(
  {
    1: LevelSpec(num_operands=2, min_digits=1, max_digits=2),
    2: LevelSpec(num_operands=2, min_digits=2, max_digits=3),
    3: LevelSpec(num_operands=2, min_digits=3, max_digits=4),
    4: LevelSpec(num_operands=3, min_digits=2, max_digits=3),
  }
)


def prompt_uid(prompt: str) -> str:
  """Returns the stable content hash identifying a prompt (first 16 hex digits of SHA-1).

  Args:
    prompt: the prompt text.

  Returns:
    A 16-character lowercase hex string.
  """
  return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Problem:
  """One arithmetic problem.

  Attributes:
    prompt: the text the model is conditioned on, e.g. ``"347+85="``.
    answer: the gold completion, the decimal sum without sign or leading zeros, e.g. ``"432"``.
    level: the difficulty level it was drawn at.
    task: the task name, ``"arith"``.
    uid: :func:`prompt_uid` of ``prompt``; computed when left empty.
  """

  prompt: str
  answer: str
  level: int
  task: str = TASK_NAME
  uid: str = ""

  def __post_init__(self) -> None:
    expected = prompt_uid(self.prompt)
    if not self.uid:
      # Frozen dataclass: the only way to fill a derived field after construction.
      object.__setattr__(self, "uid", expected)
    elif self.uid != expected:
      raise ValueError(f"uid {self.uid!r} does not match prompt {self.prompt!r} (expected {expected!r})")


def _check_operands(operands: Iterable[int]) -> list[int]:
  values = [operator.index(x) for x in operands]
  if not values:
    raise ValueError("need at least one operand")
  for x in values:
    if x < 0:
      raise ValueError(f"operands must be non-negative, got {values}")
  return values


def count_carries(operands: Iterable[int]) -> int:
  """Counts the columns that produce a carry in schoolbook addition.

  A column counts when its digit sum plus the incoming carry is 10 or more, including
  the leftmost column (whose carry becomes a new leading digit).  ``47+85`` has 2.

  Args:
    operands: non-negative integers to add.

  Returns:
    The number of carrying columns.

  Raises:
    ValueError: if there are no operands or one is negative.
  """
  values = _check_operands(operands)
  width = max(len(str(x)) for x in values)
  carry = 0
  count = 0
  for col in range(width):
    column = sum((x // 10**col) % 10 for x in values) + carry
    carry = column // 10
    count += carry > 0
  return count


def no_carry_sum(operands: Iterable[int]) -> int:
  """Adds column by column, keeping each column's sum mod 10 and dropping every carry.

  This is the typical mistake the imperfect SFT demonstrations teach: ``47+85`` gives
  ``22`` (7+5=12 -> 2, 4+8=12 -> 2) instead of 132.  It equals the true sum exactly when
  :func:`count_carries` is zero.

  Args:
    operands: non-negative integers to add.

  Returns:
    The carry-free sum (leading zero columns vanish: ``95+15`` gives 0).

  Raises:
    ValueError: if there are no operands or one is negative.
  """
  values = _check_operands(operands)
  width = max(len(str(x)) for x in values)
  return sum((sum((x // 10**col) % 10 for x in values) % 10) * 10**col for col in range(width))


def parse_operands(prompt: str) -> tuple[int, ...]:
  """Parses a prompt such as ``"347+85="`` back into its operands.

  Args:
    prompt: a prompt in this task's format.

  Returns:
    The operands, in order.

  Raises:
    ValueError: if ``prompt`` is not digits joined by ``+`` and terminated by ``=``.
  """
  if not prompt.endswith("="):
    raise ValueError(f"prompt {prompt!r} does not end with '='")
  parts = prompt[:-1].split("+")
  # str.isdigit accepts non-ASCII digits such as '²'; only 0-9 belong to this format.
  if not all(p and all("0" <= c <= "9" for c in p) for p in parts):
    raise ValueError(f"prompt {prompt!r} is not of the form 'a+b+...='")
  return tuple(int(p) for p in parts)


def make_problem(operands: Sequence[int], *, level: int, reverse_answer: bool = False) -> Problem:
  """Builds the problem that adds ``operands``.

  Args:
    operands: non-negative integers.
    level: the level to record on the problem.
    reverse_answer: write the answer least-significant digit first (``"234"`` for 432).

  Returns:
    The problem, e.g. ``Problem(prompt="347+85=", answer="432", level=2, ...)``.

  Raises:
    ValueError: if there are no operands or one is negative.
  """
  values = _check_operands(operands)
  answer = str(sum(values))
  return Problem(
    prompt="+".join(map(str, values)) + "=", answer=answer[::-1] if reverse_answer else answer, level=level
  )


def _draw_operands(rng: np.random.Generator, spec: LevelSpec, n: int) -> np.ndarray:
  """Draws ``[n, num_operands]`` operands: digit count first, then the value."""
  digits = rng.integers(spec.min_digits, spec.max_digits + 1, size=(n, spec.num_operands))
  low = np.where(digits == 1, 0, 10 ** (digits - 1))
  return rng.integers(low, 10**digits)


class ArithTask:
  """Addition problems with a strict verifier, a fixed held-out split and SFT data.

  Args:
    levels: difficulty levels to draw from (keys of :data:`LEVELS`); training samples
      pick one uniformly per problem.  Stored sorted.
    seed: seed of the held-out split (non-negative).
    heldout_size: number of held-out problems, spread evenly over ``levels``.
    reverse_answer: answers are written least-significant digit first, which turns the
      carry into a local, left-to-right computation that a tiny model learns quickly.
    sft_wrong_carry_fraction: default ``wrong_carry_fraction`` of :meth:`sft_examples`.

  Raises:
    ValueError: on an unknown or repeated level, a negative seed or size, or a held-out
      share larger than a quarter of some level's distinct prompts.
  """

  # Verification compares strings; nothing the model writes is executed (no sandbox needed).
  runs_untrusted_code = False

  def __init__(
    self,
    levels: Sequence[int] = (1, 2),
    seed: int = 0,
    heldout_size: int = 256,
    *,
    reverse_answer: bool = False,
    sft_wrong_carry_fraction: float = 0.0,
  ) -> None:
    levels = tuple(operator.index(x) for x in levels)
    if not levels:
      raise ValueError("levels must not be empty")
    if len(set(levels)) != len(levels):
      raise ValueError(f"levels must not repeat, got {levels}")
    unknown = [x for x in levels if x not in LEVELS]
    if unknown:
      raise ValueError(f"unknown levels {unknown}; known levels are {sorted(LEVELS)}")
    seed = operator.index(seed)
    if seed < 0:
      raise ValueError(f"seed must be non-negative, got {seed}")
    heldout_size = operator.index(heldout_size)
    if heldout_size < 0:
      raise ValueError(f"heldout_size must be non-negative, got {heldout_size}")
    self.levels: tuple[int, ...] = tuple(sorted(levels))
    self.seed = seed
    self.heldout_size = heldout_size
    self.reverse_answer = bool(reverse_answer)
    if not 0.0 <= sft_wrong_carry_fraction <= 1.0:
      raise ValueError(f"sft_wrong_carry_fraction must be in [0, 1], got {sft_wrong_carry_fraction}")
    self.sft_wrong_carry_fraction = float(sft_wrong_carry_fraction)

    per_level = self._heldout_counts()
    for level, count in per_level.items():
      limit = int(LEVELS[level].num_prompts * _MAX_HELDOUT_FRACTION)
      if count > limit:
        raise ValueError(
          f"heldout_size={heldout_size} puts {count} problems in level {level}, more than its limit of {limit} "
          f"({_MAX_HELDOUT_FRACTION:.0%} of its {LEVELS[level].num_prompts} distinct prompts)"
        )
    self._heldout = self._build_heldout(per_level)
    self._heldout_uids = frozenset(p.uid for p in self._heldout)

  # ---- shape ---------------------------------------------------------------------

  @property
  def name(self) -> str:
    """The task name stored on every problem."""
    return TASK_NAME

  @property
  def max_prompt_len(self) -> int:
    """Longest prompt over this task's levels, in characters (= tokens with :func:`build_tokenizer`)."""
    return max(LEVELS[x].max_prompt_len for x in self.levels)

  @property
  def max_answer_len(self) -> int:
    """Longest gold answer over this task's levels, in characters, excluding EOS."""
    return max(LEVELS[x].max_answer_len for x in self.levels)

  # ---- held-out split --------------------------------------------------------------

  def _heldout_counts(self) -> dict[int, int]:
    base, extra = divmod(self.heldout_size, len(self.levels))
    return {level: base + (i < extra) for i, level in enumerate(self.levels)}

  def _build_heldout(self, per_level: dict[int, int]) -> list[Problem]:
    taken: set[str] = set()
    by_level: dict[int, list[Problem]] = {}
    for level in self.levels:
      # One stream per level: a level's held-out problems do not shift when other
      # levels are added or removed (except for prompts another level already took).
      rng = np.random.default_rng([_HELDOUT_TAG, self.seed, level])
      chosen: list[Problem] = []
      for _ in range(_MAX_ROUNDS):
        if len(chosen) >= per_level[level]:
          break
        for row in _draw_operands(rng, LEVELS[level], _HELDOUT_BATCH):
          problem = make_problem(row.tolist(), level=level, reverse_answer=self.reverse_answer)
          if problem.uid in taken:
            continue
          taken.add(problem.uid)
          chosen.append(problem)
          if len(chosen) == per_level[level]:
            break
      else:
        raise RuntimeError(f"could not draw {per_level[level]} distinct held-out problems for level {level}")
      by_level[level] = chosen
    # Round-robin over levels, so every prefix of the held-out list is balanced too.
    order = sorted(
      ((i, li) for li, level in enumerate(self.levels) for i in range(len(by_level[level]))),
    )
    return [by_level[self.levels[li]][i] for i, li in order]

  def heldout(self) -> list[Problem]:
    """Returns the held-out problems.

    The list depends only on ``seed``, ``levels`` and ``heldout_size``; levels are
    interleaved round-robin and their counts differ by at most one.  Prompts are unique.

    Returns:
      A new list (the problems themselves are immutable).
    """
    return list(self._heldout)

  def is_heldout(self, problem: Problem) -> bool:
    """Whether ``problem``'s prompt is in the held-out set (compared by uid).

    Args:
      problem: any problem, from any level.

    Returns:
      True if a held-out problem has the same prompt.
    """
    return problem.uid in self._heldout_uids

  # ---- training data ---------------------------------------------------------------

  def sample(self, rng: np.random.Generator, n: int, *, levels: Sequence[int] | None = None) -> list[Problem]:
    """Draws ``n`` training problems, never one whose prompt is held out.

    Each problem's level is drawn uniformly from ``levels``; a held-out draw is
    redrawn at the same level, so the level mix is unaffected.  All randomness comes
    from ``rng``, so the caller can replay a stream by restoring its state.

    Args:
      rng: the numpy generator to draw from (advanced in place).
      n: number of problems.
      levels: draw from these of the task's levels only (default: all of them).

    Returns:
      ``n`` problems (repeats are possible: they are independent draws).

    Raises:
      ValueError: if ``n`` is negative, or ``levels`` names a level the task does not have.
    """
    n = operator.index(n)
    if n < 0:
      raise ValueError(f"n must be non-negative, got {n}")
    allowed = self.levels if levels is None else tuple(levels)
    if not allowed or not set(allowed) <= set(self.levels):
      raise ValueError(f"levels {list(allowed)} must be a non-empty subset of the task's levels {list(self.levels)}")
    out: list[Problem | None] = [None] * n
    level_idx = np.asarray([self.levels.index(allowed[c]) for c in rng.integers(len(allowed), size=n)], np.int64)
    pending = np.arange(n)
    for _ in range(_MAX_ROUNDS):
      if pending.size == 0:
        break
      rejected: list[int] = []
      # Vectorised per level: one generator call per level and round instead of
      # several per problem keeps large batches cheap.
      for li, level in enumerate(self.levels):
        idx = pending[level_idx[pending] == li]
        if idx.size == 0:
          continue
        for i, row in zip(idx.tolist(), _draw_operands(rng, LEVELS[level], idx.size), strict=True):
          problem = make_problem(row.tolist(), level=level, reverse_answer=self.reverse_answer)
          if problem.uid in self._heldout_uids:
            rejected.append(i)
          else:
            out[i] = problem
      pending = np.asarray(sorted(rejected), dtype=np.int64)
    else:
      if pending.size:
        raise RuntimeError(f"rejection sampling did not converge: {pending.size} problems still held out")
    return out  # type: ignore[return-value]  # every slot is filled once pending is empty

  def sample_distinct(self, rng: np.random.Generator, n: int, *, max_rounds: int = 64) -> list[Problem]:
    """Draws ``n`` distinct training problems (by uid), in the order first drawn.

    Raises:
      ValueError: if ``max_rounds`` rounds of :meth:`sample` find fewer (the levels hold too few).
    """
    out: list[Problem] = []
    seen: set[str] = set()
    for _ in range(max_rounds):
      for problem in self.sample(rng, n - len(out)):
        if problem.uid not in seen:
          seen.add(problem.uid)
          out.append(problem)
      if len(out) == n:
        return out
    raise ValueError(f"could not generate {n} distinct arith problems for levels {list(self.levels)}")

  def sft_examples(
    self,
    rng: np.random.Generator,
    n: int,
    *,
    wrong_carry_fraction: float | None = None,
    levels: Sequence[int] | None = None,
    easiest: bool = False,
  ) -> list[tuple[str, str]]:
    """Draws ``n`` supervised demonstrations, some of them deliberately wrong.

    A problem with at least one carry is answered with :func:`no_carry_sum` (the
    forgot-to-carry mistake) with probability ``wrong_carry_fraction``, otherwise with
    the gold answer; problems without carries are always answered correctly (for them
    both procedures agree).

    Args:
      rng: the numpy generator to draw from (advanced in place).
      n: number of demonstrations.
      wrong_carry_fraction: probability in ``[0, 1]`` that a carry problem's (default: the
        task's ``sft_wrong_carry_fraction``)
        demonstration is wrong.
      levels: draw the problems from these levels only (default: all; see :meth:`sample`).
      easiest: draw from the easiest of the task's levels only (the warm start's curriculum,
        ``--sft_curriculum_steps``); overrides ``levels``.

    Returns:
      ``(prompt, completion)`` pairs; completions carry no EOS, the caller appends it.

    Raises:
      ValueError: if ``n`` is negative or ``wrong_carry_fraction`` is outside ``[0, 1]``.
    """
    if wrong_carry_fraction is None:
      wrong_carry_fraction = self.sft_wrong_carry_fraction
    fraction = float(wrong_carry_fraction)
    if not 0.0 <= fraction <= 1.0:
      raise ValueError(f"wrong_carry_fraction must be in [0, 1], got {wrong_carry_fraction}")
    problems = self.sample(rng, n, levels=(min(self.levels),) if easiest else levels)
    # One uniform per problem, carry or not, so which problems turn wrong does not
    # change the stream consumed for the others.  rng.random() is in [0, 1): fraction 0
    # never and fraction 1 always makes a carry problem wrong.
    coins = rng.random(len(problems))
    examples: list[tuple[str, str]] = []
    for problem, coin in zip(problems, coins.tolist(), strict=True):
      operands = parse_operands(problem.prompt)
      if coin < fraction and count_carries(operands) > 0:
        wrong = str(no_carry_sum(operands))
        examples.append((problem.prompt, wrong[::-1] if self.reverse_answer else wrong))
      else:
        examples.append((problem.prompt, problem.answer))
    return examples

  def tokenizer_corpus(self) -> list[str]:
    """Returns texts to train the tokenizer on.

    A line with every character of :data:`ALPHABET` followed by prompt+answer lines
    drawn from the training distribution (held-out prompts excluded).  It does not depend
    on ``seed``'s training stream and is the same on every call.

    Returns:
      The corpus lines.
    """
    rng = np.random.default_rng([_CORPUS_TAG, self.seed])
    return [ALPHABET] + [p.prompt + p.answer for p in self.sample(rng, _CORPUS_SIZE)]

  # ---- verification ----------------------------------------------------------------

  def reward(self, problem: Problem, completion_text: str) -> float:
    """Scores a completion: 1.0 for exactly the gold answer, else 0.0.

    Only surrounding whitespace is forgiven; leading zeros, inner spaces, trailing text
    and the empty string all score 0.

    Args:
      problem: the problem that was posed.
      completion_text: the decoded completion (special tokens already removed).

    Returns:
      1.0 or 0.0.
    """
    return 1.0 if completion_text.strip() == problem.answer else 0.0

  def digit_credit(self, problem: Problem, completion_text: str) -> float:
    """A dense reward: the fraction of answer digits in place, compared least-significant digit first.

    Position ``i`` counts when the completion's ``i``-th digit from the units end equals the
    gold answer's; the count is divided by the longer of the two lengths, so a missing or an extra
    digit costs its share.  Only surrounding whitespace is forgiven; any other character never
    matches a digit.  The exact answer scores 1.0, the empty completion 0.0.

    Args:
      problem: the problem that was posed.
      completion_text: the decoded completion (special tokens already removed).

    Returns:
      A value in [0, 1].
    """
    pred, gold = completion_text.strip(), problem.answer
    if not self.reverse_answer:  # align on the units digit
      pred, gold = pred[::-1], gold[::-1]
    if not pred:
      return 0.0
    matches = sum(a == b for a, b in zip(pred, gold, strict=False))
    return matches / max(len(pred), len(gold))

  def has_carry(self, problem: Problem) -> bool:
    """Whether adding ``problem``'s operands carries in at least one column.

    Args:
      problem: a problem of this task.

    Returns:
      True if :func:`count_carries` of its operands is positive.
    """
    return count_carries(parse_operands(problem.prompt)) > 0


def build_tokenizer(task: ArithTask, *, vocab_size: int = 64) -> SentencePieceTokenizer:
  """Trains the task's tokenizer: one token per character of :data:`ALPHABET`.

  Every character is a user-defined symbol, so SentencePiece cannot merge any of them:
  ids are ``pad=0, unk=1, bos=2, eos=3``, then ``"0".."9"`` as 4..13, ``"+"`` as 14 and
  ``"="`` as 15, whatever the corpus; an answer of ``k`` digits is exactly ``k`` tokens.
  The vocabulary therefore has 16 pieces for any ``vocab_size >= 16`` (the trainer may
  return fewer pieces than asked, never more).  Byte fallback is off because it would add
  256 byte pieces that no problem ever needs.

  Args:
    task: the task whose :meth:`ArithTask.tokenizer_corpus` is used.
    vocab_size: target vocabulary size passed to SentencePiece; at least 16.

  Returns:
    The trained tokenizer; deterministic for a given task configuration.

  Raises:
    ValueError: if training fails (e.g. ``vocab_size`` below 16) or a character of
      :data:`ALPHABET` does not map to a single token.
  """
  tokenizer = train_sentencepiece(
    task.tokenizer_corpus(),
    vocab_size=vocab_size,
    model_type="bpe",
    user_defined_symbols=tuple(ALPHABET),
    byte_fallback=False,
  )
  # The whole demo relies on one token per character (answer length = token count), so
  # fail loudly if a SentencePiece upgrade ever changes that.
  ids = tokenizer.encode(ALPHABET)
  if len(ids) != len(ALPHABET) or tokenizer.decode(ids) != ALPHABET:
    raise ValueError(f"tokenizer does not map {ALPHABET!r} to one token per character: {ids}")
  return tokenizer
