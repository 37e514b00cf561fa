"""Oracle tests: our model against Hugging Face ``transformers`` (torch, CPU), both ways."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

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


def _our_logits(model, tokens, mask):
  return np.asarray(jax.jit(lambda t, m: model(t, attention_mask=m))(tokens, mask))


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
