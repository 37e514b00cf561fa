"""XLA:CPU settings the trainer ships with, applied when ``mimo_jax`` is imported.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, so these take effect when
``mimo_jax`` is imported before JAX's first computation (every entry point and the tests
do).  A flag the user already set in ``XLA_FLAGS`` is never overridden.

* ``--xla_cpu_experimental_ynn_fusion_type=-individual_dot``: matrix products outside a
  fusion run on XLA's Eigen kernels instead of YNNPACK's.  At this project's CPU shapes
  (batch-16 decode steps, the learner's [tokens x d_model] products) Eigen's were faster;
  the measurements are in BUILD_NOTES ("XLA:CPU matmul kernels").  It changes CPU results
  in the last bits (another summation order), never on GPU or TPU, where the flag does
  nothing.  ``MIMO_JAX_CPU_DOTS=ynn`` keeps XLA's default, ``MIMO_JAX_CPU_DOTS=eigen`` takes
  Eigen's everywhere; unset, one kind of program may still ask for YNNPACK's
  (:func:`ynn_dots_compiler_options`).

* ``PJRT_NPROC``, only with several emulated CPU devices (``--xla_force_host_platform_device_count``
  or ``JAX_NUM_CPU_DEVICES`` above 1) and only where neither ``PJRT_NPROC`` nor ``NPROC`` is set:
  XLA:CPU's thread pool gets :data:`CPU_POOL_THREADS_PER_DEVICE` threads per device instead of
  one per core (at least one per device).  All emulated devices run their collectives on that one
  pool, and a device waiting at a collective holds its thread until every device has arrived;
  with one thread per device, a device whose next piece of work is queued behind the waiting ones
  never arrives, and XLA aborts the process after its collective timeout (BUILD_NOTES, "Tests and
  CI time").  A process with one CPU device is left as it is.

Two settings are per program rather than per process: the learner's programs compile on XLA:CPU
with its loop emitters instead of the MLIR fusion emitters (:func:`learner_compiler_options`), and
the sampler's generate program takes YNNPACK's products at the row counts where they were measured
faster (:func:`ynn_dots_compiler_options`, chosen by ``Sampler.uses_ynn_dots``).
"""

from __future__ import annotations

import os

CPU_DOTS_ENV = "MIMO_JAX_CPU_DOTS"
_YNN_FUSION_FLAG = "xla_cpu_experimental_ynn_fusion_type"
CPU_DEFAULT_FLAGS = (f"--{_YNN_FUSION_FLAG}=-individual_dot",)
CPU_DOTS_CHOICES = ("eigen", "ynn")
# XLA:CPU's own list of the work it hands to YNNPACK, as a program's option spells it.  The option
# replaces the whole list (XLA does not expose its default), so this is the default written out;
# tests/test_xla_defaults.py checks that a program compiled with it is the program XLA compiles
# without our flag.
XLA_DEFAULT_YNN_FUSIONS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"

# The flags a mimo_jax process added to XLA_FLAGS, for the processes it starts (they inherit its
# environment): what is listed there was not the user's choice.
ADDED_FLAGS_ENV = "MIMO_JAX_ADDED_XLA_FLAGS"


def user_xla_flags(environ: dict | None = None) -> str | None:
  """``XLA_FLAGS`` without the flags an ancestor mimo_jax process added (``MIMO_JAX_ADDED_XLA_FLAGS``);
  None when unset."""
  env = os.environ if environ is None else environ
  flags = env.get("XLA_FLAGS")
  added = set(env.get(ADDED_FLAGS_ENV, "").split())
  if flags is None or not added:
    return flags
  return " ".join(f for f in flags.split() if f not in added)


# XLA_FLAGS (as the user set it) and PJRT_NPROC as the process found them, before :func:`apply` (None: unset).
_USER_XLA_FLAGS: str | None = user_xla_flags()
_USER_PJRT_NPROC: str | None = os.environ.get("PJRT_NPROC")

# XLA:CPU sizes the pool its emulated devices share from PJRT_NPROC (else NPROC, else the core
# count), and never below the device count.  Eight threads per device: a device holds a pool thread
# for each collective it has started and not finished, and programs whose collectives sit in a
# while loop that runs asynchronously let a device start the next collective before the loop's
# have finished, so a device can hold more than one.
CPU_POOL_THREADS_PER_DEVICE = 8
_POOL_SIZE_ENV = ("PJRT_NPROC", "NPROC")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="


def emulated_cpu_devices(environ: dict | None = None) -> int:
  """The CPU device count the environment asks XLA for (1 when it asks for none)."""
  env = os.environ if environ is None else environ
  counts = [1]
  for flag in env.get("XLA_FLAGS", "").split():
    if flag.startswith(_DEVICE_COUNT_FLAG) and flag[len(_DEVICE_COUNT_FLAG) :].isdigit():
      counts = [int(flag[len(_DEVICE_COUNT_FLAG) :])]  # XLA takes the last one
  jax_count = env.get("JAX_NUM_CPU_DEVICES", "").strip()
  if jax_count.isdigit():
    counts.append(int(jax_count))
  return max(counts)


def cpu_pool_threads(environ: dict | None = None) -> int | None:
  """The XLA:CPU pool size :func:`apply` sets for the environment's emulated devices (None: leaves
  XLA's own, with one device or when the user has sized the pool)."""
  env = os.environ if environ is None else environ
  devices = emulated_cpu_devices(env)
  if devices <= 1 or any(env.get(name, "").strip() for name in _POOL_SIZE_ENV):
    return None
  return max(os.cpu_count() or 1, CPU_POOL_THREADS_PER_DEVICE * devices)


# XLA:CPU compiles the learner's programs (the score pass, the update) with its loop emitters
# rather than the MLIR fusion emitters.  At the Tunix benchmark shape the update compiles in 2.4 s
# instead of 3.8-4.2 s and the score pass in 0.36 s instead of 0.56-0.62 s, so the first step is ~2 s
# shorter; those two programs run ~2% longer (BUILD_NOTES, "The learner's programs on XLA:CPU's loop
# emitters").  The sampler keeps the fusion emitters: its decode step ran ~16% slower on the loop
# emitters.  A debug option of the CPU compiler, set per program (``jax.jit``'s ``compiler_options``).
CPU_LEARNER_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def learner_compiler_options(platform: str) -> dict | None:
  """``jax.jit``'s ``compiler_options`` for the learner's programs on ``platform`` (None: XLA's own)."""
  return dict(CPU_LEARNER_COMPILER_OPTIONS) if platform == "cpu" else None


def cpu_dots_choice(environ: dict | None = None) -> str | None:
  """``MIMO_JAX_CPU_DOTS`` as set (``eigen`` or ``ynn``, any case); None when unset or blank."""
  env = os.environ if environ is None else environ
  choice = env.get(CPU_DOTS_ENV, "").strip().lower() or None
  if choice is not None and choice not in CPU_DOTS_CHOICES:
    raise ValueError(
      f"{CPU_DOTS_ENV}={env[CPU_DOTS_ENV]!r} is not allowed; allowed values: {', '.join(CPU_DOTS_CHOICES)}"
    )
  return choice


def ynn_dots_compiler_options(platform: str) -> dict | None:
  """``jax.jit``'s ``compiler_options`` that give one program YNNPACK's products (XLA:CPU's own
  default) in a process whose default is Eigen's; None where the process's choice stands: not CPU,
  ``MIMO_JAX_CPU_DOTS`` set either way, or the user's own ``XLA_FLAGS`` naming the option (not the
  flag a parent mimo_jax process added, which its children inherit: :func:`user_xla_flags`)."""
  if platform != "cpu" or cpu_dots_choice() is not None or _YNN_FUSION_FLAG in (_USER_XLA_FLAGS or ""):
    return None
  return {_YNN_FUSION_FLAG: XLA_DEFAULT_YNN_FUSIONS}


def apply(environ: dict | None = None) -> list[str]:
  """Appends the default CPU flags to ``XLA_FLAGS`` (those the user has not set) and sizes
  XLA:CPU's pool for emulated devices (:func:`cpu_pool_threads`); returns the flags added."""
  env = os.environ if environ is None else environ
  choice = cpu_dots_choice(env) or "eigen"
  threads = cpu_pool_threads(env)
  if threads is not None:
    env["PJRT_NPROC"] = str(threads)
  if choice == "ynn":
    return []
  current = env.get("XLA_FLAGS", "")
  added = [f for f in CPU_DEFAULT_FLAGS if f.split("=", 1)[0] not in current]
  if added:
    env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    env[ADDED_FLAGS_ENV] = " ".join(sorted({*env.get(ADDED_FLAGS_ENV, "").split(), *added}))
  return added


def user_environ() -> dict:
  """This process's environment with ``XLA_FLAGS`` and ``PJRT_NPROC`` as the user set them: for
  programs that are not mimo-jax (a peer being measured), which should run on their own defaults."""
  env = dict(os.environ)
  env.pop(ADDED_FLAGS_ENV, None)
  for name, value in (("XLA_FLAGS", _USER_XLA_FLAGS), ("PJRT_NPROC", _USER_PJRT_NPROC)):
    if value is None:
      env.pop(name, None)
    else:
      env[name] = value
  return env
