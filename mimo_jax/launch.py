"""Runs one multi-process training job on this machine: ``N`` local processes, one coordinator.

    python -m mimo_jax.launch --num_processes=2 [--devices_per_process=4] [--port=0] -- <main flags>

Each process runs ``python -m mimo_jax.main <main flags> --coordinator_address=localhost:PORT
--num_processes=N --process_id=i``; on CPU each gets ``--devices_per_process`` emulated devices, so
``N x devices_per_process`` devices form the run's one global mesh, as ``N`` hosts of a pod would.
This is how the multi-process tests run, and how a user reproduces a pod's control flow (one
controller per host, collectives across processes, process 0 writing the run directory) on a laptop.

Process 0's output is passed through; the others' is prefixed with ``[pI]``.  SIGTERM and SIGINT (a
Ctrl-C) reach every process as SIGTERM: the run saves at the next step boundary, all processes at the
same step.  The processes run in a session of their own, so a terminal's Ctrl-C reaches them only
through the launcher, and each is killed by the kernel if the launcher dies (:mod:`mimo_jax.sweep.child`).
If a process dies, the others end on their own once the coordinator misses its heartbeats
(``--heartbeat_timeout_s``); the launcher then exits with the first non-zero exit status.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

__all__ = ["describe", "free_port", "launch", "main", "process_command", "process_env"]


def free_port() -> int:
  """A TCP port that is free on localhost now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_command(
  flags: Sequence[str], *, process_id: int, num_processes: int, port: int, parent: int = 0
) -> list[str]:
  """The command line of process ``process_id``; with ``parent`` (a pid), through
  :mod:`mimo_jax.sweep.child`, which dies with that process."""
  wrapper = ["mimo_jax.sweep.child", f"--parent={parent}", "--"] if parent else ["mimo_jax.main"]
  return [
    sys.executable,
    "-m",
    *wrapper,
    *flags,
    f"--coordinator_address=localhost:{port}",
    f"--num_processes={num_processes}",
    f"--process_id={process_id}",
  ]


def process_env(devices_per_process: int, base: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of one local process: CPU with ``devices_per_process`` emulated devices (0: leave
  the platform and device flags as they are, e.g. one GPU per process set by the caller)."""
  env = dict(os.environ if base is None else base)
  if devices_per_process:
    env.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
  return env


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(prefix + line)
    out.flush()
  stream.close()


def launch(
  flags: Sequence[str], *, num_processes: int, devices_per_process: int = 4, port: int = 0, env=None
) -> list[int]:
  """Starts the processes, passes SIGTERM and SIGINT on to them as SIGTERM, waits for all; returns their
  exit statuses."""
  port = port or free_port()
  procs, pumps = [], []
  for i in range(num_processes):
    p = subprocess.Popen(
      process_command(flags, process_id=i, num_processes=num_processes, port=port, parent=os.getpid()),
      env=process_env(devices_per_process, env),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      bufsize=1,
      start_new_session=True,  # a terminal's Ctrl-C reaches the launcher alone, which forwards it
    )
    procs.append(p)
    t = threading.Thread(target=_pump, args=(p.stdout, "" if i == 0 else f"[p{i}] ", sys.stdout), daemon=True)
    t.start()
    pumps.append(t)

  def forward(_signum, _frame):
    # SIGTERM for both: the trainer saves on it at its next step boundary, where a SIGINT would raise
    # KeyboardInterrupt wherever each process happens to be (no save, not at one step).
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    codes = [p.wait() for p in procs]
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for t in pumps:
    t.join(timeout=5)
  return codes


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  own, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
  parser = argparse.ArgumentParser(prog="python -m mimo_jax.launch", description=__doc__.split("\n\n")[0])
  parser.add_argument("--num_processes", type=int, default=2, help="local processes to start (>= 1)")
  parser.add_argument(
    "--devices_per_process", type=int, default=4, help="emulated CPU devices per process (0: leave as set)"
  )
  parser.add_argument("--port", type=int, default=0, help="coordinator port on localhost (0: a free one)")
  args = parser.parse_args(own)
  if args.num_processes < 1:
    parser.error(f"--num_processes={args.num_processes}: must be >= 1")
  if args.devices_per_process < 0:
    parser.error(f"--devices_per_process={args.devices_per_process}: must be >= 0")
  if not 0 <= args.port < 65536:
    parser.error(f"--port={args.port}: must be in [0, 65536)")
  for f in flags:
    if f.split("=")[0] in ("--coordinator_address", "--num_processes", "--process_id"):
      parser.error(f"{f.split('=')[0]} is set by the launcher; pass --num_processes before the --")
  codes = launch(flags, num_processes=args.num_processes, devices_per_process=args.devices_per_process, port=args.port)
  bad = [c for c in codes if c != 0]
  if bad:
    print(f"launch: {describe(codes)}", file=sys.stderr)
  return (128 - bad[0] if bad[0] < 0 else bad[0]) if bad else 0


def describe(codes: Sequence[int]) -> str:
  """What the exit statuses of a run's processes say, in words."""
  parts = []
  for i, c in enumerate(codes):
    if c < 0:
      name = signal.Signals(-c).name if -c in signal.Signals._value2member_map_ else str(-c)
      parts.append(f"process {i} was killed by {name}")
    elif c:
      parts.append(f"process {i} exited with status {c}")
  lost = [i for i, c in enumerate(codes) if c in (-signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS)]
  if lost and len(lost) < len(codes):
    parts.append(
      "the others ended when they lost it (its heartbeats stopped); the committed checkpoints are intact: "
      "rerun the same command to resume"
    )
  return "; ".join(parts)


if __name__ == "__main__":
  sys.exit(main())
