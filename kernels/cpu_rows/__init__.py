"""A product of a few rows on the CPU's cores at once: the decode step's matrix products on XLA:CPU.

A decode step multiplies a few rows (1 to 32 in the sampler's rule) by each weight: the product
streams the weight once and does little arithmetic per byte.  XLA:CPU runs it on Eigen (or
YNNPACK), split over its intra-op pool,
whose helper thread starts 30-70 us after the caller (a futex wake; measured on a 2-core virtual
machine, BUILD_NOTES "A decode step's products on both cores"), so such a product runs at about one
core's rate.  :func:`rows_matmul` is an XLA FFI custom call (``rows_matmul.cc``) whose calling
thread and helper threads (which spin for 300 us after each product, then sleep) claim chunks of the
weight's column panels from one counter, so all start at once and a late helper takes less.

The weight is packed once into column panels (:func:`pack`, ``[K, N] -> [ceil(N / 16), K, 16]``),
each panel one contiguous stream.  The sampler packs a call's weights once, before its decode loop
(``Transformer.decode_weights``), or keeps them packed with its layer copy; ``project`` in
``mimo_jax.models.transformer`` multiplies by a packed weight (:class:`Panels`) on the kernel.

Each output element is one thread's fused multiply-adds over ``k`` in order, so results do not
depend on the number of threads; they differ from XLA's products in the last bits (another
summation order).  Float32 only, CPU only, no gradient (generation only).

The library is compiled from ``rows_matmul.cc`` on first use with the host's C++ compiler and its
own vector width (``-march=native``), into ``$MIMO_JAX_CACHE_DIR/cpu_rows`` (default
``~/.cache/mimo_jax/cpu_rows``), one file per source, jaxlib version and CPU; where that fails
(no compiler, another OS) :func:`available` is False with the reason in :func:`unavailable_reason`,
and callers keep XLA's products.  ``MIMO_JAX_CPU_ROWS=0`` turns it off; ``MIMO_JAX_CPU_ROWS_THREADS``
sets the number of threads (default: the cores this process may run on).
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

PANEL = 16
SOURCE = Path(__file__).with_name("rows_matmul.cc")
ENABLE_ENV = "MIMO_JAX_CPU_ROWS"
THREADS_ENV = "MIMO_JAX_CPU_ROWS_THREADS"
CACHE_ENV = "MIMO_JAX_CACHE_DIR"
TARGET = "mimo_rows_matmul_f32"
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def _cache_dir() -> Path:
  root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "mimo_jax")
  return Path(root) / "cpu_rows"


def _cpu_signature() -> str:
  """The CPU's model and features, so that a library built with ``-march=native`` is not reused on another CPU."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _compile_command(out: str) -> list[str]:
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
  if cxx is None:
    raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
  return [
    cxx,
    "-O3",
    "-march=native",
    "-std=gnu++20",
    "-ffp-contract=fast",
    "-shared",
    "-fPIC",
    f"-I{jax.ffi.include_dir()}",
    str(SOURCE),
    "-o",
    out,
    "-lpthread",
  ]


def _library_path() -> Path:
  key = hashlib.sha256()
  key.update(SOURCE.read_bytes())
  key.update(jax.__version__.encode())
  key.update(_cpu_signature().encode())
  key.update(" ".join(_compile_command("OUT")[:1]).encode())
  return _cache_dir() / f"rows_matmul-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
  """Compiles the library to ``path`` (atomically, under a lock: concurrent processes build it once)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path.parent / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if path.exists():
      return
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
      proc = subprocess.run(_compile_command(tmp), capture_output=True, text=True, timeout=300)
      if proc.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr[-2000:]}")
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)


_lock = threading.Lock()


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
  """(the loaded and registered library, None) or (None, why not).

  Raises ValueError for a value of ``MIMO_JAX_CPU_ROWS`` or ``MIMO_JAX_CPU_ROWS_THREADS`` it cannot read."""
  switch = os.environ.get(ENABLE_ENV, "").strip().lower()
  if switch not in _OFF + _ON:
    raise ValueError(f"{ENABLE_ENV}={os.environ[ENABLE_ENV]!r}: expected one of {', '.join(_ON[1:] + _OFF)} (or unset)")
  threads_env = os.environ.get(THREADS_ENV, "").strip()
  if threads_env and not (threads_env.isdigit() and int(threads_env) > 0):
    raise ValueError(f"{THREADS_ENV}={os.environ[THREADS_ENV]!r}: expected a positive integer (or unset)")
  if switch in _OFF:
    return None, f"{ENABLE_ENV}={os.environ[ENABLE_ENV]}"
  if platform.system() != "Linux":
    return None, f"built and tested on Linux only (this is {platform.system()})"
  with _lock:
    try:
      path = _library_path()
      if not path.exists():
        _build(path)
      lib = ctypes.CDLL(str(path))
      if lib.MimoRowsMatmulPanel() != PANEL:
        return None, f"the library's panel width is {lib.MimoRowsMatmulPanel()}, not {PANEL}"
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MimoRowsMatmulF32), platform="cpu")
    except Exception as e:  # no compiler, a failed build, a library that does not load
      log.warning("mimo_jax.kernels.cpu_rows is unavailable; decode steps keep XLA's products: %s", e)
      return None, str(e)
  return lib, None


def available() -> bool:
  """Whether :func:`rows_matmul` can run here (builds the library on first call)."""
  return _load()[0] is not None


def unavailable_reason() -> str | None:
  """Why :func:`available` is False (None when it is True)."""
  return _load()[1]


def threads() -> int:
  """How many threads (the caller included) split each product."""
  lib = _load()[0]
  if lib is None:
    raise RuntimeError(f"cpu_rows is unavailable: {unavailable_reason()}")
  return int(lib.MimoRowsMatmulThreads())


def max_rows_per_pass() -> int:
  """Rows the kernel multiplies per pass over a panel (more rows read each panel again, from cache)."""
  lib = _load()[0]
  return 0 if lib is None else int(lib.MimoRowsMatmulMaxRows())


def pack(w: jax.Array) -> jax.Array:
  """``w [K, N]`` as column panels ``[ceil(N / 16), K, 16]`` (columns past ``N`` are zeros)."""
  if w.ndim != 2:
    raise ValueError(f"pack: w must be [K, N], got shape {w.shape}")
  K, N = w.shape
  P = -(-N // PANEL)
  if P * PANEL != N:
    w = jnp.pad(w, ((0, 0), (0, P * PANEL - N)))
  return jnp.transpose(w.reshape(K, P, PANEL), (1, 0, 2))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class Panels:
  """A ``[K, N]`` weight packed for :func:`rows_matmul` (made once, kept between calls).

  ``data``: :func:`pack`'s ``[ceil(N / 16), K, 16]`` panels; ``n``: the weight's ``N`` (static).
  ``models.transformer.project`` multiplies by it on :func:`rows_matmul`.
  """

  data: jax.Array
  n: int

  @classmethod
  def of(cls, w: jax.Array) -> Panels:
    """``w [K, N]`` packed."""
    return cls(pack(w), int(w.shape[1]))

  @property
  def k(self) -> int:
    return int(self.data.shape[1])


def rows_matmul(x: jax.Array, panels: jax.Array, n: int | None = None) -> jax.Array:
  """``x [M, K] @ w`` with ``w`` given as :func:`pack`'s panels; the first ``n`` columns (default all).

  Float32 on CPU; builds and registers the library on first use, and raises ``RuntimeError``
  where :func:`available` is False.
  """
  if not available():
    raise RuntimeError(f"cpu_rows is unavailable: {unavailable_reason()}")
  if x.ndim != 2 or panels.ndim != 3 or panels.shape[1] != x.shape[1] or panels.shape[2] != PANEL:
    raise ValueError(f"rows_matmul: x [M, K] and panels [P, K, {PANEL}] expected, got {x.shape} and {panels.shape}")
  if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
    raise ValueError(f"rows_matmul: float32 only, got {x.dtype} and {panels.dtype}")
  width = panels.shape[0] * PANEL
  n = width if n is None else n
  if not 0 < n <= width:
    raise ValueError(f"rows_matmul: n={n} outside the panels' {width} columns")
  y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], width), jnp.float32))(x, panels)
  return y if n == width else y[:, :n]


def reference(x: jax.Array, panels: jax.Array, n: int | None = None) -> jax.Array:
  """The pure-jnp product :func:`rows_matmul` computes (float32 sums at the highest precision)."""
  w = jnp.transpose(panels, (1, 0, 2)).reshape(panels.shape[1], -1)
  y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
  return y if n is None else y[:, :n]
