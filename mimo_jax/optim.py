"""The train state pytree, the optimizer, and the guarded gradient application."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mimo_jax.config import OptimConfig


class TrainState(flax.struct.PyTreeNode):
  """Everything a jitted step reads and writes; donated into each step.

  Attributes:
    step: int32, optimizer updates applied (skipped non-finite updates do not count).
    params: the state half of ``nnx.split(model)`` (parameters only).
    opt_state: the optax state.
    rng: PRNG key threaded through the steps.
    skipped: int32, updates skipped because the loss or gradients were not finite.
    lr_scale: float32 multiplier on every update (lowered by a non-finite rollback).
    controllers: the RL controllers' state (``rl.controllers.ControllerState``; None in SFT).
    master: the optimizer's higher-precision copy of ``params`` (mixed precision), or None when
      the optimizer updates ``params`` directly.  With a master copy the optimizer state is
      built on it, updates are applied to it, and ``params`` is its cast to the parameter dtype
      (what the forward passes read).
    graphdef: the static half of ``nnx.split(model)``.
    tx: the optax transformation (static).
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  skipped: jax.Array
  lr_scale: jax.Array
  graphdef: Any = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  controllers: Any = None
  master: Any = None

  @classmethod
  def create(
    cls,
    model: nnx.Module,
    tx: optax.GradientTransformation,
    rng: jax.Array,
    controllers: Any = None,
    *,
    master_dtype: Any = None,
  ) -> TrainState:
    """A fresh state for ``model``, every array committed where a jitted step returns it.

    Fresh scalars (step counters, the PRNG key, controller state) would otherwise start
    uncommitted on the default device while a step's outputs live on the parameters' mesh:
    the second call of every step would then see new input shardings and compile again.

    Args:
      model: the module whose parameters are trained.
      tx: the optimizer.
      rng: the state's PRNG key.
      controllers: the RL controllers' state (None in SFT).
      master_dtype: keep a master copy in this dtype when some parameter has another
        (e.g. float32 for bfloat16 parameters); None: no copy.
    """
    graphdef, params = nnx.split(model)
    master = master_copy(params, master_dtype)
    state = cls(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=init_opt_state(tx, params if master is None else master),
      rng=rng,
      skipped=jnp.zeros((), jnp.int32),
      lr_scale=jnp.ones((), jnp.float32),
      graphdef=graphdef,
      tx=tx,
      controllers=controllers,
      master=master,
    )
    return commit_like_params(state, params)

  def model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.params)


def master_copy(params: Any, dtype: Any) -> Any:
  """``params`` cast to ``dtype`` (same shardings), or None when no copy is needed (``dtype`` None, or
  every parameter already in it)."""
  if dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  if all(jnp.dtype(x.dtype) == dtype for x in jax.tree.leaves(params)):
    return None
  shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), params)
  if all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings, is_leaf=lambda s: s is None)):
    return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p), out_shardings=shardings)(params)
  return jax.tree.map(lambda x: x.astype(dtype), params)


def commit_like_params(tree: Any, params: Any) -> Any:
  """Commits every array of ``tree`` next to ``params``: replicated on their mesh (leaves
  already on a named mesh are kept), or on their single device."""
  leaves = jax.tree.leaves(params)
  first = getattr(leaves[0], "sharding", None) if leaves else None
  if isinstance(first, NamedSharding):
    replicated = NamedSharding(first.mesh, PartitionSpec())

    def place(x):
      return x if isinstance(getattr(x, "sharding", None), NamedSharding) else jax.device_put(x, replicated)

    return jax.tree.map(place, tree)
  if first is None:
    return tree
  device = SingleDeviceSharding(next(iter(first.device_set)))
  return jax.tree.map(lambda x: jax.device_put(x, device), tree)


def opt_state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
  """Shardings of ``tx.init(params)``: every params-shaped subtree (Adam's moments)
  is sharded exactly like the parameters, everything else (step counts) replicated.

  Left to propagation, XLA may replicate the moments, which multiplies optimizer
  memory by the FSDP size.

  Args:
    tx: the optimizer.
    params: concrete arrays or ``ShapeDtypeStruct``s carrying ``NamedSharding``s.

  Returns:
    A pytree of shardings matching the optimizer state, or None if the parameters are
    not on a named mesh.
  """
  leaves = jax.tree.leaves(params)
  first = getattr(leaves[0], "sharding", None) if leaves else None
  if not isinstance(first, NamedSharding):
    return None
  replicated = NamedSharding(first.mesh, PartitionSpec())
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  param_def = jax.tree.structure(params)

  def is_params_like(x):
    return jax.tree.structure(x) == param_def

  abstract = jax.eval_shape(tx.init, params)
  return jax.tree.map(lambda x: param_shardings if is_params_like(x) else replicated, abstract, is_leaf=is_params_like)


def init_opt_state(tx: optax.GradientTransformation, params: Any) -> Any:
  """``tx.init(params)`` with the optimizer state laid out like the parameters."""
  return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params))(params)


def learning_rate_schedule(cfg: OptimConfig, total_steps: int, *, peak: float | None = None) -> optax.Schedule:
  """Linear warm-up from 0, then cosine decay to 10% of the peak (or constant)."""
  peak = cfg.learning_rate if peak is None else peak
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  if cfg.lr_schedule == "constant":
    after = optax.constant_schedule(peak)
  else:
    after = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1), alpha=0.1)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _decay_mask(params):
  """Weight decay on matrices only (``w_*``, embeddings, heads), never on norms or biases."""

  def decide(path, _):
    name = str(getattr(path[-1], "key", path[-1]))
    return name.startswith(("w_", "embed", "lm_head"))

  return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(
  cfg: OptimConfig, total_steps: int, *, peak: float | None = None, clip: bool = True, constant: bool = False
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with the configured schedule and global-norm clipping; returns ``(tx, schedule)``.

  Args:
    cfg: the optimizer config.
    total_steps: updates the schedule spans.
    peak: peak learning rate (default ``cfg.learning_rate``).
    clip: include the static global-norm clip (False when the caller clips dynamically,
      see :func:`apply_gradients`).
    constant: a constant schedule at the peak (when a controller shapes the LR instead).
  """
  schedule = optax.constant_schedule(peak or cfg.learning_rate) if constant else None
  schedule = schedule or learning_rate_schedule(cfg, total_steps, peak=peak)
  parts = []
  if clip and cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, weight_decay=cfg.weight_decay, mask=_decay_mask))
  return optax.chain(*parts), schedule


def apply_gradients(
  state: TrainState,
  grads: Any,
  loss: jax.Array,
  *,
  lr_mult: jax.Array | None = None,
  clip_norm: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """Applies ``grads`` unless the loss or any gradient is non-finite.

  A non-finite update leaves parameters *and* optimizer state untouched (so a NaN never
  reaches the weights or Adam's moments) and is counted in ``state.skipped``.  With a master
  copy (``state.master``) the gradients are cast to its dtype, the update is applied to it, and
  the parameters become its cast to their own dtypes.

  Args:
    state: the train state.
    grads: gradients shaped like ``state.params``.
    loss: the loss they came from (checked for finiteness).
    lr_mult: optional dynamic multiplier of the update (a controller's LR shape), on top of
      ``state.lr_scale``; AdamW's update is linear in the learning rate, so this equals
      scaling the learning rate.
    clip_norm: optional dynamic global-norm clip threshold applied before the optimizer
      (e.g. linked to the LR); ``inf`` disables it.

  Returns:
    The new state and metrics ``grad_norm`` (before clipping), ``update_norm``, ``skipped``
    (0/1 this call).
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
  scale = jnp.ones((), jnp.float32)
  if clip_norm is not None:
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(grad_norm, 1e-12))
  target = state.params if state.master is None else state.master
  grads = jax.tree.map(lambda g, t: g.astype(t.dtype), grads, target)
  safe_grads = jax.tree.map(lambda g: jnp.where(finite, g * scale.astype(g.dtype), jnp.zeros_like(g)), grads)
  updates, new_opt = state.tx.update(safe_grads, state.opt_state, target)
  lr = state.lr_scale if lr_mult is None else state.lr_scale * lr_mult
  updates = jax.tree.map(lambda u: (u * lr).astype(u.dtype), updates)
  new_target = optax.apply_updates(target, updates)

  def keep(new, old):
    return jnp.where(finite, new, old)

  new_target = jax.tree.map(keep, new_target, target)
  if state.master is None:
    new_params, new_master = new_target, None
  else:
    new_params, new_master = jax.tree.map(lambda m, p: m.astype(p.dtype), new_target, state.params), new_target
  new_state = state.replace(
    step=state.step + finite.astype(jnp.int32),
    params=new_params,
    master=new_master,
    opt_state=jax.tree.map(keep, new_opt, state.opt_state),
    skipped=state.skipped + (~finite).astype(jnp.int32),
  )
  metrics = {
    "grad_norm": grad_norm,
    "update_norm": jnp.where(finite, optax.tree.norm(updates), 0.0),
    "skipped": (~finite).astype(jnp.float32),
  }
  return new_state, metrics
