"""Hugging Face checkpoints in and out (``LlamaForCausalLM``, ``Qwen2ForCausalLM``).

Loading never builds the whole model on one device: safetensors files are memory
mapped on the host, and every parameter is created with
``jax.make_array_from_callback`` directly in its target sharding, so each device
(and, on a pod, each host) reads only the slices it owns.  The stacked layer axis is
assembled per shard from the per-layer tensors of the checkpoint.

On-disk format written by :func:`save_hf`: ``config.json`` (transformers 5 spelling,
``rope_parameters``) and ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors``
plus ``model.safetensors.index.json`` above ``max_shard_bytes``), tensors named and
laid out exactly as ``transformers`` expects (``[out, in]`` linear weights).

Everything read from a checkpoint directory is checked before it is used: the
safetensors header (its length against the file and a :data:`MAX_HEADER_BYTES` cap, its
JSON, each tensor's dtype, shape and byte range), the index's file names, the values in
``config.json`` (positive integer sizes, heads that divide, a finite positive
``rms_norm_eps`` and ``rope_theta``), and every tensor's dtype and shape against the
config, all before any tensor data is read.  Each problem is a ``ValueError`` naming the
file, field or tensor and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from mimo_jax.models.config import ModelConfig, RopeScaling
from mimo_jax.models.transformer import Transformer
from mimo_jax.sharding import TRAIN_RULES, Rules, state_shardings

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")

# ----------------------------------------------------------------------------
# safetensors (the format is a little-endian u64 header length, a JSON header, raw data)
# ----------------------------------------------------------------------------

_ST_TO_NP = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
# Tensor dtypes a model parameter may be stored in.
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# The largest safetensors JSON header accepted (the reference implementation's limit).
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFile:
  """A memory-mapped safetensors file; ``get`` returns zero-copy numpy views.

  The header is validated on open (see :func:`_check_header`), so a corrupt or hostile
  file fails with a ``ValueError`` naming it instead of a ``MemoryError`` or an
  out-of-bounds read later.
  """

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (truncated header)")
      (header_len,) = struct.unpack("<Q", raw)
      if header_len > MAX_HEADER_BYTES:
        raise ValueError(
          f"{path}: safetensors header length {header_len} bytes exceeds the {MAX_HEADER_BYTES}-byte limit "
          "(corrupt or not a safetensors file)"
        )
      if header_len > size - 8:
        raise ValueError(
          f"{path}: safetensors header length {header_len} bytes is larger than the rest of the file "
          f"({size - 8} bytes; truncated or not a safetensors file)"
        )
      blob = f.read(header_len)
    try:
      header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
      raise ValueError(f"{path}: safetensors header is not valid UTF-8 JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
      raise ValueError(f"{path}: safetensors header must be a JSON object, got {type(header).__name__}")
    header.pop("__metadata__", None)
    _check_header(path, header, size - 8 - header_len)
    self._header = header
    self._data_start = 8 + header_len
    self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

  def keys(self) -> list[str]:
    return list(self._header)

  def __contains__(self, name: str) -> bool:
    return name in self._header

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._header[name]["shape"])

  def dtype(self, name: str) -> str:
    """The tensor's safetensors dtype code (``F32``, ``BF16``, ...)."""
    return self._header[name]["dtype"]

  def get(self, name: str) -> np.ndarray:
    info = self._header[name]
    if info["dtype"] not in _ST_TO_NP:
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    dtype = _ST_TO_NP[info["dtype"]]
    begin, end = info["data_offsets"]
    buf = self._mmap[self._data_start + begin : self._data_start + end]
    return buf.view(dtype).reshape(info["shape"])


def _check_header(path: str, header: Mapping[str, Any], data_bytes: int) -> None:
  """Checks every tensor entry of a safetensors header; raises ValueError naming the tensor.

  Each entry needs a ``dtype`` string, a ``shape`` of non-negative integers and
  ``data_offsets`` ``[begin, end]`` inside the data section whose length matches the
  shape (for the dtypes this module reads).
  """
  for name, info in header.items():
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
      raise ValueError(f"{where}: header entry must be an object, got {type(info).__name__}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
      raise ValueError(f"{where}: header entry has no dtype string")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
      raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (
      not isinstance(offsets, list)
      or len(offsets) != 2
      or not all(_is_int(o) for o in offsets)
      or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
      raise ValueError(
        f"{where}: data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end <= {data_bytes} "
        "(the data section's size)"
      )
    if dtype in _ST_TO_NP:
      expected = math.prod(shape) * _ST_TO_NP[dtype].itemsize
      if offsets[1] - offsets[0] != expected:
        raise ValueError(
          f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but {dtype} {tuple(shape)} "
          f"needs {expected}"
        )


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
  """Writes ``tensors`` (numpy, any supported dtype) as one safetensors file."""
  header: dict[str, Any] = {}
  offset = 0
  arrays = {}
  for name in sorted(tensors):
    arr = np.ascontiguousarray(tensors[name])
    if arr.dtype not in _NP_TO_ST:
      raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors")
    header[name] = {
      "dtype": _NP_TO_ST[arr.dtype],
      "shape": list(arr.shape),
      "data_offsets": [offset, offset + arr.nbytes],
    }
    offset += arr.nbytes
    arrays[name] = arr
  if metadata:
    header["__metadata__"] = dict(metadata)
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in sorted(arrays):
      f.write(arrays[name].tobytes())
  os.replace(tmp, path)


class CheckpointReader:
  """All tensors of a Hugging Face checkpoint directory (single file or sharded with an index)."""

  def __init__(self, path: str):
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    self._where: dict[str, SafetensorsFile] = {}
    if os.path.exists(index) and os.path.exists(single):
      # Two models in one directory (e.g. a re-export over another layout): transformers reads the single
      # file, an index-first reader the shards; refuse rather than pick one.
      raise ValueError(
        f"{path}: holds both model.safetensors and model.safetensors.index.json, two different layouts "
        "(a stale export?); remove the one that is not the checkpoint"
      )
    if os.path.exists(index):
      try:
        with open(index, encoding="utf-8") as f:
          weight_map = json.load(f)["weight_map"]
      except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from None
      if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
      ):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
      for fn in set(weight_map.values()):
        if not fn or os.path.basename(fn) != fn or fn in (".", ".."):
          raise ValueError(f"{index}: weight_map names {fn!r}, which is not a file name inside {path}")
      files = {fn: SafetensorsFile(os.path.join(path, fn)) for fn in sorted(set(weight_map.values()))}
      for name, fn in weight_map.items():
        if name not in files[fn]:
          raise ValueError(f"{index}: tensor {name!r} is mapped to {fn}, which does not hold it")
      self._where = {name: files[fn] for name, fn in weight_map.items()}
    elif os.path.exists(single):
      f = SafetensorsFile(single)
      self._where = {name: f for name in f.keys()}
    else:
      raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are supported)"
      )

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> list[str]:
    return list(self._where)

  def get(self, name: str) -> np.ndarray:
    return self._where[name].get(name)

  def shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape as stored (from the header; no data is read)."""
    return self._where[name].shape(name)

  def dtype(self, name: str) -> str:
    """The tensor's safetensors dtype code (from the header; no data is read)."""
    return self._where[name].dtype(name)


# ----------------------------------------------------------------------------
# config.json <-> ModelConfig
# ----------------------------------------------------------------------------


def _hf_int(hf: Mapping[str, Any], key: str, default: Any = None, *, where: str = "config.json") -> int:
  """``hf[key]`` (or ``default`` when absent or null) as a positive integer; ValueError naming the field."""
  value = hf.get(key)
  if value is None:
    value = default
  if value is None:
    raise ValueError(f"{where}: required field {key!r} is missing")
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise ValueError(f"{where}: {key}={value!r} must be a positive integer")
  return int(value)


def _hf_float(hf: Mapping[str, Any], key: str, default: float | None = None, *, where: str = "config.json") -> float:
  """``hf[key]`` (or ``default`` when absent or null) as a finite float > 0; ValueError naming the field."""
  value = hf.get(key)
  if value is None:
    value = default
  if value is None:
    raise ValueError(f"{where}: required field {key!r} is missing")
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{where}: {key}={value!r} must be a finite number > 0")
  return float(value)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  params = hf.get("rope_parameters")
  if params is not None and not isinstance(params, Mapping):
    raise ValueError(f"config.json: rope_parameters must be an object, got {type(params).__name__}")
  scaling = hf.get("rope_scaling")
  if params is not None and scaling is not None and scaling != params:
    # transformers takes rope_scaling over rope_parameters; a reader taking the other would load other positions.
    raise ValueError(
      "config.json: rope_parameters and rope_scaling are both set and differ; keep one (rope_parameters is the "
      "transformers 5 spelling)"
    )
  if params is None and scaling is not None and not isinstance(scaling, Mapping):
    raise ValueError(f"config.json: rope_scaling must be an object or null, got {type(scaling).__name__}")
  if isinstance(params, Mapping) and "rope_theta" not in params and "rope_type" not in params:
    raise ValueError("config.json: per-layer-type rope_parameters are not supported")
  if params is None:
    params = dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  outer_theta = hf.get("rope_theta")
  theta = _hf_float(params, "rope_theta", 10000.0 if outer_theta is None else outer_theta)
  kind = params.get("rope_type", params.get("type", "default"))
  if kind in ("default", None):
    return theta, None
  where = "config.json: rope parameters"
  if kind == "linear":
    return theta, RopeScaling("linear", _hf_float(params, "factor", where=where))
  if kind == "llama3":
    return theta, RopeScaling(
      "llama3",
      _hf_float(params, "factor", where=where),
      _hf_float(params, "low_freq_factor", where=where),
      _hf_float(params, "high_freq_factor", where=where),
      _hf_int(params, "original_max_position_embeddings", where=where),
    )
  raise ValueError(f"config.json: rope type {kind!r} is not supported (supported: default, linear, llama3)")


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", compute_dtype: str | None = None) -> ModelConfig:
  """Converts a Hugging Face ``config.json`` dict to a :class:`ModelConfig`.

  Raises:
    ValueError: an unsupported architecture or option, or a value that is out of range
      (non-positive sizes, key/value heads that do not divide the heads, an odd head
      dimension, a non-finite or non-positive ``rms_norm_eps``/``rope_theta``/RoPE factor);
      the message names the ``config.json`` field.
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"config.json: must be a JSON object, got {type(hf).__name__}")
  archs = hf.get("architectures") or []
  families = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
  model_type = hf.get("model_type")
  arch = archs[0] if archs else families.get(model_type)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
      f"config.json: architecture {arch or model_type!r} is not supported; "
      f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
  if model_type is not None and families.get(model_type) != arch:
    # transformers builds the model from model_type: a "mistral" config (sliding windows) read as Llama
    # would load into other logits.
    raise ValueError(
      f"config.json: model_type {model_type!r} is not the family of architecture {arch!r} "
      f"(supported pairs: {', '.join(f'{k}/{v}' for k, v in families.items())})"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
  if hf.get("mlp_bias"):
    raise ValueError("config.json: mlp_bias=true is not supported")
  if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
    raise ValueError("config.json: use_sliding_window=true is not supported")
  theta, scaling = _rope_from_hf(hf)
  vocab = _hf_int(hf, "vocab_size")
  hidden = _hf_int(hf, "hidden_size")
  layers = _hf_int(hf, "num_hidden_layers")
  heads = _hf_int(hf, "num_attention_heads")
  kv_heads = _hf_int(hf, "num_key_value_heads", heads)
  mlp = _hf_int(hf, "intermediate_size")
  max_pos = _hf_int(hf, "max_position_embeddings", 2048)
  if heads % kv_heads:
    raise ValueError(f"config.json: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
  if hf.get("head_dim") is None and hidden % heads:
    raise ValueError(
      f"config.json: hidden_size={hidden} must be divisible by num_attention_heads={heads} when head_dim is not set"
    )
  head_dim = _hf_int(hf, "head_dim", hidden // heads)
  if head_dim % 2:
    raise ValueError(f"config.json: head_dim={head_dim} must be even (rotary embeddings rotate pairs)")
  eps = _hf_float(hf, "rms_norm_eps", 1e-6)
  for key in ("attention_bias", "tie_word_embeddings"):
    if hf.get(key) is not None and not isinstance(hf[key], bool):
      raise ValueError(f"config.json: {key}={hf[key]!r} must be true or false")
  if arch == "Qwen2ForCausalLM":
    qkv_bias, o_bias = True, False
  else:
    qkv_bias = o_bias = bool(hf.get("attention_bias", False))
  name = hf.get("_name_or_path")
  return ModelConfig(
    name=name if isinstance(name, str) and name else arch,
    vocab_size=vocab,
    d_model=hidden,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    mlp_dim=mlp,
    rope_theta=theta,
    rope_scaling=scaling,
    rms_norm_eps=eps,
    qkv_bias=qkv_bias,
    o_bias=o_bias,
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_seq_len=max_pos,
    param_dtype=dtype,
    dtype=compute_dtype or dtype,
  )


def config_to_hf(cfg: ModelConfig, *, torch_dtype: str = "float32") -> dict[str, Any]:
  """A ``config.json`` dict that ``transformers`` loads into the equivalent model."""
  if cfg.qkv_bias and not cfg.o_bias:
    arch, model_type, extra = "Qwen2ForCausalLM", "qwen2", {"use_sliding_window": False}
  elif cfg.o_bias and not cfg.qkv_bias:
    raise ValueError("an output-projection bias without q/k/v bias has no Hugging Face equivalent")
  else:
    arch, model_type, extra = "LlamaForCausalLM", "llama", {"attention_bias": cfg.qkv_bias, "mlp_bias": False}
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    rope = {"rope_type": s.kind, "rope_theta": cfg.rope_theta, "factor": s.factor}
    if s.kind == "llama3":
      rope.update(
        low_freq_factor=s.low_freq_factor,
        high_freq_factor=s.high_freq_factor,
        original_max_position_embeddings=s.original_max_position,
      )
  return {
    "architectures": [arch],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.resolved_head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.rms_norm_eps,
    "tie_word_embeddings": cfg.tie_embeddings,
    "rope_parameters": rope,
    "dtype": torch_dtype,
    **extra,
  }


# ----------------------------------------------------------------------------
# Parameter name mapping
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mapping:
  """One of our parameters <-> one HF tensor (per layer for stacked parameters).

  ``to_ours(hf_array, cfg)`` and ``to_hf(our_array, cfg)`` convert one (unstacked) tensor.
  """

  hf_name: str  # may contain "{i}" for the layer index
  to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
  to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
  hf_shape: Callable[[ModelConfig], tuple[int, ...]]  # the tensor's shape in the checkpoint

  @property
  def stacked(self) -> bool:
    return "{i}" in self.hf_name


def _identity(x, cfg):
  return x


def _transpose(x, cfg):
  return x.T


def _proj_in(heads_attr: str):
  """HF ``[heads*H, D]`` -> ours ``[D, heads, H]`` and back."""

  def to_ours(x, cfg):
    return x.T.reshape(cfg.d_model, getattr(cfg, heads_attr), cfg.resolved_head_dim)

  def to_hf(x, cfg):
    return x.reshape(cfg.d_model, -1).T

  return to_ours, to_hf


def _bias(heads_attr: str):
  def to_ours(x, cfg):
    return x.reshape(getattr(cfg, heads_attr), cfg.resolved_head_dim)

  def to_hf(x, cfg):
    return x.reshape(-1)

  return to_ours, to_hf


def _o_to_ours(x, cfg):  # [D, N*H] -> [N, H, D]
  return x.T.reshape(cfg.num_heads, cfg.resolved_head_dim, cfg.d_model)


def _o_to_hf(x, cfg):
  return x.reshape(-1, cfg.d_model).T


def _vd(c: ModelConfig) -> tuple[int, ...]:
  return (c.vocab_size, c.d_model)


def _d(c: ModelConfig) -> tuple[int, ...]:
  return (c.d_model,)


def _nh(c: ModelConfig) -> int:
  return c.num_heads * c.resolved_head_dim


def _kh(c: ModelConfig) -> int:
  return c.num_kv_heads * c.resolved_head_dim


_LAYER = "model.layers.{i}."
_MAPPINGS: dict[tuple[str, ...], _Mapping] = {
  ("decoder", "embed_vd"): _Mapping("model.embed_tokens.weight", _identity, _identity, _vd),
  ("decoder", "final_norm", "scale"): _Mapping("model.norm.weight", _identity, _identity, _d),
  ("lm_head_dv",): _Mapping("lm_head.weight", _transpose, _transpose, _vd),
  ("decoder", "layers", "attn_norm", "scale"): _Mapping(_LAYER + "input_layernorm.weight", _identity, _identity, _d),
  ("decoder", "layers", "mlp_norm", "scale"): _Mapping(
    _LAYER + "post_attention_layernorm.weight", _identity, _identity, _d
  ),
  ("decoder", "layers", "attn", "w_q_dnh"): _Mapping(
    _LAYER + "self_attn.q_proj.weight", *_proj_in("num_heads"), lambda c: (_nh(c), c.d_model)
  ),
  ("decoder", "layers", "attn", "w_k_dkh"): _Mapping(
    _LAYER + "self_attn.k_proj.weight", *_proj_in("num_kv_heads"), lambda c: (_kh(c), c.d_model)
  ),
  ("decoder", "layers", "attn", "w_v_dkh"): _Mapping(
    _LAYER + "self_attn.v_proj.weight", *_proj_in("num_kv_heads"), lambda c: (_kh(c), c.d_model)
  ),
  ("decoder", "layers", "attn", "w_o_nhd"): _Mapping(
    _LAYER + "self_attn.o_proj.weight", _o_to_ours, _o_to_hf, lambda c: (c.d_model, _nh(c))
  ),
  ("decoder", "layers", "attn", "b_q_nh"): _Mapping(
    _LAYER + "self_attn.q_proj.bias", *_bias("num_heads"), lambda c: (_nh(c),)
  ),
  ("decoder", "layers", "attn", "b_k_kh"): _Mapping(
    _LAYER + "self_attn.k_proj.bias", *_bias("num_kv_heads"), lambda c: (_kh(c),)
  ),
  ("decoder", "layers", "attn", "b_v_kh"): _Mapping(
    _LAYER + "self_attn.v_proj.bias", *_bias("num_kv_heads"), lambda c: (_kh(c),)
  ),
  ("decoder", "layers", "attn", "b_o_d"): _Mapping(_LAYER + "self_attn.o_proj.bias", _identity, _identity, _d),
  ("decoder", "layers", "mlp", "w_gate_df"): _Mapping(
    _LAYER + "mlp.gate_proj.weight", _transpose, _transpose, lambda c: (c.mlp_dim, c.d_model)
  ),
  ("decoder", "layers", "mlp", "w_up_df"): _Mapping(
    _LAYER + "mlp.up_proj.weight", _transpose, _transpose, lambda c: (c.mlp_dim, c.d_model)
  ),
  ("decoder", "layers", "mlp", "w_down_fd"): _Mapping(
    _LAYER + "mlp.down_proj.weight", _transpose, _transpose, lambda c: (c.d_model, c.mlp_dim)
  ),
}

# Tensors that checkpoints may carry and that we knowingly do not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _path_key(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def _variables_with_paths(state) -> list[tuple[tuple[str, ...], nnx.Variable]]:
  leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return [(_path_key(p), v) for p, v in leaves]


def _mapping_for(key: tuple[str, ...]) -> _Mapping:
  if key not in _MAPPINGS:
    raise KeyError(f"parameter {'/'.join(key)} has no Hugging Face name")
  return _MAPPINGS[key]


# ----------------------------------------------------------------------------
# load_hf / save_hf
# ----------------------------------------------------------------------------


def load_hf(
  path: str,
  *,
  mesh: Mesh | None = None,
  dtype: str = "float32",
  compute_dtype: str | None = None,
  rules: Rules = TRAIN_RULES,
  config_overrides: Mapping[str, Any] | None = None,
) -> Transformer:
  """Loads a Hugging Face Llama/Qwen2 checkpoint directory as a :class:`Transformer`.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or sharded files
      with ``model.safetensors.index.json``).
    mesh: the mesh to place parameters on (sharded by ``rules``); one device if None.
    dtype: parameter dtype (``float32``, ``bfloat16``, ``float16``).
    compute_dtype: matmul dtype; defaults to ``dtype``.
    rules: logical-axis rules for the parameter layout.
    config_overrides: ModelConfig fields to override (e.g. ``remat``, ``max_seq_len``).

  Returns:
    The model, every parameter already in its sharding.

  Raises:
    ValueError: unsupported architecture/options, out-of-range ``config.json`` values,
      a corrupt safetensors file, or tensors missing from the checkpoint or of the wrong
      dtype or shape for the config (the message names the tensor, the expected and the
      actual shape).
  """
  config_path = os.path.join(path, "config.json")
  try:
    with open(config_path, encoding="utf-8") as f:
      hf_cfg = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise ValueError(f"{config_path}: not valid UTF-8 JSON ({type(e).__name__}: {e})") from None
  cfg = config_from_hf(hf_cfg, dtype=dtype, compute_dtype=compute_dtype)
  if config_overrides:
    cfg = cfg.replace(**config_overrides)
  reader = CheckpointReader(path)

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  variables = _variables_with_paths(abs_state)

  unused = unused_tensors(reader, cfg)
  if unused:
    logging.warning("%s: %d checkpoint tensors are not used: %s", path, len(unused), ", ".join(unused[:5]))

  # Fail before touching any data if something is missing.
  missing = []
  for key, _ in variables:
    m = _mapping_for(key)
    names = [m.hf_name.format(i=i) for i in range(cfg.num_layers)] if m.stacked else [m.hf_name]
    missing += [n for n in names if n not in reader]
  if missing:
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    raise ValueError(f"{path}: checkpoint is missing tensors required by {cfg.name}: {shown}")
  check_tensors(reader, cfg, [key for key, _ in variables], where=path)

  if mesh is not None:
    shardings = state_shardings(abs_state, mesh, rules)
    sharding_by_key = {k: s.get_value() for k, s in _variables_with_paths(shardings)}
  else:
    device = jax.local_devices()[0]
    sharding_by_key = {k: jax.sharding.SingleDeviceSharding(device) for k, _ in variables}

  @functools.lru_cache(maxsize=8)
  def converted(hf_name: str, key: tuple[str, ...]) -> np.ndarray:
    m = _MAPPINGS[key]
    return np.asarray(m.to_ours(reader.get(hf_name), cfg))

  def make(key: tuple[str, ...], var: nnx.Variable) -> jax.Array:
    m = _MAPPINGS[key]
    shape, target_dtype = var.get_value().shape, var.get_value().dtype

    def callback(index: tuple[slice, ...]) -> np.ndarray:
      if m.stacked:
        layers = range(cfg.num_layers)[index[0]]
        parts = [converted(m.hf_name.format(i=i), key)[index[1:]] for i in layers]
        out = np.stack(parts)
      else:
        out = converted(m.hf_name, key)[index]
      return out.astype(target_dtype)

    return jax.make_array_from_callback(shape, sharding_by_key[key], callback)

  arrays = {key: make(key, var) for key, var in variables}

  def fill(path_, var):
    return var.replace(arrays[_path_key(path_)])

  state = jax.tree_util.tree_map_with_path(fill, abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


def check_tensors(reader: CheckpointReader, cfg: ModelConfig, keys: list[tuple[str, ...]], *, where: str) -> None:
  """Checks the dtype and shape of every checkpoint tensor the parameters ``keys`` need (headers only).

  Every layer's tensor is checked, not only the first, and a transposed tensor is caught
  even where a reshape would silently accept it.

  Raises:
    ValueError: listing (up to 5 of) the tensors that are not floating point or whose shape
      is not the one ``cfg`` implies, with the expected and actual shape.
  """
  problems = []
  for key in keys:
    m = _mapping_for(key)
    expected = tuple(m.hf_shape(cfg))
    for name in [m.hf_name.format(i=i) for i in range(cfg.num_layers)] if m.stacked else [m.hf_name]:
      dtype, shape = reader.dtype(name), tuple(reader.shape(name))
      if dtype not in _FLOAT_DTYPES:
        problems.append(
          f"tensor {name} has dtype {dtype}, expected a floating-point dtype ({', '.join(_FLOAT_DTYPES)})"
        )
      elif shape != expected:
        problems.append(f"tensor {name} has shape {shape}, expected {expected}")
  if problems:
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    raise ValueError(
      f"{where}: checkpoint tensors do not match config.json (vocab_size={cfg.vocab_size}, "
      f"hidden_size={cfg.d_model}, intermediate_size={cfg.mlp_dim}, num_attention_heads={cfg.num_heads}, "
      f"num_key_value_heads={cfg.num_kv_heads}, head_dim={cfg.resolved_head_dim}): {shown}"
    )


def _to_host(x: jax.Array) -> np.ndarray:
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_hf(
  model: Transformer,
  path: str,
  *,
  dtype: str | None = None,
  max_shard_bytes: int = 4 * 1024**3,
  tokenizer: Any = None,
) -> None:
  """Writes ``model`` as a Hugging Face checkpoint directory that ``transformers`` loads.

  Args:
    model: the policy.
    path: output directory (created).
    dtype: tensor dtype on disk; the model's parameter dtype by default.
    max_shard_bytes: above this total size, tensors are split over several files
      with an index.
    tokenizer: the policy's :class:`mimo_jax.tokenization.Tokenizer`: its special ids go into
      ``config.json`` and ``generation_config.json`` (every stop id: ``generate`` ends at each); a
      SentencePiece model is written beside the weights as ``tokenizer.model``, a Hugging Face one as
      ``tokenizer.json`` with a ``tokenizer_config.json`` (its special tokens and chat template).  Without it, a loader
      knows no end of sequence (``generate`` runs to its length limit).
  """
  cfg = model.config
  out_dtype = (
    np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.param_dtype) == "bfloat16" else np.dtype(dtype or cfg.param_dtype)
  )
  os.makedirs(path, exist_ok=True)
  tensors: dict[str, np.ndarray] = {}
  for key, var in _variables_with_paths(nnx.state(model, nnx.Param)):
    m = _mapping_for(key)
    host = _to_host(var.get_value())
    if m.stacked:
      for i in range(cfg.num_layers):
        tensors[m.hf_name.format(i=i)] = np.ascontiguousarray(m.to_hf(host[i], cfg)).astype(out_dtype)
    else:
      tensors[m.hf_name] = np.ascontiguousarray(m.to_hf(host, cfg)).astype(out_dtype)
  if jax.process_index() != 0:
    return
  torch_dtype = "bfloat16" if out_dtype == np.dtype(ml_dtypes.bfloat16) else str(out_dtype)
  total = sum(t.nbytes for t in tensors.values())
  meta = {"format": "pt"}
  if total <= max_shard_bytes:
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, meta)
    _finish_export(path, ["model.safetensors"], config_to_hf(cfg, torch_dtype=torch_dtype), tokenizer)
    return
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors):
    if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += tensors[name].nbytes
  weight_map = {}
  for j, shard in enumerate(shards):
    fn = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(os.path.join(path, fn), shard, meta)
    weight_map.update({name: fn for name in shard})
  _write_json(
    os.path.join(path, "model.safetensors.index.json"), {"metadata": {"total_size": total}, "weight_map": weight_map}
  )
  files = ["model.safetensors.index.json", *sorted(set(weight_map.values()))]
  _finish_export(path, files, config_to_hf(cfg, torch_dtype=torch_dtype), tokenizer)


_WEIGHT_FILE = re.compile(r"model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors")


def _write_json(path: str, obj: Any) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def _finish_export(path: str, written: Sequence[str], config: Mapping[str, Any], tokenizer: Any = None) -> None:
  """After the weights: removes the weight files of an earlier export in ``path`` that this one did not
  write (a single file left beside new shards, or shards beside a new single file, would be a second
  model that some loader picks), writes the tokenizer's files, then ``config.json`` last."""
  keep = set(written)
  for name in os.listdir(path):
    if _WEIGHT_FILE.fullmatch(name) and name not in keep:
      os.remove(os.path.join(path, name))
  config = dict(config)
  generation = os.path.join(path, "generation_config.json")
  if tokenizer is None:
    if os.path.exists(generation):  # an earlier export's, of another tokenizer maybe
      os.remove(generation)
  else:
    stops = [int(i) for i in tokenizer.stop_ids]
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": stops[0], "pad_token_id": int(tokenizer.pad_id)}
    config.update(ids)
    _write_json(generation, {**ids, "eos_token_id": stops if len(stops) > 1 else stops[0]})
    if hasattr(tokenizer, "save_pretrained"):  # a tokenizer.json: written with its config and chat template
      tokenizer.save_pretrained(path)
    if hasattr(tokenizer, "model_proto_bytes"):
      tmp = os.path.join(path, "tokenizer.model.tmp")
      with open(tmp, "wb") as f:
        f.write(tokenizer.model_proto_bytes())
      os.replace(tmp, os.path.join(path, "tokenizer.model"))
  _write_json(os.path.join(path, "config.json"), config)


def unused_tensors(reader: CheckpointReader, cfg: ModelConfig) -> list[str]:
  """Checkpoint tensors that :func:`load_hf` does not read (for diagnostics)."""
  used = set()
  for m in _MAPPINGS.values():
    if m.stacked:
      used.update(m.hf_name.format(i=i) for i in range(cfg.num_layers))
    else:
      used.add(m.hf_name)
  return [n for n in reader.names() if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
