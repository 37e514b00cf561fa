"""Tiny random Hugging Face checkpoints built with ``transformers`` (a test-only extra)."""

from __future__ import annotations

from typing import Any


def save_random_hf_model(
  path: str,
  *,
  arch: str = "llama",
  tie: bool = False,
  bias: bool = False,
  seed: int = 0,
  rope: dict[str, Any] | None = None,
  **overrides: Any,
):
  """Builds a tiny random ``transformers`` model, saves it to ``path`` and returns it (eval mode).

  Args:
    path: output directory.
    arch: ``llama`` or ``qwen2`` (Qwen2 always has q/k/v bias).
    tie: tie the input and output embeddings.
    bias: Llama ``attention_bias`` (q/k/v/o bias).
    seed: torch seed.
    rope: ``rope_parameters`` dict (transformers 5 spelling).
    **overrides: other config fields.

  Returns:
    The torch model.
  """
  import torch
  import transformers

  torch.manual_seed(seed)
  kw: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=tie,
    rms_norm_eps=1e-6,
  )
  if rope is not None:
    kw["rope_parameters"] = rope
  kw.update(overrides)
  if arch == "qwen2":
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
  elif arch == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=bias, **kw))
  else:
    raise ValueError(f"arch must be llama or qwen2, got {arch!r}")
  # Random init leaves biases at 0 and norms at 1; perturb them so the test sees them.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "bias" in name or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(path)
  return model


def save_random_judge(path: str) -> str:
  """A tiny random Llama with a SentencePiece tokenizer of judge-like text, saved as a Hugging Face
  checkpoint directory usable as ``--judge_checkpoint`` (it writes digits and signs, never a valid
  ``Score:`` line). Returns ``path``."""
  import os

  from mimo_jax.tokenization import train_sentencepiece

  save_random_hf_model(path, vocab_size=128, max_position_embeddings=512)
  corpus = ["Rate the answer to the question from 0 to 10. Score: 7", "Question: 12+34= Answer: 64"] * 20
  tok = train_sentencepiece(corpus, vocab_size=60, byte_fallback=False)
  with open(os.path.join(path, "tokenizer.model"), "wb") as f:
    f.write(tok.model_proto_bytes())
  return path


# A ChatML chat template in the style of Qwen's (a default system turn when the conversation has none).
CHATML_TEMPLATE = (
  "{%- if messages[0]['role'] == 'system' %}"
  "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
  "{%- else %}{{- '<|im_start|>system\\nYou are a careful solver.<|im_end|>\\n' }}{%- endif %}"
  "{%- for message in messages %}"
  "{%- if message.role not in ['system', 'user', 'assistant'] %}"
  "{{- raise_exception('unknown role ' + message.role) }}{%- endif %}"
  "{%- if message.role != 'system' %}"
  "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
  "{%- endif %}{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_SPECIAL_TOKENS = (
  "<|endoftext|>",
  "<|im_start|>",
  "<|im_end|>",
  "<|begin_of_text|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eot_id|>",
)


def save_chat_tokenizer(
  directory: str, template: Any = CHATML_TEMPLATE, *, corpus: tuple[str, ...] = (), **config: Any
) -> str:
  """Saves a small byte-level BPE ``tokenizer.json`` (every byte encodable; the chat specials of
  :data:`CHAT_SPECIAL_TOKENS` added) and a ``tokenizer_config.json`` with ``template`` as its
  ``chat_template`` and ``config``'s entries (``eos_token``, ``bos_token``, ...): a model directory's
  tokenizer as ``transformers`` and :func:`mimo_jax.tokenization.load_tokenizer` both read it.

  Returns:
    ``directory``.
  """
  import json
  import os

  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=420,
    special_tokens=list(CHAT_SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  texts = ["What is 12 + 30? Answer tersely. system user assistant #### 42", *corpus]
  tok.train_from_iterator(texts * 20, trainer=trainer)
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **config}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(settings, f)
  return directory
