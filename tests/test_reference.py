"""The frozen reference in less memory: bf16, weight-only int8, host memory; against the f32 reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax import sharding
from mimo_jax.models import Transformer, create_sharded
from mimo_jax.models.config import tiny
from mimo_jax.models.logprobs import completion_logprobs
from mimo_jax.models.reference import Int8Weight, abstract_reference, dense_reference, make_reference
from mimo_jax.sharding import MeshConfig, build_mesh
from mimo_jax.testing import kill_resume


@pytest.fixture(scope="module")
def policy():
  mesh = build_mesh(MeshConfig(mesh_data=2, mesh_fsdp=2, mesh_tensor=2))
  model = create_sharded(lambda: Transformer(tiny(), rngs=nnx.Rngs(3)), mesh)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  batch = (
    jnp.asarray(rng.integers(3, 256, (8, 6)), jnp.int32),
    jnp.ones((8, 6), bool),
    jnp.asarray(rng.integers(3, 256, (8, 10)), jnp.int32),
    jnp.ones((8, 10), bool),
  )
  return mesh, graphdef, params, batch


def _logprobs(mesh, graphdef, params, reference, batch, offload="none"):
  @jax.jit
  def f(reference):
    dense = dense_reference(reference, params, offload=offload)
    with sharding.use_rules(mesh, sharding.TRAIN_RULES):
      return completion_logprobs(nnx.merge(graphdef, dense), *batch, 1.0)

  return np.asarray(f(reference))


@pytest.mark.parametrize("dtype, tol", [("", 0.0), ("bfloat16", 0.05), ("int8", 0.05)])
def test_reference_log_probs_against_the_f32_reference(policy, dtype, tol):
  mesh, graphdef, params, batch = policy
  exact = _logprobs(mesh, graphdef, params, params, batch)
  ref = make_reference(params, dtype=dtype)
  got = _logprobs(mesh, graphdef, params, ref, batch)
  err = np.abs(got - exact).max()
  assert err <= tol, err
  if dtype:
    assert err > 0  # a real change of precision, not the f32 weights again
  # Every array stays on the policy's mesh; int8 weights shrink the bytes about 4x against f32.
  leaves = jax.tree.leaves(ref)
  assert all(isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh for x in leaves)
  got_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
  ps = jax.tree.leaves(params)
  expected = {
    "": sum(4 * x.size for x in ps),
    "bfloat16": sum(2 * x.size for x in ps),
    # int8 weights and an f32 scale over axis -2 of every stacked array; the unstacked vectors stay f32.
    "int8": sum(x.size + 4 * x.size // x.shape[-2] if x.ndim >= 2 else 4 * x.size for x in ps),
  }[dtype]
  assert got_bytes == expected


def test_int8_is_per_output_channel_weight_only_and_exact_on_its_grid(policy):
  mesh, _, params, _ = policy
  ref = make_reference(params, dtype="int8")
  flat_p = jax.tree.leaves(params)
  flat_r = jax.tree.leaves(ref, is_leaf=lambda x: isinstance(x, Int8Weight))
  for p, r in zip(flat_p, flat_r, strict=True):
    if p.ndim < 2:
      assert not isinstance(r, Int8Weight) and r.dtype == p.dtype
      continue
    assert r.q.dtype == jnp.int8 and r.scale.shape == p.shape[:-2] + (1,) + p.shape[-1:]
    w = np.asarray(p)
    scale = np.abs(w).max(axis=-2, keepdims=True) / 127.0
    np.testing.assert_allclose(np.asarray(r.scale), scale, rtol=1e-6)
    # Hand-computed: the nearest int8 grid point of each weight, error at most half a step.
    np.testing.assert_array_equal(np.asarray(r.q), np.clip(np.round(w / scale), -127, 127).astype(np.int8))
    assert np.all(np.abs(np.asarray(r.q) * scale - w) <= scale / 2 + 1e-7)
  # The abstract form (restore targets, dry runs) matches the real one, shardings included.
  abstract = abstract_reference(
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params), dtype="int8"
  )
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(ref), strict=True):
    assert (a.shape, a.dtype, a.sharding) == (r.shape, r.dtype, r.sharding)


def test_a_reference_offloaded_to_host_memory_gives_identical_log_probs(policy):
  mesh, graphdef, params, batch = policy
  ref = make_reference(params, offload="host")
  assert {x.sharding.memory_kind for x in jax.tree.leaves(ref)} == {"pinned_host"}
  exact = _logprobs(mesh, graphdef, params, params, batch)
  np.testing.assert_array_equal(_logprobs(mesh, graphdef, params, ref, batch, offload="host"), exact)
  int8_host = make_reference(params, dtype="int8", offload="host")
  np.testing.assert_array_equal(
    _logprobs(mesh, graphdef, params, int8_host, batch, offload="host"),
    _logprobs(mesh, graphdef, params, make_reference(params, dtype="int8"), batch),
  )


@pytest.mark.slow
def test_a_run_with_an_int8_reference_in_host_memory_equals_one_with_it_in_device_memory(tmp_path):
  import json
  import os

  from mimo_jax.main import main

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  flags = [
    "prog",
    f"--flagfile={os.path.join(root, 'experiments', 'grpo_tiny.flags')}",
    "--model_preset=tiny",
    "--sft_steps=2",
    "--sft_batch_size=16",
    "--max_steps=3",
    "--prompts_per_step=8",
    "--num_samples=4",
    "--eval_prompts=8",
    "--eval_samples=2",
    "--checkpoint_every=2",
    "--max_new_tokens=6",
    "--kl_coef=0.01",
    "--tensorboard=false",
    "--reference_dtype=int8",
  ]

  def records(d):
    return [
      {k: v for k, v in json.loads(line).items() if not k.startswith(kill_resume.VOLATILE_PREFIXES)}
      for line in open(d / "metrics.jsonl")
    ]

  assert main([*flags, f"--run_dir={tmp_path / 'dev'}"]) == 0
  assert main([*flags, f"--run_dir={tmp_path / 'host'}", "--reference_offload=host"]) == 0
  dev = records(tmp_path / "dev")
  assert records(tmp_path / "host") == dev
  kl = [r["kl_k3"] for r in dev if "kl_k3" in r]
  assert all(math.isfinite(k) for k in kl) and max(kl) > 0


def test_an_int8_reference_checkpoint_restores_into_its_abstract_form(policy, tmp_path):
  """The trainer saves the reference as stored and restores it into ``abstract_reference``'s target."""
  from mimo_jax.ckpt import Checkpointer
  from mimo_jax.ckpt.manager import abstract_like

  mesh, _, params, _ = policy
  ref = make_reference(params, dtype="int8")
  ck = Checkpointer(str(tmp_path / "reference"), keep_last=1, async_save=False)
  meta = {
    "phase": "rl",
    "step": 0,
    "log_step": 0,
    "optimizer_layout": 2,
    "created_unix": 0.0,
    "config_digest": "test",
    "model_config": {},
    "data_rng": {},
    "buffer": {
      "next_batch_id": 0,
      "policy_version": 0,
      "sampling_params_version": "test",
      "batches": [],
      "pending": [],
    },
  }
  ck.save(0, {"params": ref}, meta)
  ck.wait()
  target = {"params": abstract_reference(abstract_like(params, mesh), dtype="int8")}
  step, restored, _ = ck.restore_latest(target)
  ck.close()
  for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(ref), strict=True):
    assert a.dtype == b.dtype and a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
