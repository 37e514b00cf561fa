"""The sweep runner: coupling rules (golden values), the gate, the plan's checks, and a real sweep killed
mid-run and continued by the same command."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from mimo_jax.config import ConfigError
from mimo_jax.files import read_jsonl
from mimo_jax.main import parse_config
from mimo_jax.sweep import coupling
from mimo_jax.sweep.gate import gate_verdict
from mimo_jax.sweep.report import _point_stats, axis_groups, judge_axis
from mimo_jax.sweep.runner import Sweep, parse_axis, parse_seeds, point_name, read_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
# Tiny points: one-digit additions after a short warm start, so that a few completions are right and the
# batch reward moves (the gate's "flat" test has something to pass).
SMALL = [
  "--model_preset=tiny",
  "--arith_levels=1",
  "--sft_steps=150",
  "--sft_batch_size=32",
  "--max_steps=6",
  "--prompts_per_step=8",
  "--num_samples=8",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--eval_every=3",
  "--checkpoint_every=2",
  "--max_new_tokens=6",
  "--alarm_window=2",
]

# Hand count of the tiny preset (d 64, 4 heads of 16, 2 KV heads, MLP 128): per layer q and o 64*64
# each, k and v 64*32 each, MLP 3*64*128, two norms 2*64; the final norm 64 (the embeddings, 2*256*64,
# are not counted: the rules scale with the non-embedding size).
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64


def _cfg(*flags):
  return parse_config(["prog", f"--flagfile={BASE}", "--model_preset=tiny", *flags])


# --- coupling: golden values ------------------------------------------------------------------------------


def test_model_size_rules_follow_the_hand_counted_parameter_ratio():
  base, point = _cfg("--entropy_coef=0.01"), _cfg("--entropy_coef=0.01", "--num_layers=6")
  r = (6 * LAYER + 64) / (2 * LAYER + 64)  # non-embedding: the layers and the final norm
  assert coupling.model_size_ratio(base, point) == pytest.approx(r)
  coupled, changes = coupling.couple(base, point, fixed={"num_layers"})
  by_flag = {c.flag: c for c in changes}
  lr = float(f"{2e-4 * r**-0.5:.4g}")
  assert by_flag["learning_rate"].after == lr == coupled.optim.learning_rate
  assert by_flag["kl_coef"].after == float(f"{0.001 / r:.4g}") == coupled.algo.kl_coef
  assert by_flag["entropy_coef"].after == float(f"{0.01 * r ** math.log2(1.3):.4g}")
  # The clip follows the coupled learning rate: 1.0 x (lr / 2e-4).
  assert by_flag["grad_clip"].after == float(f"{lr / 2e-4:.4g}")
  assert [c.rule for c in changes] == [
    "lr_with_model_size",
    "kl_with_model_size",
    "entropy_with_model_size",
    "grad_clip_with_learning_rate",
  ]
  assert "parameters x" in by_flag["learning_rate"].why


def test_the_reports_doubling_numbers():
  # Report 000, section 5, x2 model: LR 1.5e-5 -> 1.0e-5 (the square-root rule: 1.06e-5), KL 0.02 -> 0.01,
  # entropy 0.01 -> 0.013. Report 000, section 3.4: a doubled rollout batch raises the LR about 20%.
  assert 1.5e-5 * 2**-0.5 == pytest.approx(1.0607e-5, rel=1e-4)
  assert 0.02 / 2 == 0.01 and 0.01 * 2 ** math.log2(1.3) == pytest.approx(0.013)
  base = _cfg("--learning_rate=1e-4")
  twice = _cfg("--learning_rate=1e-4", "--prompts_per_step=32")  # 16 -> 32 prompts x 8 samples
  _, changes = coupling.couple(base, twice, fixed={"prompts_per_step"})
  assert [(c.flag, c.after) for c in changes] == [("learning_rate", 1.2e-4), ("grad_clip", 1.2)]
  four = _cfg("--learning_rate=1e-4", "--prompts_per_step=16", "--num_samples=32")  # x4
  _, changes = coupling.couple(base, four, fixed={"num_samples"})
  assert changes[0].after == pytest.approx(1.44e-4)


def test_no_rule_touches_a_flag_the_axis_sets_and_zero_stays_zero():
  base, point = _cfg(), _cfg("--num_layers=4", "--learning_rate=1e-3")
  coupled, changes = coupling.couple(base, point, fixed={"num_layers", "learning_rate"})
  assert coupled.optim.learning_rate == 1e-3 and "learning_rate" not in {c.flag for c in changes}
  assert {c.flag for c in changes} == {"kl_coef", "grad_clip"}  # entropy_coef 0 in the base: no bonus added
  assert coupled.optim.grad_clip == 5.0  # the clip follows the axis's learning rate (x5)
  # An adaptive KL controller's bounds hold the coupled coefficient.
  adaptive = ["--kl_controller=adaptive", "--kl_coef=0.001", "--kl_coef_min=0.0008"]
  _, changes = coupling.couple(_cfg(*adaptive), _cfg(*adaptive, "--num_layers=8"), fixed={"num_layers"})
  assert {c.flag: c.after for c in changes}["kl_coef"] == 0.0008
  # So does the adaptive entropy controller's upper bound (above it the point's config was refused, and
  # with it the whole sweep at planning).
  adaptive = ["--entropy_controller=adaptive", "--entropy_coef=0.04"]
  coupled, changes = coupling.couple(_cfg(*adaptive), _cfg(*adaptive, "--num_layers=8"), fixed={"num_layers"})
  assert {c.flag: c.after for c in changes}["entropy_coef"] == 0.05 == coupled.algo.entropy_coef_max


# --- the gate ------------------------------------------------------------------------------------------------


def _records(rewards, **extra):
  return [
    {"step": i + 1, "reward_mean": r, "loss": 0.1, "kl_k3": 0.01, "frac_groups_all_equal": 0.5, **extra}
    for i, r in enumerate(rewards)
  ]


def test_the_gate_names_each_failure():
  assert gate_verdict(_records([0.1, 0.2, 0.15]), [], 3).verdict == "pass"
  nan = _records([0.1, float("nan"), 0.2])
  assert gate_verdict(nan, [], 3).verdict == "nan" and "reward_mean" in gate_verdict(nan, [], 3).detail
  skipped = _records([0.1, 0.2, 0.3])
  skipped[1]["skipped"] = 1.0
  assert gate_verdict(skipped, [], 3).verdict == "nan"
  flat = gate_verdict(_records([0.0, 0.0, 0.0], frac_groups_all_equal=1.0), [], 3)
  assert flat.verdict == "flat" and "zero advantages" in flat.detail
  uniform = _records([0.1, 0.2, 0.3], frac_groups_all_equal=1.0)  # rewards differ between steps only
  assert gate_verdict(uniform, [], 3).verdict == "flat"
  # A sparse reward that happens to repeat is not flat while some group's samples differ.
  assert gate_verdict(_records([1 / 64, 1 / 64]), [], 2).verdict == "pass"
  unlogged = [{k: v for k, v in r.items() if k != "frac_groups_all_equal"} for r in _records([0.2, 0.2])]
  assert gate_verdict(unlogged, [], 2).verdict == "flat"
  small = gate_verdict(_records([0.1, 0.11, 0.1]), [], 3, min_reward_change=0.05)
  assert small.verdict == "flat" and "--gate_min_reward_change" in small.detail
  alarm = [{"step": 2, "kind": "kl_blowup", "evidence": {"kl_k3": 3.0}}]
  v = gate_verdict(_records([0.1, 0.2, 0.3]), alarm, 3)
  assert v.verdict == "alarm" and "kl_blowup at RL step 2" in v.detail
  late = [{"step": 9, "kind": "kl_blowup", "evidence": {}}, {"step": 2, "kind": "length_explosion", "evidence": {}}]
  assert gate_verdict(_records([0.1, 0.2, 0.3]), late, 3).verdict == "pass"
  assert gate_verdict(_records([0.1, 0.2]), [], 3).verdict == "incomplete"
  # SFT records (no reward) and the warm start's evaluation are not gate steps.
  mixed = [{"step": 1, "sft_loss": 2.0}, {"step": 0, "eval/greedy_accuracy": 0.1}, *_records([0.1, 0.3])]
  assert gate_verdict(mixed, [], 2).verdict == "pass"


# --- the plan ------------------------------------------------------------------------------------------------


def test_axes_and_seeds_are_parsed_with_named_errors():
  a = parse_axis("prompts_per_step:max_steps=8:800,16:400")
  assert a.flags == ("prompts_per_step", "max_steps") and a.values == (("8", "800"), ("16", "400"))
  for text, match in (
    ("learning_rat=1e-4,2e-4", "--learning_rat is not a trainer flag.*--learning_rate"),
    ("seed=1,2", "set by the sweep itself"),
    ("learning_rate", "expected NAME=v1,v2"),
    ("prompts_per_step:max_steps=8:800,16", "needs 2 part"),
    ("learning_rate=1e-4,1e-4", "appears twice"),
  ):
    with pytest.raises(ConfigError, match=match):
      parse_axis(text)
  assert parse_seeds("3") == 3 and parse_seeds("0,5") == (0, 5)
  with pytest.raises(ConfigError, match="--seeds=0"):
    parse_seeds("0")


def test_points_one_axis_at_a_time_or_as_a_grid(tmp_path):
  axes = [parse_axis("learning_rate=2e-4,4e-4"), parse_axis("num_layers=1,2,3")]
  sweep = Sweep(base=BASE, axes=axes, out=str(tmp_path), extra=["--model_preset=tiny"], num_devices=8)
  # 2e-4 is the base's learning rate and 2 the tiny preset's layers: both are the base point, run once.
  assert sweep.points() == [{}, {"learning_rate": "4e-4"}, {"num_layers": "1"}, {"num_layers": "3"}]
  members = {point_name(p): m for p, m, _ in sweep._resolve()}
  assert members["base"] == [("learning_rate", 0), ("num_layers", 1)]
  assert members["num_layers=3"] == [("num_layers", 2)]
  grid = Sweep(base=BASE, axes=axes, out=str(tmp_path), extra=["--model_preset=tiny"], grid=True, num_devices=8)
  assert len(grid.points()) == 6
  runs = Sweep(
    base=BASE, axes=axes[1:], out=str(tmp_path), seeds=2, extra=["--model_preset=tiny"], gate_steps=0, num_devices=8
  ).plan()
  assert [r.name for r in runs] == [f"{p}-seed{s}" for s in (0, 1) for p in ("base", "num_layers=1", "num_layers=3")]
  bigger = runs[2]
  assert {c.flag for c in bigger.changes} == {"learning_rate", "kl_coef", "grad_clip"}
  assert f"--learning_rate={bigger.cfg.optim.learning_rate:.4g}" in bigger.argv


def test_no_rule_changes_a_flag_the_points_axes_set_even_to_the_bases_value(tmp_path):
  """A grid of size x learning rate: the cell at the base's learning rate runs at it (the rule scaled it
  down with the size, so that column held two learning rates); a joint axis that sets the base's learning
  rate beside a smaller batch keeps it too.  Flags no axis sets are still coupled."""
  axes = [parse_axis("num_layers=3,6"), parse_axis("learning_rate=2e-4,4e-4")]
  runs = Sweep(base=BASE, axes=axes, out=str(tmp_path / "g"), grid=True, gate_steps=0, num_devices=8).plan()
  by_name = {r.point: r for r in runs}
  assert by_name["num_layers=6"].cfg.optim.learning_rate == 2e-4  # the demo preset's 3 layers at 2e-4: base
  assert by_name["num_layers=6,learning_rate=4e-4"].cfg.optim.learning_rate == 4e-4
  assert {c.flag for c in by_name["num_layers=6"].changes} == {"kl_coef"}  # coupled: no axis sets it
  joint = [parse_axis("prompts_per_step:learning_rate=8:2e-4,32:3e-4")]
  runs = Sweep(base=BASE, axes=joint, out=str(tmp_path / "j"), gate_steps=0, num_devices=8).plan()
  smaller = next(r for r in runs if r.point == "prompts_per_step=8")
  assert smaller.cfg.optim.learning_rate == 2e-4 and smaller.changes == ()


def test_an_interrupt_between_two_trainers_starts_no_other(tmp_path, monkeypatch):
  """A Ctrl-C or SIGTERM that lands while no trainer runs (the gate's verdict being read) starts no long
  run (it started, ignored the signal and ran to its end); one that lands while a trainer starts is passed
  on to it once it exists."""
  from mimo_jax.sweep import runner
  from mimo_jax.sweep.gate import Verdict

  sweep = Sweep(
    base=BASE, axes=[parse_axis("learning_rate=4e-4")], out=str(tmp_path), gate_steps=2, num_devices=8,
    share_warm_start=False,
  )  # fmt: skip
  started, signals = [], []

  class Trainer:  # stands in for the trainer's process: exits 0 at once
    def __init__(self, argv, **kwargs):
      started.append("gate" if any(a.startswith("--stop_at_step") for a in argv) else "long run")
      if len(started) == hook_at:
        sweep._interrupt(signal.SIGTERM, None)  # the signal arrives while the process starts

    def wait(self):
      return 0

    def poll(self):
      return 0

    def send_signal(self, sig):
      signals.append(sig)

  def verdict(*args, **kwargs):
    sweep._interrupt(signal.SIGTERM, None)  # the signal arrives between the two trainers
    return Verdict("pass", "ok", 2)

  monkeypatch.setattr(runner.subprocess, "Popen", Trainer)
  monkeypatch.setattr(runner, "gate_verdict", verdict)
  run = sweep.plan()[0]
  for sub in ("state", "logs"):
    os.makedirs(tmp_path / sub, exist_ok=True)
  hook_at = 0
  assert sweep._run_one(run) is None and started == ["gate"] and signals == []
  sweep._interrupted, started[:] = False, []
  hook_at = 1
  assert sweep._run_one(run) is None and started == ["long run"] and signals == [signal.SIGTERM]


def test_planning_leaves_the_accelerators_to_the_trainers(tmp_path):
  """The sweep's own process plans its runs for the host's device count without starting a JAX backend
  (started there, it kept a GPU's preallocated memory or a TPU's chips under every trainer it ran)."""
  code = (
    "import sys; from mimo_jax.sweep.runner import Sweep, parse_axis; from jax._src import xla_bridge\n"
    f"runs = Sweep(base={BASE!r}, axes=[parse_axis('num_layers=1')], out={str(tmp_path)!r}).plan()\n"
    "print(len(runs), sorted(xla_bridge._backends))"
  )
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split("\n")[-2] == "2 []"


def test_the_runs_of_a_seed_with_one_warm_start_share_it(tmp_path, capsys):
  """An RL axis shares its seed's warm start; a model-size point trains its own (alone in its group)."""
  from mimo_jax.sweep.__main__ import main

  axes = [parse_axis("learning_rate=4e-4,8e-4"), parse_axis("num_layers=1")]
  sweep = Sweep(base=BASE, axes=axes, out=str(tmp_path), seeds=2, extra=["--model_preset=tiny"], num_devices=8)
  runs = sweep.plan()
  shared = sweep.shared_warm_starts(runs)
  for seed in (0, 1):
    takers = sorted(n for n in shared if n.endswith(f"-seed{seed}"))
    assert takers == [f"{p}-seed{seed}" for p in ("base", "learning_rate=4e-4", "learning_rate=8e-4")]
    (source,) = {shared[n] for n in takers}
    assert os.path.dirname(source) == str(tmp_path / "warm_starts")
    assert os.path.basename(source).startswith(f"seed{seed}-")
  assert len(set(shared.values())) == 2 and "num_layers=1-seed0" not in shared
  assert (
    main(
      [f"--base={BASE}", "--axis=learning_rate=4e-4", f"--out={tmp_path / 'p'}", "--plan", "--", "--model_preset=tiny"]
    )
    == 0
  )
  assert capsys.readouterr().out.count("takes the shared warm start") == 2
  assert (
    main([f"--base={BASE}", "--axis=learning_rate=4e-4", f"--out={tmp_path / 'p'}", "--plan", "--no_shared_warm_start"])
    == 0
  )
  assert "takes the shared warm start" not in capsys.readouterr().out


def test_an_invalid_point_fails_the_sweep_before_anything_runs(tmp_path, capsys):
  from mimo_jax.sweep.__main__ import main

  out = tmp_path / "sweep"
  rc = main([f"--base={BASE}", "--axis=num_kv_heads=1,3", f"--out={out}", "--", "--model_preset=tiny"])
  err = capsys.readouterr().err
  assert rc == 2 and "sweep point num_kv_heads=3: " in err and "--num_kv_heads=3" in err
  assert not out.exists()
  assert main([f"--base={BASE}", "--axis=num_layers=1", f"--out={out}", "--gate_steps=20", "--", "--max_steps=10"]) == 2
  assert "--gate_steps=20: must be below the point's --max_steps=10" in capsys.readouterr().err
  assert main([f"--base={BASE}", "--axis=num_layers=1", f"--out={out}", "--", "--run_dir=/x"]) == 2
  assert "--run_dir is set by the sweep itself" in capsys.readouterr().err


@pytest.mark.parametrize("line", ["--stop_at_step=30", "--rollback_to=5", "--mode=smoke", "--dry_run", "--overwrite"])
def test_a_base_flagfile_that_sets_what_the_sweep_decides_is_refused(tmp_path, line):
  # A --stop_at_step there outlived the gate's: the long run stopped at it, without a summary, every time.
  base = tmp_path / "base.flags"
  base.write_text(open(BASE).read() + line + "\n")
  flag = line.lstrip("-").partition("=")[0]
  with pytest.raises(ConfigError, match=f"--base=.*: --{flag}=.* there is set by the sweep itself"):
    Sweep(base=str(base), axes=[parse_axis("num_layers=1")], out=str(tmp_path / "sweep"), num_devices=8)


def test_a_rerun_with_another_definition_is_refused(tmp_path):
  sweep = Sweep(base=BASE, axes=[parse_axis("num_layers=1")], out=str(tmp_path), gate_steps=0, num_devices=8)
  sweep._claim()
  other = Sweep(base=BASE, axes=[parse_axis("num_layers=3")], out=str(tmp_path), gate_steps=0, num_devices=8)
  with pytest.raises(ConfigError, match="holds another sweep.*axes"):
    other._claim()
  sweep._claim()  # the same sweep again: accepted
  # The same definition whose plan changed (here: another command for the run) is refused too.
  runs = sweep.plan()
  fresh = tmp_path / "fresh"
  Sweep(base=BASE, axes=[parse_axis("num_layers=1")], out=str(fresh), gate_steps=0, num_devices=8)._claim(runs)
  changed = [dataclasses.replace(runs[0], argv=(*runs[0].argv, "--kl_coef=0.5"))]
  with pytest.raises(ConfigError, match="plans run base-seed0 differently"):
    Sweep(base=BASE, axes=[parse_axis("num_layers=1")], out=str(fresh), gate_steps=0, num_devices=8)._claim(changed)


def test_an_extended_sweeps_report_orders_the_new_axis_as_a_fresh_sweep_does(tmp_path):
  """The base ran in a sweep over model size; the sweep is then extended by a rollout-batch axis around
  the base's 16 prompts.  Its report orders that axis 8, base, 32, and judges it as the same sweep run
  afresh does (the base row kept its old memberships and went first: "saturated at base" read as a
  smaller setting that was worse)."""
  from mimo_jax.files import read_json

  finals = {"base": 0.60, "prompts_per_step=8": 0.30, "prompts_per_step=32": 0.61}
  verdicts = []
  for out, extend in ((tmp_path / "extended", True), (tmp_path / "fresh", False)):

    def sweep(*axes, out=out):
      return Sweep(base=BASE, axes=[parse_axis(a) for a in axes], out=str(out), gate_steps=0, num_devices=8)

    def record(s, runs):
      summary = {"final": {"greedy_accuracy": 0.0}, "warm_start": {"greedy_accuracy": 0.2}, "compute": {}}
      for r in runs:
        summary["final"]["greedy_accuracy"] = finals.get(r.point, 0.5)
        s._write_row(r, {}, status="done", summary=summary)

    if extend:
      first = sweep("num_layers=1,4")
      plan = first.plan()
      first._claim(plan)
      record(first, plan)
    wider = sweep("num_layers=1,4", "prompts_per_step=8,16,32")
    plan = wider.plan()
    wider._claim(plan)
    done = {r["run"] for r in read_results(str(out))}
    record(wider, [r for r in plan if r.name not in done])
    rows = read_results(str(out))
    groups = dict(axis_groups(read_json(str(out / "sweep.json")), rows))
    assert groups["prompts_per_step"] == ["prompts_per_step=8", "base", "prompts_per_step=32"], out
    by_point = {}
    for r in rows:
      by_point.setdefault(r["point"], []).append(r)
    verdicts.append(
      judge_axis("prompts_per_step", [(p, _point_stats(by_point[p])) for p in groups["prompts_per_step"]])
    )
  assert verdicts[0] == verdicts[1]


def test_a_sweep_can_be_extended_by_axes_and_seeds_that_keep_its_recorded_runs(tmp_path, capsys):
  """More axes or seeds in the same --out reuse the recorded runs (the base's first); any other change is refused."""

  def sweep(*axes, seeds=1):
    return Sweep(
      base=BASE, axes=[parse_axis(a) for a in axes], out=str(tmp_path), seeds=seeds, gate_steps=0, num_devices=8
    )

  first = sweep("num_layers=1")
  first._claim(first.plan())
  wider = sweep("num_layers=1", "advantage=grpo,reinforce_baseline", seeds=2)
  plan = wider.plan()
  wider._claim(plan)
  assert "extends the recorded sweep (axes, seeds): 4 run(s) added, 2 recorded run(s) reused" in capsys.readouterr().out
  recorded = json.load(open(tmp_path / "sweep.json"))
  assert [a["flags"] for a in recorded["axes"]] == [["num_layers"], ["advantage"]] and recorded["seeds"] == [0, 1]
  assert set(recorded["commands"]) == {r.name for r in plan} >= {"base-seed0", "num_layers=1-seed0"}
  wider._claim(plan)  # the extended sweep's own rerun: accepted, nothing more said
  assert "extends" not in capsys.readouterr().out
  # Going back to the smaller sweep, changing a recorded axis, or an extension that plans a recorded run
  # differently is refused.
  with pytest.raises(ConfigError, match="holds another sweep.*axes"):
    first._claim(first.plan())
  changed = sweep("num_layers=3", "advantage=grpo,reinforce_baseline", "num_kv_heads=1", seeds=2)
  with pytest.raises(ConfigError, match="holds another sweep.*axes"):
    changed._claim(changed.plan())
  third = sweep("num_layers=1", "advantage=grpo,reinforce_baseline", "num_kv_heads=1", seeds=2)
  moved = [
    dataclasses.replace(r, argv=(*r.argv, "--kl_coef=0.5")) if r.name == "base-seed1" else r for r in third.plan()
  ]
  with pytest.raises(ConfigError, match="holds another sweep.*axes"):
    third._claim(moved)
  third._claim(third.plan())
  assert "2 run(s) added, 6 recorded run(s) reused" in capsys.readouterr().out


def _stats(finals):
  return {
    "final_median": sorted(finals)[len(finals) // 2],
    "final_min": min(finals),
    "final_max": max(finals),
    "done": len(finals),
  }


def test_the_report_orders_each_axis_and_says_what_paid():
  rows = [
    {"point": "base", "members": [["num_layers", 1]]},
    {"point": "num_layers=4", "members": [["num_layers", 2]]},
    {"point": "num_layers=1", "members": [["num_layers", 0]]},
    {"point": "learning_rate=4e-4", "members": [["learning_rate", 0]]},
  ]
  definition = {"axes": [{"flags": ["num_layers"]}, {"flags": ["learning_rate"]}]}
  assert axis_groups(definition, rows) == [
    ("num_layers", ["num_layers=1", "base", "num_layers=4"]),
    ("learning_rate", ["base", "learning_rate=4e-4"]),  # the base's value is not recorded: first
  ]
  # The base's value off the axis goes where it falls (first, it read as the smallest: an axis of
  # 1 and 2 layers around a base of 4 whose accuracy rose with size was said to get worse past the base).
  values = {"base": 4, "num_layers=1": 1, "num_layers=2": 2}
  rows = [{"point": p, "members": [["num_layers", i]] if p != "base" else [], "values": {"num_layers": v}}
          for i, (p, v) in enumerate(values.items())]  # fmt: skip
  definition = {"axes": [{"flags": ["num_layers"]}]}
  (group,) = axis_groups(definition, rows)
  assert group == ("num_layers", ["num_layers=1", "num_layers=2", "base"])
  finals = ([0.28, 0.30, 0.32], [0.43, 0.45, 0.47], [0.58, 0.60, 0.62])
  stats = {p: _stats(f) for p, f in zip(group[1], finals, strict=True)}
  assert judge_axis("num_layers", [(p, stats[p]) for p in group[1]]).startswith("num_layers: paid")
  # Three seeds per point, a spread of 0.04 (noise +/-0.02).
  paid = judge_axis(
    "size", [("s", _stats([0.30, 0.32, 0.34])), ("m", _stats([0.40, 0.42, 0.44])), ("l", _stats([0.50, 0.52, 0.54]))]
  )
  assert paid.startswith("size: paid") and "l 52.0%" in paid and "noise +/-2.0" in paid
  saturated = judge_axis(
    "size", [("s", _stats([0.30, 0.32, 0.34])), ("m", _stats([0.50, 0.52, 0.54])), ("l", _stats([0.50, 0.53, 0.54]))]
  )
  assert saturated.startswith("size: saturated at m;")
  worse = judge_axis(
    "lr", [("a", _stats([0.50, 0.52, 0.54])), ("b", _stats([0.60, 0.62, 0.64])), ("c", _stats([0.20, 0.22, 0.24]))]
  )
  assert worse.startswith("lr: made things worse past b")
  # Worse past the best though still above the first point: a drop of 35 points is not saturation.
  peaked = judge_axis(
    "lr", [("a", _stats([0.28, 0.30, 0.32])), ("b", _stats([0.68, 0.70, 0.72])), ("c", _stats([0.33, 0.35, 0.37]))]
  )
  assert peaked.startswith("lr: made things worse past b")
  none = judge_axis("lr", [("a", _stats([0.50, 0.52, 0.54])), ("b", _stats([0.51, 0.53, 0.55]))])
  assert none.startswith("lr: no effect beyond the seed spread")


# --- a real sweep --------------------------------------------------------------------------------------------


def _trainers_of(path: str) -> list[int]:
  """Live processes whose command line names ``path``."""
  found = []
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          if path.encode() in f.read():
            found.append(int(pid))
      except OSError:
        continue
  return found


def _rl_steps(run_dir: str) -> list[int]:
  return [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "reward_mean" in r]


def test_a_sweep_gates_records_and_continues_after_a_kill(tmp_path):
  out = str(tmp_path / "sweep")
  cmd = [
    sys.executable,
    "-m",
    "mimo_jax.sweep",
    f"--base={BASE}",
    "--axis=debug_nan_steps=1",
    "--gate_steps=2",
    f"--out={out}",
    "--",
    *SMALL,
  ]
  base_dir = os.path.join(out, "runs", "base-seed0")
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 600
    # Kill the sweep outright in the base point's long run (past the gate's 2 steps, before its 6th).
    while time.monotonic() < deadline and proc.poll() is None:
      if any(s >= 3 for s in _rl_steps(base_dir)):
        break
      time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0]
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  # The trainer died with it (it would hold the run directory's lock otherwise).
  for _ in range(100):
    if not _trainers_of(base_dir):
      break
    time.sleep(0.1)
  assert _trainers_of(base_dir) == []
  assert max(_rl_steps(base_dir)) < 6 and read_results(out) == []
  state = json.load(open(os.path.join(out, "state", "base-seed0.json")))
  assert state["gate"]["verdict"] == "pass" and state["attempts"] == 1  # the gate's
  # The killed attempt's start is on the record; its time runs to the trainer's last output.
  lost = os.path.getmtime(os.path.join(out, "logs", "base-seed0.log")) - state["attempt_started"]
  assert lost > 0

  done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "1 already done" not in done.stdout and "0 already done" in done.stdout
  rows = {r["run"]: r for r in read_results(out)}
  assert set(rows) == {"base-seed0", "debug_nan_steps=1-seed0"}
  base = rows["base-seed0"]
  assert base["status"] == "done" and base["gate"]["verdict"] == "pass"
  summary = json.load(open(os.path.join(base_dir, "summary.json")))
  assert summary["resumed_from"]["phase"] == "rl" and summary["resumed_from"]["step"] >= 2  # not from scratch
  assert sorted(_rl_steps(base_dir)) == [1, 2, 3, 4, 5, 6]  # each step logged once
  assert base["final"] == summary["final"] and base["flops_total"] == summary["compute"]["flops_total"] > 0
  assert base["best"]["greedy_accuracy"] >= base["final"]["greedy_accuracy"]
  assert base["command"][:3] == ["python", "-m", "mimo_jax.main"] and "--seed=0" in base["command"]
  # Three attempts (the gate, the killed one, the resumed one), the killed one's time counted.
  assert base["attempts"] == 3 and base["wall_time_s"] > state["wall_s"] + lost - 0.1
  nan = rows["debug_nan_steps=1-seed0"]
  assert nan["status"] == "gate_failed" and nan["gate"]["verdict"] == "nan" and nan["final"] == {}
  assert "non-finite" in nan["gate"]["detail"]
  assert _rl_steps(nan["run_dir"]) == [1, 2]  # stopped at the gate: no long run
  # One supervised warm start, trained once (a run stopped after it) and taken by both points: no SFT in
  # either point's run, and both start RL from its weights (the same held-out evaluation at RL step 0).
  (source,) = [os.path.join(out, "warm_starts", n) for n in os.listdir(os.path.join(out, "warm_starts"))]
  assert os.path.basename(source).startswith("seed0-")
  assert base["warm_start_from"] == nan["warm_start_from"] == source
  warm = json.load(open(os.path.join(source, "summary.json")))
  assert warm["rl_steps"] == 0 and any("sft_loss" in r for r in read_jsonl(os.path.join(source, "metrics.jsonl")))
  for row in (base, nan):
    assert not any("sft_loss" in r for r in read_jsonl(os.path.join(row["run_dir"], "metrics.jsonl")))
    assert f"warm start taken from {source}" in open(os.path.join(out, "logs", f"{row['run']}.log")).read()
  assert base["warm_start"] == warm["warm_start"] == summary["warm_start"]
  first_eval = [r for r in read_jsonl(os.path.join(nan["run_dir"], "metrics.jsonl")) if r["step"] == 0]
  assert {k[5:]: v for k, v in first_eval[0].items() if k.startswith("eval/")} == warm["warm_start"]
  report = open(os.path.join(out, "report.html"), encoding="utf-8").read()
  assert "Axis debug_nan_steps" in report and report.count("<img ") == 7 and "gate_failed" in report

  # A third time: everything is done, nothing runs again.
  logs = {n: open(os.path.join(out, "logs", n)).read() for n in os.listdir(os.path.join(out, "logs"))}
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and "2 already done" in again.stdout, again.stdout + again.stderr
  assert {n: open(os.path.join(out, "logs", n)).read() for n in os.listdir(os.path.join(out, "logs"))} == logs
  assert len(read_results(out)) == 2
