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
