"""One tokenizer interface, two backends: SentencePiece and Hugging Face ``tokenizers``.

Everything downstream (rollout, reward parsing, data loading) talks to :class:`Tokenizer`
and never to a backend library, so a model can switch between a ``.model`` file and a
``tokenizer.json`` without touching the trainer.

Conventions shared by both backends:

* ``encode`` never adds special tokens on its own; ``add_bos`` / ``add_eos`` are the only
  way BOS/EOS get in.  Backends that would add them implicitly (HF post-processors) are
  told not to, so prompts are never double-prefixed, and a special token spelled in the
  text (``"</s>"``) is encoded as text, not as its id.
* ``decode`` with ``skip_special=True`` drops exactly the pad/BOS/EOS ids, identically
  for both backends, and rejects ids outside the vocabulary (and values that are not
  integers) with a :class:`TokenIdError` naming the id and its position, instead of
  silently rendering garbage or failing inside a backend.  The vocabulary policy: a model
  whose vocabulary is larger than the tokenizer's (padded embedding tables) must never
  emit the extra ids; the sampler guarantees it with
  ``SamplingParams(vocab_limit=tokenizer.vocab_size)``, and decode refuses them loudly
  should one get through.
* ``pad_id`` is always a valid id (falls back to EOS), so padded arrays can be fed to an
  embedding lookup without masking the ids first.

* A model's own chat template (``chat_template`` in ``tokenizer_config.json``, or
  ``chat_template.jinja`` beside it) is rendered the way Hugging Face ``transformers`` renders
  it (Jinja in a sandbox, ``trim_blocks`` / ``lstrip_blocks``) and the rendered text is encoded
  with its special tokens recognised and nothing added, as ``apply_chat_template(...,
  tokenize=True)`` does there (:meth:`Tokenizer.encode_chat`).  With ``--chat_template=model`` a
  run's prompts go through it (:meth:`Tokenizer.with_chat_prompts`).

:func:`train_sentencepiece` trains a small lossless model in memory, mostly for tests
and toy experiments; :func:`load_tokenizer` picks a backend from a path on disk.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import datetime
import functools
import io
import json
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import sentencepiece as spm

from mimo_jax.files import write_atomic

if TYPE_CHECKING:
  import tokenizers

__all__ = [
  "CHAT_ROLES",
  "HFTokenizer",
  "PaddedBatch",
  "SentencePieceTokenizer",
  "TokenIdError",
  "Tokenizer",
  "bucket_length",
  "load_tokenizer",
  "train_sentencepiece",
]

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")
# Where a Hugging Face model directory keeps its chat template when not in tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

PathLike = str | os.PathLike[str]


class TokenIdError(ValueError):
  """An id given to :meth:`Tokenizer.decode` that is not an integer in ``[0, vocab_size)``."""


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedBatch:
  """A batch of token sequences padded to one bucket length.

  ``eq=False`` because element-wise numpy comparison makes a generated ``__eq__``
  ambiguous; compare the arrays explicitly instead.

  Attributes:
    ids: ``int32 [B, T]`` token ids; padding positions hold the tokenizer's pad id.
    mask: ``bool [B, T]``, True at real tokens and False at padding.
    lengths: ``int32 [B]`` number of real tokens per row.
  """

  ids: np.ndarray
  mask: np.ndarray
  lengths: np.ndarray

  def __post_init__(self) -> None:
    if self.ids.ndim != 2 or self.ids.shape != self.mask.shape or self.lengths.shape != self.ids.shape[:1]:
      raise ValueError(
        f"inconsistent PaddedBatch shapes: ids {self.ids.shape}, mask {self.mask.shape}, lengths {self.lengths.shape}"
      )


def keep_last_tokens(ids: list[int], limit: int, bos_id: int | None) -> list[int]:
  """``ids`` cut to their last ``limit`` tokens, a leading BOS kept in front of them: a prompt cut from the
  left still starts like every prompt the model saw (it lost its BOS with its head)."""
  if len(ids) <= limit:
    return ids
  if bos_id is not None and limit > 1 and ids[0] == bos_id:
    return [ids[0], *ids[len(ids) - limit + 1 :]]
  return ids[-limit:]


def bucket_length(n: int, buckets: Sequence[int]) -> int:
  """Returns the smallest bucket length that holds ``n`` tokens.

  Bucketing keeps the set of padded shapes small, so jitted functions compile once per
  bucket instead of once per distinct batch length.

  Args:
    n: the length that must fit.
    buckets: candidate lengths, in any order; each must be a positive integer.

  Returns:
    The smallest ``b`` in ``buckets`` with ``b >= n``.

  Raises:
    ValueError: if ``buckets`` is empty or holds a non-positive length, or if ``n``
      exceeds every bucket.
  """
  ordered = sorted(int(b) for b in buckets)
  if not ordered:
    raise ValueError("buckets must not be empty")
  if ordered[0] <= 0:
    raise ValueError(f"bucket lengths must be positive, got {ordered}")
  for b in ordered:
    if b >= n:
      return b
  raise ValueError(f"longest sequence has length {n}, which fits none of the buckets {ordered}")


class Tokenizer(abc.ABC):
  """The tokenizer interface the rest of ``mimo_jax`` relies on.

  Subclasses implement the backend-specific primitives (vocabulary, special ids,
  ``_encode_plain`` / ``_decode_plain`` / ``_decode_keep_special``); padding, special-token
  handling, id validation and the chat template live here so that both backends behave
  identically.
  """

  # ---- backend primitives -------------------------------------------------------

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can produce (valid ids are ``0 .. vocab_size - 1``)."""

  @property
  @abc.abstractmethod
  def bos_id(self) -> int | None:
    """The beginning-of-sequence id, or None if the vocabulary has no BOS token."""

  @property
  @abc.abstractmethod
  def eos_id(self) -> int:
    """The end-of-sequence id."""

  @property
  @abc.abstractmethod
  def pad_id(self) -> int:
    """The padding id; equal to :attr:`eos_id` when the vocabulary has no pad token."""

  @abc.abstractmethod
  def _encode_plain(self, texts: list[str]) -> list[list[int]]:
    """Encodes texts without adding any special tokens."""

  @abc.abstractmethod
  def _decode_plain(self, ids: list[int]) -> str:
    """Decodes ids that contain none of pad/BOS/EOS."""

  @abc.abstractmethod
  def _decode_keep_special(self, ids: list[int]) -> str:
    """Decodes ids, rendering pad/BOS/EOS as their token text."""

  # ---- public API ----------------------------------------------------------------

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The ids that end a generation: :attr:`eos_id` first, then any other end-of-sequence ids the model
    declares (a chat model's end-of-turn token)."""
    return (self.eos_id,)

  @property
  def special_ids(self) -> frozenset[int]:
    """The ids :meth:`decode` drops when ``skip_special`` is set: pad, BOS and the stop ids."""
    ids = {*self.stop_ids, self.pad_id}
    if self.bos_id is not None:
      ids.add(self.bos_id)
    return frozenset(ids)

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Encodes one string.

    Args:
      text: the text to encode.
      add_bos: prepend :attr:`bos_id`.
      add_eos: append :attr:`eos_id`.

    Returns:
      The token ids.

    Raises:
      ValueError: if ``add_bos`` is set but the tokenizer has no BOS token.
    """
    return self.encode_batch([text], add_bos=add_bos, add_eos=add_eos)[0]

  def encode_batch(self, texts: Iterable[str], *, add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
    """Encodes several strings; same semantics as :meth:`encode` applied to each.

    Args:
      texts: the texts to encode.
      add_bos: prepend :attr:`bos_id` to every sequence.
      add_eos: append :attr:`eos_id` to every sequence.

    Returns:
      One list of ids per input text, in order.

    Raises:
      TypeError: if an element of ``texts`` is not a string.
      ValueError: if ``add_bos`` is set but the tokenizer has no BOS token.
    """
    texts = list(texts)
    for i, t in enumerate(texts):
      if not isinstance(t, str):
        raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
    if add_bos and self.bos_id is None:
      raise ValueError("add_bos=True but this tokenizer has no BOS token")
    prefix = [self.bos_id] if add_bos else []
    suffix = [self.eos_id] if add_eos else []
    return [prefix + seq + suffix for seq in self._encode_plain(texts)]

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    """Decodes ids back to text.

    Decoding does not stop at EOS; callers that want truncation do it on the ids.

    Args:
      ids: token ids (any integer sequence, including a 1-D numpy array).
      skip_special: drop pad/BOS/EOS ids; otherwise they are rendered as their token text.

    Returns:
      The decoded string.

    Raises:
      TokenIdError: (a ``ValueError``) if an id is not an integer, is negative or is
        ``>= vocab_size``; the message names the id and its position.
    """
    checked = self._check_ids(ids)
    if skip_special:
      specials = self.special_ids
      return self._decode_plain([i for i in checked if i not in specials])
    return self._decode_keep_special(checked)

  def pad_batch(
    self,
    seqs: Sequence[Sequence[int]],
    *,
    buckets: Sequence[int],
    side: Literal["left", "right"] = "left",
  ) -> PaddedBatch:
    """Pads sequences to the smallest bucket length that fits the longest one.

    Left padding is the default because generation appends to the right end of every
    row: with left padding all prompts end at the same column.

    Args:
      seqs: token id sequences.
      buckets: allowed padded lengths (see :func:`bucket_length`).
      side: where the padding goes, ``"left"`` or ``"right"``.

    Returns:
      A :class:`PaddedBatch` whose padding positions hold :attr:`pad_id`.

    Raises:
      ValueError: if ``side`` is invalid or the longest sequence fits no bucket.
    """
    if side not in ("left", "right"):
      raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    rows = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
    lengths = np.array([r.shape[0] for r in rows], dtype=np.int32)
    longest = int(lengths.max()) if rows else 0
    width = bucket_length(longest, buckets)
    ids = np.full((len(rows), width), self.pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=bool)
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
      start = width - n if side == "left" else 0
      ids[b, start : start + n] = row
      mask[b, start : start + n] = True
    return PaddedBatch(ids=ids, mask=mask, lengths=lengths)

  @property
  def adds_bos(self) -> bool:
    """Whether a prompt starts with :attr:`bos_id` (:meth:`encode_prompt`): as the model's own tokenizer
    encodes a text; by default whenever there is a BOS."""
    return self.bos_id is not None

  @property
  def chat_template(self) -> str | None:
    """The model's own chat template (Jinja source), or None when the tokenizer ships none."""
    return None

  _chat_prompts = False  # set on the copy with_chat_prompts makes

  @property
  def chat_prompts(self) -> bool:
    """Whether :meth:`encode_prompt` renders a prompt through :attr:`chat_template` (:meth:`with_chat_prompts`)."""
    return self._chat_prompts

  def with_chat_prompts(self) -> Tokenizer:
    """This tokenizer, with :meth:`encode_prompt` rendering each prompt as the one user message of a
    conversation through the model's :attr:`chat_template` (a copy; this one is unchanged).

    Raises:
      ValueError: if the tokenizer has no chat template.
    """
    if self.chat_template is None:
      raise ValueError(
        "this tokenizer has no chat template (an HF directory's tokenizer_config.json 'chat_template' "
        f"or {CHAT_TEMPLATE_FILE})"
      )
    chat = copy.copy(self)
    chat._chat_prompts = True
    return chat

  def encode_prompt(self, text: str) -> list[int]:
    """A task's prompt as the policy reads it: the text after BOS (when the tokenizer has one); with
    :meth:`with_chat_prompts`, the one user message of a conversation rendered by the model's chat
    template, ending where the assistant's turn begins (:meth:`encode_chat`)."""
    if self.chat_prompts:
      return self.encode_chat([{"role": "user", "content": text}])
    return self.encode(text, add_bos=self.adds_bos)

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
  ) -> str:
    """Renders a conversation: with the model's own :attr:`chat_template` when it has one, else with
    the package's simple chat format.

    The model's template is rendered as ``transformers`` renders it (the messages,
    ``add_generation_prompt`` and the special tokens' texts as ``bos_token`` / ``eos_token`` /
    ``pad_token`` / ``unk_token``).  The simple format makes each message
    ``"<|{role}|>\\n{content}\\n"``.  The result is a string (not ids): :meth:`encode_chat` encodes it.

    Args:
      messages: mappings with ``"role"`` and ``"content"`` (the simple format: a role of
        :data:`CHAT_ROLES` and string content).
      add_generation_prompt: end where the assistant's reply begins (the simple format appends
        ``"<|assistant|>\\n"``).

    Returns:
      The rendered conversation.

    Raises:
      ValueError: if a message lacks a key, has an unknown role, or non-string content, or the model's
        template fails (its own ``raise_exception``, a syntax error).
    """
    for i, message in enumerate(messages):
      if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
        keys = sorted(message) if isinstance(message, Mapping) else type(message).__name__
        raise ValueError(f"messages[{i}] must have 'role' and 'content' keys, got {keys}")
    if self.chat_template is not None:
      return _render_chat_template(
        self.chat_template,
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        **self._special_token_texts(),
      )
    pieces: list[str] = []
    for i, message in enumerate(messages):
      role, content = message["role"], message["content"]
      if role not in CHAT_ROLES:
        raise ValueError(f"messages[{i}] has role {role!r}; expected one of {CHAT_ROLES}")
      if not isinstance(content, str):
        raise ValueError(f"messages[{i}] content must be str, got {type(content).__name__}")
      pieces.append(f"<|{role}|>\n{content}\n")
    if add_generation_prompt:
      pieces.append("<|assistant|>\n")
    return "".join(pieces)

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    """A conversation's ids, :meth:`apply_chat_template` then encoded.

    The model's own template writes its special tokens (a turn's start and end, a BOS where the model
    wants one) as text: they are encoded as their ids, and nothing is added, as ``transformers``'
    ``apply_chat_template(..., tokenize=True)`` does.  The simple format's text is encoded like any
    prompt (after BOS when there is one; its markers are text).
    """
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    if self.chat_template is None:
      return self.encode(text, add_bos=self.adds_bos)
    return self._encode_with_specials(text)

  def _special_token_texts(self) -> dict[str, str]:
    """The special tokens' texts a chat template reads (``bos_token``, ``eos_token``, ...)."""
    return {}

  def _encode_with_specials(self, text: str) -> list[int]:
    """Encodes ``text`` with the special tokens written in it recognised as their ids, nothing added."""
    raise NotImplementedError(f"{type(self).__name__} renders no model chat template")

  # ---- helpers -------------------------------------------------------------------

  def _check_ids(self, ids: Sequence[int]) -> list[int]:
    if hasattr(ids, "__array__") and not isinstance(ids, (list, tuple)):
      ids = np.asarray(ids)  # numpy and jax arrays
    if isinstance(ids, np.ndarray):
      if ids.dtype.kind not in "iub":
        raise TokenIdError(f"token ids must be integers, got an array of dtype {ids.dtype}")
      raw = ids.reshape(-1).tolist()
    else:
      raw = ids
    out = []
    for pos, i in enumerate(raw):
      try:
        out.append(operator.index(i))
      except TypeError:
        raise TokenIdError(f"token id {i!r} at position {pos} is not an integer") from None
    n = self.vocab_size
    for pos, i in enumerate(out):
      if i < 0 or i >= n:
        raise TokenIdError(
          f"token id {i} at position {pos} is outside the vocabulary [0, {n}) of this tokenizer; a model whose "
          f"vocabulary is larger must not sample such ids (sample with SamplingParams(vocab_limit={n}))"
        )
    return out


# ======================================================================================
# SentencePiece
# ======================================================================================


class SentencePieceTokenizer(Tokenizer):
  """A :class:`Tokenizer` backed by a serialized SentencePiece model.

  The serialized proto is kept so the exact model can be written next to a checkpoint
  (:meth:`model_proto_bytes`).
  """

  def __init__(self, model_proto: bytes, *, more_stop_ids: Sequence[int] = ()) -> None:
    """Loads a model from its serialized proto.

    Args:
      model_proto: the bytes of a ``.model`` file.
      more_stop_ids: other ids that end a generation besides EOS (a checkpoint directory's
        ``config.json`` / ``generation_config.json`` ``eos_token_id`` lists).

    Raises:
      ValueError: if the model has no EOS piece.
    """
    self._proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
    eos = self._sp.eos_id()
    if eos < 0:
      raise ValueError("SentencePiece model has no EOS piece (eos_id = -1); one is required")
    bos = self._sp.bos_id()
    pad = self._sp.pad_id()
    self._eos = eos
    self._bos = bos if bos >= 0 else None
    self._pad = pad if pad >= 0 else eos
    vocab = self._sp.get_piece_size()
    self._stops = (eos, *dict.fromkeys(int(i) for i in more_stop_ids if int(i) != eos and 0 <= int(i) < vocab))

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The EOS id, then the other end-of-sequence ids the directory's configs list."""
    return self._stops

  @classmethod
  def from_file(cls, path: PathLike) -> SentencePieceTokenizer:
    """Loads a ``.model`` file.

    Args:
      path: path to the SentencePiece model file.

    Returns:
      The tokenizer.
    """
    with open(path, "rb") as f:
      return cls(f.read())

  @classmethod
  def from_bytes(cls, model_proto: bytes) -> SentencePieceTokenizer:
    """Loads a model from serialized bytes (e.g. :meth:`model_proto_bytes` output).

    Args:
      model_proto: the serialized model.

    Returns:
      The tokenizer.
    """
    return cls(model_proto)

  def model_proto_bytes(self) -> bytes:
    """Returns the serialized model, byte-identical to what was loaded or trained."""
    return self._proto

  @property
  def processor(self) -> spm.SentencePieceProcessor:
    """The underlying ``SentencePieceProcessor``, for backend-specific queries."""
    return self._sp

  @property
  def vocab_size(self) -> int:
    """Number of pieces in the model."""
    return self._sp.get_piece_size()

  @property
  def bos_id(self) -> int | None:
    """The BOS id, or None if the model defines none."""
    return self._bos

  @property
  def eos_id(self) -> int:
    """The EOS id."""
    return self._eos

  @property
  def pad_id(self) -> int:
    """The pad id, or the EOS id if the model defines no pad piece."""
    return self._pad

  def _encode_plain(self, texts: list[str]) -> list[list[int]]:
    if not texts:
      return []
    return [list(seq) for seq in self._sp.encode(texts, out_type=int)]

  def _decode_plain(self, ids: list[int]) -> str:
    return self._sp.decode(ids) if ids else ""

  def _decode_keep_special(self, ids: list[int]) -> str:
    # SentencePiece always drops control pieces (pad/BOS/EOS) when decoding, so their
    # text has to be spliced in.  Decoding the runs between them separately would be
    # wrong for models with a dummy prefix (each run would lose its leading space), so
    # decode the plain ids once and insert each special at the offset where the decoded
    # prefix before it ends.
    specials = self.special_ids
    plain = [i for i in ids if i not in specials]
    full = self._decode_plain(plain)
    inserts: list[tuple[int, str]] = []
    n_plain = 0
    offset = 0
    decoded_upto = 0
    for i in ids:
      if i not in specials:
        n_plain += 1
        continue
      if decoded_upto != n_plain:
        prefix = self._decode_plain(plain[:n_plain])
        if not full.startswith(prefix):
          # Prefix decoding is not a prefix of the whole (a special splitting a
          # byte-fallback character): fall back to per-run decoding.
          return self._decode_by_runs(ids)
        offset, decoded_upto = len(prefix), n_plain
      inserts.append((offset, self._sp.id_to_piece(i)))
    parts: list[str] = []
    last = 0
    for pos, text in inserts:
      parts.append(full[last:pos])
      parts.append(text)
      last = pos
    parts.append(full[last:])
    return "".join(parts)

  def _decode_by_runs(self, ids: list[int]) -> str:
    specials = self.special_ids
    parts: list[str] = []
    run: list[int] = []
    for i in ids:
      if i in specials:
        parts.append(self._decode_plain(run))
        parts.append(self._sp.id_to_piece(i))
        run = []
      else:
        run.append(i)
    parts.append(self._decode_plain(run))
    return "".join(parts)


def train_sentencepiece(
  texts: Iterable[str],
  *,
  vocab_size: int,
  model_type: str = "bpe",
  user_defined_symbols: Sequence[str] = (),
  byte_fallback: bool = True,
  num_threads: int = 1,
) -> SentencePieceTokenizer:
  """Trains a lossless SentencePiece model in memory.

  SentencePiece's defaults normalise text (NFKC, collapsing whitespace runs, adding a
  leading space), which breaks exact round trips on code and arithmetic; this turns all
  of that off and splits digits so numbers tokenize uniformly.  Ids are fixed to
  ``pad=0, unk=1, bos=2, eos=3``.

  Args:
    texts: training sentences.  Each element is one sentence; it may contain newlines.
    vocab_size: target vocabulary size.  Training may return fewer pieces when the corpus
      is too small (``hard_vocab_limit=False``), never more.  With ``byte_fallback`` it
      must cover the 256 byte pieces, the 4 special pieces and every distinct character.
    model_type: ``"bpe"``, ``"unigram"``, ``"char"`` or ``"word"``.
    user_defined_symbols: strings always kept as single pieces (e.g. chat markers).
    byte_fallback: encode characters missing from the vocabulary as UTF-8 bytes instead
      of ``<unk>``, keeping round trips exact for unseen text.
    num_threads: trainer threads.  Unigram scores depend on the thread count (floating
      point summation order), so it is pinned to keep model bytes reproducible.

  Returns:
    The trained tokenizer.

  Raises:
    ValueError: if training fails (typically ``vocab_size`` too small for the corpus).
  """
  writer = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts),
      model_writer=writer,
      vocab_size=vocab_size,
      model_type=model_type,
      user_defined_symbols=list(user_defined_symbols),
      byte_fallback=byte_fallback,
      pad_id=0,
      unk_id=1,
      bos_id=2,
      eos_id=3,
      pad_piece="<pad>",
      unk_piece="<unk>",
      bos_piece="<s>",
      eos_piece="</s>",
      normalization_rule_name="identity",
      add_dummy_prefix=False,
      remove_extra_whitespaces=False,
      split_digits=True,
      hard_vocab_limit=False,
      # Without this, runs of spaces can only be spelled one "▁" at a time, which makes
      # indented code needlessly long.
      allow_whitespace_only_pieces=True,
      # Cover every character seen: the default (0.9995) maps rare characters to <unk>
      # (or bytes), which is the wrong trade-off for small corpora.
      character_coverage=1.0,
      num_threads=num_threads,
      minloglevel=2,
    )
  except RuntimeError as e:
    raise ValueError(f"SentencePiece training failed (vocab_size={vocab_size}, model_type={model_type!r}): {e}") from e
  return SentencePieceTokenizer(writer.getvalue())


# ======================================================================================
# A model's chat template
# ======================================================================================


class ChatTemplateError(ValueError):
  """A model's chat template refused the conversation (its ``raise_exception``) or failed to render."""


def _template_error(message: str) -> None:
  raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
  # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON, non-ASCII kept.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> Any:
  """``source`` compiled in a sandboxed Jinja environment set up as chat templates expect."""
  try:
    import jinja2
    from jinja2 import ext, sandbox
  except ImportError as e:
    raise ImportError("a model's chat template needs jinja2: pip install jinja2 (part of the `hf` extra)") from e

  class GenerationBlock(ext.Extension):
    """``{% generation %} ... {% endgeneration %}`` (it marks the assistant's tokens for a training
    mask elsewhere): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
      next(parser.stream)
      return parser.parse_statements(("name:endgeneration",), drop_needle=True)

  env = sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _template_error
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def _render_chat_template(source: str, **context: Any) -> str:
  import jinja2

  template = _compile_chat_template(source)
  try:
    return template.render(**context)
  except ChatTemplateError:
    raise
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the chat template failed to render: {e}") from e


def _chat_template_of(config_dir: str, tok_config: Mapping[str, Any]) -> str | None:
  """A model directory's chat template: ``chat_template.jinja`` if present, else ``tokenizer_config.json``'s
  ``chat_template`` (a string, or a list of named templates, of which ``default`` is taken)."""
  path = os.path.join(config_dir, CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  value = tok_config.get("chat_template")
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise ValueError(
      f"tokenizer_config.json in {config_dir!r}: chat_template lists templates {sorted(map(str, named))} "
      "but none named 'default'"
    )
  raise ValueError(
    f"tokenizer_config.json in {config_dir!r}: chat_template must be a string or a list of named templates, "
    f"got {type(value).__name__}"
  )


# ======================================================================================
# Hugging Face tokenizers
# ======================================================================================


def _import_tokenizers() -> Any:
  try:
    import tokenizers
  except ImportError as e:
    raise ImportError("HFTokenizer needs the Hugging Face `tokenizers` package: pip install tokenizers") from e
  return tokenizers


def _token_content(value: Any) -> str | None:
  """Extracts a token string from a ``tokenizer_config.json`` field (str, AddedToken dict or null)."""
  if value is None:
    return None
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"unrecognised special-token entry {value!r}: expected a string or a dict with 'content'")


def _first_id(value: Any) -> int | None:
  """Reads a ``config.json`` id field, which may be null, an int, or a list of ints."""
  ids = _all_ids(value)
  # Multi-EOS configs (e.g. end-of-text and end-of-turn) list the primary one first.
  return ids[0] if ids else None


def _all_ids(value: Any) -> list[int]:
  """Every id of a ``config.json`` / ``generation_config.json`` id field (null, an int, or a list)."""
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: str) -> dict[str, Any]:
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if not isinstance(data, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
  return data


class HFTokenizer(Tokenizer):
  """A :class:`Tokenizer` backed by a Hugging Face ``tokenizers.Tokenizer`` (``tokenizer.json``)."""

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    *,
    eos_id: int,
    bos_id: int | None = None,
    pad_id: int | None = None,
    more_stop_ids: Sequence[int] = (),
    chat_template: str | None = None,
    template_tokens: Mapping[str, str] | None = None,
    adds_bos: bool | None = None,
  ) -> None:
    """Wraps an existing ``tokenizers.Tokenizer``.

    Args:
      tokenizer: the backend tokenizer.
      eos_id: the EOS id.
      bos_id: the BOS id, or None if there is none.
      pad_id: the pad id; None falls back to ``eos_id``.
      more_stop_ids: other ids that end a generation (a chat model's end-of-turn), after ``eos_id``.
      chat_template: the model's chat template (Jinja source), if it has one.
      template_tokens: the special tokens' texts the template reads (``bos_token``, ``eos_token``, ...);
        None: those of ``bos_id`` / ``eos_id`` / ``pad_id``.
      adds_bos: whether prompts start with ``bos_id`` (None: whenever there is one).

    Raises:
      ValueError: if a given id is outside the vocabulary.
    """
    _import_tokenizers()
    # Special tokens spelled in a text are text: a completion that writes "</s>" must not end the
    # document a judge or a reward model reads (the backend matches added special tokens in the text
    # even with add_special_tokens=False).  Set on the backend itself: it is what encodes.
    tokenizer.encode_special_tokens = True
    self._tok = tokenizer
    self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    named = [("eos_id", eos_id), ("bos_id", bos_id), ("pad_id", pad_id), *(("stop id", i) for i in more_stop_ids)]
    for name, value in named:
      if value is not None and not 0 <= value < self._vocab_size:
        raise ValueError(f"{name}={value} is outside the vocabulary [0, {self._vocab_size})")
    self._eos = int(eos_id)
    self._stops = tuple(dict.fromkeys((self._eos, *(int(i) for i in more_stop_ids))))
    self._bos = None if bos_id is None else int(bos_id)
    self._pad = self._eos if pad_id is None else int(pad_id)
    self._chat_template = chat_template
    self._template_tokens = None if template_tokens is None else dict(template_tokens)
    self._adds_bos = self._bos is not None if adds_bos is None else bool(adds_bos) and self._bos is not None
    self._with_specials: tokenizers.Tokenizer | None = None

  @classmethod
  def from_file(
    cls,
    path: PathLike,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
  ) -> HFTokenizer:
    """Loads a ``tokenizer.json`` with explicitly named special tokens.

    Args:
      path: path to the ``tokenizer.json`` file.
      bos_token: the BOS token text, or None for no BOS.
      eos_token: the EOS token text (required).
      pad_token: the pad token text; None falls back to EOS.

    Returns:
      The tokenizer.

    Raises:
      ValueError: if ``eos_token`` is missing or a named token is not in the vocabulary.
    """
    tk = _import_tokenizers()
    tok = tk.Tokenizer.from_file(os.fspath(path))
    if eos_token is None:
      raise ValueError(f"HFTokenizer.from_file({os.fspath(path)!r}) needs eos_token")
    return cls(
      tok,
      eos_id=cls._lookup(tok, eos_token, "eos_token", path),
      bos_id=None if bos_token is None else cls._lookup(tok, bos_token, "bos_token", path),
      pad_id=None if pad_token is None else cls._lookup(tok, pad_token, "pad_token", path),
    )

  @classmethod
  def from_pretrained_dir(cls, directory: PathLike) -> HFTokenizer:
    """Loads a Hugging Face model directory's tokenizer.

    Reads ``tokenizer.json``; special tokens come from ``tokenizer_config.json``
    (``bos_token`` / ``eos_token`` / ``pad_token``) when it sets them (to a token or to null), else
    from ``config.json`` (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``); with
    ``add_bos_token: false`` there (as Qwen's) prompts get no BOS, as transformers gives them none.

    Args:
      directory: the directory holding ``tokenizer.json``.

    Returns:
      The tokenizer.

    Raises:
      FileNotFoundError: if ``tokenizer.json`` is missing.
      ValueError: if no EOS token can be determined or a named token is not in the vocabulary.
    """
    directory = os.fspath(directory)
    return cls._from_json_and_configs(os.path.join(directory, "tokenizer.json"), directory)

  @classmethod
  def _from_json_and_configs(cls, json_path: str, config_dir: str) -> HFTokenizer:
    if not os.path.isfile(json_path):
      raise FileNotFoundError(f"no tokenizer.json at {json_path!r}")
    tk = _import_tokenizers()
    tok = tk.Tokenizer.from_file(json_path)

    ids: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
    decided: set[str] = set()  # set in tokenizer_config.json, a null included: config.json does not override it
    tok_config_path = os.path.join(config_dir, "tokenizer_config.json")
    tok_config: dict[str, Any] = {}
    if os.path.isfile(tok_config_path):
      tok_config = _read_json(tok_config_path)
      for kind in ids:
        if f"{kind}_token" in tok_config:
          decided.add(kind)
        content = _token_content(tok_config.get(f"{kind}_token"))
        if content is not None:
          ids[kind] = cls._lookup(tok, content, f"{kind}_token", tok_config_path)
      if tok_config.get("add_bos_token") is False:  # (Qwen) transformers adds no BOS: neither do prompts here
        ids["bos"] = None
        decided.add("bos")
    add_bos = tok_config.get("add_bos_token")
    chat_template = _chat_template_of(config_dir, tok_config)
    model_config_path = os.path.join(config_dir, "config.json")
    more_eos: list[int] = []  # a chat model's other end-of-sequence ids (end of turn): they stop generation too
    if os.path.isfile(model_config_path):
      model_config = _read_json(model_config_path)
      for kind in ids:
        if ids[kind] is None and kind not in decided:
          ids[kind] = _first_id(model_config.get(f"{kind}_token_id"))
      more_eos += _all_ids(model_config.get("eos_token_id"))
    generation_config_path = os.path.join(config_dir, "generation_config.json")
    if os.path.isfile(generation_config_path):
      more_eos += _all_ids(_read_json(generation_config_path).get("eos_token_id"))

    eos = ids["eos"]
    if eos is None:
      raise ValueError(
        f"could not determine the EOS token for {json_path!r}: looked for 'eos_token' in {tok_config_path!r} "
        f"and 'eos_token_id' in {model_config_path!r}"
      )
    if ids["bos"] is not None and not isinstance(add_bos, bool):
      # Not said: transformers' encoding adds a BOS where the tokenizer's post-processor does (Llama 3's
      # template processing); a BOS token it never adds (a byte-level model's <|endoftext|>) starts no prompt.
      probe = tok.encode("a", add_special_tokens=True).ids
      add_bos = bool(probe) and probe[0] == ids["bos"]
    return cls(
      tok,
      eos_id=eos,
      bos_id=ids["bos"],
      pad_id=ids["pad"],
      more_stop_ids=more_eos,
      adds_bos=add_bos if isinstance(add_bos, bool) else None,
      chat_template=chat_template,
      # As transformers hands them to a template: tokenizer_config.json's texts, a BOS the model does not
      # add included (a template may write it itself); without that file, the ids' texts.
      template_tokens={
        f"{kind}_token": text
        for kind in ("bos", "eos", "pad", "unk")
        if (text := _token_content(tok_config.get(f"{kind}_token"))) is not None
      }
      if tok_config
      else None,
    )

  @staticmethod
  def _lookup(tok: tokenizers.Tokenizer, token: str, what: str, source: PathLike) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{what} {token!r} (from {os.fspath(source)!r}) is not in the tokenizer vocabulary")
    return int(token_id)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying ``tokenizers.Tokenizer``, for backend-specific queries."""
    return self._tok

  @property
  def vocab_size(self) -> int:
    """Vocabulary size including added tokens."""
    return self._vocab_size

  @property
  def bos_id(self) -> int | None:
    """The BOS id, or None if none was configured."""
    return self._bos

  @property
  def eos_id(self) -> int:
    """The EOS id."""
    return self._eos

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The EOS id, then the other end-of-sequence ids of ``config.json`` / ``generation_config.json``."""
    return self._stops

  @property
  def pad_id(self) -> int:
    """The pad id, or the EOS id if none was configured."""
    return self._pad

  @property
  def chat_template(self) -> str | None:
    """The chat template of ``chat_template.jinja`` or ``tokenizer_config.json``, or None."""
    return self._chat_template

  @property
  def adds_bos(self) -> bool:
    """Whether prompts start with the BOS: ``tokenizer_config.json``'s ``add_bos_token`` where it says,
    else whether the tokenizer's own post-processor adds it (as transformers encodes)."""
    return self._adds_bos

  def _special_token_texts(self) -> dict[str, str]:
    if self._template_tokens is not None:
      return dict(self._template_tokens)
    named = {"bos_token": self._bos, "eos_token": self._eos, "pad_token": self._pad}
    return {name: self._tok.id_to_token(i) for name, i in named.items() if i is not None}

  def save_pretrained(self, directory: PathLike) -> None:
    """Writes ``tokenizer.json`` and a ``tokenizer_config.json`` (the special tokens, the chat template)
    into ``directory``: what ``transformers``' ``AutoTokenizer`` and :func:`load_tokenizer` read back as
    this tokenizer."""
    directory = os.fspath(directory)
    texts = self._special_token_texts()
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config.update({name: texts.get(name) for name in ("bos_token", "eos_token", "pad_token")})
    if "unk_token" in texts:
      config["unk_token"] = texts["unk_token"]
    config["add_bos_token"] = self._adds_bos  # read back by load_tokenizer as this tokenizer's prompts start
    if self._chat_template is not None:
      config["chat_template"] = self._chat_template
    # The backend that reads specials in a text as specials: a loader's own default.
    write_atomic(os.path.join(directory, "tokenizer.json"), self._specials_backend().to_str())
    write_atomic(os.path.join(directory, "tokenizer_config.json"), json.dumps(config, indent=2, ensure_ascii=False))
    stale = os.path.join(directory, CHAT_TEMPLATE_FILE)  # an earlier export's template would win over this one's
    if os.path.exists(stale):
      os.remove(stale)

  def _specials_backend(self) -> tokenizers.Tokenizer:
    """A second backend that matches the special tokens written in a text (this one encodes them as text)."""
    if self._with_specials is None:
      backend = _import_tokenizers().Tokenizer.from_str(self._tok.to_str())
      backend.encode_special_tokens = False
      self._with_specials = backend
    return self._with_specials

  def _encode_with_specials(self, text: str) -> list[int]:
    return list(self._specials_backend().encode(text, add_special_tokens=False).ids)

  def _encode_plain(self, texts: list[str]) -> list[list[int]]:
    if not texts:
      return []
    # add_special_tokens=False: a post-processor (e.g. TemplateProcessing adding <s>)
    # must not sneak specials in; add_bos/add_eos are the only switch.
    return [list(enc.ids) for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

  def _decode_plain(self, ids: list[int]) -> str:
    # skip_special_tokens=False: which ids count as special is decided by the interface
    # (pad/BOS/EOS only), not by whatever the tokenizer.json marks as special.
    return self._tok.decode(ids, skip_special_tokens=False) if ids else ""

  def _decode_keep_special(self, ids: list[int]) -> str:
    # The backend renders special tokens itself and its decoder (spacing, byte-level
    # merging) must see the whole sequence, so no splicing is needed here.
    return self._tok.decode(ids, skip_special_tokens=False) if ids else ""


# ======================================================================================
# Dispatch
# ======================================================================================


def load_tokenizer(path: PathLike) -> Tokenizer:
  """Loads a tokenizer, choosing the backend from what is at ``path``.

  * a ``*.model`` file -> :class:`SentencePieceTokenizer`;
  * a ``*.json`` file (normally ``tokenizer.json``) -> :class:`HFTokenizer`, with special
    tokens from the ``tokenizer_config.json`` / ``config.json`` next to it;
  * a directory with ``tokenizer.json`` -> :class:`HFTokenizer` (preferred, as HF
    directories often ship both files);
  * a directory with ``tokenizer.model`` -> :class:`SentencePieceTokenizer`.

  Args:
    path: a file or directory.

  Returns:
    The tokenizer.

  Raises:
    FileNotFoundError: if ``path`` does not exist, or is a directory with neither file.
    ValueError: if ``path`` is a file of an unrecognised kind.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    json_path = os.path.join(path, "tokenizer.json")
    if os.path.isfile(json_path):
      return HFTokenizer.from_pretrained_dir(path)
    model_path = os.path.join(path, "tokenizer.model")
    if os.path.isfile(model_path):
      # A model directory's other end-of-sequence ids (a chat model's end of turn) stop generation too.
      more = []
      for name in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(path, name)):
          more += _all_ids(_read_json(os.path.join(path, name)).get("eos_token_id"))
      with open(model_path, "rb") as f:
        return SentencePieceTokenizer(f.read(), more_stop_ids=more)
    raise FileNotFoundError(f"tokenizer directory {path!r} contains neither 'tokenizer.json' nor 'tokenizer.model'")
  if os.path.isfile(path):
    if path.endswith(".model"):
      return SentencePieceTokenizer.from_file(path)
    if path.endswith(".json"):
      return HFTokenizer._from_json_and_configs(path, os.path.dirname(path) or ".")
    raise ValueError(
      f"unrecognised tokenizer file {path!r}: expected a SentencePiece '.model' file or a 'tokenizer.json' file"
    )
  raise FileNotFoundError(
    f"no tokenizer at {path!r}: expected a '.model' file, a 'tokenizer.json' file, "
    "or a directory containing 'tokenizer.json' or 'tokenizer.model'"
  )
