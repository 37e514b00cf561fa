"""Test set-up: 8 emulated CPU devices, so sharding in tests is real (and a patient collective timeout).

XLA reads the device count when the backend starts, so this must run before anything
imports jax.

One persistent compilation cache for the session (a fresh directory, so nothing carries over
between sessions): the many end-to-end runs compile the same programs, and the subprocesses
of the kill/resume and SIGTERM tests inherit it through the environment. No-recompile tests
still see every program the loop asks for: ``count_compilations`` counts cache hits too.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# The 8 emulated devices meet at every collective; XLA aborts the whole process when one of them has
# not arrived after 40 s (--xla_cpu_collective_call_terminate_timeout_seconds).  On a 2-core machine
# that also runs other work, a device thread can be that late without anything being wrong, so the
# suite waits up to 10 minutes (a real deadlock still ends; subprocesses inherit the setting).
if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
  _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
# The suite is compile-bound: about half of its time is XLA:CPU compiling programs (every test's
# configuration is programs of its own shapes), and about half of a program's compile is LLVM
# optimising its kernels (the tiny model's learn program: 1.9 s at level 0, 3.4 s at XLA's default, 3).
# The tests check what the programs compute, not how fast their kernels run, so the suite compiles the
# same optimised HLO (the same fusions and layouts) with LLVM's optimiser off; the whole suite ran ~19%
# shorter (BUILD_NOTES, "Tests and CI time").  A kernel's exp or log may round differently in its last bit.
# Naming the flag in XLA_FLAGS tests at another level.
if "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mimo_jax_xla_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

# mimo_jax sets its XLA:CPU defaults (the emulated devices' pool size among them) before the backend starts.
import mimo_jax  # noqa: E402, F401

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionfinish(session, exitstatus):
  if _OWN_CACHE is not None:
    import shutil

    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
