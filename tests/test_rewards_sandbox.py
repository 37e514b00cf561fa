"""Tests for ``mimo_jax.rewards.sandbox``: hostile programs must be contained and the host must stay healthy.

Every behavioural test runs in the mode the machine supports (``auto``: namespace mode
where user namespaces work) and in the Python-guard fallback (``guard``), which must
contain the same naive attacks.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import shutil
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


def _processes_in_pid_namespace(ns: str) -> list[int]:
  """Pids of live processes in the PID namespace ``ns`` (``readlink /proc/<pid>/ns/pid``)."""
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.readlink(f"/proc/{entry}/ns/pid") == ns:
          found.append(int(entry))
      except OSError:
        continue
  return found


def _wait_until_gone(text: str, seconds: float = 60.0) -> list[int]:
  """Waits until no process mentions ``text``: a host path (guard mode) or a ``pid:[...]`` namespace."""
  find = _processes_in_pid_namespace if text.startswith("pid:[") else _processes_mentioning
  end = time.monotonic() + seconds
  left = find(text)
  while left and time.monotonic() < end:
    time.sleep(0.05)
    left = find(text)
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


def test_code_runs_as_main_in_a_fresh_directory_that_is_removed(
  mode: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
  code = "import os\nprint(__name__)\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('scratch.txt', 'w').write('ok')"
  made: list[str] = []
  mkdtemp = tempfile.mkdtemp

  def recording_mkdtemp(*args: object, **kwargs: object) -> str:
    made.append(mkdtemp(*args, **kwargs))  # type: ignore[arg-type]
    return made[-1]

  monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording_mkdtemp)
  result = _run(code, mode)
  assert result.ok, result.stderr
  name, cwd, listing = result.stdout.splitlines()
  assert name == "__main__"
  assert listing == "[]"
  if result.isolation == "namespace":
    assert cwd == "/work"  # its own root: the host's path of the directory is not even visible
  else:
    assert os.path.basename(os.path.dirname(cwd)).startswith("mimo-sandbox-")
  assert made and all(os.path.basename(d).startswith("mimo-sandbox-") for d in made)  # (and the probe's)
  assert not any(os.path.exists(d) for d in made)  # removed afterwards


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
    "print(os.getcwd(), os.readlink('/proc/self/ns/pid'), flush=True)\n"
    "while True:\n"
    "  try:\n"
    "    if os.fork() == 0:\n"
    f"      {child}\n"
    "  except OSError:\n"
    "    pass\n"
  )
  result = _run(code, mode, timeout_s=1.5)
  assert result.timed_out
  cwd, pid_ns = result.stdout.splitlines()[0].split()
  if result.isolation == "namespace":
    assert _wait_until_gone(pid_ns) == []  # nothing left in its PID namespace
  else:
    root = os.path.dirname(cwd)
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
    assert (iso.network, iso.filesystem, iso.processes) == ("namespace", "minimal-root", "pid-namespace")
    assert iso.proc in ("private", "hidden") and iso.oom_score_adj == 1000
    code = (
      "import os\nprint([l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]])\nprint(os.getpid())"
    )
    result = run_python(code)
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


# ---- attacks an adversarial policy would try (namespace mode: the kernel's guarantees) -------


def _outcomes(result: SandboxResult) -> dict[str, str]:
  assert result.ok, result.stderr
  return dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)


_TRY = (
  "import errno, os, socket, sys\n"
  # Guard mode's Python-level block on ctypes is one line to undo: the kernel filter must hold anyway.
  "for name in ('ctypes', '_ctypes'):\n"
  "  sys.modules.pop(name, None)\n"
  "def attempt(name, fn):\n"
  "  try:\n"
  "    fn()\n"
  "    print(name, 'done', flush=True)\n"
  "  except OSError as e:\n"
  "    print(name, errno.errorcode.get(e.errno, type(e).__name__), flush=True)\n"
)


def test_host_unix_sockets_are_unreachable(mode: str | None, tmp_path: os.PathLike[str]) -> None:
  """Pathname and abstract unix sockets on the host, the reward pool's forkserver among them."""
  import multiprocessing
  from multiprocessing import forkserver

  ctx = multiprocessing.get_context("forkserver")
  proc = ctx.Process(target=print, args=("",))
  proc.start()
  proc.join()
  forkserver_address = forkserver._forkserver._forkserver_address  # the socket that unpickles what it gets
  assert forkserver_address and os.path.exists(forkserver_address)
  listen_dir = tempfile.mkdtemp()
  os.chmod(listen_dir, 0o755)
  pathname = os.path.join(listen_dir, "trainer.sock")
  abstract = f"\0mimo-sandbox-test-{os.getpid()}"
  servers = []
  for address in (pathname, abstract):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(4)
    servers.append(server)
  os.chmod(pathname, 0o777)
  lines = [_TRY]
  for name, address in (("forkserver", forkserver_address), ("pathname", pathname), ("abstract", abstract)):
    lines.append(f"attempt({name!r}, lambda: socket.socket(socket.AF_UNIX).connect({address!r}))")
  lines.append("attempt('socketpair', lambda: socket.socketpair())")  # between its own processes: allowed
  try:
    outcomes = _outcomes(_run("\n".join(lines), mode))
  finally:
    for server in servers:
      server.close()
    shutil.rmtree(listen_dir, ignore_errors=True)
  assert outcomes.pop("socketpair") == "done"
  assert outcomes == {"forkserver": "EPERM", "pathname": "EPERM", "abstract": "EPERM"}, outcomes


def test_host_files_and_directories_are_invisible(tmp_path: os.PathLike[str]) -> None:
  """Training data (with its solutions), run directories, /tmp, home: not there at all."""
  from mimo_jax.tasks import humaneval

  secret_dir = tempfile.mkdtemp()  # a run directory, say
  os.chmod(secret_dir, 0o755)
  secret = os.path.join(secret_dir, "answers.jsonl")
  with open(secret, "w") as f:
    f.write("canonical solution\n")
  os.chmod(secret, 0o644)
  targets = [
    secret,
    secret_dir,
    humaneval.DEFAULT_TRAIN_PATH,
    os.getcwd(),
    "/tmp",
    "/run",
    "/root",
    "/home",
    os.path.expanduser("~"),
    sys.prefix,
    "/etc/passwd",
    "/dev/shm",
    os.path.dirname(sandbox.__file__),
  ]
  code = _TRY + "".join(f"attempt({t!r}, lambda: os.stat({t!r}))\n" for t in targets)
  try:
    outcomes = _outcomes(run_python(code, mode="namespace"))
  finally:
    shutil.rmtree(secret_dir, ignore_errors=True)
  for target in targets:
    assert outcomes[target] == "ENOENT", (target, outcomes[target])
  # What the code does see: the system's read-only tree, with every site-packages tree masked empty.
  masked = [path for kind, path, _ in sandbox._root_layout(sandbox.isolation().python) if kind == "mask"]
  assert masked and any(os.listdir(path) for path in masked)  # not all empty on the host
  listing = run_python(
    f"import os\nprint(sorted(os.listdir('/')))\nprint([os.listdir(p) for p in {masked!r}])", mode="namespace"
  )
  top = ast.literal_eval(listing.stdout.splitlines()[0])
  assert ast.literal_eval(listing.stdout.splitlines()[1]) == [[] for _ in masked]
  assert set(top) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "main.py", "proc", "sbin", "usr", "work"}


def test_shared_memory_cannot_escape_the_memory_limit(mode: str | None) -> None:
  code = _TRY + (
    "import ctypes\n"
    "attempt('memfd', lambda: os.memfd_create('hoard'))\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def sysv():\n"
    "  if libc.shmget(0, 64 << 20, 0o1600) < 0:\n"
    "    raise OSError(ctypes.get_errno(), 'shmget')\n"
    "attempt('shmget', sysv)\n"
    "def mqueue():\n"
    "  if libc.syscall(240 if os.uname().machine == 'x86_64' else 180, b'/hoard', 0o100 | 2, 0o600, None) < 0:\n"
    "    raise OSError(ctypes.get_errno(), 'mq_open')\n"
    "attempt('mq_open', mqueue)\n"
    "def sem():\n"  # SysV semaphore arrays and message queues: kernel memory, as shared memory is
    "  if libc.semget(0, 32000, 0o1600) < 0:\n"
    "    raise OSError(ctypes.get_errno(), 'semget')\n"
    "attempt('semget', sem)\n"
    "def msg():\n"
    "  if libc.msgget(0, 0o1600) < 0:\n"
    "    raise OSError(ctypes.get_errno(), 'msgget')\n"
    "attempt('msgget', msg)\n"
  )
  outcomes = _outcomes(_run(code, mode))
  expected = {"memfd": "EPERM", "shmget": "EPERM", "mq_open": "EPERM", "semget": "EPERM", "msgget": "EPERM"}
  assert outcomes == expected, outcomes


def test_dev_shm_is_absent_and_the_working_tmpfs_is_bounded() -> None:
  code = _TRY + (
    "attempt('dev_shm', lambda: open('/dev/shm/hoard', 'wb'))\n"
    "def fill():\n"
    "  with open('big', 'wb') as f:\n"
    "    for _ in range(100):\n"
    "      f.write(b'x' * (1 << 20))\n"
    "attempt('fill', fill)\n"
  )
  outcomes = _outcomes(run_python(code, mode="namespace", file_size_mb=200))
  assert outcomes == {"dev_shm": "ENOENT", "fill": "ENOSPC"}, outcomes  # 64 MiB tmpfs, whatever RLIMIT_FSIZE says


def test_the_sandbox_is_the_oom_killers_first_choice(mode: str | None) -> None:
  result = _run("print(open('/proc/self/oom_score_adj').read().strip())", mode)
  assert result.ok and result.stdout.strip() == "1000", result
  with open("/proc/self/oom_score_adj") as f:
    assert int(f.read()) < 1000  # the trainer's own score is untouched


def test_no_nested_namespaces_mounts_or_io_uring(mode: str | None) -> None:
  code = _TRY + (
    "import ctypes, signal\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "x86 = os.uname().machine == 'x86_64'\n"
    "def sys(name, nr_x86, nr_arm, *args):\n"
    "  libc.syscall.restype = ctypes.c_long\n"
    "  if libc.syscall(nr_x86 if x86 else nr_arm, *args) < 0:\n"
    "    raise OSError(ctypes.get_errno(), name)\n"
    "attempt('unshare_user', lambda: sys('unshare', 272, 97, 0x10000000))\n"
    "attempt('clone_newuser', lambda: sys('clone', 56, 220, 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0))\n"
    "attempt('clone3', lambda: sys('clone3', 435, 435, None, 0))\n"
    "attempt('io_uring', lambda: sys('io_uring_setup', 425, 425, 8, None))\n"
    "attempt('mount', lambda: sys('mount', 165, 40, b'none', b'/work', b'tmpfs', 0, None))\n"
    "attempt('ptrace', lambda: sys('ptrace', 101, 117, 16, 1, 0, 0))\n"
    "attempt('pidfd_send_signal', lambda: sys('pidfd_send_signal', 424, 424, 0, 9, None, 0))\n"
    "pid = os.fork()\n"  # plain fork and threads still work
    "if pid == 0:\n"
    "  os._exit(7)\n"
    "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
  )
  outcomes = _outcomes(_run(code, mode))
  expected = {
    name: "EPERM" for name in ("unshare_user", "clone_newuser", "io_uring", "mount", "ptrace", "pidfd_send_signal")
  }
  assert outcomes == {**expected, "clone3": "ENOSYS", "fork": "7"}, outcomes


def _run_bpf(program: list[tuple[int, int, int, int]], nr: int, arch: int, arg0: int = 0) -> int:
  """A classic-BPF interpreter for the four instructions the filter uses: the test's oracle."""
  data = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF}
  acc, pc = 0, 0
  while True:
    code, jt, jf, k = program[pc]
    pc += 1
    if code == 0x20:
      acc = data[k]
    elif code in (0x15, 0x35, 0x45):
      taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
      pc += jt if taken else jf
    elif code == 0x06:
      return k
    else:
      raise AssertionError(f"unexpected opcode {code:#x}")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_syscall_filter_decisions(machine: str) -> None:
  program = sandbox.seccomp_program(machine)
  table = sandbox._SYSCALLS[machine]
  arch = table["arch"]
  allow, eperm, enosys, kill = 0x7FFF0000, 0x00050001, 0x00050026, 0x80000000
  for name, nr in table["deny"].items():
    assert _run_bpf(program, nr, arch) == eperm, name
  read, write = (0, 1) if machine == "x86_64" else (63, 64)
  assert _run_bpf(program, read, arch) == allow and _run_bpf(program, write, arch) == allow
  assert _run_bpf(program, table["clone"], arch, 0x01200011) == allow  # what fork() passes
  assert _run_bpf(program, table["clone"], arch, 0x003D0F00) == allow  # what pthread_create passes
  for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
    assert _run_bpf(program, table["clone"], arch, 0x01200011 | flag) == eperm, hex(flag)
  assert _run_bpf(program, table["clone3"], arch) == enosys
  assert _run_bpf(program, read, 0x40000003) == kill  # i386 calls on x86_64: another syscall table
  if table["x32_bit"]:
    assert _run_bpf(program, table["x32_bit"] | read, arch) == eperm
  assert sandbox.seccomp_program("riscv64") is None
