"""Building models directly in their sharding (no full copy on one device)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh

from mimo_jax.sharding import TRAIN_RULES, Rules, state_shardings

M = TypeVar("M", bound=nnx.Module)


def create_sharded(make: Callable[[], M], mesh: Mesh | None, rules: Rules = TRAIN_RULES) -> M:
  """Builds ``make()`` with every variable created in its sharding.

  The module is first traced abstractly (``nnx.eval_shape``: no memory), its
  shardings are derived from the ``logical_axes`` metadata, and the initialiser is
  compiled with those ``out_shardings``, so each device materialises only its shard.

  Args:
    make: zero-argument constructor, e.g. ``lambda: Transformer(cfg, rngs=nnx.Rngs(0))``.
    mesh: target mesh; None builds on the default device.
    rules: logical-axis rules.

  Returns:
    The module with concrete, sharded variables.
  """
  if mesh is None:
    return make()
  abstract = nnx.eval_shape(make)
  graphdef, abs_state = nnx.split(abstract)
  shardings = state_shardings(abs_state, mesh, rules)

  @jax.jit
  def init():
    return nnx.split(make())[1]

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def abstract_state(make: Callable[[], M], mesh: Mesh | None = None, rules: Rules = TRAIN_RULES):
  """``(graphdef, state)`` of ``make()`` with ``jax.ShapeDtypeStruct`` leaves (sharded if ``mesh``)."""
  abstract = nnx.eval_shape(make)
  graphdef, state = nnx.split(abstract)
  if mesh is None:
    return graphdef, state
  shardings = state_shardings(state, mesh, rules)
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)
  return graphdef, state
