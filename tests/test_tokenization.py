"""Tests for ``mimo_jax.tokenization``: both backends, padding, chat template and dispatch."""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from mimo_jax.tokenization import (
  HFTokenizer,
  PaddedBatch,
  SentencePieceTokenizer,
  Tokenizer,
  bucket_length,
  load_tokenizer,
  train_sentencepiece,
)

tokenizers = pytest.importorskip("tokenizers")

from mimo_jax.testing.hf_models import CHATML_TEMPLATE, save_chat_tokenizer  # noqa: E402

VOCAB_SIZE = 600

# Strings that a lossy normaliser would mangle: whitespace runs, leading/trailing spaces,
# tabs, newlines, digits, punctuation, and characters never seen in training.
ROUND_TRIP_CASES = [
  "",
  "hello world",
  "  leading and trailing  ",
  "a    b\t\tc\n\nd",
  "def add(x, y):\n    return x + y\n",
  "class Foo:\n    def bar(self):\n        if self.x:\n            return [1, 2, 3]\n\treturn None\n",
  "12345 + 67890 = 80235",
  "3.14159 * 2 == 6.28318;",
  "x = {'a': 1, \"b\": [2, 3]}  # comment",
  "\t\t\tindented with tabs",
  "trailing newline\n",
  "   ",
  "unicode: caf\u00e9 na\u00efve \u00fcber \u2211 \U0001f642",
  "\u4f60\u597d\uff0c\u4e16\u754c",
  "<|user|>\nWhat is 2+2?\n<|assistant|>\n4\n",
]

WORDS = (
  "the a quick brown fox jumps over lazy dog model token train reward policy value "
  "gradient sample prompt answer question number sum product result because therefore"
).split()


def make_corpus(n: int = 400, seed: int = 0) -> list[str]:
  """A small mixed corpus: arithmetic, English-like prose and indented code."""
  rng = random.Random(seed)
  lines: list[str] = []
  for i in range(n):
    kind = i % 3
    if kind == 0:
      a, b = rng.randint(0, 9999), rng.randint(0, 9999)
      op = rng.choice(["+", "-", "*"])
      value = {"+": a + b, "-": a - b, "*": a * b}[op]
      lines.append(f"Q: What is {a} {op} {b}?  A: {value}.")
    elif kind == 1:
      words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
      sep = rng.choice([" ", "  ", "\t", " , "])
      lines.append(sep.join(words).capitalize() + rng.choice([".", "!", "?", ";", ":"]))
    else:
      name = rng.choice(WORDS)
      indent = " " * rng.choice([2, 4, 8])
      lines.append(
        f"def {name}_{i}(x, y={rng.randint(0, 99)}):\n{indent}# {rng.choice(WORDS)} {rng.choice(WORDS)}\n"
        f"{indent}if x > {rng.randint(0, 9)}:\n{indent}{indent}return (x + y) * {rng.randint(1, 9)}\n"
        f"\t{indent}return [x, y, {{'k': '{name}'}}]\n"
      )
  return lines


@pytest.fixture(scope="module")
def corpus() -> list[str]:
  return make_corpus()


@pytest.fixture(scope="module")
def sp_tok(corpus: list[str]) -> SentencePieceTokenizer:
  return train_sentencepiece(corpus, vocab_size=VOCAB_SIZE)


# ---------------------------------------------------------------------------------------
# SentencePiece
# ---------------------------------------------------------------------------------------


def test_sp_special_ids_and_vocab(sp_tok: SentencePieceTokenizer) -> None:
  assert (sp_tok.pad_id, sp_tok.bos_id, sp_tok.eos_id) == (0, 2, 3)
  assert sp_tok.processor.unk_id() == 1
  assert [sp_tok.processor.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
  # hard_vocab_limit=False: never more than requested; byte fallback alone needs 256 + 4.
  assert 260 < sp_tok.vocab_size <= VOCAB_SIZE
  assert isinstance(sp_tok, Tokenizer)


@pytest.mark.parametrize("text", ROUND_TRIP_CASES)
def test_sp_round_trip_exact(sp_tok: SentencePieceTokenizer, text: str) -> None:
  ids = sp_tok.encode(text)
  assert all(0 <= i < sp_tok.vocab_size for i in ids)
  assert sp_tok.decode(ids) == text
  # Byte fallback means even unseen characters never become <unk>.
  assert 1 not in ids


def test_sp_round_trip_corpus_and_generated(sp_tok: SentencePieceTokenizer, corpus: list[str]) -> None:
  held_out = make_corpus(150, seed=123)
  texts = corpus[:100] + held_out
  encoded = sp_tok.encode_batch(texts)
  assert encoded == [sp_tok.encode(t) for t in texts]
  assert [sp_tok.decode(ids) for ids in encoded] == texts


def test_sp_compresses_and_splits_digits(sp_tok: SentencePieceTokenizer) -> None:
  text = "def train(x, y):\n    return x + y\n"
  # The vocabulary actually learned merges; a byte-level model would be 1 id per char.
  assert len(sp_tok.encode(text)) < len(text) * 0.8
  # split_digits: each digit is its own piece, so numbers tokenize uniformly.
  pieces = [sp_tok.processor.id_to_piece(i) for i in sp_tok.encode("1234567")]
  assert pieces == list("1234567")


def test_sp_add_bos_eos_and_skip_special(sp_tok: SentencePieceTokenizer) -> None:
  text = "Q: What is 12 + 30?"
  plain = sp_tok.encode(text)
  assert plain[0] != 2 and plain[-1] != 3
  assert sp_tok.encode(text, add_bos=True) == [2, *plain]
  assert sp_tok.encode(text, add_eos=True) == [*plain, 3]
  both = sp_tok.encode(text, add_bos=True, add_eos=True)
  assert both == [2, *plain, 3]
  assert sp_tok.encode_batch([text, ""], add_bos=True, add_eos=True) == [both, [2, 3]]

  assert sp_tok.decode(both) == text
  assert sp_tok.decode([0, 0, *both, 0]) == text
  assert sp_tok.decode(both, skip_special=False) == f"<s>{text}</s>"
  assert sp_tok.decode([0, *both], skip_special=False) == f"<pad><s>{text}</s>"
  # Specials in the middle are dropped without disturbing the text around them.
  mid = sp_tok.encode("ab") + [3, 0] + sp_tok.encode("cd")
  assert sp_tok.decode(mid) == "abcd"
  assert sp_tok.decode(mid, skip_special=False) == "ab</s><pad>cd"


def test_sp_decode_accepts_numpy_and_rejects_bad_ids(sp_tok: SentencePieceTokenizer) -> None:
  ids = sp_tok.encode("x = 42", add_bos=True)
  assert sp_tok.decode(np.asarray(ids, dtype=np.int32)) == "x = 42"
  bad = sp_tok.vocab_size
  with pytest.raises(ValueError, match=rf"token id {bad} at position 1"):
    sp_tok.decode([ids[0], bad])
  with pytest.raises(ValueError, match=r"token id -1"):
    sp_tok.decode([-1])


def test_sp_training_deterministic(corpus: list[str], sp_tok: SentencePieceTokenizer) -> None:
  again = train_sentencepiece(iter(corpus), vocab_size=VOCAB_SIZE)
  assert again.model_proto_bytes() == sp_tok.model_proto_bytes()
  uni_a = train_sentencepiece(corpus, vocab_size=VOCAB_SIZE, model_type="unigram")
  uni_b = train_sentencepiece(corpus, vocab_size=VOCAB_SIZE, model_type="unigram")
  assert uni_a.model_proto_bytes() == uni_b.model_proto_bytes()
  for text in ROUND_TRIP_CASES:
    assert uni_a.decode(uni_a.encode(text)) == text


def test_sp_bytes_and_file_round_trip(sp_tok: SentencePieceTokenizer, tmp_path: Path) -> None:
  blob = sp_tok.model_proto_bytes()
  from_bytes = SentencePieceTokenizer.from_bytes(blob)
  path = tmp_path / "tok.model"
  path.write_bytes(blob)
  from_file = SentencePieceTokenizer.from_file(path)
  for other in (from_bytes, from_file):
    assert other.model_proto_bytes() == blob
    assert other.vocab_size == sp_tok.vocab_size
    assert other.encode_batch(ROUND_TRIP_CASES) == sp_tok.encode_batch(ROUND_TRIP_CASES)


def test_sp_user_defined_symbols(corpus: list[str]) -> None:
  markers = ["<|user|>", "<|assistant|>"]
  tok = train_sentencepiece(corpus, vocab_size=VOCAB_SIZE, user_defined_symbols=markers)
  chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
  ids = tok.encode(chat)
  marker_ids = [tok.processor.piece_to_id(m) for m in markers]
  assert marker_ids[0] in ids and marker_ids[1] in ids
  assert tok.decode(ids) == chat


def test_sp_model_without_pad_falls_back_to_eos(corpus: list[str]) -> None:
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(corpus),
    model_writer=writer,
    vocab_size=400,
    pad_id=-1,
    bos_id=-1,
    unk_id=0,
    eos_id=1,
    byte_fallback=True,
    hard_vocab_limit=False,
    minloglevel=2,
  )
  tok = SentencePieceTokenizer.from_bytes(writer.getvalue())
  assert tok.bos_id is None
  assert tok.eos_id == 1
  assert tok.pad_id == 1
  with pytest.raises(ValueError, match="no BOS"):
    tok.encode("hi", add_bos=True)


def test_sp_keep_special_preserves_dummy_prefix_spaces(corpus: list[str]) -> None:
  """Models with SentencePiece's default dummy prefix (e.g. Llama's) must not lose spaces around specials."""
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(corpus),
    model_writer=writer,
    vocab_size=400,
    pad_id=0,
    unk_id=1,
    bos_id=2,
    eos_id=3,
    byte_fallback=True,
    hard_vocab_limit=False,
    minloglevel=2,
  )
  tok = SentencePieceTokenizer.from_bytes(writer.getvalue())
  first, second = tok.encode("the quick"), tok.encode("brown fox")
  assert tok.processor.id_to_piece(second[0]).startswith("\u2581")
  ids = [2, *first, 3, *second, 3, 0]
  assert tok.decode(ids) == "the quick brown fox"
  assert tok.decode(ids, skip_special=False) == "<s>the quick</s> brown fox</s><pad>"


def test_sp_train_too_small_vocab_is_value_error(corpus: list[str]) -> None:
  with pytest.raises(ValueError, match="vocab_size=50"):
    train_sentencepiece(corpus, vocab_size=50)


# ---------------------------------------------------------------------------------------
# pad_batch / bucket_length
# ---------------------------------------------------------------------------------------


def test_bucket_length() -> None:
  assert bucket_length(3, [8, 4, 16]) == 4
  assert bucket_length(4, [8, 4, 16]) == 4
  assert bucket_length(5, [8, 4, 16]) == 8
  assert bucket_length(0, [8]) == 8
  with pytest.raises(ValueError, match=r"length 17.*\[4, 8, 16\]"):
    bucket_length(17, [16, 8, 4])
  with pytest.raises(ValueError, match="empty"):
    bucket_length(1, [])
  with pytest.raises(ValueError, match="positive"):
    bucket_length(1, [0, 4])


def test_pad_batch_left(sp_tok: SentencePieceTokenizer) -> None:
  batch = sp_tok.pad_batch([[5, 6, 7], [8], []], buckets=[2, 4, 8])
  assert isinstance(batch, PaddedBatch)
  np.testing.assert_array_equal(batch.ids, np.array([[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]], dtype=np.int32))
  np.testing.assert_array_equal(
    batch.mask,
    np.array([[False, True, True, True], [False, False, False, True], [False, False, False, False]]),
  )
  np.testing.assert_array_equal(batch.lengths, np.array([3, 1, 0], dtype=np.int32))
  assert batch.ids.dtype == np.int32 and batch.mask.dtype == np.bool_ and batch.lengths.dtype == np.int32


def test_pad_batch_right(sp_tok: SentencePieceTokenizer) -> None:
  batch = sp_tok.pad_batch([[5, 6, 7], [8]], buckets=[4, 2, 8], side="right")
  np.testing.assert_array_equal(batch.ids, np.array([[5, 6, 7, 0], [8, 0, 0, 0]], dtype=np.int32))
  np.testing.assert_array_equal(batch.mask, np.array([[True, True, True, False], [True, False, False, False]]))
  np.testing.assert_array_equal(batch.lengths, np.array([3, 1], dtype=np.int32))
  # Real tokens are exactly ids[mask], in order, for either side.
  left = sp_tok.pad_batch([[5, 6, 7], [8]], buckets=[4, 2, 8])
  np.testing.assert_array_equal(batch.ids[batch.mask], left.ids[left.mask])


def test_pad_batch_bucket_selection_and_errors(sp_tok: SentencePieceTokenizer) -> None:
  assert sp_tok.pad_batch([[1] * 4], buckets=[16, 4, 8]).ids.shape == (1, 4)
  assert sp_tok.pad_batch([[1] * 5, [1]], buckets=[16, 4, 8]).ids.shape == (2, 8)
  assert sp_tok.pad_batch([[1] * 9], buckets=[16, 4, 8]).ids.shape == (1, 16)
  with pytest.raises(ValueError, match=r"length 17.*\[4, 8, 16\]"):
    sp_tok.pad_batch([[1] * 17, [1]], buckets=[16, 4, 8])
  with pytest.raises(ValueError, match="side"):
    sp_tok.pad_batch([[1]], buckets=[4], side="middle")  # type: ignore[arg-type]


def test_pad_batch_uses_pad_id_and_round_trips(sp_tok: SentencePieceTokenizer) -> None:
  texts = ["short", "a somewhat longer prompt with  spaces"]
  batch = sp_tok.pad_batch(sp_tok.encode_batch(texts, add_bos=True), buckets=[64, 128])
  assert batch.ids.shape == (2, 64)
  assert np.all(batch.ids[~batch.mask] == sp_tok.pad_id)
  assert [sp_tok.decode(row) for row in batch.ids] == texts


# ---------------------------------------------------------------------------------------
# Chat template
# ---------------------------------------------------------------------------------------


def test_chat_template_exact(sp_tok: SentencePieceTokenizer) -> None:
  messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
  ]
  expected = "<|system|>\nBe brief.\n<|user|>\nWhat is 2+2?\n<|assistant|>\n4\n<|user|>\nAnd 3+3?\n"
  assert sp_tok.apply_chat_template(messages, add_generation_prompt=False) == expected
  assert sp_tok.apply_chat_template(messages) == expected + "<|assistant|>\n"
  assert sp_tok.apply_chat_template([]) == "<|assistant|>\n"


def test_chat_template_invalid(sp_tok: SentencePieceTokenizer) -> None:
  with pytest.raises(ValueError, match=r"messages\[1\] has role 'tool'.*system.*user.*assistant"):
    sp_tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}])
  with pytest.raises(ValueError, match=r"messages\[0\].*'role' and 'content'"):
    sp_tok.apply_chat_template([{"role": "user"}])


# ---------------------------------------------------------------------------------------
# Hugging Face tokenizers
# ---------------------------------------------------------------------------------------


def _word_level_tokenizer() -> tokenizers.Tokenizer:
  from tokenizers import models, pre_tokenizers

  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5, "foo": 6, "bar": 7, "!": 8}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<pad>", "<s>", "</s>"])
  return tok


def _byte_level_bpe(corpus: list[str]) -> tokenizers.Tokenizer:
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=500,
    special_tokens=["<pad>", "<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer=trainer)
  # A post-processor that adds <s> ... </s>: HFTokenizer.encode must not apply it.
  tok.post_processor = processors.TemplateProcessing(
    single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))]
  )
  return tok


def _save_hf_dir(directory: Path, tok: tokenizers.Tokenizer, config: dict[str, object] | None) -> Path:
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  if config is not None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
  return directory


def test_hf_word_level_from_dir(tmp_path: Path) -> None:
  config = {
    # Both serialisations seen in the wild: a plain string and an AddedToken dict.
    "bos_token": "<s>",
    "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
    "pad_token": "<pad>",
  }
  d = _save_hf_dir(tmp_path / "wl", _word_level_tokenizer(), config)
  tok = load_tokenizer(d)
  assert isinstance(tok, HFTokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 9)
  assert tok.encode("hello world !") == [4, 5, 8]
  assert tok.encode("hello world !", add_bos=True, add_eos=True) == [1, 4, 5, 8, 2]
  assert tok.encode("zzz") == [3]
  assert not {0, 1, 2} & set(tok.encode("hello </s> <s> <pad> world"))
  # Without a decoder, WordLevel joins tokens with single spaces.
  assert tok.decode([0, 1, 4, 5, 8, 2]) == "hello world !"
  assert tok.decode([1, 4, 2], skip_special=False) == "<s> hello </s>"
  with pytest.raises(ValueError, match="token id 9"):
    tok.decode([4, 9])


def test_hf_config_json_fallback_and_pad_to_eos(tmp_path: Path) -> None:
  d = _save_hf_dir(tmp_path / "cfg", _word_level_tokenizer(), None)
  (d / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 8]}))
  tok = HFTokenizer.from_pretrained_dir(d)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
  # tokenizer_config.json wins over config.json.
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "!", "pad_token": None}))
  tok = HFTokenizer.from_pretrained_dir(d)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 8, 8)
  # Every end-of-sequence id of config.json and generation_config.json ends a generation (a chat model's
  # end of turn: only the first stopped it, and decode kept the others as text), EOS first.
  from mimo_jax.config import RolloutConfig
  from mimo_jax.rollout.encoding import sampling_params

  assert tok.stop_ids == (8, 2) and 2 in tok.special_ids
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
  tok = HFTokenizer.from_pretrained_dir(d)
  assert tok.stop_ids == (8, 2, 7) and sampling_params(RolloutConfig(), tok).stop_ids == (8, 2, 7)
  assert tok.decode([4, 7, 5]) == "hello world" and tok.decode([4, 7, 5], skip_special=False) != "hello world"
  (d / "generation_config.json").unlink()
  # A BOS set to null there (Qwen: "bos_token": null, "add_bos_token": false, while config.json names
  # <|endoftext|> as bos_token_id) is no BOS: transformers puts none before a prompt, so neither do we.
  for config in ({"eos_token": "!", "bos_token": None}, {"eos_token": "!", "add_bos_token": False}):
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_pretrained_dir(d)
    assert tok.bos_id is None and tok.encode("hello", add_bos=tok.bos_id is not None) == [4], config


def test_hf_missing_eos_and_unknown_token(tmp_path: Path) -> None:
  d = _save_hf_dir(tmp_path / "noeos", _word_level_tokenizer(), {"bos_token": "<s>"})
  with pytest.raises(ValueError, match="could not determine the EOS token"):
    load_tokenizer(d)
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
  with pytest.raises(ValueError, match=r"eos_token '<\|endoftext\|>'.*not in the tokenizer vocabulary"):
    load_tokenizer(d)


def test_hf_from_file_explicit_tokens(tmp_path: Path) -> None:
  d = _save_hf_dir(tmp_path / "ff", _word_level_tokenizer(), None)
  tok = HFTokenizer.from_file(d / "tokenizer.json", eos_token="</s>")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 2, 2)
  tok = HFTokenizer.from_file(d / "tokenizer.json", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
  with pytest.raises(ValueError, match="needs eos_token"):
    HFTokenizer.from_file(d / "tokenizer.json")


def test_hf_byte_level_bpe_round_trip_no_implicit_specials(tmp_path: Path, corpus: list[str]) -> None:
  backend = _byte_level_bpe(corpus)
  d = _save_hf_dir(tmp_path / "bpe", backend, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
  tok = load_tokenizer(d / "tokenizer.json")  # the file path works as well as the directory
  assert isinstance(tok, HFTokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  # The saved post-processor would add <s>/</s>; our encode must not.
  assert backend.encode("hello").ids[0] == 1
  # Special tokens spelled in a text (a completion closing a judge's document) are text, not their ids.
  for text in [*ROUND_TRIP_CASES, "an answer</s><s>Score: 10 <pad>"]:
    ids = tok.encode(text)
    assert not set(ids) & {0, 1, 2}
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True, add_eos=True) == [1, *ids, 2]
  assert tok.encode_batch(ROUND_TRIP_CASES) == [tok.encode(t) for t in ROUND_TRIP_CASES]
  padded = tok.pad_batch(tok.encode_batch(["a", "def f(x):\n  return x"]), buckets=[32, 64])
  assert np.all(padded.ids[~padded.mask] == 0)
  assert [tok.decode(r) for r in padded.ids] == ["a", "def f(x):\n  return x"]


def test_hf_matches_transformers(tmp_path: Path, corpus: list[str]) -> None:
  transformers = pytest.importorskip("transformers")
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=_byte_level_bpe(corpus), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
  )
  d = tmp_path / "hf"
  fast.save_pretrained(str(d))
  tok = load_tokenizer(d)
  assert isinstance(tok, HFTokenizer)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id)
  texts = ROUND_TRIP_CASES + make_corpus(30, seed=7)
  for text in texts:
    assert tok.encode(text) == fast(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------
# load_tokenizer dispatch
# ---------------------------------------------------------------------------------------


def test_load_tokenizer_sentencepiece(sp_tok: SentencePieceTokenizer, tmp_path: Path) -> None:
  model = tmp_path / "any_name.model"
  model.write_bytes(sp_tok.model_proto_bytes())
  loaded = load_tokenizer(str(model))
  assert isinstance(loaded, SentencePieceTokenizer)
  assert loaded.model_proto_bytes() == sp_tok.model_proto_bytes()

  d = tmp_path / "spdir"
  d.mkdir()
  (d / "tokenizer.model").write_bytes(sp_tok.model_proto_bytes())
  loaded = load_tokenizer(d)
  assert isinstance(loaded, SentencePieceTokenizer)
  assert loaded.encode("x = 1") == sp_tok.encode("x = 1")
  assert loaded.stop_ids == (sp_tok.eos_id,)
  # A model directory's other end-of-sequence ids stop generation too (they were ignored beside a
  # tokenizer.model; a tokenizer.json took them), EOS first, each once.
  eos = sp_tok.eos_id
  (d / "config.json").write_text(json.dumps({"eos_token_id": [eos, 7]}))
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
  assert load_tokenizer(d).stop_ids == (eos, 7, 9)


def test_load_tokenizer_prefers_json_in_dir(sp_tok: SentencePieceTokenizer, tmp_path: Path) -> None:
  d = _save_hf_dir(tmp_path / "both", _word_level_tokenizer(), {"eos_token": "</s>"})
  (d / "tokenizer.model").write_bytes(sp_tok.model_proto_bytes())
  assert isinstance(load_tokenizer(d), HFTokenizer)


def test_load_tokenizer_errors(tmp_path: Path) -> None:
  missing = tmp_path / "nope"
  with pytest.raises(FileNotFoundError, match=r"nope.*tokenizer\.json.*tokenizer\.model"):
    load_tokenizer(missing)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=r"empty.*neither 'tokenizer\.json' nor 'tokenizer\.model'"):
    load_tokenizer(empty)
  other = tmp_path / "vocab.txt"
  other.write_text("a\nb\n")
  with pytest.raises(ValueError, match=r"vocab\.txt.*'\.model'.*'tokenizer\.json'"):
    load_tokenizer(os.fspath(other))


# ---- vocabulary policy: ids past the tokenizer's vocabulary -------------------------------


def test_decode_of_ids_past_the_vocabulary_is_a_named_error_on_both_backends(sp_tok: SentencePieceTokenizer) -> None:
  from mimo_jax.tokenization import HFTokenizer, TokenIdError

  hf_tok = HFTokenizer(_word_level_tokenizer(), eos_id=2, bos_id=1, pad_id=0)
  for tok in (sp_tok, hf_tok):
    n = tok.vocab_size
    # A padded model vocabulary (here 64 ids past the tokenizer's) and an absurd id.
    for bad in (n, n + 63, 2**40):
      with pytest.raises(TokenIdError, match=rf"token id {bad} at position 2 is outside the vocabulary \[0, {n}\)"):
        tok.decode(np.asarray([tok.eos_id, 4, bad], dtype=np.int64))
      with pytest.raises(ValueError, match=rf"vocab_limit={n}"):
        tok.decode([4, 4, bad], skip_special=False)


def test_decode_refuses_non_integer_ids(sp_tok: SentencePieceTokenizer) -> None:
  from mimo_jax.tokenization import TokenIdError

  with pytest.raises(TokenIdError, match=r"token id 4\.5 at position 1 is not an integer"):
    sp_tok.decode([4, 4.5])
  with pytest.raises(TokenIdError, match="dtype float32"):
    sp_tok.decode(np.asarray([4.0, 5.0], np.float32))
  assert sp_tok.decode(np.asarray([], np.int32)) == ""


def test_a_prompt_cut_to_the_largest_bucket_keeps_its_bos():
  """A prompt longer than the largest bucket keeps its last tokens (the question's end and the answer
  cue) and, in front of them, its BOS: cut from the left it lost the start-of-sequence token every
  other prompt has (30 of 300 GSM8K prompts at grpo_gsm8k_small's buckets).  The reward model's
  encoding follows the same rule."""
  from mimo_jax.rewards.reward_model import _encode_prompt
  from mimo_jax.rollout.encoding import encode_prompts
  from mimo_jax.tasks.arith import ArithTask, build_tokenizer

  tok = build_tokenizer(ArithTask(levels=(1,), seed=0, heldout_size=4))
  text = "1234+5="
  ids = tok.encode(text, add_bos=True)
  assert ids[0] == tok.bos_id and len(ids) == 8
  tokens, mask, cut = encode_prompts(tok, [text], (8,))  # exactly a bucket: untouched
  assert cut == 0 and tokens[0].tolist() == ids
  tokens, mask, cut = encode_prompts(tok, [text, "1+2="], (7,))
  assert cut == 1 and mask[0].all() and tokens[0].tolist() == [tok.bos_id, *ids[2:]]
  assert _encode_prompt(tok, text, 7) == ([tok.bos_id, *ids[2:]], True)
  assert _encode_prompt(tok, text, 8) == (ids, False)


# ---------------------------------------------------------------------------------------
# A model's own chat template, against transformers

# A template in the style of Llama 3's, written over lines as real ones are (block tags' newlines and
# indentation are trimmed): it writes the BOS itself, trims contents, marks the reply with {% generation %}.
HEADER_TEMPLATE = """{{- bos_token }}
{% for message in messages %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {% if message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}
    {% else %}
        {{ message['content'] | trim + '<|eot_id|>' }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% endif %}
"""
CONVERSATIONS = [
  [{"role": "user", "content": "What is 12 + 30?"}],
  [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "  Und 7 × 6?  \n"}],
  [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5. #### 5"},
    {"role": "user", "content": "And <|im_end|> then?"},
  ],
]


def _chat_model_dir(directory: Path, template, **config: object) -> Path:
  return Path(save_chat_tokenizer(str(directory), template, **config))


def _transformers_chat(directory: Path, messages, add_generation_prompt: bool) -> tuple[str, list[int]]:
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(str(directory))
  text = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
  ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
  return text, list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.parametrize(
  "template, config",
  [
    (CHATML_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}),
    (HEADER_TEMPLATE, {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}),
  ],
  ids=["chatml", "header"],
)
def test_a_models_chat_template_renders_and_encodes_as_transformers_does(tmp_path: Path, template, config) -> None:
  """``apply_chat_template`` renders an HF tokenizer's own template, and ``encode_chat`` encodes it, to
  the text and ids of transformers' ``apply_chat_template`` (tokenize False and True): the specials the
  template writes are their ids, a BOS the template writes is there once, nothing is added."""
  d = _chat_model_dir(tmp_path / "chat", template, **config)
  tok = load_tokenizer(d)
  assert tok.chat_template == template
  for messages in CONVERSATIONS:
    for generation_prompt in (True, False):
      text, ids = _transformers_chat(d, messages, generation_prompt)
      assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == text
      assert tok.encode_chat(messages, add_generation_prompt=generation_prompt) == ids
  ids = tok.encode_chat(CONVERSATIONS[0])
  starts = [tok.backend.token_to_id(t) for t in ("<|im_start|>", "<|start_header_id|>")]
  assert ids.count(starts[0]) + ids.count(starts[1]) == 3 - (template == HEADER_TEMPLATE)
  if template == HEADER_TEMPLATE:  # the template's BOS, once, and the tokenizer's BOS is the same token
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
  else:
    assert tok.bos_id is None
  # Plain encoding still reads a special token written in a text as text.
  assert tok.backend.token_to_id("<|im_end|>") not in tok.encode("x <|im_end|> y")


def test_chat_prompts_go_through_the_template_only_when_asked(tmp_path: Path, sp_tok: SentencePieceTokenizer) -> None:
  """``with_chat_prompts`` is a copy whose ``encode_prompt`` is the one user message through the
  template (what ``encode_prompts`` then left-pads); the original still encodes the text after BOS.
  A tokenizer without a template refuses it."""
  from mimo_jax.rollout.encoding import encode_prompts

  d = _chat_model_dir(tmp_path / "chat", CHATML_TEMPLATE, eos_token="<|im_end|>", bos_token=None)
  tok = load_tokenizer(d)
  chat = tok.with_chat_prompts()
  prompt = "What is 12 + 30?"
  assert chat.chat_prompts and not tok.chat_prompts
  assert chat.encode_prompt(prompt) == _transformers_chat(d, [{"role": "user", "content": prompt}], True)[1]
  assert tok.encode_prompt(prompt) == tok.encode(prompt)
  tokens, mask, cut = encode_prompts(chat, [prompt, "2 + 3?"], (64,))
  assert cut == 0 and tokens[0][mask[0]].tolist() == chat.encode_prompt(prompt)
  assert tokens[1][mask[1]].tolist() == chat.encode_prompt("2 + 3?")
  plain = _save_hf_dir(tmp_path / "plain", _word_level_tokenizer(), {"eos_token": "</s>"})
  with pytest.raises(ValueError, match="no chat template"):
    load_tokenizer(plain).with_chat_prompts()
  with pytest.raises(ValueError, match="no chat template"):
    sp_tok.with_chat_prompts()


def test_chat_template_sources_and_failures(tmp_path: Path) -> None:
  """``chat_template.jinja`` beside the config wins over the config's entry (as transformers reads a
  directory); a list of named templates gives its ``default``; a list without one is refused at load;
  the template's own ``raise_exception`` and a syntax error are a ``ChatTemplateError``."""
  from mimo_jax.tokenization import ChatTemplateError

  d = _chat_model_dir(tmp_path / "file", "{{ 'ignored' }}", eos_token="<|im_end|>")
  (d / "chat_template.jinja").write_text(CHATML_TEMPLATE)
  tok = load_tokenizer(d)
  assert tok.chat_template == CHATML_TEMPLATE
  assert tok.apply_chat_template(CONVERSATIONS[0]) == _transformers_chat(d, CONVERSATIONS[0], True)[0]
  named = [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": CHATML_TEMPLATE}]
  d = _chat_model_dir(tmp_path / "named", named, eos_token="<|im_end|>")
  assert load_tokenizer(d).chat_template == CHATML_TEMPLATE
  d = _chat_model_dir(tmp_path / "nodefault", named[:1], eos_token="<|im_end|>")
  with pytest.raises(ValueError, match=r"\['tool_use'\] but none named 'default'"):
    load_tokenizer(d)
  tok = load_tokenizer(_chat_model_dir(tmp_path / "raise", CHATML_TEMPLATE, eos_token="<|im_end|>"))
  with pytest.raises(ChatTemplateError, match="unknown role tool"):
    tok.encode_chat([{"role": "tool", "content": "{}"}])
  with pytest.raises(ValueError, match=r"messages\[0\].*'role' and 'content'"):
    tok.encode_chat([{"role": "user"}])
  # The template's JSON is plain JSON, non-ASCII and HTML characters kept (Jinja's own tojson escapes them).
  d = _chat_model_dir(tmp_path / "json", "{{ messages[0] | tojson }}", eos_token="<|im_end|>")
  messages = [{"role": "user", "content": "<7 × 6> & 'x'"}]
  assert load_tokenizer(d).apply_chat_template(messages) == _transformers_chat(d, messages, True)[0]
  assert load_tokenizer(d).apply_chat_template(messages) == '{"role": "user", "content": "<7 × 6> & \'x\'"}'
  broken = load_tokenizer(_chat_model_dir(tmp_path / "broken", "{% for m in messages %}", eos_token="<|im_end|>"))
  with pytest.raises(ChatTemplateError, match="does not compile"):
    broken.encode_chat(CONVERSATIONS[0])


def test_a_prompt_starts_with_bos_where_the_models_own_tokenizer_puts_one(tmp_path: Path) -> None:
  """A BOS token named in ``tokenizer_config.json`` starts a prompt only where transformers' encoding
  puts one: ``add_bos_token`` where the config says, else the tokenizer's post-processor (a byte-level
  model's ``<|endoftext|>`` as BOS, never added there, started every prompt here)."""
  transformers = pytest.importorskip("transformers")
  corpus = ["hello world", "foo bar"] * 5
  cases = [
    ("none", _word_level_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>"}, False),
    ("template", _byte_level_bpe(corpus), {"bos_token": "<s>", "eos_token": "</s>"}, True),
    ("said", _word_level_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, True),
  ]
  for name, backend, config, adds in cases:
    d = _save_hf_dir(tmp_path / name, backend, {"tokenizer_class": "PreTrainedTokenizerFast", **config})
    tok = load_tokenizer(d)
    assert tok.bos_id is not None and tok.adds_bos is adds, name
    ids = tok.encode_prompt("hello world")
    assert (ids[0] == tok.bos_id) is adds and ids[adds:] == tok.encode("hello world"), name
    if name != "said":  # transformers' own (a plain fast tokenizer does not read add_bos_token)
      theirs = transformers.AutoTokenizer.from_pretrained(str(d))("hello world")["input_ids"]
      assert (theirs[0] == tok.bos_id) is adds, name
