"""Oracle tests: our model against Hugging Face ``transformers`` (torch, CPU), both ways."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from mimo_jax.models import load_hf, save_hf
from mimo_jax.models.hf import CheckpointReader
from mimo_jax.sharding import MeshConfig, build_mesh
from mimo_jax.testing import save_random_hf_model

LLAMA3_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 500000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 64,
}

VARIANTS = {
  "llama": dict(arch="llama"),
  "llama_tied_bias": dict(arch="llama", tie=True, bias=True),
  "llama3_rope": dict(arch="llama", rope=LLAMA3_ROPE),
  "llama_linear_rope": dict(arch="llama", rope={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
  "qwen2": dict(arch="qwen2"),
  "qwen2_tied": dict(arch="qwen2", tie=True),
}


def _batch(seed=0, vocab=128):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (4, 24)).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  mask[1, :7] = False  # left padded
  mask[2, 17:] = False  # right padded
  return tokens, mask


def _hf_logits(model, tokens, mask):
  with torch.no_grad():
    out = model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask.astype(np.int64)))
  return out.logits.float().numpy()


@jax.jit
def _logits(graphdef, state, tokens, mask):
  # The weights are arguments: closed over, they would be constants of the program, which XLA folds.
  return nnx.merge(graphdef, state)(tokens, attention_mask=mask)


def _our_logits(model, tokens, mask):
  return np.asarray(_logits(*nnx.split(model), tokens, mask))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("mesh_shape", [None, (1, 2, 4)])
def test_logits_match_transformers(tmp_path, variant, mesh_shape):
  hf_model = save_random_hf_model(str(tmp_path), **VARIANTS[variant])
  mesh = build_mesh(MeshConfig(*mesh_shape)) if mesh_shape else None
  model = load_hf(str(tmp_path), mesh=mesh)
  tokens, mask = _batch()
  ours, ref = _our_logits(model, tokens, mask), _hf_logits(hf_model, tokens, mask)
  # Padding positions are garbage in both; compare the real tokens.
  np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=0)
  assert np.abs(ours[mask] - ref[mask]).max() < 1e-4


@pytest.mark.parametrize("variant", ["llama_tied_bias", "qwen2", "llama3_rope"])
def test_save_hf_roundtrip_through_transformers(tmp_path, variant):
  src, dst = tmp_path / "src", tmp_path / "dst"
  hf_model = save_random_hf_model(str(src), **VARIANTS[variant])
  model = load_hf(str(src), mesh=build_mesh(MeshConfig(1, 4, 2)))
  save_hf(model, str(dst))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(dst))
  reloaded.eval()
  assert type(reloaded) is type(hf_model)
  tokens, mask = _batch(1)
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens, mask), _hf_logits(hf_model, tokens, mask))


def test_save_hf_sharded_files_with_index(tmp_path):
  save_random_hf_model(str(tmp_path / "src"), arch="llama")
  model = load_hf(str(tmp_path / "src"))
  save_hf(model, str(tmp_path / "dst"), max_shard_bytes=20_000)
  files = sorted(os.listdir(tmp_path / "dst"))
  shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
  assert len(shards) > 2 and "model.safetensors.index.json" in files
  again = load_hf(str(tmp_path / "dst"))
  tokens, mask = _batch(2)
  np.testing.assert_array_equal(_our_logits(again, tokens, mask), _our_logits(model, tokens, mask))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst"))
  reloaded.eval()
  np.testing.assert_allclose(
    _hf_logits(reloaded, tokens, mask)[mask], _our_logits(model, tokens, mask)[mask], atol=1e-4
  )


@pytest.mark.parametrize("first_sharded", [False, True])
def test_an_export_over_an_earlier_one_of_another_layout_leaves_one_model(tmp_path, first_sharded):
  """Saving over a directory whose earlier export had the other layout (one file vs shards with an index)
  removes the earlier weight files: left beside the new ones, transformers read the single file and our
  reader the index, two different models from one directory.  A directory holding both is refused."""
  save_random_hf_model(str(tmp_path / "a"), arch="llama", seed=1)
  save_random_hf_model(str(tmp_path / "b"), arch="llama", seed=2)
  a, b = load_hf(str(tmp_path / "a")), load_hf(str(tmp_path / "b"))
  out = str(tmp_path / "out")
  big, small = 20_000, 4 * 1024**3
  save_hf(a, out, max_shard_bytes=big if first_sharded else small)
  save_hf(b, out, max_shard_bytes=small if first_sharded else big)
  files = sorted(os.listdir(out))
  weights = [f for f in files if f != "config.json"]
  if first_sharded:
    assert weights == ["model.safetensors"]
  else:
    assert "model.safetensors" not in weights and "model.safetensors.index.json" in weights
  tokens, mask = _batch(5)
  want = _our_logits(b, tokens, mask)
  np.testing.assert_array_equal(_our_logits(load_hf(out), tokens, mask), want)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
  theirs.eval()
  np.testing.assert_allclose(_hf_logits(theirs, tokens, mask)[mask], want[mask], atol=1e-4)
  # Both layouts in one directory (written by something else): refused, not one of them picked.
  save_hf(a, str(tmp_path / "other"), max_shard_bytes=big if first_sharded else small)  # the other layout
  for name in os.listdir(tmp_path / "other"):
    if name.startswith("model"):
      os.replace(tmp_path / "other" / name, os.path.join(out, name))
  with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
    load_hf(out)


def test_bf16_checkpoint_loads(tmp_path):
  hf_model = save_random_hf_model(str(tmp_path / "f32"), arch="qwen2")
  hf_model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
  reader = CheckpointReader(str(tmp_path / "bf16"))
  assert str(reader.get("model.norm.weight").dtype) == "bfloat16"
  model = load_hf(str(tmp_path / "bf16"), dtype="float32")
  tokens, mask = _batch(3)
  ref = _hf_logits(hf_model.to(torch.float32), tokens, mask)  # weights rounded to bf16 above
  np.testing.assert_allclose(_our_logits(model, tokens, mask)[mask], ref[mask], atol=1e-4)


def test_old_config_spelling(tmp_path):
  hf_model = save_random_hf_model(str(tmp_path), arch="llama", rope=LLAMA3_ROPE)
  cfg_path = tmp_path / "config.json"
  cfg = json.loads(cfg_path.read_text())
  rope = cfg.pop("rope_parameters")
  cfg["rope_theta"] = rope.pop("rope_theta")
  cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
  cfg_path.write_text(json.dumps(cfg))
  model = load_hf(str(tmp_path))
  assert model.config.rope_theta == 500000.0 and model.config.rope_scaling.kind == "llama3"
  tokens, mask = _batch(4)
  np.testing.assert_allclose(
    _our_logits(model, tokens, mask)[mask], _hf_logits(hf_model, tokens, mask)[mask], atol=1e-4
  )


def test_unsupported_architecture_is_named(tmp_path):
  save_random_hf_model(str(tmp_path), arch="llama")
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["architectures"] = ["MistralForCausalLM"]
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="MistralForCausalLM.*not supported.*LlamaForCausalLM"):
    load_hf(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
  from mimo_jax.models.hf import SafetensorsFile, write_safetensors

  save_random_hf_model(str(tmp_path), arch="llama")
  f = SafetensorsFile(str(tmp_path / "model.safetensors"))
  tensors = {k: np.array(f.get(k)) for k in f.keys() if k != "model.layers.1.mlp.up_proj.weight"}
  del f
  write_safetensors(str(tmp_path / "model.safetensors"), tensors)
  with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
    load_hf(str(tmp_path))


def test_load_places_shards_directly(tmp_path):
  save_random_hf_model(str(tmp_path), arch="llama", num_hidden_layers=4)
  mesh = build_mesh(MeshConfig(1, 2, 4))
  model = load_hf(str(tmp_path), mesh=mesh)
  w_q = model.decoder.layers.attn.w_q_dnh[...]
  # [L, D, N, H] = [4, 64, 4, 16]: D over fsdp (2), N over tensor (4).
  assert w_q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  assert {s.data.shape for s in w_q.addressable_shards} == {(4, 32, 1, 16)}


# ----------------------------------------------------------------------------
# Checkpoints validated at the door: tensors, config values, safetensors headers
# ----------------------------------------------------------------------------


def _rewrite_tensors(path, change):
  """Applies ``change(tensors)`` to the ``model.safetensors`` of a checkpoint directory."""
  from mimo_jax.models.hf import SafetensorsFile, write_safetensors

  f = SafetensorsFile(str(path / "model.safetensors"))
  tensors = {k: np.array(f.get(k)) for k in f.keys()}
  del f
  change(tensors)
  write_safetensors(str(path / "model.safetensors"), tensors)


def _edit_config(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(changes)
  (path / "config.json").write_text(json.dumps(cfg))


def test_transposed_k_proj_is_refused_naming_tensor_and_shapes(tmp_path):
  save_random_hf_model(str(tmp_path), arch="llama")
  name = "model.layers.1.self_attn.k_proj.weight"  # not layer 0: every layer is checked

  def transpose(tensors):
    tensors[name] = np.ascontiguousarray(tensors[name].T)

  _rewrite_tensors(tmp_path, transpose)
  # [K*H, D] = [32, 64] stored as [64, 32]: the old reshape-based check let this through.
  with pytest.raises(ValueError, match=rf"tensor {name} has shape \(64, 32\), expected \(32, 64\)"):
    load_hf(str(tmp_path))


@pytest.mark.parametrize(
  "name, shape",
  [
    ("model.embed_tokens.weight", (127, 64)),
    ("model.layers.0.mlp.down_proj.weight", (96, 64)),
    ("model.norm.weight", (65,)),
  ],
)
def test_wrong_tensor_shapes_are_refused(tmp_path, name, shape):
  save_random_hf_model(str(tmp_path), arch="llama")

  def reshape(tensors):
    tensors[name] = np.zeros(shape, np.float32)

  _rewrite_tensors(tmp_path, reshape)
  with pytest.raises(ValueError, match=rf"tensor {name} has shape \({shape[0]},"):
    load_hf(str(tmp_path))


def test_integer_tensor_dtype_is_refused(tmp_path):
  save_random_hf_model(str(tmp_path), arch="llama")
  name = "model.layers.0.input_layernorm.weight"

  def to_int(tensors):
    tensors[name] = tensors[name].astype(np.int32)

  _rewrite_tensors(tmp_path, to_int)
  with pytest.raises(ValueError, match=rf"tensor {name} has dtype I32, expected a floating-point dtype"):
    load_hf(str(tmp_path))


@pytest.mark.parametrize(
  "changes, pattern",
  [
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan must be a finite number > 0"),
    ({"rms_norm_eps": 0.0}, r"rms_norm_eps=0\.0 must be a finite number > 0"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps=-1e-06 must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -10000.0}}, r"rope_theta=-10000\.0 must be"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, r"rope_theta=0 must be a finite number > 0"),
    (
      {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": float("inf")}},
      r"factor=inf must be a finite number > 0",
    ),
    ({"hidden_size": 0}, r"hidden_size=0 must be a positive integer"),
    ({"vocab_size": -5}, r"vocab_size=-5 must be a positive integer"),
    ({"num_hidden_layers": 2.5}, r"num_hidden_layers=2\.5 must be a positive integer"),
    ({"intermediate_size": True}, r"intermediate_size=True must be a positive integer"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads=3 must divide num_attention_heads=4"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None}, r"hidden_size=64 must be divisible"),
    ({"head_dim": 15}, r"head_dim=15 must be even"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings=0 must be a positive integer"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings='false' must be true or false"),
    # transformers builds a Mistral (sliding windows) from this: loading it as Llama gave other logits.
    (
      {"model_type": "mistral", "sliding_window": 6},
      r"model_type 'mistral' is not the family of architecture 'LlamaForCausalLM'",
    ),
    # transformers takes rope_scaling over rope_parameters: read the other way, other positions.
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, r"rope_parameters and rope_scaling are both set"),
  ],
)
def test_bad_config_values_are_refused_naming_the_field(tmp_path, changes, pattern):
  save_random_hf_model(str(tmp_path), arch="llama")
  _edit_config(tmp_path, **changes)
  with pytest.raises(ValueError, match=r"config\.json.*" + pattern):
    load_hf(str(tmp_path))


def test_model_config_refuses_non_finite_numerics():
  from mimo_jax.config_base import ConfigError
  from mimo_jax.models.config import RopeScaling, tiny

  with pytest.raises(ConfigError, match=r"rms_norm_eps=nan: must be a finite number > 0"):
    tiny().replace(rms_norm_eps=float("nan"))
  with pytest.raises(ConfigError, match=r"rope_theta=-1\.0: must be a finite number > 0"):
    tiny().replace(rope_theta=-1.0)
  with pytest.raises(ConfigError, match=r"max_seq_len=0: must be a positive integer"):
    tiny().replace(max_seq_len=0)
  with pytest.raises(ConfigError, match=r"rope_scaling\.factor=nan"):
    RopeScaling("linear", float("nan"))


def _write_raw_safetensors(path, header_len: int, body: bytes = b"", size: int | None = None):
  import struct

  with open(path, "wb") as f:
    f.write(struct.pack("<Q", header_len))
    f.write(body)
    if size is not None:
      f.truncate(size)  # sparse: no real disk use


def test_safetensors_header_longer_than_the_file_is_refused(tmp_path):
  from mimo_jax.models.hf import SafetensorsFile

  path = tmp_path / "x.safetensors"
  _write_raw_safetensors(path, 2**62, b"{}")  # reading this header used to raise MemoryError
  with pytest.raises(ValueError, match=r"header length 4611686018427387904 bytes exceeds the 104857600-byte limit"):
    SafetensorsFile(str(path))
  _write_raw_safetensors(path, 1000, b"{}")
  with pytest.raises(ValueError, match=r"header length 1000 bytes is larger than the rest of the file \(2 bytes"):
    SafetensorsFile(str(path))


def test_safetensors_header_above_the_cap_is_refused_even_if_the_file_is_larger(tmp_path):
  from mimo_jax.models.hf import MAX_HEADER_BYTES, SafetensorsFile

  path = tmp_path / "big.safetensors"
  _write_raw_safetensors(path, MAX_HEADER_BYTES + 1, b"{", size=MAX_HEADER_BYTES + 64)
  with pytest.raises(ValueError, match="exceeds the 104857600-byte limit"):
    SafetensorsFile(str(path))


@pytest.mark.parametrize(
  "header, pattern",
  [
    (b"\xff\xfe", "not valid UTF-8 JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}}).encode(), "data_offsets"),
    (json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode(), "needs 12"),
    (json.dumps({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}).encode(), "non-negative"),
  ],
)
def test_corrupt_safetensors_headers_are_refused(tmp_path, header, pattern):
  from mimo_jax.models.hf import SafetensorsFile

  path = tmp_path / "x.safetensors"
  _write_raw_safetensors(path, len(header), header + b"\0" * 8)
  with pytest.raises(ValueError, match=pattern):
    SafetensorsFile(str(path))


def test_index_naming_a_file_outside_the_directory_is_refused(tmp_path):
  save_random_hf_model(str(tmp_path / "src"), arch="llama")
  model = load_hf(str(tmp_path / "src"))
  save_hf(model, str(tmp_path / "dst"), max_shard_bytes=20_000)
  index = tmp_path / "dst" / "model.safetensors.index.json"
  data = json.loads(index.read_text())
  first = next(iter(data["weight_map"]))
  data["weight_map"][first] = "../src/model.safetensors"
  index.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=r"not a file name inside"):
    load_hf(str(tmp_path / "dst"))
