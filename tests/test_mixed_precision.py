"""Mixed precision: bf16 weights learn like f32 ones when the optimizer keeps an f32 master copy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax.config import OptimConfig
from mimo_jax.models import Transformer
from mimo_jax.models.config import tiny
from mimo_jax.models.logprobs import completion_logprobs
from mimo_jax.optim import TrainState, apply_gradients, make_optimizer
from mimo_jax.rl.losses import aggregate
from mimo_jax.train.steps import SequenceBatch, make_sft_step

LR = 2e-5  # Adam moves each weight by about LR a step: far below bf16's spacing near 0.02 (~1.2e-4)
STEPS = 20


def _batch(vocab: int) -> SequenceBatch:
  rng = np.random.default_rng(0)
  return SequenceBatch(
    jnp.asarray(rng.integers(4, vocab, (8, 6)), jnp.int32),
    jnp.ones((8, 6), bool),
    jnp.asarray(rng.integers(4, vocab, (8, 6)), jnp.int32),
    jnp.ones((8, 6), bool),
  )


def _f32_loss(params, graphdef, batch) -> float:
  """The SFT loss of ``params`` evaluated in float32 (one yardstick for every run)."""
  params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  model = nnx.merge(graphdef, params)
  logp = completion_logprobs(
    model, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens, batch.completion_mask
  )
  return float(-aggregate(logp, batch.completion_mask, "token-mean"))


@functools.cache
def _train(param_dtype: str, master_dtype: str | None):
  """``STEPS`` SFT steps from the same (bf16-representable) initial weights; returns (initial, final
  f32 weights as the optimizer sees them, f32 graphdef)."""
  cfg = tiny().replace(param_dtype="bfloat16", dtype="bfloat16")
  init = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
  f32_cfg = cfg.replace(param_dtype="float32", dtype="float32")
  f32_graphdef = nnx.split(Transformer(f32_cfg, rngs=nnx.Rngs(0)))[0]
  run_cfg = cfg if param_dtype == "bfloat16" else f32_cfg
  model = Transformer(run_cfg, rngs=nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda x: x.astype(param_dtype), init))
  tx, _ = make_optimizer(OptimConfig(learning_rate=LR, lr_schedule="constant", grad_clip=0.0), STEPS)
  state = TrainState.create(model, tx, jax.random.key(0), master_dtype=master_dtype)
  step = make_sft_step(None)
  batch = _batch(cfg.vocab_size)
  for _ in range(STEPS):
    state, _ = step(state, batch)
  final = state.params if state.master is None else state.master
  return init, final, state, f32_graphdef, batch


def _displacement(init, final) -> np.ndarray:
  leaves = zip(jax.tree.leaves(init), jax.tree.leaves(final), strict=True)
  return np.concatenate([(np.asarray(b, np.float32) - np.asarray(a, np.float32)).ravel() for a, b in leaves])


def test_bf16_with_an_f32_master_learns_like_f32_and_bf16_alone_does_not():
  init, f32_final, _, graphdef, batch = _train("float32", None)
  _, mixed_final, mixed_state, _, _ = _train("bfloat16", "float32")
  _, bf16_final, bf16_state, _, _ = _train("bfloat16", "bfloat16")
  assert bf16_state.master is None and mixed_state.master is not None
  # The master copy and Adam's moments are float32; the weights the forward reads stay bf16.
  assert {x.dtype for x in jax.tree.leaves(mixed_state.master)} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(mixed_state.params)} == {jnp.dtype(jnp.bfloat16)}
  moments = [x for x in jax.tree.leaves(mixed_state.opt_state) if x.ndim > 0]
  assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}

  d_f32, d_mixed, d_bf16 = (_displacement(init, f) for f in (f32_final, mixed_final, bf16_final))
  # The f32 master moves the way the f32 model moves (bf16 compute only perturbs the gradients).
  # (Measured: 2% of the f32 displacement; bf16 alone is 87% off, and 27% of its weights moved at all.)
  assert np.linalg.norm(d_mixed - d_f32) < 0.1 * np.linalg.norm(d_f32)
  # bf16 alone: most updates round to nothing (only weights near zero, where bf16 is fine, move).
  assert np.linalg.norm(d_bf16 - d_f32) > 0.5 * np.linalg.norm(d_f32)
  assert np.mean(d_bf16 != 0) < 0.5 * np.mean(d_mixed != 0)

  loss0 = _f32_loss(init, graphdef, batch)
  drop_f32 = loss0 - _f32_loss(f32_final, graphdef, batch)
  drop_mixed = loss0 - _f32_loss(mixed_final, graphdef, batch)
  drop_bf16 = loss0 - _f32_loss(bf16_final, graphdef, batch)
  assert drop_f32 > 0
  assert abs(drop_mixed - drop_f32) < 0.1 * drop_f32  # measured: 0.1107 vs 0.1107
  assert drop_bf16 < 0.5 * drop_f32  # measured: 0.039
  # The bf16 weights served to the forward pass are the master's rounding.
  for p, m in zip(jax.tree.leaves(mixed_state.params), jax.tree.leaves(mixed_state.master), strict=True):
    np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(p.dtype)))


def test_a_non_finite_update_leaves_the_master_copy_untouched():
  _, _, state, _, _ = _train("bfloat16", "float32")  # (apply_gradients below does not donate it)
  before = jax.tree.map(np.asarray, (state.params, state.master, state.opt_state.inner_state))
  grads = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan, p.dtype), state.params)
  state, metrics = apply_gradients(state, grads, jnp.float32(1.0))
  assert float(metrics["skipped"]) == 1.0 and int(state.skipped) == 1
  after = jax.tree.map(np.asarray, (state.params, state.master, state.opt_state.inner_state))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_bfloat16_master_never_rounds_a_wider_parameter():
  """A bf16 critic's head and bias are float32: ``--master_dtype=bfloat16`` made a bf16 copy of the whole
  model, the head included, and an update of 1e-5 to a head weight of 1.000244 left it at 1.0.  Each
  parameter's master is the wider of the two dtypes: no copy at all here (bf16 everywhere else), and the
  head moves by the update."""
  from mimo_jax.models.transformer import ValueModel
  from mimo_jax.optim import master_copy

  model = ValueModel(tiny().replace(param_dtype="bfloat16", dtype="bfloat16"), rngs=nnx.Rngs(0))
  model.value_head_d.set_value(jnp.full(model.value_head_d.shape, 1.000244, jnp.float32))
  params = nnx.split(model)[1]
  assert master_copy(params, "bfloat16") is None
  wide = master_copy(params, "float32")
  assert {x.dtype for x in jax.tree.leaves(wide)} == {jnp.dtype(jnp.float32)}
  tx, _ = make_optimizer(OptimConfig(learning_rate=1e-5, lr_schedule="constant", grad_clip=0.0), 4)
  state = TrainState.create(model, tx, jax.random.key(0), master_dtype="bfloat16")
  assert state.master is None
  grads = jax.tree.map(jnp.ones_like, state.params)  # Adam's first step: each weight moves by -lr
  state, _ = apply_gradients(state, grads, jnp.float32(1.0))
  head = np.asarray(state.params["value_head_d"])
  assert head.dtype == np.float32
  np.testing.assert_allclose(head, np.float32(1.000244) - 1e-5, rtol=0, atol=2e-7)
