"""mimo_jax.kernels.cpu_rows: the decode step's products on all cores (an XLA FFI custom call).

Oracles: numpy's float64 product; the same product on one thread (another process) for the split's
independence from the thread count; XLA's products for the sampler's tokens and log-probs.
"""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax.kernels import cpu_rows
from mimo_jax.models import Transformer
from mimo_jax.models.config import tiny
from mimo_jax.rollout.encoding import left_pad
from mimo_jax.rollout.sampler import Sampler
from mimo_jax.rollout.sampling import SamplingParams
from mimo_jax.sharding import MeshConfig, build_mesh
from mimo_jax.testing import count_compilations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _operands(m, k, n, seed=0):
  rng = np.random.default_rng(seed)
  return rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)


def test_the_library_builds_and_registers_here():
  """The kernel is not optional in this project's CI: a machine with a C++ compiler builds it."""
  assert cpu_rows.available(), cpu_rows.unavailable_reason()
  assert cpu_rows.unavailable_reason() is None
  assert cpu_rows.threads() >= 1
  assert cpu_rows.max_rows_per_pass() >= 3


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 40])
@pytest.mark.parametrize(("k", "n"), [(8, 16), (256, 40), (1000, 512), (3, 5)])
def test_rows_matmul_equals_a_float64_product(m, k, n):
  """Every row count (several passes over a panel past the kernel's rows per pass), contraction
  length and width (columns past a multiple of 16 padded and cut off)."""
  x, w = _operands(m, k, n)
  got = jax.jit(lambda x, w: cpu_rows.rows_matmul(x, cpu_rows.pack(w), n))(x, w)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  want = x.astype(np.float64) @ w.astype(np.float64)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
  np.testing.assert_allclose(np.asarray(cpu_rows.reference(x, cpu_rows.pack(w), n)), want, rtol=1e-5, atol=1e-4)


def test_pack_lays_out_column_panels_and_pads_with_zeros():
  w = np.arange(3 * 20, dtype=np.float32).reshape(3, 20)
  panels = np.asarray(cpu_rows.pack(w))
  assert panels.shape == (2, 3, 16)
  np.testing.assert_array_equal(panels[0], w[:, :16])
  np.testing.assert_array_equal(panels[1, :, :4], w[:, 16:])
  np.testing.assert_array_equal(panels[1, :, 4:], 0)
  p = cpu_rows.Panels.of(jnp.asarray(w))
  assert p.n == 20 and p.k == 3
  leaves, treedef = jax.tree.flatten(p)
  assert len(leaves) == 1 and jax.tree.unflatten(treedef, leaves).n == 20  # one array; n is static


def test_rows_matmul_refuses_what_it_cannot_multiply():
  x, w = _operands(2, 8, 16)
  with pytest.raises(ValueError, match="float32 only"):
    cpu_rows.rows_matmul(jnp.asarray(x, jnp.bfloat16), cpu_rows.pack(w))
  with pytest.raises(ValueError, match=r"panels \[P, K, 16\] expected"):
    cpu_rows.rows_matmul(x[:, :4], cpu_rows.pack(w))
  with pytest.raises(ValueError, match="outside the panels"):
    cpu_rows.rows_matmul(x, cpu_rows.pack(w), 17)
  with pytest.raises(ValueError, match=r"must be \[K, N\]"):
    cpu_rows.pack(w[None])


def _in_subprocess(code: str, env: dict) -> str:
  proc = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_results_do_not_depend_on_the_thread_count(tmp_path):
  """Each output element is one thread's sum in one order: one thread and three threads (other
  processes) give this process's result to the bit."""
  x, w = _operands(16, 384, 2048 + 48, seed=3)
  np.save(tmp_path / "x.npy", x)
  np.save(tmp_path / "w.npy", w)
  here = np.asarray(jax.jit(lambda x, w: cpu_rows.rows_matmul(x, cpu_rows.pack(w), w.shape[1]))(x, w))
  code = f"""
    import numpy as np, jax
    from mimo_jax.kernels import cpu_rows
    x, w = np.load({str(tmp_path / "x.npy")!r}), np.load({str(tmp_path / "w.npy")!r})
    y = jax.jit(lambda x, w: cpu_rows.rows_matmul(x, cpu_rows.pack(w), w.shape[1]))(x, w)
    np.save({str(tmp_path)!r} + f"/y{{cpu_rows.threads()}}.npy", np.asarray(y))
    print(cpu_rows.threads())
  """
  for threads in (1, 3):
    assert _in_subprocess(code, {cpu_rows.THREADS_ENV: str(threads)}).strip() == str(threads)
    np.testing.assert_array_equal(np.load(tmp_path / f"y{threads}.npy"), here)


def test_devices_calling_at_once_each_get_their_product():
  """Eight devices' programs call the kernel at the same time (shard_map over the rows): one holds
  the helpers, the others multiply on their own threads; every shard is right."""
  mesh = build_mesh(MeshConfig(8, 1, 1))
  x, w = _operands(8 * 4, 256, 1024, seed=4)
  panels = cpu_rows.pack(w)

  @jax.jit
  def f(x, panels):
    return jax.shard_map(
      lambda x, p: cpu_rows.rows_matmul(x, p), mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")
    )(x, panels)

  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  want = x.astype(np.float64) @ w.astype(np.float64)
  for _ in range(20):
    np.testing.assert_allclose(np.asarray(f(xs, panels)), want, rtol=1e-5, atol=1e-3)


def test_back_to_back_products_of_two_sizes_on_preempted_helpers_finish_and_stay_right():
  """A million products alternating 16 and 128 panels, on eight threads sharing the machine's cores,
  so that helpers are often preempted between claims.  A helper that read the next product's size
  under the last product's exhausted work word claimed panels past that product's end: the product
  then never counted as done (a hang, about every 200k products here) or took a wrong output.
  Every product must equal the first of its kind, and the run must end."""
  code = """
    import jax, jax.numpy as jnp, numpy as np
    from mimo_jax.kernels import cpu_rows
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 256), np.float32))
    small, large = (cpu_rows.pack(jnp.asarray(rng.standard_normal((256, n), np.float32))) for n in (256, 2048))
    want_small, want_large = cpu_rows.rows_matmul(x, small), cpu_rows.rows_matmul(x, large)

    @jax.jit
    def run(x, small, large):
      def body(i, carry):
        x, wrong = carry
        y_small = cpu_rows.rows_matmul(x, small)
        x = x + 0.0 * y_small  # each product waits for the last
        y_large = cpu_rows.rows_matmul(x, large)
        x = x + 0.0 * y_large[:, :256]
        return x, wrong + jnp.sum(y_small != want_small) + jnp.sum(y_large != want_large)
      return jax.lax.fori_loop(0, 500_000, body, (x, jnp.zeros((), jnp.int32)))[1]

    print(cpu_rows.threads(), int(run(x, small, large)))
  """
  # A hang ends in _in_subprocess's timeout; here the million products take about 15 s.
  assert _in_subprocess(code, {cpu_rows.THREADS_ENV: "8"}).split() == ["8", "0"]


def test_switched_off_or_unbuildable_it_says_why_and_generation_keeps_xla_products(tmp_path):
  """MIMO_JAX_CPU_ROWS=0, or a compiler that fails (a fresh cache directory): available() is False
  with the reason, and the sampler decodes on XLA's products."""
  code = """
    import jax, numpy as np
    from flax import nnx
    from mimo_jax.kernels import cpu_rows
    from mimo_jax.models import Transformer
    from mimo_jax.models.config import tiny
    from mimo_jax.rollout import generate
    from mimo_jax.rollout.sampler import Sampler
    m = Transformer(tiny(), rngs=nnx.Rngs(0))
    print(cpu_rows.available(), Sampler(m).uses_cpu_rows(4))
    print(cpu_rows.unavailable_reason().splitlines()[0])
    print(generate(m, [[5, 6, 7]], max_new_tokens=3, temperature=0.0).completion_tokens.shape)
  """
  off = _in_subprocess(code, {cpu_rows.ENABLE_ENV: "0"}).splitlines()
  assert off[0] == "False False" and off[1] == f"{cpu_rows.ENABLE_ENV}=0" and off[2] == "(1, 3)"
  broken = _in_subprocess(code, {"CXX": "false", cpu_rows.CACHE_ENV: str(tmp_path)}).splitlines()
  assert broken[0] == "False False" and "compiling rows_matmul.cc failed" in broken[1]
  assert not list((tmp_path / "cpu_rows").glob("*.so*"))  # nothing half-written is left to load


def test_unreadable_switches_are_refused_with_the_allowed_values():
  code = """
    from mimo_jax.kernels import cpu_rows
    try:
      cpu_rows.available()
    except ValueError as e:
      print(e)
  """
  out = _in_subprocess(code, {cpu_rows.ENABLE_ENV: "maybe"})
  assert "MIMO_JAX_CPU_ROWS='maybe': expected one of 1, true, yes, on, 0, false, no, off" in out
  for bad in ("0", "two", "-1"):
    out = _in_subprocess(code, {cpu_rows.THREADS_ENV: bad})
    assert f"MIMO_JAX_CPU_ROWS_THREADS='{bad}': expected a positive integer" in out


def test_a_fresh_cache_builds_the_library_once(tmp_path):
  """An empty cache directory (a new machine): the first use compiles the library there, and the next
  process loads that file instead of compiling again."""
  code = """
    import os
    from mimo_jax.kernels import cpu_rows
    print(cpu_rows.available(), cpu_rows._library_path(), os.path.getmtime(cpu_rows._library_path()))
  """
  env = {cpu_rows.CACHE_ENV: str(tmp_path)}
  first = _in_subprocess(code, env).split()
  assert first[0] == "True" and first[1].startswith(str(tmp_path / "cpu_rows"))
  assert _in_subprocess(code, env).split() == first  # the same file, not rebuilt
  assert [p.name for p in (tmp_path / "cpu_rows").glob("*.so*")] == [os.path.basename(first[1])]


def _case(seed=5, prompts=((5, 6, 7, 8), (9, 10), (11, 12, 13), (14,)), samples=2):
  cfg = tiny().replace(num_layers=3, num_heads=4, num_kv_heads=2, qkv_bias=True)
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  tokens, mask = left_pad([list(p) for p in prompts], 8, 0)
  kw = dict(num_samples=samples, max_len=10, sampling=SamplingParams(stop_ids=(3,)), temperature=0.0)
  return model, tokens, mask, kw


def test_the_sampler_decodes_on_it_with_xla_products_tokens():
  """Greedy and sampled generation on cpu_rows (the default at 1-32 rows on one CPU device) against
  the same sampler on XLA's products: the same tokens and stops, log-probs to float32 rounding."""
  model, tokens, mask, kw = _case()
  for temperature in (0.0, 0.7):
    kw.update(temperature=temperature, key=jax.random.key(11))
    for keep in (False, True):
      ours = Sampler(model, keep_layer_copy=keep)
      assert ours.uses_cpu_rows(8) and ours.fuses_projections(8)
      got = ours.generate(tokens, mask, **kw)
      want = Sampler(model, keep_layer_copy=keep, cpu_rows_products=False).generate(tokens, mask, **kw)
      np.testing.assert_array_equal(got.completion_tokens, want.completion_tokens)
      np.testing.assert_array_equal(got.lengths, want.lengths)
      np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)


def test_the_kept_copy_holds_packed_weights_made_once():
  """keep_layer_copy: the layers' and the unembedding's packed weights are made at the first call,
  reused with nothing recompiled, dropped with new weights; the decode step's every product is the
  custom call (4 per layer and the unembedding), and the prefill gets none of them."""
  model, tokens, mask, kw = _case()
  kw.update(key=jax.random.key(0))
  cfg = model.config
  sampler = Sampler(model, keep_layer_copy=True)
  first = sampler.generate(tokens, mask, **kw)
  layers, head = sampler._fused_copy[True]
  assert len(layers) == cfg.num_layers and all(isinstance(p, cpu_rows.Panels) for p in layers[0])
  H, D, F = cfg.resolved_head_dim, cfg.d_model, cfg.mlp_dim
  assert [p.n for p in layers[0]] == [(cfg.num_heads + 2 * cfg.num_kv_heads) * H, 2 * F, D, D]
  assert [p.k for p in layers[0]] == [D, D, cfg.num_heads * H, F]
  assert (head.n, head.k) == (cfg.vocab_size, D)
  with count_compilations() as c:
    again = sampler.generate(tokens, mask, **kw)
  assert c.count == 0 and sampler._fused_copy[True][1] is head
  np.testing.assert_array_equal(again.completion_tokens, first.completion_tokens)

  B = tokens.shape[0] * kw["num_samples"]
  args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.zeros((B,)), kw["key"], jnp.int32(10))
  static = dict(num_samples=kw["num_samples"], max_len=kw["max_len"], sampling=kw["sampling"])
  text = sampler.generate_program(B).lower(sampler._state, sampler._layers(), *args, layers, head, **static).as_text()
  assert text.count(f"@{cpu_rows.TARGET}") == 4 * cfg.num_layers + 1
  with pytest.raises(ValueError, match="not decode_weights"):
    model.decoder.prefill(
      jnp.asarray(tokens), jnp.asarray(mask, jnp.int32), jnp.asarray(mask), sampler._layers(), layers
    )

  other = Transformer(cfg, rngs=nnx.Rngs(6))
  sampler.update_params(other)
  assert sampler._fused_copy == {}
  want = Sampler(other, cpu_rows_products=False).generate(tokens, mask, **kw)
  np.testing.assert_array_equal(sampler.generate(tokens, mask, **kw).completion_tokens, want.completion_tokens)


def _while_bodies(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while":
      yield eqn.params["body_jaxpr"].jaxpr
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _while_bodies(sub)


def test_without_the_kept_copy_the_weights_are_packed_once_before_the_loop():
  """No kept copy: the generate program packs each weight once, outside the decode loop, whose every
  product is the custom call; the loop body moves no weight into panels."""
  model, tokens, mask, kw = _case()
  cfg = model.config
  sampler = Sampler(model)
  assert sampler.uses_cpu_rows(8)
  B = tokens.shape[0] * kw["num_samples"]
  args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.zeros((B,)), jax.random.key(0), jnp.int32(10))
  static = dict(num_samples=kw["num_samples"], max_len=kw["max_len"], sampling=kw["sampling"])
  closed = jax.make_jaxpr(functools.partial(sampler._generate_impl, **static))(sampler._state, None, *args)
  (body,) = [b for b in _while_bodies(closed.jaxpr) if any("ffi" in e.primitive.name for e in b.eqns)]
  calls = [e for e in body.eqns if "ffi" in e.primitive.name]
  assert len(calls) == 4 * cfg.num_layers + 1

  def packs(eqns):  # cpu_rows.pack: [K, P, 16] -> [P, K, 16]
    return [e for e in eqns if e.primitive.name == "transpose" and e.params["permutation"] == (1, 0, 2)]

  assert packs(body.eqns) == []
  assert len(packs(closed.jaxpr.eqns)) == 4 * cfg.num_layers + 1


def test_where_the_sampler_does_not_use_it():
  """Past 32 rows, on a mesh of several devices, for a bfloat16 model, in the scanned decode, with
  separate projections, or when asked not to: XLA's products (the custom call is not partitioned, and float32 only)."""
  model, *_ = _case()
  assert Sampler(model).uses_cpu_rows(32) and Sampler(model).uses_cpu_rows(1)
  assert not Sampler(model).uses_cpu_rows(33) and not Sampler(model).uses_cpu_rows(64)
  assert Sampler(model, cpu_rows_products=True).uses_cpu_rows(64)
  assert not Sampler(model, cpu_rows_products=False).uses_cpu_rows(8)
  assert not Sampler(model, unrolled_decode=False).uses_cpu_rows(8)
  assert not Sampler(model, fuse_projections=False).uses_cpu_rows(8)
  with pytest.raises(ValueError, match="cpu_rows_products=True needs fuse_projections"):
    Sampler(model, cpu_rows_products=True, fuse_projections=False)
  mesh = build_mesh(MeshConfig(2, 2, 2))
  assert not Sampler(model, mesh=mesh).uses_cpu_rows(16)
  one = build_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  assert Sampler(model, mesh=one).uses_cpu_rows(8)
  bf16 = Transformer(model.config.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
  assert not Sampler(bf16).uses_cpu_rows(8)
  with pytest.raises(ValueError, match="float32 models only"):
    bf16.decode_weights(bf16.decoder.layer_states())
