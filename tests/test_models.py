"""Model invariances and presets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax.models import (
  PRESETS,
  PUBLIC_PARAM_COUNTS,
  KVCache,
  ModelConfig,
  Transformer,
  ValueModel,
  get_preset,
)
from mimo_jax.models.config import ConfigError, tiny
from mimo_jax.models.transformer import project


def _model(**changes) -> Transformer:
  return Transformer(tiny().replace(**changes), rngs=nnx.Rngs(0))


def _count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_abstractly_with_the_right_size(name):
  cfg = get_preset(name)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  n = _count(nnx.state(abstract, nnx.Param))
  assert n == cfg.num_params()
  if name in PUBLIC_PARAM_COUNTS:
    assert n == PUBLIC_PARAM_COUNTS[name]
  # Every parameter is stacked over layers or is a global tensor: depth is scanned.
  layer_leaves = jax.tree.leaves(nnx.state(abstract.decoder.layers, nnx.Param))
  assert all(x.shape[0] == cfg.num_layers for x in layer_leaves)


def test_small_preset_is_tens_of_millions():
  assert 10e6 < get_preset("small").num_params() < 100e6


def test_value_model_counts_and_shape():
  cfg = tiny()
  value = ValueModel(cfg, rngs=nnx.Rngs(1))
  assert _count(nnx.state(value, nnx.Param)) == cfg.num_params(with_value_head=True) - cfg.vocab_size * cfg.d_model
  tokens = jnp.arange(12).reshape(2, 6)
  assert value(tokens).shape == (2, 6)


def test_value_model_from_policy_copies_backbone():
  policy = _model()
  value = ValueModel.from_policy(policy)
  np.testing.assert_array_equal(value.decoder.embed_vd[...], policy.decoder.embed_vd[...])
  tokens = jnp.arange(12).reshape(2, 6) % 200
  hp, _ = policy.hidden(tokens)
  hv, _ = value.decoder(tokens, jnp.broadcast_to(jnp.arange(6), (2, 6)), jnp.ones((2, 6), bool))
  np.testing.assert_allclose(hp, hv, atol=1e-6)
  np.testing.assert_array_equal(value(tokens), 0.0)  # zero-initialised head


def test_invalid_model_config_is_named():
  with pytest.raises(ConfigError, match="num_kv_heads.*must divide num_heads=4"):
    ModelConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ConfigError, match="remat"):
    ModelConfig(remat="sometimes")
  with pytest.raises(ConfigError, match="model_preset='huge'.*tiny"):
    get_preset("huge")


def test_left_padding_does_not_change_predictions():
  model = _model()
  rng = np.random.default_rng(0)
  seq = rng.integers(0, 256, (1, 10)).astype(np.int32)
  base = model(jnp.asarray(seq))
  for pad in (1, 5):
    padded = np.concatenate([np.zeros((1, pad), np.int32), seq], axis=1)
    mask = np.concatenate([np.zeros((1, pad), bool), np.ones((1, 10), bool)], axis=1)
    out = model(jnp.asarray(padded), attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(out[:, pad:], base, atol=1e-5, rtol=1e-5)


def test_right_padding_does_not_change_predictions():
  model = _model()
  seq = np.random.default_rng(1).integers(0, 256, (1, 8)).astype(np.int32)
  base = model(jnp.asarray(seq))
  padded = np.concatenate([seq, np.full((1, 4), 7, np.int32)], axis=1)
  mask = np.arange(12)[None] < 8
  out = model(jnp.asarray(padded), attention_mask=jnp.asarray(mask))
  np.testing.assert_allclose(out[:, :8], base, atol=1e-5, rtol=1e-5)


def test_causality():
  model = _model()
  seq = np.random.default_rng(2).integers(0, 256, (2, 12)).astype(np.int32)
  other = seq.copy()
  other[:, 8:] = (other[:, 8:] + 1) % 256
  np.testing.assert_allclose(model(jnp.asarray(seq))[:, :8], model(jnp.asarray(other))[:, :8], atol=1e-6)


@pytest.mark.parametrize("left_pad", [0, 3])
def test_prefill_then_decode_equals_full_forward(left_pad):
  model = _model(qkv_bias=True)
  T, P = 14, 6
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 256, (2, T)).astype(np.int32)
  mask = np.ones((2, T), bool)
  mask[1, :left_pad] = False
  full = model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  cache = KVCache.init(model.config, batch=2, max_len=20)
  logits, cache = model(
    jnp.asarray(tokens[:, :P]),
    attention_mask=jnp.asarray(mask[:, :P]),
    positions=jnp.asarray(positions[:, :P]),
    cache=cache,
  )
  chunks = [logits]
  for t in range(P, T):
    logits, cache = model(
      jnp.asarray(tokens[:, t : t + 1]),
      attention_mask=jnp.asarray(mask[:, t : t + 1]),
      positions=jnp.asarray(positions[:, t : t + 1]),
      cache=cache,
    )
    chunks.append(logits)
  assert int(cache.index) == T
  stepped = np.concatenate(chunks, axis=1)
  np.testing.assert_allclose(stepped[mask], np.asarray(full)[mask], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_changes_nothing_numerically(remat):
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 9)), jnp.int32)

  def loss_and_grad(model):
    graphdef, state = nnx.split(model)

    def loss(state):
      return jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens)).mean()

    return jax.jit(jax.value_and_grad(loss))(state)

  l0, g0 = loss_and_grad(_model())
  l1, g1 = loss_and_grad(_model(remat=remat))
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g0, g1)

  # The learner's stack with shared prompts (two groups of two rows) rematerialises the same way.
  from mimo_jax.models.logprobs import completion_logprobs

  prompts = jnp.repeat(tokens[:, :5], 2, axis=0)
  completions = jnp.asarray(np.random.default_rng(5).integers(0, 256, (4, 4)), jnp.int32)
  ones = (jnp.ones(prompts.shape, bool), jnp.ones(completions.shape, bool))

  def shared_grad(model):
    graphdef, state = nnx.split(model)

    def loss(state):
      m = nnx.merge(graphdef, state)
      return completion_logprobs(m, prompts, ones[0], completions, ones[1], prompt_group=2).mean()

    return jax.jit(jax.value_and_grad(loss))(state)

  l0, g0 = shared_grad(_model())
  l1, g1 = shared_grad(_model(remat=remat))
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g0, g1)


def test_project_is_the_einsum_over_the_last_dims():
  rng = np.random.default_rng(6)
  x = rng.standard_normal((3, 5, 4, 6)).astype(np.float32)
  w2 = rng.standard_normal((4, 6, 7)).astype(np.float32)
  w1 = rng.standard_normal((6, 2, 3)).astype(np.float32)
  np.testing.assert_allclose(project(x, w2, contract=2), np.einsum("btnh,nhd->btd", x, w2), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(project(x, w1), np.einsum("btnh,hkd->btnkd", x, w1), rtol=1e-5, atol=1e-5)
  wide = project(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w1, jnp.bfloat16), preferred_element_type=jnp.float32)
  assert wide.dtype == jnp.float32 and wide.shape == (3, 5, 4, 2, 3)
  with pytest.raises(ValueError, match="disagree on the 2 contracted dims"):
    project(x, np.swapaxes(w2, 0, 1), contract=2)


def test_weight_gradients_are_row_products_without_a_transposed_activation():
  """Every projection is one ``[B*T, in] @ [in, out]`` product, so its weight gradient is ``x^T @ g`` over
  the rows.  As ``[B, T, D]`` einsums the weight gradient contracts over two dims and XLA:CPU first copies
  the ``[B, T, F]`` activation gradient into a transposed ``[F, B*T]`` array (with the SwiGLU derivative
  fused into the copy, read column-wise), which took longer than the products themselves."""
  cfg = tiny().replace(mlp_dim=96)
  B, T = 3, 7
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, 256, (B, T)), jnp.int32)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

  def loss(state):
    return jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)

  hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
  F = cfg.mlp_dim
  transposed = [f"f32[{F},{B * T}]", f"f32[{F},{B},{T}]"]
  assert f"f32[{B * T},{F}]" in hlo  # the activation itself, as rows
  assert not [t for t in transposed if t in hlo], [
    line for line in hlo.splitlines() if any(t in line for t in transposed)
  ][:3]


def test_bf16_params_keep_float32_logits():
  model = _model(param_dtype="bfloat16", dtype="bfloat16")
  ref = _model()
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 7)), jnp.int32)
  out = model(tokens)
  assert out.dtype == jnp.float32
  assert model.decoder.embed_vd[...].dtype == jnp.bfloat16
  # Same init (rounded to bf16), so logits agree to bf16 precision.
  np.testing.assert_allclose(out, ref(tokens), atol=5e-2)
