"""Model configuration and the named presets (tiny ... 13b).

One decoder-only family covers the Llama 2/3 and Qwen2/2.5 architectures: RMSNorm,
RoPE (plain, linear-scaled or Llama-3-scaled), SwiGLU MLP, grouped-query attention,
optional q/k/v (and o) bias, tied or untied embeddings.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Literal

from mimo_jax.config_base import ConfigError, check, check_choice

RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling, as in Hugging Face ``rope_scaling``/``rope_parameters``.

  Attributes:
    kind: ``linear`` (positions divided by ``factor``) or ``llama3`` (wavelength-banded
      scaling of Llama 3.1+).
    factor: the scaling factor.
    low_freq_factor: llama3 only.
    high_freq_factor: llama3 only.
    original_max_position: llama3 only; the pre-training context length.
  """

  kind: Literal["linear", "llama3"] = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    check_choice("rope_scaling", self.kind, ("linear", "llama3"))
    check(_finite_positive(self.factor), "rope_scaling.factor", self.factor, "must be a finite number > 0")
    if self.kind == "llama3":
      for name in ("low_freq_factor", "high_freq_factor"):
        value = getattr(self, name)
        check(_finite_positive(value), f"rope_scaling.{name}", value, "must be a finite number > 0")
      check(
        _positive_int(self.original_max_position),
        "rope_scaling.original_max_position",
        self.original_max_position,
        "must be a positive integer",
      )
      check(
        self.high_freq_factor > self.low_freq_factor,
        "rope_scaling.high_freq_factor",
        self.high_freq_factor,
        "must be greater than low_freq_factor",
      )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder-only transformer.

  Attributes:
    name: preset name, for logs.
    vocab_size: V.
    d_model: D, the residual width.
    num_layers: L.
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads (K divides N; K == N is plain multi-head).
    head_dim: H; None means d_model // num_heads.
    mlp_dim: F, the SwiGLU hidden width.
    rope_theta: RoPE base.
    rope_scaling: optional RoPE scaling.
    rms_norm_eps: RMSNorm epsilon.
    qkv_bias: bias on the q, k, v projections (Qwen2).
    o_bias: bias on the output projection (Llama with ``attention_bias``).
    tie_embeddings: the unembedding is the transposed embedding table.
    max_seq_len: the longest sequence (prompt + completion) the model is used with.
    param_dtype: storage dtype of the parameters.
    dtype: compute dtype of matmuls; norms, softmax and log-probs are always float32.
    remat: rematerialisation of each layer in the backward pass.
  """

  name: str = "custom"
  vocab_size: int = 256
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None
  mlp_dim: int = 128
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  o_bias: bool = False
  tie_embeddings: bool = False
  max_seq_len: int = 2048
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: RematPolicy = "none"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim", "max_seq_len"):
      check(_positive_int(getattr(self, name)), name, getattr(self, name), "must be a positive integer")
    if self.head_dim is not None:
      check(_positive_int(self.head_dim), "head_dim", self.head_dim, "must be a positive integer (or None)")
    check(_finite_positive(self.rope_theta), "rope_theta", self.rope_theta, "must be a finite number > 0")
    check(_finite_positive(self.rms_norm_eps), "rms_norm_eps", self.rms_norm_eps, "must be a finite number > 0")
    check(
      self.num_heads % self.num_kv_heads == 0,
      "num_kv_heads",
      self.num_kv_heads,
      f"must divide num_heads={self.num_heads}",
    )
    if self.head_dim is None:
      check(
        self.d_model % self.num_heads == 0,
        "d_model",
        self.d_model,
        f"must be divisible by num_heads={self.num_heads} when head_dim is not set",
      )
    check(self.resolved_head_dim % 2 == 0, "head_dim", self.resolved_head_dim, "must be even (RoPE)")
    check_choice("param_dtype", self.param_dtype, DTYPES)
    check_choice("dtype", self.dtype, DTYPES)
    check_choice("remat", self.remat, REMAT_POLICIES)

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
    """The inverse of ``dataclasses.asdict`` (as stored in checkpoint metadata, via JSON).

    Raises:
      ValueError: not an object, or fields this version does not know (a newer trainer's checkpoint).
    """
    if not isinstance(fields, Mapping):
      raise ValueError(f"model_config must be an object, got {type(fields).__name__}")
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"model_config has fields this version does not know: {', '.join(map(str, unknown))}")
    fields = dict(fields)
    if fields.get("rope_scaling"):
      fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return cls(**fields)

  def num_params(self, *, with_value_head: bool = False) -> int:
    """Exact parameter count (matches Hugging Face's count for the same architecture)."""
    D, F, V, H = self.d_model, self.mlp_dim, self.vocab_size, self.resolved_head_dim
    N, K = self.num_heads, self.num_kv_heads
    attn = D * N * H + 2 * D * K * H + N * H * D
    if self.qkv_bias:
      attn += N * H + 2 * K * H
    if self.o_bias:
      attn += D
    layer = attn + 3 * D * F + 2 * D
    total = self.num_layers * layer + V * D + D
    if not self.tie_embeddings:
      total += V * D
    if with_value_head:
      total += D + 1
    return total


def _positive_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x > 0


def _finite_positive(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# ----------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------


def tiny() -> ModelConfig:
  """2 layers, vocab 256: unit tests and end-to-end tests in seconds."""
  return ModelConfig(
    name="tiny",
    vocab_size=256,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=128,
    max_seq_len=256,
    tie_embeddings=False,
  )


def demo() -> ModelConfig:
  """About 0.5M parameters: the embedded CPU demo (vocabulary set from the task's tokenizer).

  ``remat="dots"``: the backward keeps the products and recomputes the elementwise work, so the
  scanned stack stores no stacked float32 activations of its own (on CPU each is a freshly
  mapped buffer, zero-filled and written once per step): the learner runs 1.2-1.4x faster on
  CPU at this preset's and at Tunix's benchmark shape (BUILD_NOTES).
  """
  return ModelConfig(
    name="demo",
    vocab_size=256,
    d_model=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=384,
    max_seq_len=128,
    remat="dots",
  )


def small() -> ModelConfig:
  """About 42M parameters with a 32k vocabulary: the CPU demo and benchmark size."""
  return ModelConfig(
    name="small",
    vocab_size=32000,
    d_model=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    mlp_dim=1536,
    max_seq_len=2048,
    tie_embeddings=True,
  )


def llama3_1b() -> ModelConfig:
  """Llama-3.2-1B shapes (1.24B parameters, tied embeddings, Llama-3 RoPE scaling)."""
  return ModelConfig(
    name="1b",
    vocab_size=128256,
    d_model=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    mlp_dim=8192,
    rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
    rms_norm_eps=1e-5,
    tie_embeddings=True,
    max_seq_len=131072,
    param_dtype="bfloat16",
    dtype="bfloat16",
    remat="full",
  )


def llama2_7b() -> ModelConfig:
  """Llama-2-7B shapes (6.74B parameters)."""
  return ModelConfig(
    name="7b",
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    mlp_dim=11008,
    rms_norm_eps=1e-5,
    max_seq_len=4096,
    param_dtype="bfloat16",
    dtype="bfloat16",
    remat="full",
  )


def llama2_13b() -> ModelConfig:
  """Llama-2-13B shapes (13.02B parameters)."""
  return ModelConfig(
    name="13b",
    vocab_size=32000,
    d_model=5120,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
    mlp_dim=13824,
    rms_norm_eps=1e-5,
    max_seq_len=4096,
    param_dtype="bfloat16",
    dtype="bfloat16",
    remat="full",
  )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
  "tiny": tiny,
  "demo": demo,
  "small": small,
  "1b": llama3_1b,
  "7b": llama2_7b,
  "13b": llama2_13b,
}

# Public parameter counts of the architectures the large presets copy.
PUBLIC_PARAM_COUNTS = {
  "1b": 1_235_814_400,  # Llama-3.2-1B
  "7b": 6_738_415_616,  # Llama-2-7B
  "13b": 13_015_864_320,  # Llama-2-13B
}


def get_preset(name: str) -> ModelConfig:
  """Returns the named preset; raises ConfigError listing the presets otherwise."""
  if name not in PRESETS:
    raise ConfigError(f"--model_preset={name!r} is not allowed; allowed values: {', '.join(PRESETS)}")
  return PRESETS[name]()
