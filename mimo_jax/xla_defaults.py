"""XLA:CPU settings the trainer ships with, applied when ``mimo_jax`` is imported.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, so these take effect when
``mimo_jax`` is imported before JAX's first computation (every entry point and the tests
do).  A flag the user already set in ``XLA_FLAGS`` is never overridden.

* ``--xla_cpu_experimental_ynn_fusion_type=-individual_dot``: matrix products outside a
  fusion run on XLA's Eigen kernels instead of YNNPACK's.  At this project's CPU shapes
  (batch-16 decode steps, the learner's [tokens x d_model] products) Eigen's were faster;
  the measurements are in BUILD_NOTES ("XLA:CPU matmul kernels").  It changes CPU results
  in the last bits (another summation order), never on GPU or TPU, where the flag does
  nothing.  ``MIMO_JAX_CPU_DOTS=ynn`` keeps XLA's default.

One setting is per program rather than per process (:func:`learner_compiler_options`): the
learner's programs compile on XLA:CPU with its loop emitters instead of the MLIR fusion emitters.
"""

from __future__ import annotations

import os

CPU_DOTS_ENV = "MIMO_JAX_CPU_DOTS"
_YNN_FUSION_FLAG = "xla_cpu_experimental_ynn_fusion_type"
CPU_DEFAULT_FLAGS = (f"--{_YNN_FUSION_FLAG}=-individual_dot",)

# XLA_FLAGS as the process found it, before :func:`apply` (None: unset).
_USER_XLA_FLAGS: str | None = os.environ.get("XLA_FLAGS")


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


def apply(environ: dict | None = None) -> list[str]:
  """Appends the default CPU flags to ``XLA_FLAGS`` (those the user has not set); returns
  the flags added."""
  env = os.environ if environ is None else environ
  choice = env.get(CPU_DOTS_ENV, "").strip().lower() or "eigen"
  if choice not in ("eigen", "ynn"):
    raise ValueError(f"{CPU_DOTS_ENV}={env[CPU_DOTS_ENV]!r} is not allowed; allowed values: eigen, ynn")
  if choice == "ynn":
    return []
  current = env.get("XLA_FLAGS", "")
  added = [f for f in CPU_DEFAULT_FLAGS if f.split("=", 1)[0] not in current]
  if added:
    env["XLA_FLAGS"] = " ".join([current, *added]).strip()
  return added


def user_environ() -> dict:
  """This process's environment with ``XLA_FLAGS`` as the user set it: for programs that are
  not mimo-jax (a peer being measured), which should run on their own defaults."""
  env = dict(os.environ)
  if _USER_XLA_FLAGS is None:
    env.pop("XLA_FLAGS", None)
  else:
    env["XLA_FLAGS"] = _USER_XLA_FLAGS
  return env
