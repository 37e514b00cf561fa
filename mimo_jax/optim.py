"""The train state pytree, the optimizer, and the guarded gradient application."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mimo_jax import multihost
from mimo_jax.config import OptimConfig


class TrainState(flax.struct.PyTreeNode):
  """Everything a jitted step reads and writes; donated into each step.

  Attributes:
    step: int32, optimizer updates applied (skipped non-finite updates do not count).
    params: the state half of ``nnx.split(model)`` (parameters only).
    opt_state: the optax state of :func:`make_optimizer` (its ``apply_if_finite`` counts the
      updates skipped because the loss or gradients were not finite: :attr:`skipped`).
    rng: PRNG key threaded through the steps.
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
      lr_scale=jnp.ones((), jnp.float32),
      graphdef=graphdef,
      tx=tx,
      controllers=controllers,
      master=master,
    )
    return commit_like_params(state, params)

  def model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.params)

  @property
  def skipped(self) -> jax.Array:
    """int32, updates skipped because the loss or gradients were not finite."""
    return self.opt_state.total_notfinite


def master_copy(params: Any, dtype: Any) -> Any:
  """``params`` in ``dtype`` or wider (same shardings): each parameter in the wider of its own dtype and
  ``dtype``, so a copy never rounds (a critic's float32 head stays float32 beside a bfloat16 master).
  None when no copy is needed (``dtype`` None, or every parameter already that wide)."""
  if dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  wider = lambda x: jnp.promote_types(x.dtype, dtype)  # noqa: E731
  if all(jnp.dtype(x.dtype) == wider(x) for x in jax.tree.leaves(params)):
    return None
  shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), params)
  if all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings, is_leaf=lambda s: s is None)):
    return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(wider(x)), p), out_shardings=shardings)(params)
  return jax.tree.map(lambda x: x.astype(wider(x)), params)


def commit_like_params(tree: Any, params: Any) -> Any:
  """Commits every array of ``tree`` next to ``params``: replicated on their mesh (leaves
  already on a named mesh are kept), or on their single device."""
  leaves = jax.tree.leaves(params)
  first = getattr(leaves[0], "sharding", None) if leaves else None
  if isinstance(first, NamedSharding):
    replicated = NamedSharding(first.mesh, PartitionSpec())

    def place(x):
      return x if isinstance(getattr(x, "sharding", None), NamedSharding) else multihost.put(x, replicated)

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
  """Weight decay on matrices only (``w_*``, embeddings, heads), never on norms or biases.

  A parameter's name is the last key of its path that is not an ``nnx.Variable``'s ``.value`` (a
  model's state paths end in ``.value``: read as the name, it decayed nothing)."""

  def decide(path, _):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    while len(names) > 1 and names[-1] == "value" and isinstance(path[len(names) - 1], jax.tree_util.GetAttrKey):
      names.pop()
    return names[-1].startswith(("w_", "embed", "lm_head"))

  return jax.tree_util.tree_map_with_path(decide, params)


# Layout of the optimizer state inside checkpoints (``optimizer_layout`` of their metadata):
# 1: the bare ``optax.chain([clip_by_global_norm], adamw)`` state of earlier releases, the skip
#    counter beside it (restored through :func:`legacy_abstract_opt_state` and :func:`upgrade_opt_state`);
# 2: the guarded chain of :func:`make_optimizer`.
OPTIMIZER_LAYOUT = 2
# apply_if_finite accepts an update after this many consecutive non-finite ones; the trainer
# never wants that (its own guard rolls back instead), so the bound is the counter's maximum.
_NEVER_GIVE_UP = int(jnp.iinfo(jnp.int32).max)


def clip_by_global_norm(max_norm: Any) -> optax.GradientTransformation:
  """Scales the updates by ``min(1, max_norm / global_norm)`` (``inf``: unclipped), keeping each leaf's dtype.

  ``optax.clip_by_global_norm`` mixes an injected float32 threshold into bfloat16 leaves and fails
  (``lax.select`` of two dtypes); this is the same transformation, dtype-preserving.
  """

  def update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _clipped_adamw(
  learning_rate: Any,
  lr_mult: Any,
  clip_norm: Any,
  b1: Any,
  b2: Any,
  weight_decay: Any,
  mask: Any,
) -> optax.GradientTransformation:
  """Global-norm clip at ``clip_norm`` (``inf``: off), then AdamW at ``learning_rate * lr_mult``; the
  updates keep the parameters' dtypes (the injected float32 rate would promote bfloat16 ones)."""
  return optax.chain(
    clip_by_global_norm(clip_norm),
    optax.adamw(learning_rate * lr_mult, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask),
    _like_params(),
  )


def _like_params() -> optax.GradientTransformation:
  def update(updates, state, params=None):
    return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def guard(factory: Any, static: tuple[str, ...] = (), **hyperparams: Any) -> optax.GradientTransformation:
  """``apply_if_finite(inject_hyperparams(factory)(**hyperparams))``: the trainers' optimizer form.

  ``factory`` must take ``lr_mult`` and ``clip_norm`` (what :func:`apply_gradients` injects each
  update); callables among ``hyperparams`` are schedules of the count of applied updates.
  ``static`` names the ones passed through as they are (constants such as Adam's betas, which as
  float32 arrays would promote bfloat16 moments, and callables that are not schedules).
  """
  inner = optax.inject_hyperparams(factory, static_args=static, hyperparam_dtype=jnp.float32)(**hyperparams)
  return optax.apply_if_finite(inner, _NEVER_GIVE_UP)


def _clipped_sgd(learning_rate: Any, lr_mult: Any, clip_norm: Any) -> optax.GradientTransformation:
  return optax.chain(clip_by_global_norm(clip_norm), optax.sgd(learning_rate * lr_mult), _like_params())


def sgd(learning_rate: float, clip_norm: float = float("inf")) -> optax.GradientTransformation:
  """Guarded plain SGD (linear in the gradient: tests that compare gradients through an update)."""
  return guard(_clipped_sgd, learning_rate=learning_rate, lr_mult=1.0, clip_norm=clip_norm)


def make_optimizer(
  cfg: OptimConfig, total_steps: int, *, peak: float | None = None, constant: bool = False
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The one optimizer of every trainer (SFT, RL policy, critic, reward model, dry run).

  ``apply_if_finite(inject_hyperparams(clip -> adamw))`` (:func:`guard`): the learning rate follows
  the schedule (evaluated by ``inject_hyperparams`` at the count of applied updates); ``lr_mult`` (a
  controller's LR shape times a rollback's scale) and ``clip_norm`` (fixed or LR-linked) are
  injected hyperparameters a step sets in the state before each update (:func:`apply_gradients`);
  an update whose gradients are not finite is dropped by ``apply_if_finite``, which keeps every
  inner state (moments, counts) as it was and counts the skip.

  Args:
    cfg: the optimizer config (``grad_clip`` 0 means no clipping).
    total_steps: updates the schedule spans.
    peak: peak learning rate (default ``cfg.learning_rate``).
    constant: a constant schedule at the peak (when a controller shapes the LR instead).

  Returns:
    ``(tx, schedule)``.
  """
  schedule = optax.constant_schedule(peak or cfg.learning_rate) if constant else None
  schedule = schedule or learning_rate_schedule(cfg, total_steps, peak=peak)
  tx = guard(
    _clipped_adamw,
    static=("b1", "b2", "weight_decay", "mask"),
    learning_rate=schedule,
    lr_mult=1.0,
    clip_norm=float(cfg.grad_clip) if cfg.grad_clip > 0 else float("inf"),
    b1=cfg.adam_b1,
    b2=cfg.adam_b2,
    weight_decay=cfg.weight_decay,
    mask=_decay_mask,
  )
  return tx, schedule


def hyperparams(opt_state: Any) -> dict[str, jax.Array]:
  """The injected hyperparameters last used (``learning_rate``, ``lr_mult``, ``clip_norm``, ...)."""
  return opt_state.inner_state.hyperparams


def abstract_opt_state(tx: optax.GradientTransformation, target: Any) -> Any:
  """``ShapeDtypeStruct``s of ``tx.init(target)``, laid out as :func:`init_opt_state` lays it out."""
  shardings = opt_state_shardings(tx, target)
  abstract = jax.eval_shape(tx.init, target)
  if shardings is None:
    return abstract
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings)


def legacy_abstract_opt_state(target: Any, *, clip: bool) -> Any:
  """The restore target of a layout-1 optimizer state: the bare ``chain([clip], adamw)`` state (its
  structure does not depend on the hyperparameter values).  The RL policy's chain had no clip (it
  was applied outside); SFT's and the critic's had one when ``grad_clip`` > 0."""
  parts = [optax.clip_by_global_norm(1.0)] if clip else []
  return abstract_opt_state(optax.chain(*parts, optax.adamw(optax.constant_schedule(1.0), mask=_decay_mask)), target)


def upgrade_opt_state(tx: optax.GradientTransformation, target: Any, legacy: Any, skipped: jax.Array) -> Any:
  """A layout-1 optimizer state (``legacy``, the bare chain's) as ``tx``'s state for ``target``: Adam's
  moments and count, the schedule's count, and the skip counter carry over; everything else is fresh.

  Every array of the result is its own buffer (the state is donated to the next step, and a buffer
  donated twice is not allowed).
  """
  fresh = init_opt_state(tx, target)
  adam, _, schedule = legacy[-1]
  inject = fresh.inner_state
  clip_state, adamw_state, *rest = inject.inner_state

  def count():
    return jnp.copy(schedule.count)

  new_inject = inject._replace(
    count=count(),
    hyperparams_states={
      k: (v._replace(count=count()) if hasattr(v, "count") else v) for k, v in inject.hyperparams_states.items()
    },
    inner_state=(clip_state, (adam, *adamw_state[1:]), *rest),
  )
  return fresh._replace(inner_state=new_inject, total_notfinite=jnp.copy(jnp.asarray(skipped, jnp.int32)))


def apply_gradients(
  state: TrainState,
  grads: Any,
  loss: jax.Array,
  *,
  lr_mult: jax.Array | None = None,
  clip_norm: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One guarded optimizer update: skipped (by the optimizer's ``apply_if_finite``) unless the loss
  and every gradient are finite.

  A skipped update leaves parameters *and* optimizer state untouched (so a NaN never reaches the
  weights or Adam's moments) and is counted (``state.skipped``).  With a master copy
  (``state.master``) the gradients are cast to its dtype, the update is applied to it, and the
  parameters become its cast to their own dtypes.

  Args:
    state: the train state.
    grads: gradients shaped like ``state.params``.
    loss: the loss they came from (checked for finiteness).
    lr_mult: optional dynamic multiplier of the learning rate (a controller's LR shape), on top of
      ``state.lr_scale``; injected as the optimizer's ``lr_mult``.
    clip_norm: optional dynamic global-norm clip threshold (e.g. linked to the LR; ``inf``: off),
      injected as the optimizer's ``clip_norm``; None keeps the configured one.

  Returns:
    The new state and metrics ``grad_norm`` (before clipping), ``update_norm``, ``skipped``
    (0/1 this call).
  """
  grad_norm = optax.tree.norm(grads)
  target = state.params if state.master is None else state.master
  # A non-finite loss with finite gradients is skipped as well: the optimizer sees a NaN.
  poison = jnp.where(jnp.isfinite(loss), 0.0, jnp.nan)
  grads = jax.tree.map(lambda g, t: (g + poison.astype(g.dtype)).astype(t.dtype), grads, target)
  hp = dict(hyperparams(state.opt_state))
  hp["lr_mult"] = (state.lr_scale if lr_mult is None else state.lr_scale * lr_mult).astype(jnp.float32)
  if clip_norm is not None:
    hp["clip_norm"] = jnp.asarray(clip_norm, jnp.float32)
  opt_state = state.opt_state._replace(inner_state=state.opt_state.inner_state._replace(hyperparams=hp))
  updates, new_opt = state.tx.update(grads, opt_state, target)
  finite = new_opt.last_finite
  new_target = optax.apply_updates(target, updates)
  if state.master is None:
    new_params, new_master = new_target, None
  else:
    new_params, new_master = jax.tree.map(lambda m, p: m.astype(p.dtype), new_target, state.params), new_target
  new_state = state.replace(
    step=state.step + finite.astype(jnp.int32),
    params=new_params,
    master=new_master,
    opt_state=new_opt,
  )
  metrics = {
    "grad_norm": grad_norm,
    "update_norm": optax.tree.norm(updates),
    "skipped": (~finite).astype(jnp.float32),
  }
  return new_state, metrics
