"""Rollout: greedy == argmax of the full forward, exact log-probs, stops, no recompiles,
sampling statistics, agreement with transformers' greedy generate."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from mimo_jax.models import KVCache, Transformer, create_sharded, load_hf
from mimo_jax.models.config import tiny
from mimo_jax.rollout import FINISH_LENGTH, FINISH_STOP, Sampler, SamplingParams, generate, left_pad
from mimo_jax.rollout.sampling import _inverse_cdf_sample, limit_vocab, sample_tokens, truncate_logits
from mimo_jax.sharding import MeshConfig, build_mesh
from mimo_jax.testing import count_compilations, save_random_hf_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def model():
  return Transformer(tiny().replace(qkv_bias=True), rngs=nnx.Rngs(0))


@jax.jit
def _last_logits(graphdef, state, tokens):
  # The weights are arguments: closed over, they would be constants of each program, which XLA folds.
  return nnx.merge(graphdef, state)(tokens)[0, -1]


def _greedy_reference(model, prompt, n):
  seq = list(prompt)
  graphdef, state = nnx.split(model)
  for _ in range(n):
    seq.append(int(jnp.argmax(_last_logits(graphdef, state, jnp.asarray([seq], jnp.int32)))))
  return seq[len(prompt) :]


def test_greedy_equals_argmax_of_full_forward(model):
  out = generate(model, PROMPTS, max_new_tokens=10, temperature=0.0)
  assert out.completion_tokens.shape == (4, 10) and out.logprobs.shape == (4, 10)
  for i, p in enumerate(PROMPTS):
    assert list(np.asarray(out.completion_tokens[i])) == _greedy_reference(model, p, 10)
  assert np.all(np.asarray(out.finish_reason) == FINISH_LENGTH)
  assert np.all(np.asarray(out.completion_mask))


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)])
def test_sharded_generation_matches_one_device(mesh_shape):
  cfg = tiny().replace(num_heads=4, num_kv_heads=2)
  ref_model = Transformer(cfg, rngs=nnx.Rngs(3))
  mesh = build_mesh(MeshConfig(*mesh_shape))
  sharded = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(3)), mesh)
  kw = dict(max_new_tokens=8, temperature=0.8, top_k=50, num_samples=2, seed=11)
  a = generate(ref_model, PROMPTS, **kw)
  b = generate(sharded, PROMPTS, mesh=mesh, **kw)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  # The KV cache and the outputs are batch-sharded over fsdp/data.
  assert b.completion_tokens.sharding.spec[0] is not None


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9), (0.0, 0, 1.0)])
def test_logprobs_equal_full_forward_recompute(model, temperature, top_k, top_p):
  sampler = Sampler(model)
  tokens, mask = left_pad(PROMPTS, 16, 0)
  out = sampler.generate(
    tokens,
    mask,
    num_samples=3,
    max_len=12,
    sampling=SamplingParams(top_k=top_k, top_p=top_p, stop_ids=(3, 4, 5)),
    temperature=temperature,
    key=jax.random.key(0),
  )
  recomputed = sampler.per_token_logps(out)
  np.testing.assert_allclose(recomputed, out.logprobs, atol=2e-5)
  assert np.all(np.asarray(out.logprobs)[~np.asarray(out.completion_mask)] == 0)
  if top_k == 0 and top_p == 1.0 and temperature > 0:
    np.testing.assert_allclose(out.sampler_logprobs, out.logprobs, atol=1e-6)
  if temperature > 0:
    # Recomputing at the wrong temperature gives different numbers: the recorded one matters.
    wrong = sampler.per_token_logps(out, temperature=temperature + 0.5)
    assert np.abs(np.asarray(wrong) - np.asarray(out.logprobs))[np.asarray(out.completion_mask)].max() > 1e-3


def _decode_case(mesh_shape, *, seed, num_samples, key):
  """A 3-layer GQA model (sharded over ``mesh_shape``, or on one device), the 4 prompts padded to
  16, and generate's keywords: top-k sampling with stop ids, so some rows stop and some run on."""
  cfg = tiny().replace(num_layers=3, num_heads=4, num_kv_heads=2, qkv_bias=True)
  if mesh_shape is None:
    mesh, model = None, Transformer(cfg, rngs=nnx.Rngs(seed))
  else:
    mesh = build_mesh(MeshConfig(*mesh_shape))
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)), mesh)
  tokens, mask = left_pad(PROMPTS, 16, 0)
  kw = dict(
    num_samples=num_samples,
    max_len=12,
    sampling=SamplingParams(top_k=40, stop_ids=(3, 4)),
    temperature=0.9,
    key=jax.random.key(key),
  )
  return mesh, model, tokens, mask, kw


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_unrolled_decode_equals_the_scanned_stack(mesh_shape):
  """The default decode loop (per-layer caches and weights, layers unrolled) against the
  scanned stack it replaces: the same tokens, log-probs and stops, with and without a mesh."""
  mesh, model, tokens, mask, kw = _decode_case(mesh_shape, seed=5, num_samples=2, key=7)
  scanned = Sampler(model, mesh=mesh, unrolled_decode=False).generate(tokens, mask, **kw)
  unrolled_sampler = Sampler(model, mesh=mesh)
  assert unrolled_sampler.unrolled_decode  # the default
  unrolled = unrolled_sampler.generate(tokens, mask, **kw)
  np.testing.assert_array_equal(unrolled.completion_tokens, scanned.completion_tokens)
  np.testing.assert_array_equal(unrolled.lengths, scanned.lengths)
  np.testing.assert_array_equal(unrolled.finish_reason, scanned.finish_reason)
  np.testing.assert_allclose(unrolled.logprobs, scanned.logprobs, atol=1e-6)
  # Some rows stopped and some ran to the limit, so both exits of the loop are covered.
  assert set(np.asarray(unrolled.finish_reason).tolist()) == {FINISH_STOP, FINISH_LENGTH}
  # The per-layer weights kept between calls (the prefill unrolled on them too).
  kept = Sampler(model, mesh=mesh, keep_layer_copy=True).generate(tokens, mask, **kw)
  np.testing.assert_array_equal(kept.completion_tokens, scanned.completion_tokens)
  np.testing.assert_array_equal(kept.finish_reason, scanned.finish_reason)
  np.testing.assert_allclose(kept.logprobs, scanned.logprobs, atol=1e-6)


@pytest.mark.parametrize("mesh_shape, unrolled", [(None, True), (None, False), ((2, 2, 2), True)])
def test_a_shared_prompt_cache_gives_the_per_row_caches_results_in_less_memory(mesh_shape, unrolled):
  """share_prompt_cache (the default): a prompt's keys and values are kept once for its samples.
  Against a cache that copies the prompt into every row: the same tokens, stops and log-probs
  (per-layer and scanned decode, with and without a mesh), and a smaller program."""
  mesh, model, tokens, mask, kw = _decode_case(mesh_shape, seed=6, num_samples=3, key=8)
  per_row = Sampler(model, mesh=mesh, unrolled_decode=unrolled, share_prompt_cache=False)
  shared = Sampler(model, mesh=mesh, unrolled_decode=unrolled)
  assert shared.shares_prompt_cache(4, 3) and not per_row.shares_prompt_cache(4, 3)
  assert not shared.shares_prompt_cache(4, 1)  # one sample per prompt: nothing to share
  a, b = per_row.generate(tokens, mask, **kw), shared.generate(tokens, mask, **kw)
  np.testing.assert_array_equal(b.completion_tokens, a.completion_tokens)
  np.testing.assert_array_equal(b.lengths, a.lengths)
  np.testing.assert_array_equal(b.finish_reason, a.finish_reason)
  np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
  np.testing.assert_allclose(b.sampler_logprobs, a.sampler_logprobs, atol=1e-5)
  assert set(np.asarray(b.finish_reason).tolist()) == {FINISH_STOP, FINISH_LENGTH}
  # The recorded log-probs are still the policy's, recomputed by a full forward.
  np.testing.assert_allclose(shared.per_token_logps(b), b.logprobs, atol=2e-5)
  if mesh is None:
    # Long prompts, many samples: the cache is most of the program's memory. Two prompts of 128
    # slots are held once, not once for each of 16 rows.
    args = (jnp.zeros((2, 128), jnp.int32), jnp.ones((2, 128), bool), jnp.ones((16,)), jax.random.key(0), jnp.int32(12))

    def temp_bytes(sampler):
      lowered = sampler.generate_program(8 * 2).lower(
        sampler._state, None, *args, num_samples=8, max_len=12, sampling=kw["sampling"]
      )
      return lowered.compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(shared) < 0.9 * temp_bytes(per_row)


def test_a_kept_layer_copy_is_reused_only_while_the_weights_are_unchanged():
  """keep_layer_copy: calls on the same arrays reuse one per-layer copy and compile nothing
  new; other weights (update_params, or a model updated in place and passed again to
  rollout.generate, which keeps one) are never read from a stale copy."""
  cfg = tiny()
  a, b = Transformer(cfg, rngs=nnx.Rngs(1)), Transformer(cfg, rngs=nnx.Rngs(2))
  tokens, mask = left_pad(PROMPTS, 16, 0)
  kw = dict(num_samples=1, max_len=8, sampling=SamplingParams(), temperature=0.0, key=jax.random.key(0))
  want_a = np.asarray(Sampler(a).generate(tokens, mask, **kw).completion_tokens)
  want_b = np.asarray(Sampler(b).generate(tokens, mask, **kw).completion_tokens)
  assert not np.array_equal(want_a, want_b)

  sampler = Sampler(a, keep_layer_copy=True)
  np.testing.assert_array_equal(sampler.generate(tokens, mask, **kw).completion_tokens, want_a)
  copy = sampler._layer_copy[1]
  sampler.update_params(a)  # the same arrays: the copy stays
  with count_compilations() as c:
    np.testing.assert_array_equal(sampler.generate(tokens, mask, **kw).completion_tokens, want_a)
  assert c.count == 0 and sampler._layer_copy[1] is copy
  sampler.update_params(b)  # released at once, not held until the next call
  assert sampler._layer_copy is None
  np.testing.assert_array_equal(sampler.generate(tokens, mask, **kw).completion_tokens, want_b)

  m = Transformer(cfg, rngs=nnx.Rngs(1))
  np.testing.assert_array_equal(generate(m, PROMPTS, max_new_tokens=8, temperature=0.0).completion_tokens, want_a)
  nnx.update(m, nnx.state(b))
  np.testing.assert_array_equal(generate(m, PROMPTS, max_new_tokens=8, temperature=0.0).completion_tokens, want_b)
  with pytest.raises(ValueError, match="unrolled_decode"):
    Sampler(a, keep_layer_copy=True, unrolled_decode=False)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4, 1)])
def test_a_kept_copy_holds_the_fused_weights_of_calls_that_fuse(mesh_shape):
  """keep_layer_copy with fused projections: each layer's [w_q | w_k | w_v] and [w_gate | w_up] are
  made at the first call that fuses and reused by the next (nothing recompiled; the program then
  concatenates no weight); a call that does not fuse keeps none; new weights drop them.  The samples
  are those of a sampler that concatenates the weights inside every call.  (XLA's products: the
  packed copy for cpu_rows is tested in test_cpu_rows.py.)"""
  mesh, model, tokens, mask, kw = _decode_case(mesh_shape, seed=5, num_samples=2, key=7)
  cfg = model.config
  xla = dict(fuse_projections=True, cpu_rows_products=False)
  per_call = Sampler(model, mesh=mesh, **xla).generate(tokens, mask, **kw)
  sampler = Sampler(model, mesh=mesh, keep_layer_copy=True, **xla)
  out = sampler.generate(tokens, mask, **kw)
  np.testing.assert_array_equal(out.completion_tokens, per_call.completion_tokens)
  np.testing.assert_array_equal(out.finish_reason, per_call.finish_reason)
  np.testing.assert_allclose(out.logprobs, per_call.logprobs, atol=1e-6)
  assert set(np.asarray(out.finish_reason).tolist()) == {FINISH_STOP, FINISH_LENGTH}
  fused, head = sampler._fused_copy[False]
  assert head is None
  H = cfg.resolved_head_dim
  assert len(fused) == cfg.num_layers
  assert fused[0][0].shape == (cfg.d_model, (cfg.num_heads + 2 * cfg.num_kv_heads) * H)
  assert fused[0][1].shape == (cfg.d_model, 2 * cfg.mlp_dim)
  with count_compilations() as c:
    again = sampler.generate(tokens, mask, **kw)
  assert c.count == 0 and sampler._fused_copy[False][0] is fused
  np.testing.assert_array_equal(again.completion_tokens, out.completion_tokens)

  B = len(PROMPTS) * kw["num_samples"]
  args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.full((B,), 0.9), kw["key"], jnp.int32(12))
  static = dict(num_samples=kw["num_samples"], max_len=kw["max_len"], sampling=kw["sampling"])

  def count(op, fused_layers):
    program = sampler.generate_program(B).lower(sampler._state, sampler._layers(), *args, fused_layers, **static)
    return program.as_text().count(op)

  L = cfg.num_layers
  assert count("stablehlo.concatenate", None) - count("stablehlo.concatenate", fused) == 2 * L
  # The prefill takes them too: per layer one product for q|k|v (three before) and one for gate|up
  # (two); the last layer's queries, on one position, keep their own products.
  assert count("stablehlo.dot_general", None) - count("stablehlo.dot_general", fused) == 3 * (L - 1) + 1
  with pytest.raises(ValueError, match="fused_weights need the per-layer weights"):
    model.decoder.prefill(jnp.asarray(tokens), jnp.asarray(mask, jnp.int32), jnp.asarray(mask), None, fused)

  not_fusing = Sampler(model, mesh=mesh, keep_layer_copy=True, fuse_projections=False, cpu_rows_products=False)
  not_fusing.generate(tokens, mask, **kw)
  assert not_fusing._layer_copy is not None and not_fusing._fused_copy == {}

  _, other, *_ = _decode_case(mesh_shape, seed=6, num_samples=2, key=7)
  sampler.update_params(other)
  assert sampler._layer_copy is None and sampler._fused_copy == {}
  want = Sampler(other, mesh=mesh, **xla).generate(tokens, mask, **kw)
  np.testing.assert_array_equal(sampler.generate(tokens, mask, **kw).completion_tokens, want.completion_tokens)


def test_convenience_generate_does_not_keep_a_dropped_model_alive():
  """rollout.generate's sampler (and its per-layer copy of the weights) goes with the model: a model
  the caller drops is freed, arrays and all, while a live one keeps its sampler between calls."""
  import gc
  import weakref

  from mimo_jax.rollout import sampler as sampler_lib

  cfg = tiny()
  kept = Transformer(cfg, rngs=nnx.Rngs(1))
  generate(kept, PROMPTS, max_new_tokens=4, temperature=0.0)
  first = sampler_lib._SAMPLERS[id(kept)]
  generate(kept, PROMPTS, max_new_tokens=4, temperature=0.0)
  assert sampler_lib._SAMPLERS[id(kept)] is first

  dropped = Transformer(cfg, rngs=nnx.Rngs(2))
  generate(dropped, PROMPTS, max_new_tokens=4, temperature=0.0)
  key = id(dropped)
  model_ref = weakref.ref(dropped)
  sampler_ref = weakref.ref(sampler_lib._SAMPLERS[key])
  weight_ref = weakref.ref(jax.tree.leaves(nnx.state(dropped))[0])
  assert sampler_ref()._layer_copy is not None
  del dropped
  gc.collect()
  assert model_ref() is None and sampler_ref() is None and weight_ref() is None
  assert key not in sampler_lib._SAMPLERS and id(kept) in sampler_lib._SAMPLERS


def test_per_layer_cache_decode_step_equals_the_stacked_one(model):
  """One cached step through Transformer.__call__: a per-layer cache (with and without
  weights sliced in advance) gives the stacked cache's logits and cache contents."""
  cfg = model.config
  tokens, mask = left_pad(PROMPTS, 8, 0)
  cache = KVCache.init(cfg, len(PROMPTS), 12)
  _, cache = model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask), cache=cache)
  step = jnp.asarray([[20], [21], [22], [23]], jnp.int32)
  pos = jnp.asarray(mask.sum(1, keepdims=True), jnp.int32)
  ref_logits, ref_cache = model(step, positions=pos, cache=cache)
  for layers in (None, model.decoder.layer_states()):
    logits, new = model(step, positions=pos, cache=cache.per_layer(), layers=layers)
    assert new.is_per_layer and len(new.k) == cfg.num_layers
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    np.testing.assert_allclose(jnp.stack(new.k), ref_cache.k, atol=1e-6)
    np.testing.assert_allclose(jnp.stack(new.v), ref_cache.v, atol=1e-6)
    assert int(new.index) == int(ref_cache.index) == 9


def test_fused_projections_give_the_separate_ones_results_with_three_fewer_products_per_layer(model):
  """A cached step with q|k|v and gate|up each as one product: the same logits and cache as the
  separate products, and per layer 4 products (qkv, o, gate|up, down) where there were 7.  Asked
  for without a per-layer cache (the scanned stack), it is ignored."""
  cfg = model.config
  tokens, mask = left_pad(PROMPTS, 8, 0)
  _, cache = model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask), cache=KVCache.init(cfg, len(PROMPTS), 12))
  step = jnp.asarray([[20], [21], [22], [23]], jnp.int32)
  pos = jnp.asarray(mask.sum(1, keepdims=True), jnp.int32)
  graphdef, state = nnx.split(model)
  layers = model.decoder.layer_states()

  @functools.partial(jax.jit, static_argnames="fuse")
  def call(state, layers, cache, fuse):
    return nnx.merge(graphdef, state)(step, positions=pos, cache=cache, layers=layers, fuse_projections=fuse)

  per_layer = cache.per_layer()
  (ref_logits, ref_cache), (logits, new) = (call(state, layers, per_layer, fuse=f) for f in (False, True))
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
  for a, b in zip(new.k + new.v, ref_cache.k + ref_cache.v, strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
  dots = {f: call.lower(state, layers, per_layer, fuse=f).as_text().count("dot_general") for f in (False, True)}
  assert dots[False] - dots[True] == 3 * cfg.num_layers
  stacked = {f: call.lower(state, layers, cache, fuse=f).as_text().count("dot_general") for f in (False, True)}
  assert stacked[True] == stacked[False]


def _assert_a_rows_rule(model, rule: str, option: str, bounds: tuple[int, int], **kw) -> Sampler:
  """What the sampler's two rows rules share: true at the range's ends and false just outside, never for
  the scanned decode, an explicit ``option`` wins, and rows count per batch shard on a data mesh.
  ``kw``: the samplers' other options.  Returns the default sampler."""
  low, high = bounds
  sampler = Sampler(model, **kw)

  def holds(s: Sampler, rows: int) -> bool:
    return getattr(s, rule)(rows)

  assert holds(sampler, low) and holds(sampler, high)
  assert not holds(sampler, low - 1) and not holds(sampler, high + 1)
  assert not holds(Sampler(model, unrolled_decode=False, **kw), high)
  assert not holds(Sampler(model, **{option: False}, **kw), high)
  assert holds(Sampler(model, **{option: True}, **kw), 1)
  data_parallel = Sampler(model, mesh=build_mesh(MeshConfig(2, 4, 1)))  # 8 batch shards
  assert holds(data_parallel, 8 * low) and holds(data_parallel, 8 * high)
  assert not holds(data_parallel, 8 * high + 8)
  return sampler


def test_a_small_cpu_decode_fuses_its_projections_unless_the_weights_are_split():
  """The sampler's rule on XLA's products: on CPU, FUSED_DECODE_ROWS rows per batch shard and weights
  whose feature axes are not split over devices; never for the scanned decode; an explicit choice
  wins.  (A decode on cpu_rows, one device and 1-16 rows, always fuses: test_cpu_rows.py.)"""
  from mimo_jax.rollout.sampler import FUSED_DECODE_ROWS

  _, model, *_ = _decode_case(None, seed=0, num_samples=1, key=0)
  _assert_a_rows_rule(model, "fuses_projections", "fuse_projections", FUSED_DECODE_ROWS, cpu_rows_products=False)
  high = FUSED_DECODE_ROWS[1]
  assert not Sampler(model, mesh=build_mesh(MeshConfig(2, 2, 2))).fuses_projections(4 * high)  # heads, mlp split


@pytest.mark.parametrize("mesh_shape", [None, (2, 4, 1)])
def test_a_fused_decode_samples_what_the_separate_products_sample(mesh_shape):
  """Whole generate calls (top-k sampling, stops, a shared prompt) with the products fused and
  not: the same tokens, stops and log-probs."""
  mesh, model, tokens, mask, kw = _decode_case(mesh_shape, seed=5, num_samples=2, key=7)
  separate = Sampler(model, mesh=mesh, fuse_projections=False).generate(tokens, mask, **kw)
  fused = Sampler(model, mesh=mesh, fuse_projections=True).generate(tokens, mask, **kw)
  np.testing.assert_array_equal(fused.completion_tokens, separate.completion_tokens)
  np.testing.assert_array_equal(fused.finish_reason, separate.finish_reason)
  np.testing.assert_allclose(fused.logprobs, separate.logprobs, atol=1e-6)
  assert set(np.asarray(fused.finish_reason).tolist()) == {FINISH_STOP, FINISH_LENGTH}


def test_a_cpu_decode_of_32_to_64_rows_per_shard_takes_ynnpacks_products(monkeypatch):
  """The sampler's rule: on CPU, YNN_DECODE_ROWS rows per batch shard in the unrolled decode; an explicit
  choice wins; never where the process's choice stands (MIMO_JAX_CPU_DOTS set)."""
  from mimo_jax.rollout.sampler import YNN_DECODE_ROWS

  low, high = YNN_DECODE_ROWS
  _, model, *_ = _decode_case(None, seed=0, num_samples=1, key=0)
  sampler = _assert_a_rows_rule(model, "uses_ynn_dots", "ynn_dots", YNN_DECODE_ROWS)
  # One program per set of options, each reused.
  assert sampler.generate_program(low) is sampler.generate_program(high)
  assert sampler.generate_program(low) is not sampler.generate_program(low - 1)
  for choice in ("eigen", "ynn"):
    monkeypatch.setenv("MIMO_JAX_CPU_DOTS", choice)
    assert not sampler.uses_ynn_dots(low) and not Sampler(model, ynn_dots=True).uses_ynn_dots(low)
    assert sampler.generate_program(low) is sampler.generate_program(low - 1)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4, 1)])
def test_ynnpacks_products_sample_what_eigens_sample(mesh_shape):
  """Whole generate calls (top-k sampling, stops, a shared prompt) compiled with YNNPACK's products and
  with the process's Eigen ones: the same tokens, stops and log-probs; the first program hands its
  products to YNNPACK, the second does not."""
  mesh, model, tokens, mask, kw = _decode_case(mesh_shape, seed=5, num_samples=2, key=7)
  rows = len(tokens) * kw["num_samples"]
  sides = {flag: Sampler(model, mesh=mesh, ynn_dots=flag) for flag in (False, True)}
  eigen, ynn = (s.generate(tokens, mask, **kw) for s in sides.values())
  np.testing.assert_array_equal(ynn.completion_tokens, eigen.completion_tokens)
  np.testing.assert_array_equal(ynn.finish_reason, eigen.finish_reason)
  np.testing.assert_allclose(ynn.logprobs, eigen.logprobs, atol=1e-5)
  assert set(np.asarray(ynn.finish_reason).tolist()) == {FINISH_STOP, FINISH_LENGTH}

  def products(sampler):
    """(products on Eigen, products in YNNPACK fusions) in the compiled program."""
    args = (sampler._state, None, jnp.asarray(tokens), jnp.asarray(mask), jnp.ones((rows,)), kw["key"], jnp.int32(6))
    lowered = sampler.generate_program(rows).lower(
      *args, num_samples=kw["num_samples"], max_len=kw["max_len"], sampling=kw["sampling"]
    )
    return _products_by_library(lowered.compile().as_text())

  (eigen_own, eigen_ynn), (ynn_own, ynn_ynn) = products(sides[False]), products(sides[True])
  assert ynn_ynn > eigen_ynn and ynn_own < eigen_own


def _products_by_library(hlo: str) -> tuple[int, int]:
  """Matrix products in a compiled XLA:CPU program: (those left to XLA's own kernels, those inside
  YNNPACK fusions).  A computation is a block of lines ending in ``}``; a fusion line names the
  computation it calls."""
  blocks: dict[str, str] = {}
  for block in hlo.split("\n\n"):
    header = block.strip().splitlines()[0] if block.strip() else ""
    if header.startswith(("%", "ENTRY")):
      blocks[header.split()[1] if header.startswith("ENTRY") else header.split()[0]] = block
  fused, ynn = set(), set()
  for line in hlo.splitlines():
    if " fusion(" in line and "calls=" in line:
      callee = line.split("calls=")[1].split(",")[0].split()[0]
      fused.add(callee)
      if "__ynn_fusion" in line:
        ynn.add(callee)
  count = {name: sum(" dot(" in line for line in block.splitlines()) for name, block in blocks.items()}
  return (
    sum(n for name, n in count.items() if name not in fused),
    sum(n for name, n in count.items() if name in ynn),
  )


@pytest.mark.parametrize("per_layer", [False, True])
def test_prefill_cache_equals_writing_the_prompt_through_a_cache(model, per_layer):
  """Decoder.prefill (attention over the prompt alone) + KVCache.from_prompt (fanned out,
  optionally per layer) against the prompt run through an empty cache and repeated:
  same hidden states, keys, values, valid slots and next index."""
  cfg = model.config
  tokens, mask = left_pad(PROMPTS, 8, 0)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  ref_hidden, ref = model.hidden(tokens, attention_mask=mask, positions=positions, cache=KVCache.init(cfg, 4, 12))
  hidden, (k, v) = model.decoder.prefill(tokens, positions, mask)
  assert k.shape == v.shape == (cfg.num_layers, 4, 8, cfg.num_kv_heads, cfg.resolved_head_dim)
  assert hidden.shape == (4, 1, cfg.d_model)  # only the last position, the one unembedded
  np.testing.assert_allclose(hidden[:, 0], ref_hidden[:, -1], atol=1e-5)
  cache = KVCache.from_prompt(k, v, mask, 12, repeats=3, per_layer=per_layer)
  assert cache.is_per_layer == per_layer and int(cache.index) == int(ref.index) == 8
  np.testing.assert_array_equal(cache.valid, jnp.repeat(ref.valid, 3, axis=0))
  got_k, got_v = (jnp.stack(cache.k), jnp.stack(cache.v)) if per_layer else (cache.k, cache.v)
  valid = np.asarray(cache.valid)  # [B, S]; keys are [L, B, K, H, S], values [L, B, K, S, H]
  np.testing.assert_allclose(
    np.where(valid[None, :, None, None], got_k, 0),
    np.where(valid[None, :, None, None], jnp.repeat(ref.k, 3, 1), 0),
    atol=1e-5,
  )
  np.testing.assert_allclose(
    np.where(valid[None, :, None, :, None], got_v, 0),
    np.where(valid[None, :, None, :, None], jnp.repeat(ref.v, 3, 1), 0),
    atol=1e-5,
  )
  assert not np.asarray(got_k)[..., 8:].any() and not np.asarray(got_v)[..., 8:, :].any()  # empty slots
  with pytest.raises(ValueError, match="cannot hold a prompt of 8 tokens"):
    KVCache.from_prompt(k, v, mask, 7)


@pytest.mark.parametrize("per_layer", [False, True])
def test_a_shared_prompt_cache_holds_the_prompt_once_and_attends_like_the_per_row_cache(model, per_layer):
  """KVCache.from_prompt(share_prompt=True): the prompt's keys, values and mask once per prompt,
  the rows' own slots empty after it; model calls of 2 tokens then 1 (the accelerators' batched
  form, then the CPU's single-query form) give the per-row cache's logits and new slots."""
  cfg = model.config
  tokens, mask = left_pad(PROMPTS, 8, 0)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  _, (k, v) = model.decoder.prefill(tokens, positions, mask)
  per_row = KVCache.from_prompt(k, v, mask, 12, repeats=3, per_layer=per_layer)
  shared = KVCache.from_prompt(k, v, mask, 12, repeats=3, per_layer=per_layer, share_prompt=True)
  stack = jnp.stack if per_layer else (lambda x: x)
  assert shared.shares_prompt and not per_row.shares_prompt and shared.is_per_layer == per_layer
  assert shared.max_len == 4 and int(shared.index) == 0 and not np.asarray(shared.valid).any()
  assert stack(shared.prompt_k).shape == (cfg.num_layers, 4, cfg.num_kv_heads, cfg.resolved_head_dim, 8)
  np.testing.assert_array_equal(stack(shared.prompt_k), stack(per_row.k)[:, ::3, ..., :8])
  np.testing.assert_array_equal(stack(shared.prompt_v), stack(per_row.v)[:, ::3, :, :8])
  np.testing.assert_array_equal(shared.prompt_valid, mask)
  rng = np.random.default_rng(1)
  start = jnp.repeat(mask.sum(1), 3)[:, None].astype(jnp.int32)
  for T, offset in ((2, 0), (1, 2)):
    step = jnp.asarray(rng.integers(1, cfg.vocab_size, (12, T)), jnp.int32)
    pos = start + offset + jnp.arange(T)[None]
    want, per_row = model(step, positions=pos, cache=per_row)
    got, shared = model(step, positions=pos, cache=shared)
    np.testing.assert_allclose(got, want, atol=1e-5)
  assert int(shared.index) == 3 and np.asarray(shared.valid)[:, :3].all()
  np.testing.assert_allclose(stack(shared.k)[..., :3], stack(per_row.k)[..., 8:11], atol=1e-6)
  np.testing.assert_allclose(stack(shared.v)[..., :3, :], stack(per_row.v)[..., 8:11, :], atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_after_a_shared_prompt_equals_attention_over_the_copied_prompt(dtype):
  """The two forms over a shared prompt (CPU single query; batched, for accelerators and calls
  of several tokens) against the batched form over each row's own copy of the prompt followed by
  its slots: GQA, padded prompt slots, masked own slots, a row that sees its prompt only."""
  from mimo_jax.models.transformer import _attend, _attend_after_prompt, _single_query_attention

  rng = np.random.default_rng(2)
  N, R, P, S, K, G, H = 2, 3, 5, 4, 2, 3, 8
  B = N * R
  q = jnp.asarray(rng.normal(size=(B, 1, K, G, H)), dtype)
  pk, pv = jnp.asarray(rng.normal(size=(N, K, H, P)), dtype), jnp.asarray(rng.normal(size=(N, K, P, H)), dtype)
  k, v = jnp.asarray(rng.normal(size=(B, K, H, S)), dtype), jnp.asarray(rng.normal(size=(B, K, S, H)), dtype)
  pvalid = jnp.asarray([[False, False, True, True, True], [True] * P])
  mask = rng.random((B, 1, S)) < 0.6
  mask[1] = False
  mask = jnp.asarray(mask)
  ref = _attend(
    q,
    jnp.concatenate([jnp.repeat(pk, R, axis=0), k], axis=-1),
    jnp.concatenate([jnp.repeat(pv, R, axis=0), v], axis=-2),
    jnp.concatenate([jnp.repeat(pvalid, R, axis=0)[:, None], mask], axis=-1),
    "BKHS",
    "BKSH",
    dtype,
  )
  batched = _attend_after_prompt(q, k, v, mask, pk, pv, pvalid, dtype)
  single = _single_query_attention(q[:, 0], k, v, mask[:, 0], dtype, (pk, pv, pvalid))[:, None]
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for out in (batched, single):
    assert out.dtype == dtype and out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
  # Row 1 sees only its prompt's three real slots.
  p_only = _attend(q[1:2], pk[:1, ..., 2:], pv[:1, :, 2:], jnp.ones((1, 1, 3), bool), "BKHS", "BKSH", dtype)
  np.testing.assert_allclose(np.asarray(single[1:2], np.float32), np.asarray(p_only, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_single_query_attention_equals_the_batched_form(dtype):
  """The CPU decode step's multiply-reduce attention against the batched-dot form the
  learner's forward uses, at the same precision (GQA, masked slots, a row with one visible
  slot, a row with none)."""
  from mimo_jax.models.transformer import _MASK_VALUE, _single_query_attention

  rng = np.random.default_rng(0)
  B, S, K, G, H = 4, 10, 2, 3, 8
  q = jnp.asarray(rng.normal(size=(B, K, G, H)), dtype)
  k = jnp.asarray(rng.normal(size=(B, S, K, H)), dtype)
  v = jnp.asarray(rng.normal(size=(B, S, K, H)), dtype)
  mask = rng.random((B, S)) < 0.6
  mask[2] = False
  mask[2, 4] = True
  mask[3] = False
  mask = jnp.asarray(mask)
  # The Attention module's batched form (T = 1).
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q[:, None], k, preferred_element_type=jnp.float32) / np.sqrt(H)
  scores = jnp.where(mask[:, None, None, None, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  ref = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)[:, 0]
  # The decode step reads the cache's layout: keys [B, K, H, S], values [B, K, S, H].
  out = _single_query_attention(q, jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 1, 3)), mask, dtype)
  assert out.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
  np.testing.assert_allclose(
    np.asarray(out[2], np.float32), np.broadcast_to(np.asarray(v[2, 4], np.float32)[:, None, :], (K, G, H)), atol=tol
  )
  assert np.isfinite(np.asarray(out[3], np.float32)).all()  # a fully masked row (a pad row) stays finite


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_the_decode_steps_attention_form_is_the_lowering_platforms(shared_prompt):
  """One query per row: multiply-reduce when lowered for CPU, batched dots for an accelerator,
  chosen by the platform the program is lowered for (a TPU dry run compiles on a CPU host).
  After a shared prompt, both forms take the prompt's two products as batched dots."""
  from mimo_jax.models.transformer import Attention, _attend, _attend_after_prompt

  D, N, K, H, B, S, Np, P = 16, 4, 2, 8, 4, 6, 2, 5
  attn = Attention(
    D, N, K, H, qkv_bias=False, o_bias=False, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
  )
  graphdef, state = nnx.split(attn)
  inv_freq = 1.0 / (10000 ** (np.arange(0, H, 2) / H))
  rng = np.random.default_rng(0)
  prompt = None
  if shared_prompt:
    pvalid = jnp.asarray(rng.random((Np, P)) < 0.7).at[:, -1].set(True)
    prompt = (
      jnp.asarray(rng.normal(size=(Np, K, H, P)), jnp.float32),
      jnp.asarray(rng.normal(size=(Np, K, P, H)), jnp.float32),
      pvalid,
    )

  def step(state, x, positions, mask, k_cache, v_cache, index, prompt):
    layer = nnx.merge(graphdef, state)
    return layer(x, positions, mask, inv_freq, kv_cache=(k_cache, v_cache), cache_index=index, prompt_kv=prompt)

  x = jnp.asarray(rng.normal(size=(B, 1, D)), jnp.float32)
  k_cache = jnp.asarray(rng.normal(size=(B, K, H, S)), jnp.float32)
  v_cache = jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32)
  mask = jnp.asarray(rng.random((B, 1, S)) < 0.7).at[:, :, 3].set(True)
  args = (state, x, jnp.full((B, 1), 3, jnp.int32), mask, k_cache, v_cache, jnp.int32(3), prompt)
  traced = jax.jit(step).trace(*args)
  # Four projections in either form; the accelerator's adds the two attention products, and
  # both forms the shared prompt's two.
  dots = {
    p: traced.lower(lowering_platforms=(p,)).as_text().count("stablehlo.dot_general") for p in ("cpu", "tpu", "cuda")
  }
  extra = 2 if shared_prompt else 0
  assert dots == {"cpu": 4 + extra, "tpu": 6 + extra, "cuda": 6 + extra}
  compiled = traced.lower().compile().as_text()
  assert "conditional" not in compiled  # the platform choice costs the CPU program nothing
  # What runs here (the CPU form) equals the batched form the accelerators get.
  out, _ = jax.jit(step)(*args)
  q, k, v = attn._qkv(x, jnp.full((B, 1), 3, jnp.int32), inv_freq)
  k_all = k_cache.at[..., 3:4].set(jnp.transpose(k, (0, 2, 3, 1)))
  v_all = v_cache.at[:, :, 3:4].set(jnp.transpose(v, (0, 2, 1, 3)))
  if shared_prompt:
    batched = attn._output(_attend_after_prompt(q, k_all, v_all, mask, *prompt, jnp.float32))
  else:
    batched = attn._output(_attend(q, k_all, v_all, mask, "BKHS", "BKSH", jnp.float32))
  np.testing.assert_allclose(np.asarray(out), np.asarray(batched), atol=1e-5, rtol=1e-5)


def test_prompt_padding_does_not_change_output(model):
  kw = dict(max_new_tokens=8, temperature=1.0, num_samples=2, seed=5)
  a = generate(model, PROMPTS, prompt_buckets=(16,), **kw)
  b = generate(model, PROMPTS, prompt_buckets=(48,), **kw)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_stop_tokens_end_completions(model):
  greedy = generate(model, PROMPTS, max_new_tokens=10, temperature=0.0)
  toks = np.asarray(greedy.completion_tokens)
  stop = int(toks[1, 4])  # make the 5th greedy token of prompt 1 a stop token
  out = generate(model, PROMPTS, max_new_tokens=10, temperature=0.0, stop_ids=(stop,), pad_id=0)
  got = np.asarray(out.completion_tokens)
  for i in range(len(PROMPTS)):
    hits = np.nonzero(toks[i] == stop)[0]
    if len(hits):
      n = hits[0] + 1
      assert int(out.lengths[i]) == n and int(out.finish_reason[i]) == FINISH_STOP
      np.testing.assert_array_equal(got[i, :n], toks[i, :n])
      assert np.all(got[i, n:] == 0) and not np.any(np.asarray(out.completion_mask)[i, n:])
    else:
      assert int(out.lengths[i]) == 10 and int(out.finish_reason[i]) == FINISH_LENGTH
  assert int(out.lengths[1]) == 5


def test_dynamic_max_new_tokens_and_early_exit(model):
  sampler = Sampler(model)
  tokens, mask = left_pad(PROMPTS, 16, 0)
  kw = dict(num_samples=1, max_len=12, sampling=SamplingParams(), temperature=0.0, key=jax.random.key(0))
  full = sampler.generate(tokens, mask, **kw)
  with count_compilations() as c:
    short = sampler.generate(tokens, mask, max_new_tokens=5, **kw)
  assert c.count == 0  # the limit is an array: no recompilation
  np.testing.assert_array_equal(np.asarray(short.lengths), 5)
  np.testing.assert_array_equal(np.asarray(short.completion_tokens)[:, :5], np.asarray(full.completion_tokens)[:, :5])
  assert np.all(np.asarray(short.completion_tokens)[:, 5:] == 0)


def test_group_sampling_layout_and_reproducibility(model):
  a = generate(model, PROMPTS, max_new_tokens=6, temperature=1.0, num_samples=4, seed=1)
  b = generate(model, PROMPTS, max_new_tokens=6, temperature=1.0, num_samples=4, seed=1)
  c = generate(model, PROMPTS, max_new_tokens=6, temperature=1.0, num_samples=4, seed=2)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  assert not np.array_equal(np.asarray(a.completion_tokens), np.asarray(c.completion_tokens))
  np.testing.assert_array_equal(a.prompt_index, np.repeat(np.arange(4), 4))
  # The samples of a prompt share its prompt and differ from each other.
  pt = np.asarray(a.prompt_tokens)
  assert np.all(pt[0] == pt[3]) and not np.array_equal(pt[0], pt[4])
  toks = np.asarray(a.completion_tokens)
  assert len({tuple(r) for r in toks[:4]}) > 1
  np.testing.assert_allclose(np.asarray(a.temperature), 1.0)


def test_second_call_in_a_bucket_compiles_nothing(model):
  sampler = Sampler(model)
  sp = SamplingParams(top_k=10, stop_ids=(2,))
  rng = np.random.default_rng(0)

  def call(seed):
    prompts = [list(rng.integers(1, 255, rng.integers(1, 16))) for _ in range(4)]
    tokens, mask = left_pad(prompts, 16, 0)
    out = sampler.generate(
      tokens, mask, num_samples=2, max_len=8, sampling=sp, temperature=0.9, key=jax.random.key(seed)
    )
    jax.block_until_ready(out)
    return sampler.per_token_logps(out).block_until_ready()

  call(0)  # warm-up
  sampler.update_params(nnx.split(model)[1])  # a new version of the weights, same shapes
  with count_compilations() as c:
    call(1)
    call(2)
  assert c.count == 0


def test_convenience_generate_reuses_compilation(model):
  generate(model, [[1, 2], [3]], max_new_tokens=5, temperature=0.5, seed=0)
  with count_compilations() as c:
    generate(model, [[9, 8, 7], [6, 5, 4, 3]], max_new_tokens=5, temperature=0.9, seed=3)
  assert c.count == 0


# ----------------------------------------------------------------------------
# Sampling statistics
# ----------------------------------------------------------------------------


def _truncated_probs(logits, temperature, top_k, top_p):
  """Numpy oracle: softmax(logits/T) restricted to the top-k, then the nucleus, renormalised."""
  x = logits / temperature
  p = np.exp(x - x.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  keep = np.zeros_like(p, bool)
  if top_k:
    keep[order[:top_k]] = True
  else:
    keep[:] = True
  kept = [i for i in order if keep[i]]
  q = p[kept] / p[kept].sum()
  cum = 0.0
  final = []
  for i, qi in zip(kept, q, strict=True):
    if cum < top_p:
      final.append(i)
    cum += qi
  out = np.zeros_like(p)
  out[final] = p[final]
  return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (1.0, 3, 1.0), (0.8, 0, 0.75), (1.5, 4, 0.8)])
def test_sampling_frequencies_match_truncated_distribution(temperature, top_k, top_p):
  logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
  n = 40000
  keys = jax.random.split(jax.random.key(0), n)
  # The inputs are arguments: closed over, they would be constants that XLA folds at compile time.
  f = jax.jit(lambda lg, k, t: sample_tokens(lg, k, t, top_k=top_k, top_p=top_p))
  tokens, logprob, sampler_logprob = f(jnp.tile(logits, (n, 1)), keys, jnp.full((n,), temperature, jnp.float32))
  expected = _truncated_probs(logits.astype(np.float64), temperature, top_k, top_p)
  freq = np.bincount(np.asarray(tokens), minlength=8) / n
  # 40k draws: the standard error of a frequency is <= 0.0025.
  np.testing.assert_allclose(freq, expected, atol=0.012)
  assert np.all(freq[expected == 0] == 0)
  np.testing.assert_allclose(np.exp(np.asarray(sampler_logprob)), expected[np.asarray(tokens)], rtol=1e-4)
  policy = np.exp(logits / temperature - np.log(np.exp(logits / temperature).sum()))
  np.testing.assert_allclose(np.exp(np.asarray(logprob)), policy[np.asarray(tokens)], rtol=1e-4)


def test_truncate_logits_keeps_at_least_one_token():
  logits = jnp.asarray([[10.0, 0.0, -1.0]])
  out = truncate_logits(logits, top_k=0, top_p=0.01)
  assert np.isfinite(np.asarray(out)[0, 0]) and np.all(np.isinf(np.asarray(out)[0, 1:]))


def test_greedy_rows_are_deterministic_with_plain_logprobs():
  logits = jnp.asarray([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
  tok, lp, slp = sample_tokens(logits, jax.random.split(jax.random.key(0), 2), jnp.asarray([0.0, 0.0]))
  np.testing.assert_array_equal(tok, [1, 1])
  np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[:, 1], rtol=1e-6)
  np.testing.assert_array_equal(slp, 0.0)


@pytest.mark.parametrize(
  "kw", [{}, {"top_k": 5}, {"top_p": 0.9}, {"vocab_limit": 29}, {"top_k": 4, "top_p": 0.8, "vocab_limit": 31}]
)
@pytest.mark.parametrize("rows", ["greedy", "sampled", "mixed"])
def test_sample_tokens_equals_the_plain_argmax_and_log_softmax(kw, rows):
  # The oracle is the plain form: the argmax and the full [B, V] log-softmax, for every row.
  B, V = 24, 32
  rng = np.random.default_rng(3)
  x = rng.normal(size=(B, V)).astype(np.float32) * 3
  x[1, 3] = np.nan  # argmax takes the first NaN
  x[2] = -np.inf  # every id equally (im)possible: the first
  x[4, [1, 5]] = x[4].max() + 1  # a tie: the first
  temps = {"greedy": np.zeros(B), "sampled": np.full(B, 0.7), "mixed": (rng.uniform(size=B) < 0.5) * 1.3}[rows]
  temps = jnp.asarray(temps, jnp.float32)
  keys = jax.random.split(jax.random.key(0), B)
  tok, lp, slp = jax.jit(lambda x, k, t: sample_tokens(x, k, t, **kw))(jnp.asarray(x), keys, temps)

  def plain(x, k, t):
    greedy = t <= 0
    scaled = x / jnp.where(greedy, 1.0, t)[:, None]
    limit = kw.get("vocab_limit", 0)
    truncated = truncate_logits(limit_vocab(scaled, limit), top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0))
    tok = jnp.where(greedy, jnp.argmax(limit_vocab(x, limit), axis=-1), _inverse_cdf_sample(k, truncated))
    at = lambda a: jnp.take_along_axis(a, tok[:, None], axis=-1)[:, 0]  # noqa: E731
    return tok, at(jax.nn.log_softmax(scaled)), jnp.where(greedy, 0.0, at(jax.nn.log_softmax(truncated)))

  ref_tok, ref_lp, ref_slp = jax.jit(plain)(jnp.asarray(x), keys, temps)
  np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
  # The same formula; XLA may sum a row's exponentials in another order or round its exp and log
  # differently: a last-bit difference of the row's log-sum-exp (up to ~15 here, whose last bit is ~1e-6),
  # which a chosen token's log-prob near 0 carries whole (0.7: the smallest temperature, the largest).
  lse = np.abs(np.asarray(jax.nn.logsumexp(jnp.asarray(x) / 0.7, axis=-1)))
  atol = 2 * float(np.spacing(np.float32(lse[np.isfinite(lse)].max())))
  np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), rtol=1e-6, atol=atol)
  np.testing.assert_allclose(np.asarray(slp), np.asarray(ref_slp), rtol=1e-6, atol=atol)
  greedy = np.asarray(temps) <= 0
  # The rows built to tell argmax's rules apart, where greedy:
  for row, first in ((1, 3), (2, 0), (4, 1)):
    if greedy[row]:
      assert int(tok[row]) == first


def test_sample_tokens_on_sharded_rows_decides_its_branch_with_one_reduction():
  """Which choice runs (argmax, draw, both) depends on every row: on rows sharded over devices that is
  one cross-device reduction per decode step, not one per question asked."""
  mesh = build_mesh(MeshConfig(8, 1, 1))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  B, V = 32, 64
  logits = jax.device_put(jnp.zeros((B, V)), rows)
  temps = jax.device_put(jnp.ones((B,)), rows)
  keys = jax.random.split(jax.random.key(0), B)
  hlo = jax.jit(lambda x, k, t: sample_tokens(x, k, t)).lower(logits, keys, temps).compile().as_text()
  assert hlo.count("all-reduce(") == 1


# ----------------------------------------------------------------------------
# Oracle: transformers' greedy generate
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_generate(tmp_path, arch):
  hf_model = save_random_hf_model(str(tmp_path), arch=arch, tie=arch == "qwen2")
  ours = load_hf(str(tmp_path))
  prompts = [[5, 17, 33, 2], [90, 1, 7, 7, 7, 12, 4, 99, 100], [64]]
  out = generate(ours, prompts, max_new_tokens=12, temperature=0.0)
  for i, p in enumerate(prompts):
    with torch.no_grad():
      ref = hf_model.generate(
        torch.tensor([p]),
        attention_mask=torch.ones(1, len(p), dtype=torch.long),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
      )
    assert list(np.asarray(out.completion_tokens[i])) == ref[0, len(p) :].tolist(), f"prompt {i}"


@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (0, 0.9)])
def test_a_truncated_token_is_never_drawn_at_any_threshold(top_k, top_p):
  """The draw at a threshold just below, at and just above every entry of the CDF the sampler computes
  (every place a token's interval begins or ends), and at u = 0: always a token the truncation kept.
  XLA:CPU's cumsum sums each prefix on its own, so the CDF wobbles by a last bit, up across removed
  tokens and down elsewhere; counting the entries below the threshold drew removed tokens there."""
  from mimo_jax.rollout.sampling import _invert_cdf

  V = 4096
  row = jnp.asarray(np.random.default_rng(0).normal(size=(1, V)).astype(np.float32) * 3)
  truncated = truncate_logits(row, top_k=top_k, top_p=top_p)
  kept = np.isfinite(np.asarray(truncated))[0]
  assert 0 < kept.sum() < V
  cdf = np.asarray(jnp.cumsum(jax.nn.softmax(truncated, axis=-1), axis=-1))[0]
  u = (cdf / cdf[-1]).astype(np.float32)
  u = np.concatenate([[0.0], u, np.nextafter(u, 0, dtype=np.float32), np.nextafter(u, 1, dtype=np.float32)])
  u = np.clip(u, 0.0, np.nextafter(np.float32(1), 0, dtype=np.float32))  # uniform draws are in [0, 1)
  draw = jax.jit(_invert_cdf)
  tokens = np.concatenate([np.asarray(draw(jnp.asarray(chunk), truncated)) for chunk in np.array_split(u, 8)])
  assert kept[tokens].all(), f"{(~kept[tokens]).sum()} removed tokens drawn"
  # Every kept token is drawn at some threshold: the draw is not stuck on a few.
  assert set(np.nonzero(kept)[0]) <= set(tokens.tolist())


def test_a_uniform_of_exactly_zero_draws_a_kept_token():
  # This row key's uniform is exactly 0 (probability 2^-23 a draw): it drew token 0, removed by top_k=1.
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(5752247), jnp.uint32(0)), 0)
  assert float(jax.random.uniform(key, (), jnp.float32)) == 0.0
  logits = jnp.asarray([[0.0, 5.0, 4.0, 3.0]])
  tok, _, sampler_lp = sample_tokens(logits, key[None], jnp.ones((1,)), top_k=1)
  assert int(tok[0]) == 1 and float(sampler_lp[0]) == 0.0


# ----------------------------------------------------------------------------
# Vocabulary limit: a model vocabulary larger than the tokenizer's
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.9), (40, 0.95)])
def test_sample_tokens_never_picks_ids_past_the_vocab_limit(top_k, top_p):
  V, limit, B = 32, 20, 512
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(B, V)).astype(np.float32)
  logits[:, limit:] += 8.0  # the padded ids are by far the most likely
  temps = jnp.asarray(np.where(np.arange(B) % 4 == 0, 0.0, 1.0), jnp.float32)  # greedy rows too
  keys = jax.random.split(jax.random.key(0), B)
  fn = jax.jit(sample_tokens, static_argnames=("top_k", "top_p", "vocab_limit"))
  tok, lp, slp = fn(jnp.asarray(logits), keys, temps, top_k=top_k, top_p=top_p, vocab_limit=limit)
  tok = np.asarray(tok)
  assert tok.max() < limit
  # Greedy picks the best allowed id; logprob stays the full-vocabulary policy.
  greedy = np.asarray(temps) == 0
  np.testing.assert_array_equal(tok[greedy], logits[greedy, :limit].argmax(-1))
  full = jax.nn.log_softmax(jnp.asarray(logits), -1)
  np.testing.assert_allclose(np.asarray(lp), np.asarray(full)[np.arange(B), tok], atol=1e-5)
  # The sampler log-prob is that of the renormalised allowed set (no top-k/p: all of [0, limit)).
  if top_k == 0 and top_p == 1.0:
    allowed = jax.nn.log_softmax(jnp.asarray(logits[:, :limit]), -1)
    np.testing.assert_allclose(np.asarray(slp)[~greedy], np.asarray(allowed)[np.arange(B), tok][~greedy], atol=1e-5)
  # Without the limit the padded ids win almost always: the test above is not vacuous.
  unlimited, _, _ = fn(jnp.asarray(logits), keys, temps, top_k=top_k, top_p=top_p, vocab_limit=0)
  assert (np.asarray(unlimited) >= limit).mean() > 0.9


def test_sampler_never_generates_ids_past_the_vocab_limit():
  limit = 200
  model = Transformer(tiny(), rngs=nnx.Rngs(4))  # vocab 256: 56 ids the "tokenizer" lacks
  w = model.lm_head_dv[...]
  model.lm_head_dv[...] = w.at[:, limit:].multiply(40.0)  # make the padded ids dominate
  sampler = Sampler(model)
  tokens, mask = left_pad(PROMPTS, 16, 0)
  kw = dict(num_samples=4, max_len=12, key=jax.random.key(1))
  for temperature in (0.0, 1.0):
    free = sampler.generate(tokens, mask, sampling=SamplingParams(), temperature=temperature, **kw)
    assert (np.asarray(free.completion_tokens) >= limit).any()  # the hazard is real
    out = sampler.generate(
      tokens, mask, sampling=SamplingParams(stop_ids=(3,), vocab_limit=limit), temperature=temperature, **kw
    )
    toks = np.asarray(out.completion_tokens)[np.asarray(out.completion_mask)]
    assert toks.size and toks.max() < limit
    # The recorded log-probs are still the full policy's, so the trainer's recompute agrees.
    np.testing.assert_allclose(sampler.per_token_logps(out), out.logprobs, atol=2e-5)
  # The limit is static: a new batch with the same params compiles nothing.
  with count_compilations() as c:
    sampler.generate(
      tokens,
      mask,
      sampling=SamplingParams(stop_ids=(3,), vocab_limit=limit),
      temperature=1.0,
      **{**kw, "key": jax.random.key(9)},
    )
  assert c.count == 0


def test_convenience_generate_takes_a_vocab_limit(model):
  out = generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, num_samples=2, seed=3, vocab_limit=7)
  assert np.asarray(out.completion_tokens).max() < 7


def test_sampling_params_check_the_vocab_limit():
  from mimo_jax.config_base import ConfigError

  with pytest.raises(ConfigError, match="vocab_limit=-1"):
    SamplingParams(vocab_limit=-1)
  with pytest.raises(ConfigError, match=r"stop_ids=\[300\]: must be ids below vocab_limit=256"):
    SamplingParams(stop_ids=(2, 300), vocab_limit=256)
  assert SamplingParams(stop_ids=(2,), pad_id=0, vocab_limit=256).vocab_limit == 256
