"""Real sharding on 8 emulated CPU devices: same numbers, parameters where the rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mimo_jax import sharding
from mimo_jax.config_base import ConfigError
from mimo_jax.models import Transformer, create_sharded
from mimo_jax.models.config import tiny
from mimo_jax.sharding import MeshConfig, build_mesh, logical_to_spec


def _cfg():
  # 8 heads of 8 / 4 KV heads / mlp 128 divide every tensor size tested.
  return tiny().replace(num_heads=8, num_kv_heads=4, d_model=64, qkv_bias=True)


def _forward(model, mesh, tokens, mask):
  graphdef, state = nnx.split(model)

  @jax.jit
  def f(state, tokens, mask):
    with sharding.use_rules(mesh, sharding.TRAIN_RULES):
      return nnx.merge(graphdef, state)(tokens, attention_mask=mask)

  return np.asarray(f(state, tokens, mask))


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1)])
def test_same_logits_as_one_device(shape):
  cfg = _cfg()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16)), jnp.int32)
  mask = jnp.asarray(np.arange(16)[None] >= np.arange(8)[:, None] % 4)  # some left padding
  one = build_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  ref = _forward(create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), one), one, tokens, mask)
  mesh = build_mesh(MeshConfig(*shape))
  model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  out = _forward(model, mesh, tokens, mask)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_parameters_are_sharded_as_the_rules_say():
  cfg = _cfg()
  mesh = build_mesh(MeshConfig(2, 2, 2))
  model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  expect = {
    "w_q_dnh": (P(None, "fsdp", "tensor", None), (2, 32, 4, 8)),
    "w_k_dkh": (P(None, "fsdp", "tensor", None), (2, 32, 2, 8)),
    "w_o_nhd": (P(None, "tensor", None, "fsdp"), (2, 4, 8, 32)),
    "b_q_nh": (P(None, "tensor", None), (2, 4, 8)),
  }
  for name, (spec, shard_shape) in expect.items():
    arr = getattr(model.decoder.layers.attn, name)[...]
    assert arr.sharding.spec == spec, name
    assert {s.data.shape for s in arr.addressable_shards} == {shard_shape}, name
  gate = model.decoder.layers.mlp.w_gate_df[...]
  assert gate.sharding.spec == P(None, "fsdp", "tensor")
  embed = model.decoder.embed_vd[...]
  assert embed.sharding.spec == P("tensor", "fsdp")
  assert model.lm_head_dv[...].sharding.spec == P("fsdp", "tensor")
  # Each device holds 1/4 of the (fsdp x tensor) sharded matrices, replicated over data.
  assert gate.addressable_shards[0].data.size * 4 == gate.size


def test_logical_to_spec_rules():
  mesh = build_mesh(MeshConfig(1, 2, 4))
  rules = sharding.TRAIN_RULES
  assert logical_to_spec(("batch", "seq", "act_embed"), rules, mesh) == P("fsdp", None, None)
  # 2 KV heads cannot be split 4 ways: that dimension is replicated.
  assert logical_to_spec(("embed", "kv_heads", "head_dim"), rules, mesh, (64, 2, 16)) == P("fsdp", None, None)
  assert logical_to_spec(("embed", "kv_heads", "head_dim"), rules, mesh, (64, 4, 16)) == P("fsdp", "tensor", None)
  with pytest.raises(KeyError, match="no sharding rule"):
    logical_to_spec(("nonsense",), rules, mesh)


def test_mesh_config_resolution_and_errors():
  assert MeshConfig(1, -1, 2).resolve(8) == (1, 4, 2)
  assert MeshConfig(2, 2, 2).resolve(8) == (2, 2, 2)
  with pytest.raises(ConfigError, match="mesh has 3 devices but 8 are available"):
    MeshConfig(1, 3, 1).resolve(8)
  with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
    MeshConfig(-1, -1, 1)
  with pytest.raises(ConfigError, match="must divide the 8 devices"):
    MeshConfig(1, -1, 3).resolve(8)
  mesh = build_mesh(MeshConfig(2, 2, 2))
  assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.size == 8
