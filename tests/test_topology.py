"""``--dry_run --dry_run_topology``: a pod's memory compiled by the real XLA:TPU compiler on this CPU host.

libtpu's compile-only topologies give TPU devices that programs compile for and never run on
(``make test`` installs libtpu off the import path, see ``mimo_jax/topology.py``).  The 13B flagfile
must fit a v5p-128 slice with the default headroom; an oversized batch must be refused by name.
"""

from __future__ import annotations

import json
import math
import os

import jax
import pytest

from mimo_jax.config_base import ConfigError
from mimo_jax.main import main, parse_config
from mimo_jax.topology import parse_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = os.path.join(ROOT, "experiments")


@pytest.mark.parametrize(
  "name, devices, chips, grid, gib",
  [
    ("v5p-128", 64, 64, (4, 4, 4), 95.0),  # 128 TensorCores, 2 per chip, one device per chip
    ("v5p-8", 4, 4, (2, 2, 1), 95.0),
    ("v4-8", 8, 4, (2, 2, 1), 16.0),  # libtpu's compile-only v4: one device per core
    ("v4-128", 128, 64, (4, 4, 4), 16.0),
    ("v5e-16", 16, 16, (4, 4), 16.0),
    ("v5e-8", 8, 8, (2, 4), 16.0),
    ("v6e-256", 256, 256, (16, 16), 32.0),
    ("v6e-1", 1, 1, (1, 1), 32.0),
  ],
)
def test_slice_names_map_to_the_compile_only_topologies(name, devices, chips, grid, gib):
  topo = parse_topology(name)
  assert (topo.platform, topo.devices, topo.chips, topo.grid, topo.device_gib) == ("tpu", devices, chips, grid, gib)
  assert topo.libtpu_name == f"{name.split('-')[0]}:{'x'.join(map(str, grid))}"


def test_bad_topology_names_are_refused_naming_the_flag_and_the_forms():
  for bad, message in [
    ("v5p", "must be <gen>-<n> for a TPU slice"),
    ("v7-8", "must be <gen>-<n>"),
    ("v5p-12", "n must give a power-of-two number of chips"),
    ("v4-3", "counts TensorCores"),
    ("gpu-4x80gb", "gpu-8x80gb, gpu-8x141gb"),
  ]:
    with pytest.raises(ConfigError, match=rf"--dry_run_topology=.*{message}"):
      parse_topology(bad)
  with pytest.raises(ConfigError, match="--dry_run_topology='v5p-8': needs --dry_run"):
    parse_config(["prog", "--dry_run_topology=v5p-8"])
  with pytest.raises(ConfigError, match="--dry_run_topology='tpu'"):
    parse_config(["prog", "--dry_run", "--dry_run_topology=tpu"])


@pytest.mark.slow
def test_grpo_13b_compiles_for_v5p_128_and_fits_with_headroom(tmp_path):
  from mimo_jax.train.dry_run import dry_run

  cfg = parse_config(
    ["prog", f"--flagfile={FLAGS}/grpo_13b.flags", "--dry_run", "--dry_run_topology=v5p-128", f"--run_dir={tmp_path}"]
  )
  report = dry_run(cfg)
  assert report["platform"] == "tpu" and report["devices"] == 64
  t = report["topology"]
  assert (t["name"], t["grid"], t["device_kind"], t["compiler"]) == (
    "v5p-128",
    "4x4x4",
    "TPU v5",
    "XLA:TPU (compile-only)",
  )
  assert report["mesh"] == {"data": 1, "fsdp": 16, "tensor": 4}
  # bf16 weights over 64 chips; the TPU compiler's own memory analysis for both programs.
  assert math.isclose(report["per_device_gib"]["params"], 13_015_864_320 * 2 / 64 / 1024**3, rel_tol=0.01)
  for name in ("learn", "generate"):
    m = report["compiled"][name]
    assert "refused_by_compiler" not in m and m["temp_gib"] > 0 and m["peak_gib"] > 0
  fit = report["fit"]
  assert fit["fits"] and fit["budget_gib"] == pytest.approx(95.0 * 0.9)
  assert fit["peak_gib"] <= fit["budget_gib"] and fit["free_gib"] > 0
  on_disk = json.load(open(tmp_path / "dry_run.json"))
  assert on_disk["topology"]["name"] == "v5p-128" and on_disk["fit"]["fits"]


@pytest.mark.slow
def test_an_oversized_batch_is_refused_naming_the_flag_and_the_overflow(tmp_path, capsys):
  """Materialised logits over a 256k vocabulary: the learner step overflows one v5e chip's budget."""
  argv = [
    "prog",
    f"--flagfile={FLAGS}/grpo_tiny.flags",
    "--model_preset=tiny",
    "--dry_run",
    "--dry_run_topology=v5e-1",
    "--prompts_per_step=64",
    "--num_samples=16",
    "--max_new_tokens=8",
    "--vocab_size=262144",
    "--logprob_impl=full",
    f"--run_dir={tmp_path}",
  ]
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert "error: --dry_run_topology=v5e-1: does not fit: the learn program needs" in err
  assert "GiB per device" in err and "over the 14.40 GiB usable (16.0 GiB less 10% headroom)" in err
  assert "change --grad_accum=1" in err and "raise --grad_accum to 2" in err
  report = json.load(open(tmp_path / "dry_run.json"))  # the report is written either way
  fit = report["fit"]
  assert not fit["fits"] and fit["program"] == "learn" and fit["peak_gib"] > fit["budget_gib"]


def test_the_grad_accum_advice_says_when_it_stops_the_learner_sharing_prompts():
  """A learn program over budget: the advice names the smallest --grad_accum that fits, and says when that
  value would make the learner run every row's own prompt, and which fitting value would not."""
  from jax.sharding import AbstractMesh

  from mimo_jax.train.dry_run import _fit
  from mimo_jax.train.learner import prompt_group

  def advice(mesh_shape, *flags):
    cfg = parse_config(["prog", *flags])
    mesh = AbstractMesh(mesh_shape, ("data", "fsdp", "tensor"))
    # The learn program 16 GiB against v5e-1's 14.4 usable, 10 of it activations: any larger --grad_accum fits.
    report = {
      "compiled": {"learn": {"peak_gib": 16.0, "temp_gib": 10.0}, "generate": {"peak_gib": 1.0}},
      "per_device_gib": {"params": 1.0, "kv_cache": 0.5},
      "mesh": dict(zip(mesh.axis_names, mesh_shape, strict=True)),
      "learner_prompt_group": prompt_group(cfg, mesh),
    }
    fit = _fit(cfg, parse_topology("v5e-1"), report, mesh)
    assert not fit["fits"]
    return fit["message"]

  # The 13B flagfile on its v5p-128 mesh shares at --grad_accum=1; at 2 its 64-row micro-batches are 8
  # groups over 16 batch shards, and no larger value shares either.
  said = advice((1, 16, 4), f"--flagfile={FLAGS}/grpo_13b.flags")
  assert (
    "raise --grad_accum to 2 (micro-batches of 64 rows instead of 128), though the learner then runs every " in said
  )
  assert "no longer split into whole groups of --num_samples=8 over the 16 batch shards)" in said
  assert "also fits" not in said
  # 6 prompts x 4 samples on 2 batch shards: 2 breaks the groups (3 per micro-batch), 3 keeps them (2).
  tiny = [f"--flagfile={FLAGS}/grpo_tiny.flags", "--prompts_per_step=6", "--num_samples=4", "--num_minibatches=1"]
  said = advice((2, 1, 1), *tiny, "--grad_accum=1")
  assert said.endswith("over the 2 batch shards); --grad_accum=3 also fits and runs each prompt once"), said
  # Nothing to lose where nothing is shared now, or where the larger value still shares.
  assert "own prompt" not in advice((2, 1, 1), *tiny, "--grad_accum=1", "--noshare_prompts")
  assert "own prompt" not in advice((1, 1, 1), *tiny, "--grad_accum=1")


def test_the_compilers_out_of_memory_refusal_is_read():
  from mimo_jax.train.dry_run import _compiler_refusal

  said = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (29.73G) "
    "exceeds available HBM (15.75G)."
  )
  r = _compiler_refusal(said)
  assert r["temp_gib"] == pytest.approx(29.73) and r["available_gib"] == pytest.approx(15.75)
  assert _compiler_refusal("RESOURCE_EXHAUSTED: Used 900.0M of 512.0M hbm.")["temp_gib"] == pytest.approx(900 / 1024)
  assert "temp_gib" not in _compiler_refusal("RESOURCE_EXHAUSTED: something else")


def test_two_processes_compile_for_a_tpu_slice_at_once():
  """The compile-only libtpu drives no chip, so a second process (a dry run beside another, or beside
  this test suite) loads it too: libtpu's one-process lock is waived for that copy."""
  import subprocess
  import sys

  code = (
    "import sys\nfrom mimo_jax.topology import parse_topology, topology_devices\n"
    "print('devices', len(topology_devices(parse_topology('v5e-4'))), flush=True)\nsys.stdin.read()\n"
  )
  env = {k: v for k, v in os.environ.items() if k not in ("TPU_LIBRARY_PATH", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
  first = subprocess.Popen(
    [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
  )
  try:
    assert first.stdout.readline().decode() == "devices 4\n"  # it holds libtpu until its stdin closes
    second = subprocess.run([sys.executable, "-c", code], env=env, input="", capture_output=True, text=True)
    assert second.returncode == 0 and second.stdout == "devices 4\n", second.stderr[-1500:]
  finally:
    first.stdin.close()
    first.wait(timeout=60)


def test_a_gpu_node_from_the_command_line_on_a_one_device_host(tmp_path):
  """The CLI on a host with one CPU device (not the tests' 8): the node's 8 stand-in devices are set
  before the CPU backend starts (once it has, JAX refuses the change)."""
  import subprocess
  import sys

  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  argv = [f"--flagfile={FLAGS}/grpo_tiny.flags", "--model_preset=tiny", "--dry_run"]
  argv += ["--dry_run_topology=gpu-8x80gb", f"--run_dir={tmp_path}"]
  out = subprocess.run([sys.executable, "-m", "mimo_jax.main", *argv], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "fits gpu-8x80gb" in out.stdout
  report = json.load(open(tmp_path / "dry_run.json"))
  assert report["devices"] == 8 and report["platform"] == "gpu" and report["mesh"]["fsdp"] == 8


def test_a_gpu_node_is_compiled_by_the_cpu_compiler_with_the_caveat_stated(tmp_path, capsys):
  from mimo_jax.train.dry_run import dry_run

  assert jax.device_count() == 8

  def cfg_argv(run_dir):
    return [
      "prog",
      f"--flagfile={FLAGS}/grpo_tiny.flags",
      "--model_preset=tiny",
      "--dry_run",
      "--dry_run_topology=gpu-8x80gb",
      f"--run_dir={run_dir}",
    ]

  cfg = parse_config(cfg_argv(tmp_path))
  report = dry_run(cfg)
  assert report["platform"] == "gpu" and report["topology"]["device_kind"] == "cpu"
  assert report["topology"]["device_memory_gib"] == pytest.approx(80e9 / 1024**3)
  assert "CPU compiler" in report["topology"]["caveat"] and report["fit"]["fits"]
  assert "caveat: compiled by the CPU compiler" in capsys.readouterr().out
  # The KV cache counted: a prompt's 10 slots once for its 8 rows, 6 completion slots per row (16
  # prompts x 8 rows); with --share_prompt_cache=false, 10 + 6 slots in every row.
  per_row = dry_run(parse_config([*cfg_argv(tmp_path), "--share_prompt_cache=false"]))
  kv, kv_per_row = report["per_device_gib"]["kv_cache"], per_row["per_device_gib"]["kv_cache"]
  assert kv / kv_per_row == pytest.approx((16 * 10 + 128 * 6) / (128 * (10 + 6)), rel=1e-9)
