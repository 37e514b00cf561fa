"""Named accelerator topologies for ``--dry_run --dry_run_topology=NAME``: what a pod or node looks like
to the compiler, from this host.

- TPU slices, ``<gen>-<n>`` as Cloud TPU names them (``v4-128``, ``v5p-128``, ``v5e-16``, ``v6e-256``),
  are compiled by the real XLA:TPU compiler on this CPU host: libtpu's compile-only topologies
  (``pip install -e '.[tpu]'``) give devices that programs compile for but never run on.  ``n`` counts
  TensorCores for v4 and v5p (2 per chip) and chips for v5e and v6e, as the slice names do.  A v5p
  chip is one JAX device (its two cores act as one); libtpu's compile-only v4 topology has one device
  per core.
  libtpu is found as the ``libtpu`` package (``pip install -e '.[tpu]'`` on a TPU host) or, on a CPU
  host, in ``<venv>/libtpu-compile`` (``make tpu-compile``; ``make test`` installs it): there it is
  off the import path, so JAX still starts on the CPU without probing for a TPU, and it is loaded
  only when a topology is asked for.
- GPU nodes (``gpu-8x80gb``: 8 x 80 GB, e.g. A100/H100; ``gpu-8x141gb``: 8 x 141 GB, H200) are
  compiled by the CPU compiler over 8 emulated devices.  That gives the sharded storage exactly and
  the programs' temporaries only approximately: the GPU compiler fuses and schedules differently.

Per-device memory is the chips' published HBM (per core for the v4 compile-only devices).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys

from mimo_jax.config_base import ConfigError

__all__ = [
  "LIBTPU_REQUIREMENT",
  "TOPOLOGY_HELP",
  "Topology",
  "libtpu_compile_dir",
  "parse_topology",
  "topology_devices",
]

GiB = 1024**3

# generation -> (name in libtpu's topology strings, cores per slice-name unit, devices per chip,
#                dimensions of the chip grid, HBM GiB per chip)
_TPU = {
  "v4": ("v4", 2, 2, 3, 32.0),
  "v5p": ("v5p", 2, 1, 3, 95.0),
  "v5e": ("v5e", 1, 1, 2, 16.0),
  "v6e": ("v6e", 1, 1, 2, 32.0),
}
_GPU = {"gpu-8x80gb": (8, 80.0), "gpu-8x141gb": (8, 141.0)}

# The libtpu release this JAX was built against (jax[tpu]'s pin).
LIBTPU_REQUIREMENT = "libtpu==0.0.42.*"

TOPOLOGY_HELP = (
  "<gen>-<n> for a TPU slice (gen in v4, v5p, v5e, v6e; n as in the slice's name, e.g. v5p-128, v5e-16), "
  "or a GPU node: gpu-8x80gb, gpu-8x141gb"
)


@dataclasses.dataclass(frozen=True)
class Topology:
  """One named topology.

  Attributes:
    name: the user-facing name (``v5p-128``).
    platform: ``tpu`` or ``gpu``.
    devices: JAX devices the programs are compiled for.
    chips: accelerator chips.
    grid: the chip grid (libtpu's ``AxBxC``); empty for GPU nodes.
    device_gib: HBM per JAX device (GB for GPUs as sold, converted to GiB).
    compiler: who compiles (``XLA:TPU (compile-only)`` or ``XLA:CPU (stand-in for the GPU compiler)``).
  """

  name: str
  platform: str
  devices: int
  chips: int
  grid: tuple[int, ...]
  device_gib: float
  compiler: str

  @property
  def libtpu_name(self) -> str:
    return f"{_TPU[self.name.split('-')[0]][0]}:{'x'.join(map(str, self.grid))}"


def _grid(chips: int, dims: int) -> tuple[int, ...]:
  """The most even power-of-two grid of ``chips`` chips in ``dims`` dimensions as Cloud TPU writes it:
  ascending, unit dimensions last (``2x2x1``, ``4x4x8``, ``8x16``)."""
  k = int(math.log2(chips))
  base, extra = divmod(k, dims)
  sizes = sorted(2 ** (base + (i < extra)) for i in range(dims))
  return tuple([s for s in sizes if s > 1] + [s for s in sizes if s == 1])


def parse_topology(name: str) -> Topology:
  """The topology ``name`` names; raises ConfigError naming ``--dry_run_topology`` and the allowed forms."""
  if name in _GPU:
    n, gb = _GPU[name]
    return Topology(name, "gpu", n, n, (), gb * 1e9 / GiB, "XLA:CPU (stand-in for the GPU compiler)")
  m = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name)
  if not m:
    raise ConfigError(f"--dry_run_topology={name!r}: must be {TOPOLOGY_HELP}")
  gen, n = m.group(1), int(m.group(2))
  _, cores_per_unit, devices_per_chip, dims, hbm = _TPU[gen]
  chips = n // cores_per_unit if cores_per_unit > 1 else n
  if n < cores_per_unit or n % cores_per_unit or chips & (chips - 1):
    unit = "TensorCores (2 per chip)" if cores_per_unit > 1 else "chips"
    raise ConfigError(
      f"--dry_run_topology={name}: {gen}-<n> counts {unit}; n must give a power-of-two number of chips"
      f"{' and be even' if cores_per_unit > 1 else ''} (e.g. {gen}-{8 * cores_per_unit})"
    )
  return Topology(
    name,
    "tpu",
    chips * devices_per_chip,
    chips,
    _grid(chips, dims),
    hbm / devices_per_chip,
    "XLA:TPU (compile-only)",
  )


def libtpu_compile_dir() -> str:
  """Where ``make tpu-compile`` puts libtpu: beside the environment's packages, off the import path."""
  return os.path.join(sys.prefix, "libtpu-compile")


def _find_libtpu() -> None:
  """Points JAX at the compile-only libtpu when no ``libtpu`` package is installed.

  That copy drives no TPU, so several processes may load it at once (dry runs side by side, a test
  suite beside a dry run): libtpu's one-process lock (``/tmp/libtpu_lockfile``), which keeps a second
  process off a TPU host's chips, is waived for it (``ALLOW_MULTIPLE_LIBTPU_LOAD``).
  """
  path = os.path.join(libtpu_compile_dir(), "libtpu", "libtpu.so")
  if os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu") is not None:
    if os.environ.get("TPU_LIBRARY_PATH") == path:
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return
  if os.path.isfile(path):
    os.environ["TPU_LIBRARY_PATH"] = path
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(topo: Topology) -> list:
  """The devices to compile for: libtpu's compile-only devices (TPU) or this host's CPU devices (GPU nodes).

  Raises:
    ConfigError: libtpu is not installed (TPU), or fewer CPU devices than the node has (GPU).
  """
  import jax

  if topo.platform == "gpu":
    cpus = jax.devices("cpu")
    if len(cpus) < topo.devices:
      raise ConfigError(
        f"--dry_run_topology={topo.name}: needs {topo.devices} CPU devices to stand in for the node's GPUs, "
        f"this process has {len(cpus)} (python -m mimo_jax.main sets them up before JAX starts)"
      )
    return cpus[: topo.devices]
  _find_libtpu()
  # Slices smaller than one host (4 chips) are one host: libtpu's default host bounds (2x2x1) would not divide them.
  kwargs = {}
  if topo.chips < 4:
    kwargs["chips_per_host_bounds"] = (*topo.grid, 1, 1)[:3]
  try:
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topo.libtpu_name, "tpu", **kwargs).devices
  except Exception as e:  # noqa: BLE001 - libtpu absent or refusing the topology
    missing = "TPU support not installed" in str(e)
    raise ConfigError(
      f"--dry_run_topology={topo.name}: the TPU compiler could not build the compile-only topology "
      f"{topo.libtpu_name} ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
      + ("; it needs libtpu: make tpu-compile (a CPU host) or pip install -e '.[tpu]' (a TPU host)" if missing else "")
    ) from None
  if len(devices) != topo.devices:
    raise ConfigError(
      f"--dry_run_topology={topo.name}: libtpu's {topo.libtpu_name} has {len(devices)} devices, expected {topo.devices}"
    )
  return list(devices)
