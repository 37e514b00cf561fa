"""The sweep runner: points of a scaling study, each a normal run directory, gated, coupled and resumable.

A sweep is a base flagfile, one or more axes (a flag and its values, or several flags that move
together) and a number of seeds.  By default the axes are swept one at a time around the base (each
point changes one axis; the others keep the base's values; the base itself is a point once); with
``grid`` every combination is a point.  For each point and seed:

1. the coupled settings are derived from the base by :mod:`mimo_jax.sweep.coupling` (never a flag the
   point's axes set) and printed;
2. every command line is parsed and validated before anything runs (a bad axis value fails the sweep
   before any compute, naming the flag);
3. the **gate** runs the point's first ``gate_steps`` RL steps (``--stop_at_step``, the warm start
   included) and :func:`~mimo_jax.sweep.gate.gate_verdict` judges them; a failing point stops there with
   its verdict recorded;
4. the **long run** resumes the same run directory to ``--max_steps`` (the gate's steps are its first
   steps);
5. one row goes to ``DIR/results.jsonl``.

Each run is a child process (``python -m mimo_jax.main``) writing ``DIR/runs/<point>-seed<s>/`` and
its log to ``DIR/logs/``.  The sweep's own bookkeeping (``DIR/sweep.json``, the definition, and
``DIR/state/``, each run's gate verdict and wall time) makes it resumable: the same command again skips
the runs that have a row, and the interrupted one resumes from its checkpoint (the trainer's own
resume).  SIGTERM or Ctrl-C is passed to the running child, which saves; the child dies with the sweep
(:mod:`mimo_jax.sweep.child`) if the sweep is killed outright, so its run directory is never left locked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mimo_jax.config import CONCERN_CLASSES, SHAPE_FLAGS, Config, ConfigError, validate
from mimo_jax.files import read_json, read_jsonl, write_atomic
from mimo_jax.sweep.coupling import Change, couple, model_size_ratio, non_embedding_params, rollout_batch_ratio
from mimo_jax.sweep.gate import Verdict, gate_verdict
from mimo_jax.train.warm_start import starts_afresh, warm_start_key

__all__ = ["Axis", "PlannedRun", "Sweep", "parse_axis", "read_results"]

# Flags the sweep sets itself on every point's command line.
RESERVED = ("run_dir", "seed", "stop_at_step", "mode", "dry_run", "dry_run_topology", "rollback_to", "overwrite")
RESULTS = "results.jsonl"
# What _spawn returns when the sweep was interrupted before the trainer could start (none was started).
INTERRUPTED_RC = 130
# The held-out metrics whose best value over a run's evaluations is recorded.
_HIGHER_IS_BETTER = re.compile(r"greedy_accuracy|(pass|maj)@[0-9]+")
DEFINITION = "sweep.json"


@dataclasses.dataclass(frozen=True)
class Axis:
  """One swept dimension: one flag, or several that move together (``a:b=1:2,3:4``)."""

  flags: tuple[str, ...]
  values: tuple[tuple[str, ...], ...]

  @property
  def name(self) -> str:
    return ":".join(self.flags)

  def to_dict(self) -> dict[str, Any]:
    return {"flags": list(self.flags), "values": [list(v) for v in self.values]}


def _flag_names() -> set[str]:
  return {f.name for cls in CONCERN_CLASSES.values() for f in dataclasses.fields(cls) if f.metadata.get("flag", True)}


def parse_axis(text: str) -> Axis:
  """Parses ``--axis=NAME=v1,v2,...`` (or ``N1:N2=a1:b1,a2:b2`` for flags that move together).

  Raises:
    ConfigError: naming ``--axis`` and what is wrong (an unknown or reserved flag, a missing value).
  """
  name, sep, values = text.partition("=")
  if not sep or not name or not values:
    raise ConfigError(f"--axis={text}: expected NAME=v1,v2,... (or N1:N2=a1:b1,a2:b2 for flags that move together)")
  flags = tuple(n.strip().removeprefix("--") for n in name.split(":"))
  known = _flag_names()
  for f in flags:
    if f in RESERVED:
      raise ConfigError(f"--axis={text}: --{f} is set by the sweep itself (use --seeds for seeds); not an axis")
    if f not in known:
      close = sorted(k for k in known if f in k or k in f)[:5]
      hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
      raise ConfigError(f"--axis={text}: --{f} is not a trainer flag (python -m mimo_jax.main --help lists them){hint}")
  if len(set(flags)) != len(flags):
    raise ConfigError(f"--axis={text}: a flag appears twice")
  parsed = []
  for v in values.split(","):
    parts = tuple(p.strip() for p in v.split(":")) if len(flags) > 1 else (v.strip(),)
    if len(parts) != len(flags) or any(p == "" for p in parts):
      raise ConfigError(f"--axis={text}: value {v!r} needs {len(flags)} part(s) separated by ':', one per flag")
    parsed.append(parts)
  if len(set(parsed)) != len(parsed):
    raise ConfigError(f"--axis={text}: a value appears twice")
  return Axis(flags, tuple(parsed))


def parse_seeds(text: str) -> tuple[int, ...] | int:
  """``--seeds=N`` (N seeds from the base's) or ``--seeds=0,3,7`` (exactly these)."""
  try:
    if "," in text:
      seeds = tuple(int(s) for s in text.split(","))
      if len(set(seeds)) != len(seeds):
        raise ValueError
      return seeds
    n = int(text)
    if n < 1:
      raise ValueError
    return n
  except ValueError:
    raise ConfigError(f"--seeds={text}: expected a positive count N or distinct integers s1,s2,...") from None


@dataclasses.dataclass(frozen=True)
class PlannedRun:
  """One point at one seed: its run directory and its command line."""

  point: str
  seed: int
  axes: dict[str, str]  # flag -> value as given
  changes: tuple[Change, ...]
  argv: tuple[str, ...]  # the trainer's flags (after the program name)
  cfg: Config
  members: tuple[tuple[str, int], ...] = ()  # (axis, value index) of each axis value that gives this point

  @property
  def name(self) -> str:
    return f"{self.point}-seed{self.seed}"


def _safe(text: str) -> str:
  return "".join(c if c.isalnum() or c in "._-=+" else "_" for c in text)


def point_name(axes: Mapping[str, str]) -> str:
  """A point's name (its run directories are ``<name>-seed<s>``): ``flag=value`` joined by commas, or
  ``base`` for the base point."""
  return ",".join(f"{f}={_safe(v)}" for f, v in axes.items()) or "base"


def _parse(argv: Sequence[str]) -> Config:
  from mimo_jax.main import parse_config

  return parse_config(["mimo_jax.main", *argv])


def _coerced(cfg: Config, flag: str) -> Any:
  for concern in CONCERN_CLASSES:
    part = getattr(cfg, concern)
    if hasattr(part, flag):
      return getattr(part, flag)
  raise KeyError(flag)


def _device_count() -> int:
  """The devices a trainer this sweep starts sees, counted in a process of its own, as the trainers run:
  counted in the sweep's process, JAX's backend would start there and keep the accelerators for the
  whole sweep (a GPU's memory preallocated, a TPU's chips held) under every trainer it starts."""
  code = "import jax; print(jax.device_count())"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
  last = (out.stdout.strip().splitlines() or [""])[-1]
  if out.returncode != 0 or not last.isdigit():
    raise ConfigError(f"could not count this host's devices: {(out.stderr or out.stdout).strip()[-500:]}")
  return int(last)


class Sweep:
  """A sweep's definition, its plan, and its execution.

  Args:
    base: the base flagfile.
    axes: the swept dimensions.
    out: the sweep directory.
    seeds: a count (seeds from the base's ``--seed`` up) or the seeds themselves.
    grid: every combination of the axes instead of one axis at a time.
    coupling: apply :mod:`~mimo_jax.sweep.coupling`'s rules.
    gate_steps: RL steps of the short-run gate (0: no gate).
    gate_min_reward_change: the gate's ``flat`` threshold on the batch reward's range.
    extra: trainer flags added to every point after the flagfile (before the axes).
    num_devices: the devices the points are validated for (default: this host's).
    share_warm_start: runs of one seed whose warm-start settings agree (every point of an axis of RL
      settings) take one supervised warm start, trained once into ``DIR/warm_starts/`` by a run stopped
      after it (``--warm_start_from``); false: each run trains its own (the same weights, at a cost).
  """

  def __init__(
    self,
    *,
    base: str,
    axes: Sequence[Axis],
    out: str,
    seeds: tuple[int, ...] | int = 1,
    grid: bool = False,
    coupling: bool = True,
    gate_steps: int = 20,
    gate_min_reward_change: float = 0.0,
    extra: Sequence[str] = (),
    num_devices: int | None = None,
    share_warm_start: bool = True,
  ):
    if not base or not os.path.isfile(base):
      raise ConfigError(f"--base={base}: not a file (the base flagfile of the sweep)")
    if not axes:
      raise ConfigError("--axis: at least one axis is needed (--axis=NAME=v1,v2,...)")
    if gate_steps < 0:
      raise ConfigError(f"--gate_steps={gate_steps}: must be >= 0 (0: no gate)")
    for arg in extra:
      flag = arg.lstrip("-").partition("=")[0]
      if flag in RESERVED:
        raise ConfigError(f"extra flag {arg}: --{flag} is set by the sweep itself")
    seen = [f for a in axes for f in a.flags]
    if len(set(seen)) != len(seen):
      raise ConfigError("--axis: a flag is swept by two axes")
    self.base = os.path.abspath(base)
    self.axes = tuple(axes)
    self.out = os.path.abspath(out)
    self.grid = grid
    self.coupling = coupling
    self.gate_steps = gate_steps
    self.gate_min_reward_change = gate_min_reward_change
    self.extra = tuple(extra)
    self.base_cfg = _parse([f"--flagfile={self.base}", *self.extra])
    # The base flagfile may not set what the sweep decides either (its --run_dir and --seed are the
    # defaults the sweep starts from): a --stop_at_step there outlived the gate's, so a run never finished.
    b = self.base_cfg
    for flag, value, unset in (
      ("stop_at_step", b.run.stop_at_step, 0),
      ("mode", b.run.mode, "train"),
      ("dry_run", b.run.dry_run, False),
      ("dry_run_topology", b.run.dry_run_topology, ""),
      ("rollback_to", b.checkpoint.rollback_to, -1),
      ("overwrite", b.checkpoint.overwrite, False),
    ):
      if value != unset:
        raise ConfigError(f"--base={base}: --{flag}={value!r} there is set by the sweep itself; remove it")
    if isinstance(seeds, int):
      seeds = tuple(self.base_cfg.run.seed + i for i in range(seeds))
    self.seeds = seeds
    self.num_devices = num_devices
    self.share_warm_start = share_warm_start
    self._warm_sources: dict[str, str] = {}  # run name -> the shared warm start's run directory
    self._child: subprocess.Popen | None = None
    self._interrupted = False

  # --- the plan -----------------------------------------------------------------------------------------

  def points(self) -> list[dict[str, str]]:
    """Each point's axis values (flag -> text), the base point first when it is one, duplicates dropped."""
    return [p for p, _, _ in self._resolve()]

  def _resolve(self) -> list[tuple[dict[str, str], list[tuple[str, int]], set[str]]]:
    """The points, each with its memberships: ``(axis name, index of the value)`` for every axis value
    that gives this point (the base is a member of each axis whose value equals the base's; a grid's
    points belong to ``grid``), and the flags its axes set (the coupling rules leave them alone, a value
    equal to the base's included: a grid cell at the base's learning rate keeps it)."""
    if self.grid:
      combos = [
        (
          {f: v for axis, vals in zip(self.axes, combo, strict=True) for f, v in zip(axis.flags, vals, strict=True)},
          ("grid", i),
        )
        for i, combo in enumerate(itertools.product(*(a.values for a in self.axes)))
      ]
    else:  # the base once, then each axis's values with the other axes at the base's
      combos = [({}, None)] + [
        (dict(zip(a.flags, vals, strict=True)), (a.name, i)) for a in self.axes for i, vals in enumerate(a.values)
      ]
    points: dict[tuple, tuple[dict[str, str], list[tuple[str, int]], set[str]]] = {}
    for combo, member in combos:
      try:
        cfg = _parse([f"--flagfile={self.base}", *self.extra, *(f"--{f}={v}" for f, v in combo.items())])
      except ConfigError as e:
        raise ConfigError(f"sweep point {point_name(combo)}: {e}") from None
      # Only the values that differ from the base's make the point (an axis value equal to the base's is the base).
      differs = {f: v for f, v in combo.items() if _coerced(cfg, f) != _coerced(self.base_cfg, f)}
      if _same_run(cfg, self.base_cfg):  # e.g. --num_layers=2 on a preset of 2 layers
        differs = {}
      key = tuple(sorted((f, repr(_coerced(cfg, f))) for f in differs))
      entry = points.setdefault(key, (differs, [], set()))
      if member is not None:
        entry[1].append(member)
        entry[2].update(combo)
    return sorted(points.values(), key=lambda p: len(p[0]) > 0)  # the base first

  def plan(self) -> list[PlannedRun]:
    """Every run of the sweep, seed-major (every point at the first seed, then the next seed), validated.

    Raises:
      ConfigError: a point's command line is invalid (the message names the point and the flag).
    """
    runs = []
    names = set()
    resolved = self._resolve()
    for seed in self.seeds:
      for axes, members, fixed in resolved:
        point = point_name(axes)
        if point in names and seed == self.seeds[0]:
          raise ConfigError(f"two points share the name {point!r}; use values that differ in their text")
        names.add(point)
        axis_flags = [f"--{f}={v}" for f, v in axes.items()]
        try:
          cfg = _parse([f"--flagfile={self.base}", *self.extra, *axis_flags])
          changes: list[Change] = []
          if self.coupling:
            cfg, changes = couple(self.base_cfg, cfg, fixed=fixed)
          argv = (
            f"--flagfile={self.base}",
            *self.extra,
            *axis_flags,
            *(f"--{c.flag}={c.after:.4g}" for c in changes),
            f"--seed={seed}",
            f"--run_dir={os.path.join(self.out, 'runs', f'{point}-seed{seed}')}",
          )
          final = _parse(argv)  # what the child will parse; must equal the coupled config
          if final != dataclasses.replace(cfg, run=final.run, logging=final.logging):
            raise ConfigError("the coupled flags do not reproduce the coupled config")
          self._validate(final)
          if self.gate_steps and self.gate_steps >= final.run.max_steps:
            raise ConfigError(
              f"--gate_steps={self.gate_steps}: must be below the point's --max_steps={final.run.max_steps} "
              "(or 0: no gate)"
            )
        except ConfigError as e:
          raise ConfigError(f"sweep point {point} (seed {seed}): {e}") from None
        runs.append(PlannedRun(point, seed, axes, tuple(changes), argv, final, tuple(members)))
    return runs

  def _validate(self, cfg: Config) -> None:
    if self.num_devices is None:
      self.num_devices = _device_count()
    validate(cfg, self.num_devices)

  def definition(self) -> dict[str, Any]:
    with open(self.base, "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
    return {
      "base": self.base,
      "base_sha256": digest,
      "axes": [a.to_dict() for a in self.axes],
      "grid": self.grid,
      "seeds": list(self.seeds),
      "coupling": self.coupling,
      "gate_steps": self.gate_steps,
      "gate_min_reward_change": self.gate_min_reward_change,
      "extra": list(self.extra),
    }

  def _claim(self, runs: Sequence[PlannedRun] = ()) -> None:
    """Writes ``sweep.json``, or checks that a rerun is the same sweep (a changed definition is refused).

    The definition holds every run's command line too: a rerun whose plan came out differently (the
    coupling rules or a default changed in between) would mix two sweeps in one report, and is refused
    with the first run that differs.  One change is accepted: more axes or more seeds whose plan keeps
    every recorded run's command as it was (an extension: the recorded runs, the base's included, are
    reused, and the definition is rewritten to the larger sweep).
    """
    os.makedirs(self.out, exist_ok=True)
    path = os.path.join(self.out, DEFINITION)
    mine = {**self.definition(), "commands": {r.name: list(r.argv) for r in runs}}
    if os.path.exists(path):
      with open(path) as f:
        theirs = json.load(f)
      differs = sorted(k for k in mine.keys() | theirs.keys() if k != "commands" and mine.get(k) != theirs.get(k))
      if differs and self._extends(theirs, mine, differs):
        added = sorted(set(mine["commands"]) - set(theirs.get("commands", {})))
        print(
          f"sweep {self.out}: extends the recorded sweep ({', '.join(differs)}): "
          f"{len(added)} run(s) added, {len(theirs.get('commands', {}))} recorded run(s) reused",
          flush=True,
        )
        write_atomic(path, json.dumps(mine, indent=2))
        self._refresh_rows(runs)
        return
      if not differs and mine["commands"] != theirs.get("commands", mine["commands"]):
        name = next(n for n in mine["commands"] if mine["commands"][n] != theirs["commands"].get(n))
        raise ConfigError(
          f"--out={self.out}: the same sweep now plans run {name} differently ({' '.join(mine['commands'][name])}; "
          f"recorded: {' '.join(theirs['commands'].get(name, ['(absent)']))}): the code changed since it started; "
          "finish it with that code, or start the sweep again in another --out"
        )
      if differs:
        what = "; ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} now" for k in differs)
        raise ConfigError(
          f"--out={self.out}: holds another sweep ({what}); rerun its own command to continue it, or choose "
          "another --out"
        )
      return
    write_atomic(path, json.dumps(mine, indent=2))

  def _refresh_rows(self, runs: Sequence[PlannedRun]) -> None:
    """An extended sweep's recorded rows take the larger sweep's memberships and axis values: a reused run
    (the base) is a member of a new axis whose value it has, and the report orders that axis by them (the
    base went first on it, and an axis whose smaller setting was worse read as saturated at the base)."""
    path = os.path.join(self.out, RESULTS)
    if not os.path.exists(path):
      return
    planned = {r.name: r for r in runs}
    rows = read_jsonl(path)
    for row in rows:
      run = planned.get(row.get("run"))
      if run is not None:
        row["members"] = [list(m) for m in run.members]
        row["values"] = {f: _coerced(run.cfg, f) for axis in self.axes for f in axis.flags}
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))

  @staticmethod
  def _extends(theirs: dict[str, Any], mine: dict[str, Any], differs: Sequence[str]) -> bool:
    """Whether ``mine`` only adds axes or seeds to ``theirs`` and plans every recorded run as it was."""
    if not set(differs) <= {"axes", "seeds"} or "commands" not in theirs or not mine["commands"]:
      return False
    old_axes, new_axes = theirs.get("axes", []), mine["axes"]
    old_seeds, new_seeds = theirs.get("seeds", []), mine["seeds"]
    if new_axes[: len(old_axes)] != old_axes or not set(old_seeds) <= set(new_seeds):
      return False
    return all(mine["commands"].get(name) == argv for name, argv in theirs["commands"].items())

  # --- execution -------------------------------------------------------------------------------------------

  def run(self) -> int:
    """Runs (or continues) the sweep; returns the process exit code (0 all done, 1 some runs failed,
    3 interrupted)."""
    runs = self.plan()
    self._claim(runs)
    for d in ("runs", "logs", "state"):
      os.makedirs(os.path.join(self.out, d), exist_ok=True)
    self._warm_sources = self.shared_warm_starts(runs) if self.share_warm_start else {}
    done = {row["run"] for row in read_results(self.out)}
    print(
      f"sweep {self.out}: {len(runs)} runs ({len(runs) // len(self.seeds)} points x {len(self.seeds)} seeds), "
      f"{len(done & {r.name for r in runs})} already done",
      flush=True,
    )
    failed = []
    previous = {s: signal.signal(s, self._interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      for i, run in enumerate(runs, 1):
        if run.name in done:
          continue
        print(f"[{i}/{len(runs)}] {run.name}", flush=True)
        for c in run.changes:
          print(f"    coupled {c.describe()}", flush=True)
        status = self._run_one(run)
        if self._interrupted:
          print(f"interrupted during {run.name}: its state is saved; rerun the same command to continue", flush=True)
          return 3
        if status is None:
          failed.append(run.name)
    finally:
      for s, h in previous.items():
        signal.signal(s, h)
    if failed:
      print(
        f"{len(failed)} run(s) failed (see {os.path.join(self.out, 'logs')}): {', '.join(failed)}; "
        "rerun the same command to retry them",
        flush=True,
      )
      return 1
    print(f"sweep complete: {os.path.join(self.out, RESULTS)}", flush=True)
    return 0

  def _interrupt(self, signum, frame) -> None:
    del frame
    self._interrupted = True
    if self._child is not None and self._child.poll() is None:
      self._child.send_signal(signal.SIGTERM)  # the trainer saves at its next step boundary

  def shared_warm_starts(self, runs: Sequence[PlannedRun]) -> dict[str, str]:
    """Run name -> the warm-start run directory it takes (``DIR/warm_starts/seed<s>-<key>``), for the
    runs with a supervised warm start whose settings (:data:`~mimo_jax.train.warm_start.WARM_START`)
    another run of the sweep shares; a run that sets ``--warm_start_from`` itself keeps it."""
    groups: dict[str, list[PlannedRun]] = {}
    for run in runs:
      if run.cfg.run.sft_steps > 0 and not run.cfg.run.warm_start_from:
        groups.setdefault(f"seed{run.seed}-{warm_start_key(run.cfg)}", []).append(run)
    return {
      run.name: os.path.join(self.out, "warm_starts", name)
      for name, members in groups.items()
      if len(members) > 1
      for run in members
    }

  def _ensure_warm_start(self, run: PlannedRun) -> bool:
    """Trains the shared warm start ``run`` takes unless it is there (a run of ``run``'s own command
    stopped after its warm start, ``--max_steps=0``); False: it failed or was interrupted."""
    source = self._warm_sources[run.name]
    if os.path.exists(os.path.join(source, "summary.json")):
      return True
    name = os.path.basename(source)
    print(f"    warm start {name}: trained once for every run of seed {run.seed} with these settings", flush=True)
    log = os.path.join(self.out, "logs", f"warm_start-{name}.log")
    t0 = time.perf_counter()
    rc = self._spawn([*run.argv, f"--run_dir={source}", "--max_steps=0", "--keep_last=3"], log)
    if self._interrupted:
      return False
    if rc != 0 or not os.path.exists(os.path.join(source, "summary.json")):
      print(f"    warm start {name}: the trainer exited with {rc} (see {log})", flush=True)
      return False
    print(f"    warm start {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return True

  def _run_one(self, run: PlannedRun) -> str | None:
    """The gate (unless already judged), then the long run; writes the results row. None: it failed."""
    state = self._state(run)
    run_dir = self.run_dir(run)
    if run.name in self._warm_sources and starts_afresh(run.cfg, run_dir) and not self._ensure_warm_start(run):
      return None
    if self.gate_steps and "gate" not in state:
      rc = self._child_run(run, state, stop_at=self.gate_steps)
      if self._interrupted:
        return None
      if rc == 3:  # the trainer gave up on non-finite steps
        state["gate"] = Verdict(
          "nan", "the trainer stopped on non-finite steps (see its log)", self.gate_steps
        ).to_dict()
      elif rc != 0:
        print(f"    gate: the trainer exited with {rc} (see {self.log_path(run)})", flush=True)
        return None
      else:
        verdict = gate_verdict(
          read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
          read_jsonl(os.path.join(run_dir, "alarms.jsonl")),
          self.gate_steps,
          min_reward_change=self.gate_min_reward_change,
        )
        if verdict.verdict == "incomplete":
          print(f"    gate: {verdict.detail} (see {self.log_path(run)})", flush=True)
          return None
        state["gate"] = verdict.to_dict()
      self._save_state(run, state)
      print(f"    gate: {state['gate']['verdict']}: {state['gate']['detail']}", flush=True)
    gate = state.get("gate")
    if gate is not None and gate["verdict"] != "pass":
      self._write_row(run, state, status="gate_failed")
      return "gate_failed"
    rc = self._child_run(run, state)
    if self._interrupted:
      return None
    if rc == 3:
      self._write_row(run, state, status="aborted")
      print("    aborted: the trainer stopped on non-finite steps (committed state intact)", flush=True)
      return "aborted"
    summary = read_json(os.path.join(run_dir, "summary.json"))
    if rc != 0 or summary is None:
      print(f"    the trainer exited with {rc} (see {self.log_path(run)})", flush=True)
      return None
    row = self._write_row(run, state, status="done", summary=summary)
    warm, final = row["warm_start"].get("greedy_accuracy"), row["final"].get("greedy_accuracy")
    if warm is not None and final is not None:
      print(
        f"    done: held-out greedy {100 * warm:.1f}% -> {100 * final:.1f}% in {row['wall_time_s']:.0f} s", flush=True
      )
    return "done"

  def _child_run(self, run: PlannedRun, state: dict[str, Any], stop_at: int = 0) -> int:
    flags = list(run.argv)
    if run.name in self._warm_sources:  # read only when the run starts afresh
      flags.append(f"--warm_start_from={self._warm_sources[run.name]}")
    if stop_at:
      flags.append(f"--stop_at_step={stop_at}")
    self._settle_lost_attempt(run, state)
    # On the record before the trainer starts: a sweep killed outright (no chance to save) still has the
    # attempt's start, and the next sweep counts its time up to the trainer's last output.
    state["attempt_started"] = time.time()
    self._save_state(run, state)
    t0 = time.perf_counter()
    rc = self._spawn(flags, self.log_path(run))
    del state["attempt_started"]
    state["wall_s"] = state.get("wall_s", 0.0) + time.perf_counter() - t0
    state["attempts"] = state.get("attempts", 0) + 1
    self._save_state(run, state)
    return rc

  def _settle_lost_attempt(self, run: PlannedRun, state: dict[str, Any]) -> None:
    """Counts an attempt whose sweep was killed while it ran (``attempt_started`` left on the record):
    its time runs to the log's last write, the trainer's last output."""
    started = state.pop("attempt_started", None)
    if not isinstance(started, (int, float)):
      return
    try:
      ended = os.path.getmtime(self.log_path(run))
    except OSError:
      ended = started
    state["wall_s"] = state.get("wall_s", 0.0) + max(ended - started, 0.0)
    state["attempts"] = state.get("attempts", 0) + 1

  def _spawn(self, flags: Sequence[str], log_path: str) -> int:
    """Runs the trainer with ``flags`` as the sweep's child, its output appended to ``log_path``; returns
    its exit code."""
    argv = [sys.executable, "-m", "mimo_jax.sweep.child", f"--parent={os.getpid()}", "--", *flags]
    if self._interrupted:  # interrupted between two trainers (a gate's verdict being read): start none
      return INTERRUPTED_RC
    with open(log_path, "a") as log:
      log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
      log.flush()
      # Its own session: a Ctrl-C in the terminal reaches the sweep only, which passes on a SIGTERM (the
      # trainer saves on SIGTERM; a SIGINT would stop it mid-step).
      self._child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
      if self._interrupted:  # the signal came while it started, before it could be passed on
        self._child.send_signal(signal.SIGTERM)
      try:
        return self._child.wait()
      finally:
        self._child = None

  # --- files -------------------------------------------------------------------------------------------

  def run_dir(self, run: PlannedRun) -> str:
    return os.path.join(self.out, "runs", run.name)

  def log_path(self, run: PlannedRun) -> str:
    return os.path.join(self.out, "logs", f"{run.name}.log")

  def _state_path(self, run: PlannedRun) -> str:
    return os.path.join(self.out, "state", f"{run.name}.json")

  def _state(self, run: PlannedRun) -> dict[str, Any]:
    return read_json(self._state_path(run)) or {}

  def _save_state(self, run: PlannedRun, state: dict[str, Any]) -> None:
    write_atomic(self._state_path(run), json.dumps(state, indent=2))

  def _write_row(
    self, run: PlannedRun, state: dict[str, Any], *, status: str, summary: Mapping[str, Any] | None = None
  ) -> dict[str, Any]:
    run_dir = self.run_dir(run)
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    best: dict[str, float] = {}
    for r in evals:
      for k, v in r.items():
        if _HIGHER_IS_BETTER.fullmatch(k[5:]) and isinstance(v, (int, float)):
          best[k[5:]] = max(best.get(k[5:], float("-inf")), float(v))
    rl = [r for r in records if "reward_mean" in r]
    last = rl[-1] if rl else {}
    compute = dict((summary or {}).get("compute") or {})
    for k in ("flops_total", "samples_total", "tokens_total"):
      compute.setdefault(k, last.get(k))
    row = {
      "run": run.name,
      "point": run.point,
      "seed": run.seed,
      "axes": {f: _coerced(run.cfg, f) for f in run.axes},
      # Every axis flag's value in this run (the base's too): orders an axis the base's value is not on.
      "values": {f: _coerced(run.cfg, f) for axis in self.axes for f in axis.flags},
      "members": [list(m) for m in run.members],
      "coupled": [c.to_dict() for c in run.changes],
      "params_non_embedding": None if run.cfg.model.hf_checkpoint else non_embedding_params(run.cfg),
      "params_ratio": model_size_ratio(self.base_cfg, run.cfg),
      "rollout_batch": run.cfg.data.prompts_per_step * run.cfg.rollout.num_samples,
      "rollout_batch_ratio": rollout_batch_ratio(self.base_cfg, run.cfg),
      "max_steps": run.cfg.run.max_steps,
      "status": status,
      "gate": state.get("gate"),
      "warm_start": dict((summary or {}).get("warm_start") or _eval_at(evals, 0)),
      "final": dict((summary or {}).get("final") or {}),
      "best": best,
      "rl_steps_done": int(last.get("step", 0)),
      "flops_total": compute.get("flops_total"),
      "samples_total": compute.get("samples_total"),
      "tokens_total": compute.get("tokens_total"),
      "wall_time_s": round(state.get("wall_s", 0.0), 1),
      "attempts": state.get("attempts", 0),
      "run_dir": run_dir,
      "command": ["python", "-m", "mimo_jax.main", *run.argv],
      # The shared warm start this run took (trained once, not counted in its wall time), or None.
      "warm_start_from": self._warm_sources.get(run.name),
    }
    with open(os.path.join(self.out, RESULTS), "a") as f:
      f.write(json.dumps(row) + "\n")
    return row


def _same_run(a: Config, b: Config) -> bool:
  """Whether two configs train the same model the same way (a shape flag equal to the preset's is no
  change)."""
  if dataclasses.replace(a, model=b.model) != b:
    return False
  if a.model.hf_checkpoint or b.model.hf_checkpoint:
    return a.model == b.model
  strip = dict.fromkeys(SHAPE_FLAGS, 0)
  return a.model.model_config() == b.model.model_config() and dataclasses.replace(
    a.model, **strip
  ) == dataclasses.replace(b.model, **strip)


def _eval_at(evals: Sequence[Mapping[str, Any]], step: int) -> dict[str, Any]:
  for r in evals:
    if r["step"] == step:
      return {k[5:]: v for k, v in r.items() if k.startswith("eval/")}
  return {}


def read_results(out: str) -> list[dict[str, Any]]:
  """The sweep's result rows (the last row of a run wins)."""
  rows: dict[str, dict[str, Any]] = {}
  for row in read_jsonl(os.path.join(out, RESULTS)):
    rows[row["run"]] = row
  return list(rows.values())
