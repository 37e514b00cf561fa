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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from collections.abc import Callable, Mapping
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


class SafetensorsFile:
  """A memory-mapped safetensors file; ``get`` returns zero-copy numpy views."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (truncated header)")
      (header_len,) = struct.unpack("<Q", raw)
      header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    self._header = header
    self._data_start = 8 + header_len
    self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

  def keys(self) -> list[str]:
    return list(self._header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    info = self._header[name]
    if info["dtype"] not in _ST_TO_NP:
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    dtype = _ST_TO_NP[info["dtype"]]
    begin, end = info["data_offsets"]
    buf = self._mmap[self._data_start + begin : self._data_start + end]
    return buf.view(dtype).reshape(info["shape"])


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
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = {fn: SafetensorsFile(os.path.join(path, fn)) for fn in sorted(set(weight_map.values()))}
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


# ----------------------------------------------------------------------------
# config.json <-> ModelConfig
# ----------------------------------------------------------------------------


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  params = hf.get("rope_parameters")
  if isinstance(params, Mapping) and "rope_theta" not in params and "rope_type" not in params:
    raise ValueError("config.json: per-layer-type rope_parameters are not supported")
  if params is None:
    params = dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind in ("default", None):
    return theta, None
  if kind == "linear":
    return theta, RopeScaling("linear", float(params["factor"]))
  if kind == "llama3":
    return theta, RopeScaling(
      "llama3",
      float(params["factor"]),
      float(params["low_freq_factor"]),
      float(params["high_freq_factor"]),
      int(params["original_max_position_embeddings"]),
    )
  raise ValueError(f"config.json: rope type {kind!r} is not supported (supported: default, linear, llama3)")


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", compute_dtype: str | None = None) -> ModelConfig:
  """Converts a Hugging Face ``config.json`` dict to a :class:`ModelConfig`."""
  archs = hf.get("architectures") or []
  arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(hf.get("model_type"))
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
      f"config.json: architecture {arch or hf.get('model_type')!r} is not supported; "
      f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
  if hf.get("mlp_bias"):
    raise ValueError("config.json: mlp_bias=true is not supported")
  if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
    raise ValueError("config.json: use_sliding_window=true is not supported")
  theta, scaling = _rope_from_hf(hf)
  heads = hf["num_attention_heads"]
  if arch == "Qwen2ForCausalLM":
    qkv_bias, o_bias = True, False
  else:
    qkv_bias = o_bias = bool(hf.get("attention_bias", False))
  return ModelConfig(
    name=hf.get("_name_or_path") or arch,
    vocab_size=hf["vocab_size"],
    d_model=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
    mlp_dim=hf["intermediate_size"],
    rope_theta=theta,
    rope_scaling=scaling,
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    qkv_bias=qkv_bias,
    o_bias=o_bias,
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_seq_len=int(hf.get("max_position_embeddings", 2048)),
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


_LAYER = "model.layers.{i}."
_MAPPINGS: dict[tuple[str, ...], _Mapping] = {
  ("decoder", "embed_vd"): _Mapping("model.embed_tokens.weight", _identity, _identity),
  ("decoder", "final_norm", "scale"): _Mapping("model.norm.weight", _identity, _identity),
  ("lm_head_dv",): _Mapping("lm_head.weight", _transpose, _transpose),
  ("decoder", "layers", "attn_norm", "scale"): _Mapping(_LAYER + "input_layernorm.weight", _identity, _identity),
  ("decoder", "layers", "mlp_norm", "scale"): _Mapping(
    _LAYER + "post_attention_layernorm.weight", _identity, _identity
  ),
  ("decoder", "layers", "attn", "w_q_dnh"): _Mapping(_LAYER + "self_attn.q_proj.weight", *_proj_in("num_heads")),
  ("decoder", "layers", "attn", "w_k_dkh"): _Mapping(_LAYER + "self_attn.k_proj.weight", *_proj_in("num_kv_heads")),
  ("decoder", "layers", "attn", "w_v_dkh"): _Mapping(_LAYER + "self_attn.v_proj.weight", *_proj_in("num_kv_heads")),
  ("decoder", "layers", "attn", "w_o_nhd"): _Mapping(_LAYER + "self_attn.o_proj.weight", _o_to_ours, _o_to_hf),
  ("decoder", "layers", "attn", "b_q_nh"): _Mapping(_LAYER + "self_attn.q_proj.bias", *_bias("num_heads")),
  ("decoder", "layers", "attn", "b_k_kh"): _Mapping(_LAYER + "self_attn.k_proj.bias", *_bias("num_kv_heads")),
  ("decoder", "layers", "attn", "b_v_kh"): _Mapping(_LAYER + "self_attn.v_proj.bias", *_bias("num_kv_heads")),
  ("decoder", "layers", "attn", "b_o_d"): _Mapping(_LAYER + "self_attn.o_proj.bias", _identity, _identity),
  ("decoder", "layers", "mlp", "w_gate_df"): _Mapping(_LAYER + "mlp.gate_proj.weight", _transpose, _transpose),
  ("decoder", "layers", "mlp", "w_up_df"): _Mapping(_LAYER + "mlp.up_proj.weight", _transpose, _transpose),
  ("decoder", "layers", "mlp", "w_down_fd"): _Mapping(_LAYER + "mlp.down_proj.weight", _transpose, _transpose),
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
    ValueError: unsupported architecture/options, or tensors missing from the checkpoint.
  """
  with open(os.path.join(path, "config.json")) as f:
    hf_cfg = json.load(f)
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

    expected = shape[1:] if m.stacked else shape
    got = converted(m.hf_name.format(i=0), key).shape
    if tuple(got) != tuple(expected):
      raise ValueError(f"{path}: tensor {m.hf_name} has shape {got} after conversion, expected {expected}")
    return jax.make_array_from_callback(shape, sharding_by_key[key], callback)

  arrays = {key: make(key, var) for key, var in variables}

  def fill(path_, var):
    return var.replace(arrays[_path_key(path_)])

  state = jax.tree_util.tree_map_with_path(fill, abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


def _to_host(x: jax.Array) -> np.ndarray:
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_hf(model: Transformer, path: str, *, dtype: str | None = None, max_shard_bytes: int = 4 * 1024**3) -> None:
  """Writes ``model`` as a Hugging Face checkpoint directory that ``transformers`` loads.

  Args:
    model: the policy.
    path: output directory (created).
    dtype: tensor dtype on disk; the model's parameter dtype by default.
    max_shard_bytes: above this total size, tensors are split over several files
      with an index.
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
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(cfg, torch_dtype=torch_dtype), f, indent=2)
  total = sum(t.nbytes for t in tensors.values())
  meta = {"format": "pt"}
  if total <= max_shard_bytes:
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, meta)
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
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def unused_tensors(reader: CheckpointReader, cfg: ModelConfig) -> list[str]:
  """Checkpoint tensors that :func:`load_hf` does not read (for diagnostics)."""
  used = set()
  for m in _MAPPINGS.values():
    if m.stacked:
      used.update(m.hf_name.format(i=i) for i in range(cfg.num_layers))
    else:
      used.add(m.hf_name)
  return [n for n in reader.names() if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
