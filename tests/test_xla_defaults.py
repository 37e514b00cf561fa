"""The XLA:CPU settings mimo_jax ships with (mimo_jax/xla_defaults.py)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mimo_jax  # noqa: F401  (applies the defaults)
from mimo_jax import xla_defaults

FLAG = "--xla_cpu_experimental_ynn_fusion_type=-individual_dot"


def test_the_default_is_in_effect_in_this_process():
  """Importing mimo_jax set the flag before the backend started: a compiled CPU matmul is
  not handed to YNNPACK (with XLA's default it is a __ynn_fusion)."""
  assert FLAG in os.environ["XLA_FLAGS"]
  compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((16, 64)), jnp.ones((64, 32))).compile()
  assert "__ynn_fusion" not in compiled.as_text()


def test_xla_default_kernels_when_asked_for_in_a_fresh_process():
  """MIMO_JAX_CPU_DOTS=ynn keeps XLA's default, and there the same matmul is a YNNPACK fusion,
  so the check above can tell the two apart."""
  code = (
    "import mimo_jax, os, jax, jax.numpy as jnp; "
    "c = jax.jit(lambda a, b: a @ b).lower(jnp.ones((16, 64)), jnp.ones((64, 32))).compile(); "
    "print('ynn' in os.environ.get('XLA_FLAGS', ''), '__ynn_fusion' in c.as_text())"
  )
  env = {**os.environ, "MIMO_JAX_CPU_DOTS": "ynn", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
  assert out.stdout.split() == ["False", "True"]


_PROGRAM_CODE = """
import re, jax, jax.numpy as jnp

def program(x, w, w2):
  h = x @ w
  y = (jnp.maximum(h, 0) * h) @ w2
  return y, jnp.sum(jnp.exp(y), axis=1), jnp.tanh(x) + 1

def compiled_text(options):
  args = (jnp.ones((64, 256)), jnp.ones((256, 1024)), jnp.ones((1024, 256)))
  text = jax.jit(program, compiler_options=options).lower(*args).compile().as_text()
  text = text[text.index("\\n%") :]  # from the first computation: the source locations differ
  return "\\n".join(re.sub(r", metadata=\\{.*?\\}", "", line) for line in text.splitlines())
"""


def test_the_per_program_option_is_xlas_own_default_written_out():
  """ynn_dots_compiler_options gives one program what XLA compiles without our flag (the option
  replaces XLA's whole list, so the list is written out): the same program text as a fresh process
  with MIMO_JAX_CPU_DOTS=ynn, products handed to YNNPACK; without it, this process's program differs."""
  namespace: dict = {}
  exec(_PROGRAM_CODE, namespace)
  options = xla_defaults.ynn_dots_compiler_options("cpu")
  assert options == {"xla_cpu_experimental_ynn_fusion_type": xla_defaults.XLA_DEFAULT_YNN_FUSIONS}
  here, eigen = namespace["compiled_text"](options), namespace["compiled_text"](None)
  precision = jax.config.jax_default_matmul_precision  # the suite's (conftest)
  code = f"import mimo_jax, jax\njax.config.update('jax_default_matmul_precision', {precision!r})\n"
  code += _PROGRAM_CODE + "\nprint(compiled_text(None), end='')"
  env = {**os.environ, "MIMO_JAX_CPU_DOTS": "ynn", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  env.pop("PJRT_NPROC", None)
  fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
  assert here == fresh.stdout
  assert "__ynn_fusion" in here and here != eigen


def test_the_per_program_option_only_where_the_process_has_not_chosen(monkeypatch):
  assert xla_defaults.ynn_dots_compiler_options("tpu") is None and xla_defaults.ynn_dots_compiler_options("gpu") is None
  for choice in ("eigen", "ynn", "Eigen "):
    monkeypatch.setenv("MIMO_JAX_CPU_DOTS", choice)
    assert xla_defaults.ynn_dots_compiler_options("cpu") is None
  monkeypatch.setenv("MIMO_JAX_CPU_DOTS", "")
  assert xla_defaults.ynn_dots_compiler_options("cpu") is not None
  monkeypatch.setattr(xla_defaults, "_USER_XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FLAG}")
  assert xla_defaults.ynn_dots_compiler_options("cpu") is None
  monkeypatch.setenv("MIMO_JAX_CPU_DOTS", "mkl")
  with pytest.raises(ValueError, match=r"MIMO_JAX_CPU_DOTS='mkl'.*allowed values: eigen, ynn"):
    xla_defaults.ynn_dots_compiler_options("cpu")


def test_a_child_process_tells_the_flag_its_parent_added_from_the_users():
  """Processes mimo_jax starts (mimo_jax.launch, the sweep runner, tests) inherit the XLA_FLAGS their parent
  extended; the parent lists what it added (MIMO_JAX_ADDED_XLA_FLAGS), so the child still takes the
  per-program option, while the same flag set by the user, unlisted, still blocks it."""
  assert FLAG in os.environ[xla_defaults.ADDED_FLAGS_ENV].split()
  inherited = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FLAG}", xla_defaults.ADDED_FLAGS_ENV: FLAG}
  assert xla_defaults.user_xla_flags(inherited) == "--xla_force_host_platform_device_count=4"
  assert xla_defaults.user_xla_flags({"XLA_FLAGS": FLAG}) == FLAG
  assert xla_defaults.user_xla_flags({}) is None
  code = (
    "import mimo_jax; from mimo_jax import xla_defaults as x; print(x.ynn_dots_compiler_options('cpu') is not None)"
  )
  run = {**os.environ}
  run.pop("MIMO_JAX_CPU_DOTS", None)
  child = subprocess.run([sys.executable, "-c", code], env=run, capture_output=True, text=True, timeout=300, check=True)
  users = {k: v for k, v in run.items() if k != xla_defaults.ADDED_FLAGS_ENV}  # the same flag, unlisted
  own = subprocess.run([sys.executable, "-c", code], env=users, capture_output=True, text=True, timeout=300, check=True)
  assert (child.stdout.split(), own.stdout.split()) == (["True"], ["False"])
  # A peer gets neither the flag nor the list.
  assert xla_defaults.ADDED_FLAGS_ENV not in xla_defaults.user_environ()


def test_apply_adds_only_what_the_user_has_not_set():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert xla_defaults.apply(env) == [FLAG]
  assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {FLAG}"
  assert xla_defaults.apply(env) == []  # idempotent
  assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1
  own = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=-reduce"}
  assert xla_defaults.apply(own) == [] and own["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=-reduce"
  empty: dict = {}
  assert xla_defaults.apply(empty) == [FLAG] and empty["XLA_FLAGS"] == FLAG
  opted_out = {"MIMO_JAX_CPU_DOTS": "ynn"}
  assert xla_defaults.apply(opted_out) == [] and "XLA_FLAGS" not in opted_out


def test_a_bad_choice_is_refused_naming_the_variable_and_the_allowed_values():
  with pytest.raises(ValueError, match=r"MIMO_JAX_CPU_DOTS='mkl'.*allowed values: eigen, ynn"):
    xla_defaults.apply({"MIMO_JAX_CPU_DOTS": "mkl"})
  # Empty means the default; the case does not matter.
  blank = {"MIMO_JAX_CPU_DOTS": " "}
  assert xla_defaults.apply(blank) == [FLAG]
  upper = {"MIMO_JAX_CPU_DOTS": "YNN"}
  assert xla_defaults.apply(upper) == [] and "XLA_FLAGS" not in upper


def test_a_peer_measured_beside_mimo_jax_gets_the_users_xla_flags(monkeypatch):
  """bench.grpo_step runs Tunix with user_environ(): XLA_FLAGS as the process found it,
  without what importing mimo_jax added."""
  monkeypatch.setattr(xla_defaults, "_USER_XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=2 {FLAG}")
  env = xla_defaults.user_environ()
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2" and env["PATH"] == os.environ["PATH"]
  monkeypatch.setattr(xla_defaults, "_USER_XLA_FLAGS", None)
  assert "XLA_FLAGS" not in xla_defaults.user_environ()


def test_the_learners_programs_compile_on_the_loop_emitters_on_cpu_only():
  """The learner's programs take XLA:CPU's loop emitters (a shorter compilation); other platforms get XLA's
  own options.  XLA accepts the option per program, and a product of the learner's kind compiled with it
  computes what the fusion emitters compute (a renamed or dropped option would fail to compile here)."""
  assert xla_defaults.learner_compiler_options("cpu") == {"xla_cpu_use_fusion_emitters": False}
  assert xla_defaults.learner_compiler_options("tpu") is None and xla_defaults.learner_compiler_options("gpu") is None

  def swiglu_loss(x, w_gate, w_up):
    return jnp.mean(jax.nn.silu(x @ w_gate) * (x @ w_up))

  keys = jax.random.split(jax.random.key(0), 3)
  args = (
    jax.random.normal(keys[0], (96, 64)),
    jax.random.normal(keys[1], (64, 128)),
    jax.random.normal(keys[2], (64, 128)),
  )
  grad = jax.value_and_grad(swiglu_loss, argnums=(1, 2))
  default = jax.jit(grad)(*args)
  loop = jax.jit(grad, compiler_options=xla_defaults.learner_compiler_options("cpu"))(*args)
  for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(loop), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def _xla_pool_threads() -> int:
  """Threads of XLA:CPU's intra-op pool in this process (TSL names them ``..XLAEigen``)."""
  names = []
  for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
      names.append(f.read().strip())
  return sum("XLAEigen" in name for name in names)


def test_the_emulated_devices_pool_has_eight_threads_per_device_in_this_process():
  """The suite runs on 8 emulated devices (conftest), so importing mimo_jax sized XLA:CPU's pool at
  64 threads before the backend started; XLA's own size would be max(cores, devices) = 8 here."""
  jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(4)))  # the backend is up
  assert jax.device_count() == 8
  expected = max(64, os.cpu_count() or 1)
  assert os.environ["PJRT_NPROC"] == str(expected) and _xla_pool_threads() == expected


def test_the_pool_is_sized_only_for_several_emulated_devices_and_never_over_the_user():
  many = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  xla_defaults.apply(many)
  assert many["PJRT_NPROC"] == str(max(64, os.cpu_count() or 1))
  # XLA takes the last device-count flag; JAX's own setting counts too.
  assert (
    xla_defaults.emulated_cpu_devices(
      {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_force_host_platform_device_count=2"}
    )
    == 2
  )
  assert xla_defaults.emulated_cpu_devices({"JAX_NUM_CPU_DEVICES": "4"}) == 4
  assert xla_defaults.emulated_cpu_devices({}) == 1
  for env in (
    {},
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "12"},
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "3"},
  ):
    before = env.get("PJRT_NPROC")
    xla_defaults.apply(env)
    assert env.get("PJRT_NPROC") == before
  # The choice of matmul kernels does not change it.
  ynn = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "MIMO_JAX_CPU_DOTS": "ynn"}
  xla_defaults.apply(ynn)
  assert ynn["PJRT_NPROC"] == str(max(16, os.cpu_count() or 1))


def test_a_peer_does_not_inherit_the_pool_size(monkeypatch):
  monkeypatch.setattr(xla_defaults, "_USER_PJRT_NPROC", None)
  monkeypatch.setenv("PJRT_NPROC", "64")
  assert "PJRT_NPROC" not in xla_defaults.user_environ()
  monkeypatch.setattr(xla_defaults, "_USER_PJRT_NPROC", "5")
  assert xla_defaults.user_environ()["PJRT_NPROC"] == "5"
