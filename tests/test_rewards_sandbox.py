"""Tests for ``mimo_jax.rewards.sandbox``: hostile programs must be contained and the host must stay healthy.

Every behavioural test runs in the mode the machine supports (``auto``: namespace mode
where user namespaces work) and in the Python-guard fallback (``guard``), which must
contain the same naive attacks.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from mimo_jax.rewards import sandbox
from mimo_jax.rewards.sandbox import SandboxResult, run_python

MODES = [None, "guard"]
MODE_IDS = ["auto", "guard"]


@pytest.fixture(params=MODES, ids=MODE_IDS)
def mode(request: pytest.FixtureRequest) -> str | None:
  return request.param


def _run(code: str, mode: str | None, **kwargs: object) -> SandboxResult:
  return run_python(code, mode=mode, **kwargs)  # type: ignore[arg-type]


def _processes_mentioning(text: str) -> list[int]:
  """Pids of live (non-zombie) processes whose command line contains ``text``."""
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if text.encode() in cmdline:
      found.append(int(entry))
  return found


def _wait_until_gone(text: str, seconds: float = 60.0) -> list[int]:
  end = time.monotonic() + seconds
  left = _processes_mentioning(text)
  while left and time.monotonic() < end:
    time.sleep(0.05)
    left = _processes_mentioning(text)
  return left


def _host_can_spawn() -> bool:
  return subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, timeout=30).stdout.strip() == b"42"


# ---- ordinary runs ------------------------------------------------------------------------


def test_runs_code_with_stdin_and_reports_output(mode: str | None) -> None:
  result = _run(
    "import sys\ndata = sys.stdin.read()\nprint(data.upper())\nprint('err', file=sys.stderr)", mode, stdin="héllo"
  )
  assert result.ok
  assert (result.exit_code, result.signal, result.timed_out) == (0, None, False)
  assert result.stdout == "HÉLLO\n"
  assert result.stderr == "err\n"
  assert not result.stdout_truncated and not result.stderr_truncated
  assert 0 < result.wall_s < 5
  assert result.isolation == (mode or sandbox.isolation().mode)


def test_exit_status_and_signals_are_reported(mode: str | None) -> None:
  exited = _run("import sys\nsys.exit(3)", mode)
  assert (exited.exit_code, exited.signal, exited.ok) == (3, None, False)
  raised = _run("raise ValueError('boom')", mode)
  assert raised.exit_code == 1 and "ValueError: boom" in raised.stderr
  killed = _run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", mode)
  assert (killed.exit_code, killed.signal, killed.timed_out) == (None, signal.SIGKILL, False)


def test_code_runs_as_main_in_a_fresh_directory_that_is_removed(mode: str | None) -> None:
  code = "import os\nprint(__name__)\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('scratch.txt', 'w').write('ok')"
  result = _run(code, mode)
  assert result.ok, result.stderr
  name, cwd, listing = result.stdout.splitlines()
  assert name == "__main__"
  assert listing == "[]"
  assert os.path.basename(os.path.dirname(cwd)).startswith("mimo-sandbox-")
  assert not os.path.exists(os.path.dirname(cwd))


def test_no_capabilities_no_new_privileges_and_no_host_root(mode: str | None) -> None:
  result = _run("print(open('/proc/self/status').read())\nprint('map', open('/proc/self/uid_map').read())", mode)
  assert result.ok, result.stderr
  status, _, uid_map = result.stdout.partition("map ")
  fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
  assert fields["CapEff"].strip() == "0" * 16
  assert fields["CapPrm"].strip() == "0" * 16
  assert fields["NoNewPrivs"].strip() == "1"
  # The host uid the code runs as: in namespace mode the second column of the uid map.
  inside_uid = int(fields["Uid"].split()[0])
  host_uid = int(uid_map.split()[1]) if result.isolation == "namespace" else inside_uid
  if os.geteuid() == 0:
    assert host_uid == 65534
  else:
    assert host_uid == os.geteuid()


# ---- time ---------------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["while True:\n  pass", "import time\ntime.sleep(60)"], ids=["busy", "sleep"])
def test_wall_clock_timeout_kills_the_code(mode: str | None, code: str) -> None:
  start = time.monotonic()
  result = _run(code, mode, timeout_s=1.0)
  elapsed = time.monotonic() - start
  assert result.timed_out
  assert (result.exit_code, result.signal) == (None, signal.SIGKILL)
  # Both programs run forever (or 60 s): a generous ceiling proves the kill, on a slow machine too.
  assert 1.0 <= elapsed < 45.0


# ---- processes ----------------------------------------------------------------------------


def test_process_limit_stops_forking(mode: str | None) -> None:
  code = (
    "import os, time\n"
    "n = 0\n"
    "while n < 1000:\n"
    "  try:\n"
    "    pid = os.fork()\n"
    "  except OSError as e:\n"
    "    print(n, e.errno, flush=True)\n"
    "    break\n"
    "  if pid == 0:\n"
    "    time.sleep(30)\n"
    "    os._exit(0)\n"
    "  n += 1\n"
  )
  result = _run(code, mode, max_processes=8, timeout_s=10.0)
  assert result.ok, result.stderr
  forks, err = map(int, result.stdout.split())
  assert err == 11  # EAGAIN: RLIMIT_NPROC
  if result.isolation == "namespace":
    assert forks == 8  # counted per user namespace: exact
  else:
    # Counted over the whole uid: other processes of the uid that exit meanwhile free slots.
    assert 0 < forks <= 8 + 32
  assert not result.timed_out  # the sleeping children did not keep the run alive


@pytest.mark.parametrize("escape", [False, True], ids=["same-group", "setsid"])
def test_fork_bomb_is_contained_and_cleaned_up(mode: str | None, escape: bool) -> None:
  child = "os.setsid()" if escape else "pass"
  code = (
    "import os\n"
    "print(os.getcwd(), flush=True)\n"
    "while True:\n"
    "  try:\n"
    "    if os.fork() == 0:\n"
    f"      {child}\n"
    "  except OSError:\n"
    "    pass\n"
  )
  result = _run(code, mode, timeout_s=1.5)
  assert result.timed_out
  root = os.path.dirname(result.stdout.splitlines()[0])
  assert root.startswith(tempfile.gettempdir())
  assert _wait_until_gone(root) == []
  assert not os.path.exists(root)
  assert _host_can_spawn()


def test_killing_its_parent_or_everything_leaves_the_host_alive(mode: str | None) -> None:
  code = (
    "import os, signal\n"
    "for target in (os.getppid(), -1, 1):\n"
    "  try:\n"
    "    os.kill(target, signal.SIGKILL)\n"
    "    print('sent', target, flush=True)\n"
    "  except OSError as e:\n"
    "    print('refused', target, type(e).__name__, flush=True)\n"
  )
  result = _run(code, mode)
  # The code itself survives: its parent is the PID namespace's init (immune to signals
  # from inside) or the guard refuses; -1 reaches nothing outside the sandbox.
  assert result.ok, result.stderr
  assert len(result.stdout.splitlines()) == 3
  assert _host_can_spawn()


def test_concurrent_runs_do_not_mix(mode: str | None) -> None:
  def one(i: int) -> SandboxResult:
    return _run("import sys\nprint(int(sys.stdin.read()) * 2)", mode, stdin=str(i))

  with ThreadPoolExecutor(4) as pool:
    results = list(pool.map(one, range(8)))
  assert [r.stdout.strip() for r in results] == [str(2 * i) for i in range(8)]


# ---- memory, files, output ----------------------------------------------------------------


@pytest.mark.parametrize(
  "code", ["x = bytearray(2 << 30)", "x = []\nwhile True:\n  x.append(bytearray(16 << 20))"], ids=["one", "grow"]
)
def test_memory_bomb_fails_inside_the_sandbox(mode: str | None, code: str) -> None:
  result = _run(code, mode, memory_mb=256, timeout_s=10.0)
  assert not result.ok and not result.timed_out
  assert "MemoryError" in result.stderr or result.signal is not None
  assert _host_can_spawn()


@pytest.fixture
def victim_dir() -> Iterator[str]:
  """A world-writable directory with a world-writable file: only the sandbox stands in the way."""
  path = tempfile.mkdtemp(prefix="mimo-sandbox-victim-")
  os.chmod(path, 0o777)
  with open(os.path.join(path, "victim.txt"), "w") as f:
    f.write("original")
  os.chmod(os.path.join(path, "victim.txt"), 0o666)
  yield path
  for name in os.listdir(path):
    os.remove(os.path.join(path, name))
  os.rmdir(path)


def test_cannot_write_outside_its_directory(mode: str | None, victim_dir: str) -> None:
  victim = os.path.join(victim_dir, "victim.txt")
  attempts = [
    f"open({victim!r}, 'w').write('pwned')",
    f"open({victim!r}, 'a').write('pwned')",
    f"os.remove({victim!r})",
    f"os.rename({victim!r}, {victim + '.moved'!r})",
    f"open({os.path.join(victim_dir, 'new.txt')!r}, 'w').write('pwned')",
    f"os.close(os.open({os.path.join(victim_dir, 'new2.txt')!r}, os.O_WRONLY | os.O_CREAT))",
    f"os.mkdir({os.path.join(victim_dir, 'newdir')!r})",
  ]
  lines = ["import os"]
  for i, attempt in enumerate(attempts):
    lines += [
      "try:",
      f"  {attempt}",
      f"  print('done {i}')",
      "except OSError as e:",
      f"  print('blocked {i}', e.errno)",
    ]
  result = _run("\n".join(lines), mode)
  assert result.ok, result.stderr
  assert "done" not in result.stdout
  assert result.stdout.count("blocked") == len(attempts)
  assert sorted(os.listdir(victim_dir)) == ["victim.txt"]
  with open(victim) as f:
    assert f.read() == "original"


def test_file_size_limit(mode: str | None) -> None:
  code = (
    "try:\n"
    "  with open('big.bin', 'wb') as f:\n"
    "    for _ in range(8):\n"
    "      f.write(b'x' * (1 << 20))\n"
    "except OSError as e:\n"
    "  print('refused', e.errno)\n"
    "import os\n"
    "print(os.path.getsize('big.bin'))\n"
  )
  result = _run(code, mode, file_size_mb=2)
  assert result.ok, result.stderr
  refused, size = result.stdout.splitlines()
  assert refused == "refused 27"  # EFBIG
  assert int(size) <= 2 << 20


def test_output_is_truncated(mode: str | None) -> None:
  finite = _run("import sys\nsys.stdout.write('y' * 200000)\nsys.stderr.write('z' * 5000)", mode, max_output_bytes=1000)
  assert finite.ok
  assert finite.stdout == "y" * 1000 and finite.stdout_truncated
  assert finite.stderr == "z" * 1000 and finite.stderr_truncated
  flood = _run("import sys\nwhile True:\n  sys.stdout.write('x' * 65536)", mode, max_output_bytes=1000, timeout_s=1.5)
  assert flood.timed_out and flood.stdout_truncated
  assert flood.stdout == "x" * 1000


# ---- secrets and network ------------------------------------------------------------------


def test_parent_environment_is_not_visible(mode: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
  secret = "mimo-secret-3f9a1c77"
  monkeypatch.setenv("MIMO_SANDBOX_TEST_SECRET", secret)
  code = (
    "import os\n"
    "print(dict(os.environ))\n"
    "for pid in sorted({os.getppid(), 1} | {int(p) for p in os.listdir('/proc') if p.isdigit()}):\n"
    "  try:\n"
    "    with open(f'/proc/{pid}/environ', 'rb') as f:\n"
    "      print(pid, f.read())\n"
    "  except OSError as e:\n"
    "    print(pid, 'unreadable', e.errno)\n"
  )
  result = _run(code, mode)
  assert result.ok, result.stderr
  assert "MIMO_SANDBOX_TEST_SECRET" not in result.stdout + result.stderr
  assert secret not in result.stdout + result.stderr
  env = ast.literal_eval(result.stdout.splitlines()[0])
  assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL"}


def test_cannot_connect_to_a_local_listener(mode: str | None) -> None:
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("127.0.0.1", 0))
  server.listen(4)
  server.settimeout(0.2)
  port = server.getsockname()[1]
  received: list[bytes] = []
  stop = threading.Event()

  def accept() -> None:
    while not stop.is_set():
      try:
        conn, _ = server.accept()
      except OSError:
        continue
      with conn:
        conn.settimeout(1.0)
        try:
          received.append(conn.recv(100) or b"<connected>")
        except OSError:
          received.append(b"<connected>")

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  code = (
    "import socket\n"
    "for attempt in ('socket', 'create_connection'):\n"
    "  try:\n"
    "    if attempt == 'socket':\n"
    "      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
    "      s.settimeout(2)\n"
    f"      s.connect(('127.0.0.1', {port}))\n"
    "    else:\n"
    f"      s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    "    s.sendall(b'leak')\n"
    "    print('connected')\n"
    "  except OSError as e:\n"
    "    print('failed', type(e).__name__)\n"
  )
  try:
    result = _run(code, mode)
    time.sleep(0.3)
  finally:
    stop.set()
    thread.join()
    server.close()
  assert result.ok, result.stderr
  lines = result.stdout.splitlines()
  assert len(lines) == 2 and all(line.startswith("failed ") for line in lines), lines
  assert received == []


# ---- isolation report and arguments ------------------------------------------------------


def test_isolation_report_matches_what_code_observes() -> None:
  iso = sandbox.isolation()
  assert iso.mode in ("namespace", "guard")
  assert os.path.isabs(iso.python) and os.access(iso.python, os.X_OK)
  assert sandbox.network_isolation() == iso.network
  assert sandbox.filesystem_isolation() == iso.filesystem
  if iso.mode == "namespace":
    assert (iso.network, iso.filesystem, iso.processes) == ("namespace", "read-only-mounts", "pid-namespace")
    assert iso.proc in ("private", "hidden")
    result = run_python("import os, socket\nprint([n for _, n in socket.if_nameindex()])\nprint(os.getpid())")
    assert result.stdout.split() == ["['lo']", "2"]
  else:
    assert (iso.network, iso.filesystem) == ("python-guard", "python-guard")
    assert iso.reason


def test_host_mounts_are_untouched() -> None:
  with open("/proc/self/mountinfo") as f:
    before = f.read()
  result = run_python("print(open('/proc/self/mountinfo').read())")
  with open("/proc/self/mountinfo") as f:
    after = f.read()
  assert result.ok and after == before
  if result.isolation == "namespace":
    # Inside, every reachable mount but the working directory's tmpfs is read-only.  A mount
    # is unreachable when another one is stacked on it at the same mount point.
    inside = [line.split() for line in result.stdout.splitlines() if line.strip()]
    shadowed = {(fields[1], fields[4]) for fields in inside}
    reachable = [fields for fields in inside if (fields[0], fields[4]) not in shadowed]
    writable = [fields[4] for fields in reachable if "rw" in fields[5].split(",")]
    assert len(writable) == 1 and writable[0].endswith("/work"), writable
    assert len(reachable) > 1


def test_forcing_an_unavailable_namespace_mode_fails(monkeypatch: pytest.MonkeyPatch) -> None:
  guard = dataclasses.replace(sandbox.isolation(), mode="guard", reason="forced by the test")
  monkeypatch.setattr(sandbox, "isolation", lambda: guard)
  with pytest.raises(sandbox.SandboxError, match="forced by the test"):
    run_python("print(1)", mode="namespace")
  assert run_python("print(1)").isolation == "guard"


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"memory_mb": 8}, "memory_mb"),
    ({"max_output_bytes": -1}, "max_output_bytes"),
    ({"max_processes": 0}, "max_processes"),
    ({"mode": "chroot"}, "mode"),
  ],
)
def test_rejects_bad_arguments(kwargs: dict[str, object], message: str) -> None:
  with pytest.raises(ValueError, match=message):
    run_python("print(1)", **kwargs)  # type: ignore[arg-type]
