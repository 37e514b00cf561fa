"""One device mesh, one logical-axis rules table, one activation-constraint helper.

Every parameter carries logical axis names (``Param(..., logical_axes=("embed", "mlp"))``);
activations are constrained with :func:`constrain`.  A rules table maps logical names
to mesh axes ``data`` / ``fsdp`` / ``tensor``.  Training and generation use different
tables over the *same* mesh and the *same* parameter layout: generation only changes
how activations and the KV cache are laid out, so the sampler reads the live training
weights without a copy.

Training rules (``TRAIN_RULES``):

| logical   | mesh axes         | used by                                  |
|-----------|-------------------|------------------------------------------|
| batch     | (data, fsdp)      | activations, KV cache                    |
| seq       | -                 | activations                              |
| embed     | fsdp              | parameters: every D dimension (FSDP)     |
| act_embed | -                 | activations: the residual stream         |
| heads     | tensor            | q/o projections, attention activations   |
| kv_heads  | tensor            | k/v projections, KV cache                |
| head_dim  | -                 |                                          |
| mlp       | tensor            | SwiGLU hidden (Megatron column/row split)|
| vocab     | tensor            | embedding table rows, unembedding cols   |
| layers    | -                 | the stacked (scanned) layer axis         |

A mesh axis is used at most once per array; a dimension that the mesh axes do not
divide falls back to replication for that dimension (e.g. 2 KV heads on tensor=4).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mimo_jax.config_base import ConfigError, check, field

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, Any], ...]

TRAIN_RULES: Rules = (
  ("batch", ("data", "fsdp")),
  ("seq", None),
  ("embed", "fsdp"),
  ("act_embed", None),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  ("layers", None),
  ("norm", None),
  ("cache_seq", None),
)

# Generation: the same activation and KV-cache layout (batch over data/fsdp, heads over tensor),
# and a weight layout of its own, replicated over fsdp: a decode step reads every weight, so
# FSDP-sharded weights would be all-gathered at every generated token.  Activations never use the
# ``embed`` axis, so on a shared mesh the sampler reads the live training weights (TRAIN layout)
# under these rules unchanged; a separate rollout mesh (``--rollout_devices``) receives its own
# copy of the weights in this layout (:func:`generation_shardings`).
GENERATE_RULES: Rules = tuple((name, None if name == "embed" else axes) for name, axes in TRAIN_RULES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape and multi-host set-up.

  Attributes:
    mesh_data: size of the ``data`` axis (pure data parallel, replicated params).
    mesh_fsdp: size of the ``fsdp`` axis (data parallel with sharded params/opt state).
    mesh_tensor: size of the ``tensor`` axis (Megatron-style tensor parallel).
    coordinator_address: ``host:port`` of process 0 for multi-host runs; empty on one host.
    num_processes: number of processes (hosts) in a multi-host run.
    process_id: this process's index in a multi-host run.
  """

  mesh_data: int = field(1, "Size of the data mesh axis (-1: all remaining devices).")
  mesh_fsdp: int = field(-1, "Size of the fsdp mesh axis (-1: all remaining devices).")
  mesh_tensor: int = field(1, "Size of the tensor-parallel mesh axis (-1: all remaining devices).")
  coordinator_address: str = field("", "host:port of process 0 for multi-host runs; empty on one host.")
  num_processes: int = field(1, "Number of processes in a multi-host run.")
  process_id: int = field(0, "Index of this process in a multi-host run.")
  heartbeat_timeout_s: int = field(
    100, "Multi-host runs: seconds without a heartbeat after which a lost process ends the run on the others."
  )

  def __post_init__(self):
    sizes = self.axis_sizes
    for name, s in zip(("mesh_data", "mesh_fsdp", "mesh_tensor"), sizes, strict=True):
      check(s == -1 or s >= 1, name, s, "must be -1 (the rest) or a positive integer")
    check(sum(s == -1 for s in sizes) <= 1, "mesh_fsdp", self.mesh_fsdp, "at most one mesh axis may be -1")
    check(self.num_processes >= 1, "num_processes", self.num_processes, "must be >= 1")
    check(
      0 <= self.process_id < self.num_processes,
      "process_id",
      self.process_id,
      f"must be in [0, {self.num_processes}) (--num_processes={self.num_processes})",
    )
    check(
      self.num_processes == 1 or bool(self.coordinator_address),
      "coordinator_address",
      self.coordinator_address,
      "is required (host:port of process 0) when --num_processes > 1",
    )
    check(self.heartbeat_timeout_s >= 1, "heartbeat_timeout_s", self.heartbeat_timeout_s, "must be >= 1")

  @property
  def axis_sizes(self) -> tuple[int, int, int]:
    return (self.mesh_data, self.mesh_fsdp, self.mesh_tensor)

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """Resolves ``-1`` against ``num_devices``; raises ConfigError if they do not fit."""
    sizes = list(self.axis_sizes)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      check(
        num_devices % known == 0,
        "mesh_fsdp",
        self.axis_sizes,
        f"the fixed mesh axes (product {known}) must divide the {num_devices} devices",
      )
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ConfigError(
        f"--mesh_data/--mesh_fsdp/--mesh_tensor={tuple(self.axis_sizes)}: the mesh has "
        f"{math.prod(sizes)} devices but {num_devices} are available"
      )
    return tuple(sizes)  # type: ignore[return-value]


def initialize_distributed(cfg: MeshConfig) -> None:
  """Starts JAX multi-controller mode when a coordinator is configured; no-op on one host."""
  if cfg.num_processes > 1 or cfg.coordinator_address:
    # CPU devices of different processes talk through gloo (the CPU backend has no collectives of
    # its own across processes); accelerators use their own and ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=cfg.coordinator_address,
      num_processes=cfg.num_processes,
      process_id=cfg.process_id,
      heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
    )


def mesh_platform(mesh: Mesh | None) -> str:
  """The platform a mesh's programs run on (``cpu``, ``gpu``, ``tpu``); without a mesh, JAX's default
  backend.  A mesh of an AOT topology (a TPU dry run on a CPU host) gives the topology's."""
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the one global mesh with axes (data, fsdp, tensor).

  Args:
    cfg: mesh shape.
    devices: the devices to use; all global devices by default.

  Returns:
    A ``Mesh`` with ``AxisType.Auto`` axes (GSPMD propagation plus explicit constraints).
  """
  devices = list(devices) if devices is not None else jax.devices()
  shape = cfg.resolve(len(devices))
  try:
    from jax.experimental import mesh_utils

    device_array = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


# ----------------------------------------------------------------------------
# Logical axes -> PartitionSpec
# ----------------------------------------------------------------------------


def logical_to_spec(
  logical_axes: Sequence[str | None],
  rules: Rules,
  mesh: Mesh | None = None,
  shape: Sequence[int] | None = None,
) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec.

  Args:
    logical_axes: one name (or None) per array dimension.
    rules: the rules table.
    mesh: if given with ``shape``, mesh axes that do not divide a dimension, or whose
      size is 1, are dropped for that dimension.
    shape: the array shape, for the divisibility check.

  Returns:
    The PartitionSpec; each mesh axis appears at most once.
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(logical_axes):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
    target = table[name]
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if a not in used)
    if mesh is not None:
      axes = tuple(a for a in axes if mesh.shape[a] > 1)
      if shape is not None:
        # Keep the longest prefix of mesh axes whose product divides the dimension.
        kept = []
        for a in axes:
          if shape[i] % (math.prod(mesh.shape[b] for b in kept) * mesh.shape[a]) == 0:
            kept.append(a)
          else:
            break
        axes = tuple(kept)
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def named_sharding(
  mesh: Mesh, logical_axes: Sequence[str | None], rules: Rules, shape: Sequence[int] | None = None
) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh, shape))


def state_shardings(state: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Any:
  """NamedShardings for an ``nnx.State`` (abstract or concrete) from its ``logical_axes``.

  Variables without ``logical_axes`` metadata are replicated.
  """

  def one(v):
    if isinstance(v, nnx.Variable):
      axes = v.get_metadata("logical_axes", None)
      shape = v.get_value().shape
      if axes is None:
        axes = (None,) * len(shape)
      if len(axes) != len(shape):
        raise ValueError(f"logical_axes {axes} do not match the shape {shape}")
      return v.replace(named_sharding(mesh, axes, rules, shape))
    shape = getattr(v, "shape", ())
    return NamedSharding(mesh, PartitionSpec(*([None] * len(shape))))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def generation_shardings(params: Any, mesh: Mesh) -> Any:
  """Where the rollout side's copy of ``params`` lives on its own ``mesh``: the generation layout
  (:data:`GENERATE_RULES`).  ``jax.device_put(params, generation_shardings(params, mesh))`` moves
  trained weights to the rollout devices device to device."""
  return state_shardings(params, mesh, GENERATE_RULES)


def split_devices(num_rollout: int, devices: Sequence[jax.Device] | None = None) -> tuple[list, list]:
  """``(rollout devices, learner devices)``: the first ``num_rollout`` of the global devices generate."""
  devices = list(devices) if devices is not None else jax.devices()
  if not 0 < num_rollout < len(devices):
    raise ValueError(f"--rollout_devices={num_rollout}: needs 0 < K < {len(devices)} devices")
  return devices[:num_rollout], devices[num_rollout:]


def run_meshes(
  mesh_cfg: MeshConfig, rollout_devices: int, devices: Sequence[jax.Device] | None = None
) -> tuple[Mesh, Mesh | None]:
  """``(learner mesh, rollout mesh or None)`` of a run over ``devices`` (all global devices by default):
  with ``rollout_devices = K > 0`` the first K form the rollout sub-mesh and ``mesh_cfg`` describes the
  learner's mesh over the rest."""
  if not rollout_devices:
    return build_mesh(mesh_cfg, devices), None
  rollout, learner = split_devices(rollout_devices, devices)
  return build_mesh(mesh_cfg, learner), rollout_mesh(rollout)


def rollout_mesh(devices: Sequence[jax.Device]) -> Mesh:
  """The rollout sub-mesh: every device a data shard (each generates its rows with a full copy of
  the weights; the generation layout replicates them anyway)."""
  return build_mesh(MeshConfig(mesh_data=len(devices), mesh_fsdp=1, mesh_tensor=1), devices)


# ----------------------------------------------------------------------------
# Activation constraints
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ShardingContext:
  mesh: Mesh
  rules: Rules


_CONTEXT: contextvars.ContextVar[_ShardingContext | None] = contextvars.ContextVar("mimo_jax_sharding", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
  """Activates ``mesh``/``rules`` for :func:`constrain` while tracing inside the block."""
  token = _CONTEXT.set(_ShardingContext(mesh, rules))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def current_mesh() -> Mesh | None:
  ctx = _CONTEXT.get()
  return ctx.mesh if ctx else None


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op outside ``use_rules``."""
  ctx = _CONTEXT.get()
  if ctx is None:
    return x
  return jax.lax.with_sharding_constraint(x, named_sharding(ctx.mesh, logical_axes, ctx.rules, x.shape))


def splits_alike(logical_axis: str, *sizes: int, mesh: Mesh | None = None, rules: Rules | None = None) -> bool:
  """Whether dimensions of these sizes named ``logical_axis`` split over the same mesh axes (the
  active :func:`use_rules`, or ``mesh`` and ``rules``; True without either)."""
  ctx = _CONTEXT.get()
  if mesh is None and ctx is not None:
    mesh, rules = ctx.mesh, ctx.rules
  if mesh is None:
    return True
  return len({logical_to_spec((logical_axis,), rules or TRAIN_RULES, mesh, (n,))[0] for n in sizes}) == 1


def kernel_layout(rows: int, vocab: int) -> tuple[Mesh, str | None, tuple[str, ...]] | None:
  """How a per-token vocabulary kernel splits under the active rules: ``(mesh, vocab_axis, row_axes)``.

  Rows (``rows`` flattened tokens) split like ``batch``, the vocabulary like ``vocab``, each keeping only
  the mesh axes that divide it. None outside :func:`use_rules` or on a single device.
  """
  ctx = _CONTEXT.get()
  if ctx is None or ctx.mesh.size == 1:
    return None

  def axes(name: str, size: int) -> tuple[str, ...]:
    entry = logical_to_spec((name,), ctx.rules, ctx.mesh, (size,))[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

  vocab_axes, row_axes = axes("vocab", vocab), axes("batch", rows)
  if len(vocab_axes) > 1:
    raise ValueError(f"the vocabulary may split over one mesh axis, the rules give {vocab_axes}")
  vocab_axis = vocab_axes[0] if vocab_axes else None
  return ctx.mesh, vocab_axis, tuple(a for a in row_axes if a != vocab_axis)


def validate_model_on_mesh(model_cfg, mesh_cfg: MeshConfig, num_devices: int) -> None:
  """Checks that the tensor-parallel size divides the head count and MLP width."""
  _, _, tp = mesh_cfg.resolve(num_devices)
  check(
    model_cfg.num_heads % tp == 0,
    "mesh_tensor",
    tp,
    f"must divide the number of attention heads ({model_cfg.num_heads})",
  )
  check(model_cfg.mlp_dim % tp == 0, "mesh_tensor", tp, f"must divide mlp_dim ({model_cfg.mlp_dim})")
