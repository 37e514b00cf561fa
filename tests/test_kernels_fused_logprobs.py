"""Tests for ``mimo_jax.kernels.fused_logprobs``: every impl vs the reference, the reference vs numpy,
vocabulary-parallel vs unsharded, compiled temp memory, and input validation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax.kernels import fused_logprobs as fl

# Forward and gradient tolerances by input dtype; bf16 runs compare with the f32 reference of bf16-cast inputs.
TOLERANCES = {
  jnp.float32: dict(rtol=1e-5, atol=1e-5),
  jnp.bfloat16: dict(rtol=1e-2, atol=1e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
  n: int
  h: int
  v: int
  temperature: float
  dtype: type
  block_sizes: fl.BlockSizes


def _sample_cases(count: int, seed: int) -> list[Case]:
  """Samples the shape grid, Latin-hypercube style: each axis is shuffled and cycled, so every value appears.

  Shapes stay small (Pallas interpret mode costs grid steps x buffer size); most N and V are not block multiples.
  """
  rng = np.random.default_rng(seed)
  axes = dict(
    n=[1, 7, 24, 37, 64],
    h=[8, 16, 32, 136],  # 136 > 128: pallas_tpu splits H into 128-wide steps and zero-pads it to 256
    v=[5, 64, 203, 300],
    temperature=[0.7, 1.0, 1.3],
    dtype=[jnp.float32, jnp.bfloat16],
    block_sizes=[
      fl.BlockSizes(16, 64, 16),
      fl.BlockSizes(8, 128, 32),
      fl.BlockSizes(32, 32, 16, num_v_splits=3),  # pallas_gpu: the last split owns masked-out blocks
    ],
  )
  orders = {name: rng.permutation(len(values)) for name, values in axes.items()}
  return [Case(**{name: values[orders[name][i % len(values)]] for name, values in axes.items()}) for i in range(count)]


CASES = _sample_cases(6, seed=0)


def _inputs(n: int, h: int, v: int, seed: int = 0):
  k_h, k_w, k_t, k_r = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(k_h, (n, h), jnp.float32)
  w = jax.random.normal(k_w, (h, v), jnp.float32) / np.sqrt(h) * 3.0
  targets = jax.random.randint(k_t, (n,), 0, v, jnp.int32)
  # Include both vocabulary ends, which sit at block and padding boundaries.
  targets = targets.at[0].set(v - 1)
  if n > 1:
    targets = targets.at[1].set(0)
  ref_logprobs = -jnp.abs(jax.random.normal(k_r, (n,), jnp.float32)) * 3.0 - 1.0
  return hidden, w, targets, ref_logprobs


def _loss_and_grads(fn, hidden, w, seed: int = 1):
  """Value and (d hidden, d w) of a random linear combination of the three outputs."""
  c_lp, c_ent, c_kl = jax.random.normal(jax.random.key(seed), (3, hidden.shape[0]), jnp.float32)

  def loss(hid, w_):
    out = fn(hid, w_)
    return jnp.sum(c_lp * out.logprobs) + jnp.sum(c_ent * out.entropy) + jnp.sum(c_kl * out.kl), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, w)
  return out, grads


def _assert_close(actual, expected, tol, what: str):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), err_msg=what, **tol)


# ----------------------------------------------------------------------------------------------------------------
# Kernel implementations vs reference (STYLE 30)
# ----------------------------------------------------------------------------------------------------------------


class TestFusedLogprobs:
  """Non-interpret: ``xla`` and ``auto`` everywhere, plus the backend's compiled Pallas kernel off CPU."""

  INTERPRET = False

  def impls(self) -> tuple[str, ...]:
    """The implementations this class runs, selected by INTERPRET and the backend."""
    if self.INTERPRET:
      return ("pallas_tpu", "pallas_gpu")
    # Compiled Pallas cannot run on CPU; elsewhere "pallas" is the backend's kernel.
    return ("xla", "auto") + (("pallas",) if jax.default_backend() != "cpu" else ())

  def _assert_matches_reference(self, hidden_in, w_in, targets, ref_lp, tol, block_sizes, **kwargs):
    """Every implementation's outputs (float32) and gradients (in the inputs' dtypes) against the
    reference's on the same inputs in float32; ``kwargs``: the temperatures."""

    def reference(hid, w_):
      return fl.fused_logprobs_reference(hid, w_, targets, ref_logprobs=ref_lp, **kwargs)

    ref_out, ref_grads = _loss_and_grads(reference, hidden_in.astype(jnp.float32), w_in.astype(jnp.float32))
    for impl in self.impls():

      def fn(hid, w_, impl=impl):
        return fl.fused_logprobs(
          hid, w_, targets, ref_logprobs=ref_lp, impl=impl, block_sizes=block_sizes, interpret=self.INTERPRET, **kwargs
        )

      out, grads = _loss_and_grads(fn, hidden_in, w_in)
      for name in ("logprobs", "entropy", "kl"):
        assert getattr(out, name).dtype == jnp.float32
        _assert_close(getattr(out, name), getattr(ref_out, name), tol, f"{impl} {name}")
      assert grads[0].dtype == hidden_in.dtype and grads[1].dtype == w_in.dtype
      _assert_close(grads[0], ref_grads[0], tol, f"{impl} d hidden")
      _assert_close(grads[1], ref_grads[1], tol, f"{impl} d w_unembed")

  @pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c.n}h{c.h}v{c.v}T{c.temperature}{c.dtype.__name__}")
  def test_matches_reference(self, case: Case):
    hidden, w, targets, ref_lp = _inputs(case.n, case.h, case.v)
    hidden_in, w_in = hidden.astype(case.dtype), w.astype(case.dtype)
    tol = TOLERANCES[case.dtype]
    self._assert_matches_reference(
      hidden_in, w_in, targets, ref_lp, tol, case.block_sizes, temperature=case.temperature
    )

  def test_without_ref_logprobs_and_large_logits(self):
    # Logits around +-60 / T: the online max rescaling must keep exp finite and entropy accurate.
    hidden, w, targets, _ = _inputs(24, 16, 203, seed=3)
    w = w * 20.0
    ref = fl.fused_logprobs_reference(hidden, w, targets, temperature=0.7)
    for impl in self.impls():
      out = fl.fused_logprobs(
        hidden,
        w,
        targets,
        temperature=0.7,
        impl=impl,
        block_sizes=fl.BlockSizes(8, 64, 16),
        interpret=self.INTERPRET,
      )
      assert out.kl is None
      _assert_close(out.logprobs, ref.logprobs, dict(rtol=1e-5, atol=1e-4), f"{impl} logprobs")
      _assert_close(out.entropy, ref.entropy, dict(rtol=1e-4, atol=1e-4), f"{impl} entropy")

  def test_per_row_temperatures_divide_the_float32_logits(self):
    """``row_temperature [N]`` divides each row's logits (with ``temperature``), values and gradients as
    the reference's; a bf16 row's logits are those of the unscaled bf16 matmul, divided in float32 (as
    the full path and the sampler compute them)."""
    hidden, w, targets, ref_lp = _inputs(37, 32, 203, seed=5)
    temps = dict(temperature=1.3, row_temperature=jnp.linspace(0.5, 1.5, 37, dtype=jnp.float32))
    sizes = fl.BlockSizes(8, 64, 16)
    self._assert_matches_reference(hidden, w, targets, ref_lp, TOLERANCES[jnp.float32], sizes, **temps)
    # bf16 inputs: the unscaled bf16 matmul's float32 logits, divided per row.
    hid16, w16 = hidden.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    want = fl.fused_logprobs_reference(hid16.astype(jnp.float32), w16.astype(jnp.float32), targets, **temps)
    for impl in self.impls():
      got = fl.fused_logprobs(hid16, w16, targets, impl=impl, block_sizes=sizes, interpret=self.INTERPRET, **temps)
      _assert_close(got.logprobs, want.logprobs, dict(rtol=1e-5, atol=2e-5), f"{impl} bf16 logprobs")


class TestFusedLogprobsInterpret(TestFusedLogprobs):
  """The Pallas kernel in interpret mode: runs on CPU."""

  INTERPRET = True


# ----------------------------------------------------------------------------------------------------------------
# Reference vs naive numpy, k3 clamps
# ----------------------------------------------------------------------------------------------------------------


def _numpy_naive(hidden, w, targets, temperature, ref_logprobs):
  logits = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64) / temperature
  logits = logits - logits.max(axis=1, keepdims=True)
  probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  logprobs = np.log(probs[np.arange(len(targets)), np.asarray(targets)])
  entropy = -(probs * np.log(probs)).sum(axis=1)
  r = np.clip(np.asarray(ref_logprobs, np.float64) - logprobs, -20, 20)
  kl = np.clip(np.exp(r) - r - 1, -10, 10)
  return logprobs, entropy, kl


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_reference_matches_numpy(temperature: float):
  hidden, w, targets, ref_lp = _inputs(33, 24, 150, seed=5)
  out = fl.fused_logprobs_reference(hidden, w, targets, temperature=temperature, ref_logprobs=ref_lp)
  expected = _numpy_naive(hidden, w, targets, temperature, ref_lp)
  for name, want in zip(("logprobs", "entropy", "kl"), expected, strict=True):
    _assert_close(getattr(out, name), want, dict(rtol=1e-5, atol=1e-5), name)


def test_k3_kl_hand_values_and_clamps():
  ref = jnp.array([-1.0, -1.0, 0.0, -30.0, 0.0])
  logp = jnp.array([-1.0, -2.0, -30.0, 0.0, -3.0])
  # r = 0 -> 0; r = 1 -> e - 2; r = 30 -> clamped value 10; r = -30 -> r clamped to -20 -> 19 -> 10; r = 3.
  want = [0.0, np.e - 2.0, 10.0, 10.0, np.exp(3.0) - 4.0]
  _assert_close(fl.k3_kl(ref, logp), np.clip(want, -10, 10), dict(rtol=1e-6, atol=1e-6), "k3")


def test_xla_large_shapes_match_reference():
  # The XLA path is cheap on CPU: a bigger, non-multiple V with several vocabulary blocks and the shifted tail.
  hidden, w, targets, ref_lp = _inputs(256, 64, 3001, seed=7)

  def make(impl):
    def fn(hid, w_):
      return fl.fused_logprobs(
        hid, w_, targets, temperature=1.3, ref_logprobs=ref_lp, impl=impl, block_sizes=fl.BlockSizes(64, 512)
      )

    return fn

  ref_out, ref_grads = _loss_and_grads(make("reference"), hidden, w)
  out, grads = _loss_and_grads(make("xla"), hidden, w)
  tol = dict(rtol=1e-5, atol=2e-5)
  for name in ("logprobs", "entropy", "kl"):
    _assert_close(getattr(out, name), getattr(ref_out, name), tol, name)
  _assert_close(grads[0], ref_grads[0], tol, "d hidden")
  _assert_close(grads[1], ref_grads[1], tol, "d w_unembed")


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary-parallel
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "mesh_shape, batch_axes, impl",
  [
    ((1, 2), (), "xla"),
    ((2, 4), (), "xla"),
    ((2, 4), ("data",), "xla"),
    ((2, 2), ("data",), "pallas_gpu"),  # interpret mode inside shard_map
    ((1, 4), (), "pallas_tpu"),
  ],
)
def test_sharded_matches_unsharded(mesh_shape: tuple[int, int], batch_axes: tuple[str, ...], impl: str):
  devices = np.array(jax.devices()[: mesh_shape[0] * mesh_shape[1]]).reshape(mesh_shape)
  mesh = Mesh(devices, ("data", "tensor"))  # Mesh() defaults to AxisType.Auto (STACK_NOTES gotcha 1).
  hidden, w, targets, ref_lp = _inputs(40, 16, 200, seed=11)
  w = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
  # 200 / 4 = 50 local columns: exercises the shifted tail block (and, for pallas_gpu, splits) per shard.
  block_sizes = fl.BlockSizes(16, 32, 16, num_v_splits=2)
  rows = jnp.linspace(0.6, 1.4, 40, dtype=jnp.float32)  # per-row temperatures, split like the rows

  def sharded(hid, w_):
    return fl.fused_logprobs_sharded(
      hid,
      w_,
      targets,
      mesh,
      axis="tensor",
      batch_axes=batch_axes,
      temperature=0.7,
      ref_logprobs=ref_lp,
      row_temperature=rows,
      impl=impl,
      block_sizes=block_sizes,
      interpret=impl != "xla",
    )

  def reference(hid, w_):
    return fl.fused_logprobs_reference(hid, w_, targets, temperature=0.7, ref_logprobs=ref_lp, row_temperature=rows)

  out, grads = _loss_and_grads(sharded, hidden, w)
  ref_out, ref_grads = _loss_and_grads(reference, hidden, w)
  tol = TOLERANCES[jnp.float32]
  for name in ("logprobs", "entropy", "kl"):
    _assert_close(getattr(out, name), getattr(ref_out, name), tol, name)
  _assert_close(grads[0], ref_grads[0], tol, "d hidden")
  _assert_close(grads[1], ref_grads[1], tol, "d w_unembed")
  if batch_axes:
    assert out.logprobs.sharding.spec == P(batch_axes)
  # Neither logits nor the unembedding are gathered: only all-reduces cross the tensor axis.
  hlo = jax.jit(sharded).lower(hidden, w).compile().as_text()
  assert "all-gather" not in hlo


def test_resolve_impl_per_backend():
  assert [fl.resolve_impl("auto", b) for b in ("cpu", "gpu", "tpu")] == ["xla", "pallas_gpu", "pallas_tpu"]
  assert [fl.resolve_impl("pallas", b) for b in ("cpu", "gpu", "tpu")] == ["pallas_tpu", "pallas_gpu", "pallas_tpu"]
  assert fl.resolve_impl("reference", "gpu") == "reference"


# ----------------------------------------------------------------------------------------------------------------
# Memory (compile only)
# ----------------------------------------------------------------------------------------------------------------


def test_xla_temp_memory_is_8x_below_reference():
  n, h, v = 4096, 512, 32000
  args = (
    jax.ShapeDtypeStruct((n, h), jnp.float32),
    jax.ShapeDtypeStruct((h, v), jnp.float32),
    jax.ShapeDtypeStruct((n,), jnp.int32),
    jax.ShapeDtypeStruct((n,), jnp.float32),
  )

  def temp_bytes(impl: str) -> int:
    def loss(hid, w_, tgt, ref_lp):
      out = fl.fused_logprobs(hid, w_, tgt, ref_logprobs=ref_lp, impl=impl)
      return jnp.sum(out.logprobs) + jnp.sum(out.entropy) + jnp.sum(out.kl)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  reference, xla = temp_bytes("reference"), temp_bytes("xla")
  assert xla * 8 <= reference, (xla, reference)


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "hidden_shape, w_shape, targets_shape, kwargs, error, match",
  [
    ((4, 8, 2), (8, 10), (4,), {}, ValueError, r"hidden must be \[N, H\], got shape \(4, 8, 2\)"),
    ((4, 8), (10,), (4,), {}, ValueError, r"w_unembed must be \[H, V\], got shape \(10,\)"),
    ((4, 8), (6, 10), (4,), {}, ValueError, r"disagree on H: hidden \(4, 8\), w_unembed \(6, 10\)"),
    ((4, 8), (8, 10), (5,), {}, ValueError, r"targets must be \[N\] = \(4,\) to match hidden \(4, 8\), got \(5,\)"),
    ((4, 8), (8, 10), (4,), dict(ref_logprobs=(3,)), ValueError, r"ref_logprobs must have the shape of targets"),
    ((4, 8), (8, 10), (4,), dict(temperature=0.0), ValueError, r"temperature must be > 0"),
    ((4, 8), (8, 10), (4,), dict(row_temperature=(3,)), ValueError, r"row_temperature must have the shape of targets"),
    ((4, 8), (8, 10), (4,), dict(impl="cuda"), ValueError, r"impl must be one of"),
    ((4, 8), (8, 10), (4,), dict(impl="triton"), ValueError, r"impl must be one of .*'pallas_gpu'"),
  ],
)
def test_bad_inputs_raise(hidden_shape, w_shape, targets_shape, kwargs, error, match):
  kwargs = dict(kwargs)
  for name in ("ref_logprobs", "row_temperature"):
    if name in kwargs:
      kwargs[name] = jnp.ones(kwargs[name])
  with pytest.raises(error, match=match):
    fl.fused_logprobs(jnp.zeros(hidden_shape), jnp.zeros(w_shape), jnp.zeros(targets_shape, jnp.int32), **kwargs)


def test_bad_dtypes_and_block_sizes_raise():
  hidden, w = jnp.zeros((4, 8)), jnp.zeros((8, 10))
  with pytest.raises(TypeError, match="targets must be an integer array, got dtype float32"):
    fl.fused_logprobs(hidden, w, jnp.zeros((4,), jnp.float32))
  with pytest.raises(TypeError, match="hidden must be floating point"):
    fl.fused_logprobs(jnp.zeros((4, 8), jnp.int32), w, jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="BlockSizes.block_n must be a positive int or None, got 0"):
    fl.BlockSizes(block_n=0)
  with pytest.raises(ValueError, match="BlockSizes.num_warps must be a positive int or None, got 2.5"):
    fl.BlockSizes(num_warps=2.5)
  with pytest.raises(ValueError, match="BlockSizes.block_v must be a positive int or None, got True"):
    fl.BlockSizes(block_v=True)


def test_sharded_bad_vocab_split_raises():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "tensor"))
  hidden, targets = jnp.zeros((4, 8)), jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match=r"V=10 .* must be divisible by mesh axis 'tensor' of size 4"):
    fl.fused_logprobs_sharded(hidden, jnp.zeros((8, 10)), targets, mesh)
  with pytest.raises(ValueError, match=r"axis 'model' is not a mesh axis"):
    fl.fused_logprobs_sharded(hidden, jnp.zeros((8, 12)), targets, mesh, axis="model")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
  with pytest.raises(ValueError, match=r"N=6 rows must be divisible by the batch axes \('data',\) \(size 4\)"):
    fl.fused_logprobs_sharded(
      jnp.zeros((6, 8)), jnp.zeros((8, 12)), jnp.zeros((6,), jnp.int32), mesh, batch_axes=("data",)
    )
  with pytest.raises(ValueError, match=r"axis 'tensor' cannot shard both the vocabulary and the rows"):
    fl.fused_logprobs_sharded(hidden, jnp.zeros((8, 12)), targets, mesh, batch_axes=("tensor",))
  with pytest.raises(ValueError, match=r"needs a blockwise impl"):
    fl.fused_logprobs_sharded(hidden, jnp.zeros((8, 12)), targets, mesh, impl="reference")
