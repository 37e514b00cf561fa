"""Runs untrusted Python (model completions) in a separate, resource-limited process.

:func:`run_python` writes the code to a fresh temporary directory, starts it in a new
session under a small launcher and returns a :class:`SandboxResult`.  It is meant for
verifying generated code in an RL loop: many short runs (about 0.05-0.1 s of overhead
each), concurrently from a thread pool, on a machine that must stay healthy whatever the
code does.  It needs neither root nor a setuid helper, and uses no ``preexec_fn`` (unsafe
in a multi-threaded trainer): all set-up happens in the launcher, a separate interpreter.

Process tree (``P0`` is the launcher started by :class:`subprocess.Popen`)::

  trainer -> P0 (session leader) -> C1 (supervisor, reaper) -> C2 (the code, an exec'd interpreter)

C1 reports C2's exit status to the trainer over a private pipe that C2 never holds, so
the status cannot be forged by printing.  The code runs as ``__main__`` from
``<dir>/main.py``; its working directory ``<dir>/work`` is the only place it may write,
and ``<dir>`` is deleted afterwards.

Isolation modes, chosen once per process by a probe that checks them from the inside
(see :func:`isolation`, :func:`network_isolation`, :func:`filesystem_isolation`):

``"namespace"`` (when the kernel lets an unprivileged process create user namespaces,
the default on most Linux distributions; verified on this project's machines):
  * P0 enters new user, mount, network, PID, IPC and UTS namespaces.  C1 is PID 1 of the
    new PID namespace: when it exits, the kernel kills every process the code created,
    however it detached itself (``setsid``, double forks), and C1 reaps them.  The code
    cannot see or signal any process outside the sandbox.
  * Network: the namespace has only a loopback device, down, so no connection to
    anything, the host's 127.0.0.1 included, is possible.  A kernel guarantee.
  * Filesystem: every mount is remounted read-only inside the sandbox's private mount
    namespace (the host's mounts are untouched); the only writable place is the working
    directory, a fresh tmpfs of at most 64 MiB and 4096 inodes.  A new ``/proc`` of the
    PID namespace hides the trainer's processes and their environments (where a kernel
    refuses to mount one, an empty tmpfs hides ``/proc``).  A kernel guarantee for
    writes; files stay *readable* as far as ordinary permissions allow.
  * Privileges: the code runs as namespace root with an empty capability bounding set,
    no capabilities and ``no_new_privs``, so it cannot undo the read-only mounts.

``"guard"`` (the fallback where user namespaces are unavailable):
  * The resource limits, scrubbed environment, uid switch and clean-up below still
    hold; C1 is a child subreaper that kills whatever the code left behind.
  * Everything else is a Python-level guard installed before the code runs: sockets
    other than ``AF_UNIX`` refused, writes and path changes outside the working
    directory refused, ``/proc/<other pid>`` unreadable, signals only to the code's own
    descendants, ``setsid``/``setpgid`` and running other programs refused, ``ctypes``
    unimportable.  These guards stop accidents and naive attacks, **not** determined
    code: native extensions, ``sys.modules`` tricks or gaps in the guard bypass them, and
    a process that escapes the process group can outlive the run (bounded in CPU time by
    ``RLIMIT_CPU``, not in wall time).  Treat this mode as best effort.

In both modes:
  * Identity: if the trainer runs as root, the code runs as uid/gid 65534 (nobody), so
    it has no host privileges (even after escaping a namespace), cannot write the
    trainer's files, read its ``/proc/<pid>/environ`` or signal it, and
    ``RLIMIT_NPROC`` applies (the kernel exempts real root from it).  The code's
    interpreter must then be runnable by nobody: the trainer's own if possible, else the
    first ``pythonX.Y`` of the same version in ``/usr/local/bin``, ``/usr/bin`` or
    ``/bin`` (:attr:`SandboxIsolation.python`; ``notes`` says when it differs).
  * Wall clock: at ``timeout_s`` the trainer asks the launcher to stop; C1 kills the
    code (the PID namespace, or in guard mode the code's process group) and reaps it.
    The launcher's process group is SIGKILLed afterwards in any case.
  * ``RLIMIT_CPU``: ``ceil(timeout_s) + 1`` CPU seconds *per process* (SIGXCPU, then
    SIGKILL a second later), a backstop for anything that escapes the wall clock.
  * ``RLIMIT_AS``: ``memory_mb`` of address space *per process*.  Not a cgroup: the code
    may run up to ``max_processes`` processes, each with that much.
  * ``RLIMIT_NPROC``: ``max_processes`` tasks (processes and threads) beyond the
    sandbox's own three.  In namespace mode (Linux 5.14+) the kernel counts tasks per
    user namespace, so the limit is exact; otherwise it counts every task of the uid,
    the limit is that count plus ``max_processes``, and concurrent sandboxes of one uid
    share a pool of that size.
  * ``RLIMIT_FSIZE`` (largest file, ``file_size_mb``), ``RLIMIT_NOFILE`` (256 open
    files), ``RLIMIT_CORE`` 0 (no core dumps).
  * Output: stdout and stderr are each cut to ``max_output_bytes``; the rest is read and
    discarded, so a flood neither blocks the code nor fills the trainer's memory.
  * Environment: only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and ``LC_ALL``; nothing is
    inherited from the trainer.  The interpreter runs with ``-I -S -B``: no ``PYTHON*``
    variables, no site-packages (only the standard library), no bytecode files.
  * The code's process is non-dumpable, so processes it starts cannot read its memory or
    open its file descriptors through ``/proc`` (:mod:`mimo_jax.rewards.code` relies on it).

Not covered: CPU and memory are not isolated from other workloads (no cgroups), the
total memory of several processes is bounded only as above, world-readable files can be
read, and timing side channels exist.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pwd
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Literal

__all__ = [
  "IsolationMode",
  "SandboxError",
  "SandboxIsolation",
  "SandboxResult",
  "filesystem_isolation",
  "isolation",
  "network_isolation",
  "run_python",
]

IsolationMode = Literal["namespace", "guard"]

# uid/gid the sandbox switches to when the trainer runs as root.
_NOBODY = 65534
# Size and inode limit of the writable tmpfs working directory in namespace mode.
_SCRATCH_MB = 64
_SCRATCH_INODES = 4096
_MAX_OPEN_FILES = 256
# Tasks of the sandbox itself that count against RLIMIT_NPROC: P0, C1 and C2.
_OWN_TASKS = 3
# After the launcher exits, how long the trainer still reads output from stragglers.
_EXIT_GRACE_S = 0.2
_CONTROL_LIMIT = 1 << 16
# Prefix of the working directory; the code itself lives in <dir>/main.py, its cwd is <dir>/work.
_DIR_PREFIX = "mimo-sandbox-"


class SandboxError(RuntimeError):
  """The sandbox itself could not be set up (never raised for anything the code does)."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What a sandboxed run did.

  Attributes:
    exit_code: the code's exit status, or None if it was killed by a signal (or by the
      wall-clock timeout).
    signal: the number of the signal that killed it, or None if it exited.  A timeout
      reads ``signal.SIGKILL``.
    stdout: standard output, decoded as UTF-8 (invalid bytes replaced), at most
      ``max_output_bytes`` bytes of it.
    stderr: standard error, likewise.
    stdout_truncated: whether stdout was longer than ``max_output_bytes``.
    stderr_truncated: whether stderr was longer than ``max_output_bytes``.
    timed_out: whether the wall-clock limit killed it.
    wall_s: seconds from start to the end of the run, set-up included.
    isolation: the mode it ran in, ``"namespace"`` or ``"guard"`` (see the module docstring).
  """

  exit_code: int | None
  signal: int | None
  stdout: str
  stderr: str
  stdout_truncated: bool
  stderr_truncated: bool
  timed_out: bool
  wall_s: float
  isolation: str

  @property
  def ok(self) -> bool:
    """Whether the code exited by itself with status 0 within the time limit."""
    return self.exit_code == 0 and not self.timed_out


@dataclasses.dataclass(frozen=True)
class SandboxIsolation:
  """The isolation :func:`run_python` actually gets on this machine, as measured by a probe run.

  Attributes:
    mode: ``"namespace"`` or ``"guard"``.
    network: ``"namespace"`` (empty network namespace, verified: no interface but
      loopback and no connection to 127.0.0.1) or ``"python-guard"``.
    filesystem: ``"read-only-mounts"`` (verified: writes to ``/``, ``/tmp``, ``/dev/shm``
      and the sandbox directory fail) or ``"python-guard"``.
    processes: ``"pid-namespace"`` or ``"process-group"``.
    proc: ``"private"`` (a new ``/proc`` of the PID namespace), ``"hidden"`` (an empty
      tmpfs over ``/proc``) or ``"host"``.
    uid: the host uid the code runs as.
    python: the interpreter that runs the code.
    reason: why namespace mode is not used (empty in namespace mode).
    notes: anything else worth knowing (mounts that could not be made read-only, a
      substitute interpreter, root's uid kept).
  """

  mode: str
  network: str
  filesystem: str
  processes: str
  proc: str
  uid: int
  python: str
  reason: str = ""
  notes: str = ""


# ---- code run inside the sandbox ---------------------------------------------------------

# The launcher: P0, then (forked) C1 and C2.  Runs as ``python -I -S -B -c _LAUNCHER <json>``.
# Every failure before C2 runs the code is reported on the control pipe as "setup-error".
_LAUNCHER = r"""
# Every import comes first: after switching to nobody, the stdlib may no longer be readable.
import ctypes, errno, json, os, re, resource, signal, sys

cfg = json.loads(sys.argv[1])
ctl = cfg["ctl_fd"]
os.set_inheritable(ctl, False)
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 36, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = (
  1024, 2048, 4096, 16384, 1 << 18, 1 << 21, 1 << 24)
LOCKED = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
          "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
STOP_SIGNALS = {signal.SIGTERM, signal.SIGCHLD}
NAMESPACES = 0x10000000 | 0x00020000 | 0x40000000 | 0x20000000 | 0x08000000 | 0x04000000
namespace = cfg["mode"] == "namespace"


def say(line):
  try:
    os.write(ctl, (line.replace("\n", " ") + "\n").encode())
  except OSError:
    pass


def fail(stage, exc):
  say("setup-error %s: %s" % (stage, exc))
  os._exit(1)


def call(ret, what):
  if ret != 0:
    e = ctypes.get_errno()
    raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def prctl(option, arg):
  call(libc.prctl(option, arg, 0, 0, 0), "prctl(%d)" % option)


def mount(source, target, fstype, flags, data):
  enc = lambda s: None if s is None else s.encode()
  call(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)


def quiet_stdio():
  null = os.open("/dev/null", os.O_RDWR)
  for fd in (0, 1, 2):
    os.dup2(null, fd)
  os.close(null)


def setup_mounts():
  mounts = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      fields = line.split()
      target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
      flags = 0
      for opt in fields[5].split(","):
        flags |= LOCKED.get(opt, 0)
      mounts.append((target, flags))
  mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing below propagates to the host
  # Read-only first, the host's /proc included (shadowed by the new one below, but still there).
  failed = []
  done = set()
  for target, flags in mounts:
    if target in done:
      continue
    done.add(target)
    try:
      mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)
    except OSError as e:
      if target == "/":
        raise
      failed.append("%s:%s" % (target.replace(" ", "\\040"), errno_name(e.errno)))
  try:
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, None)
    proc = "private"
  except OSError:
    try:
      mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0555")
      proc = "hidden"
    except OSError:
      proc = "host"
  mount("tmpfs", cfg["scratch"], "tmpfs", MS_NOSUID | MS_NODEV,
        "size=%dm,nr_inodes=%d,mode=0700" % (cfg["scratch_mb"], cfg["scratch_inodes"]))
  say("mounts proc=%s read-only=%d failed=%s" % (proc, len(done) - len(failed), ",".join(failed) or "-"))


def errno_name(n):
  return errno.errorcode.get(n, str(n))


def run_c2():
  try:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # C1 blocked some; a mask survives execve
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for name, (soft, hard) in cfg["rlimits"].items():
      resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
    if namespace:
      for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
          if ctypes.get_errno() == 22:  # EINVAL: past the last capability
            break
          call(-1, "drop capability %d" % cap)
    else:
      os.setpgid(0, 0)  # its own group, which the trainer kills on timeout while C1 reaps the orphans
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    os.chdir(cfg["scratch"])
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
  except BaseException as e:
    fail("exec", e)


def own_children():
  me = os.getpid()
  try:
    with open("/proc/self/task/%d/children" % me) as f:
      return [int(pid) for pid in f.read().split()]
  except OSError:  # a kernel without CONFIG_PROC_CHILDREN: scan every process
    children = []
    for entry in os.listdir("/proc"):
      if entry.isdigit():
        try:
          with open("/proc/%s/stat" % entry) as f:
            stat = f.read()
        except OSError:
          continue
        if int(stat.rpartition(")")[2].split()[1]) == me:
          children.append(int(entry))
    return children


def run_c1(p0):
  try:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() not in (p0, 0):  # 0: our parent is outside the new PID namespace
      os._exit(1)
    if namespace:
      setup_mounts()
    else:
      prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_DUMPABLE, 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    c2 = os.fork()
  except BaseException as e:
    fail("supervisor", e)
  if c2 == 0:
    run_c2()
  if not namespace:
    try:
      os.setpgid(c2, c2)  # also here, so the group exists before anything can signal it
    except OSError:
      pass
  quiet_stdio()
  # Reap children (as the PID namespace's init: every orphan) until C2 is gone.  On SIGTERM
  # (forwarded by P0 when the trainer stops the run) kill the code: C2 is not reaped yet,
  # so neither its pid nor its group id can have been reused.
  status = None
  while True:
    try:
      pid, wait_status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:  # cannot happen before C2 is reaped
      os._exit(0)
    if pid == c2:
      status = wait_status
      break
    if pid != 0:
      continue  # an orphan: reap the next one without waiting
    info = signal.sigtimedwait(STOP_SIGNALS, 0.5)
    if info is not None and info.si_signo == signal.SIGTERM:
      try:
        if namespace:
          os.kill(-1, signal.SIGKILL)  # from the namespace's init: every other process in it
        else:
          os.killpg(c2, signal.SIGKILL)
      except OSError:
        pass
  if os.WIFSIGNALED(status):
    say("signal %d" % os.WTERMSIG(status))
  else:
    say("exit %d" % os.waitstatus_to_exitcode(status))
  if not namespace:
    # Subreaper: orphans of the code were re-parented to C1; kill them (the PID namespace does this otherwise).
    for _ in range(50):
      children = own_children()
      if not children:
        break
      for child in children:
        try:
          os.kill(child, signal.SIGKILL)
        except OSError:
          pass
      try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
          pass
      except ChildProcessError:
        pass
  os._exit(0)


try:
  if cfg["uid"] is not None:
    os.setgroups([])
    os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
  # After any uid change: a credential change clears the parent-death signal.
  prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  if namespace:
    uid, gid = os.getuid(), os.getgid()
    prctl(PR_SET_DUMPABLE, 1)  # a uid change made us non-dumpable, which hides /proc/self/*_map from us
    call(libc.unshare(NAMESPACES), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
      with open("/proc/self/" + name, "w") as f:
        f.write(text)
  prctl(PR_SET_DUMPABLE, 0)
  p0 = os.getpid()
  c1 = os.fork()
except BaseException as e:
  fail("namespaces" if namespace else "launcher", e)
if c1 == 0:
  run_c1(p0)
quiet_stdio()
# The trainer stops a run by sending SIGTERM here; it is forwarded to C1, which is not reaped
# before this loop ends, so its pid cannot have been reused.
signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
while True:
  pid, status = os.waitpid(c1, os.WNOHANG)
  if pid:
    break
  info = signal.sigtimedwait(STOP_SIGNALS, 0.5)
  if info is not None and info.si_signo == signal.SIGTERM:
    os.kill(c1, signal.SIGTERM)
if os.WIFSIGNALED(status):
  sig = os.WTERMSIG(status)
  signal.pthread_sigmask(signal.SIG_SETMASK, set())
  signal.signal(sig, signal.SIG_DFL)
  os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""

# C2's program: ``python -I -S -B -c _RUNNER <main.py> <mode> <workdir> <scratch>``.  It makes
# the process non-dumpable, installs the Python-level guards in guard mode, then runs
# main.py as ``__main__``.
_RUNNER = r"""
def _sandbox_prepare():
  import ctypes, sys
  ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
  path, mode, root, scratch = sys.argv[1:5]
  if mode == "guard":
    _sandbox_guard(root, scratch)
  if mode == "guard":
    for name in ("ctypes", "_ctypes"):
      sys.modules[name] = None
  sys.argv[:] = [path]
  with open(path, "rb") as f:
    source = f.read()
  return compile(source, path, "exec"), path


def _sandbox_guard(root, scratch):
  import builtins, io, os, posix, socket, _socket, subprocess
  realpath, getpid, getpgid = os.path.realpath, os.getpid, os.getpgid
  orig_open, orig_os_open, join = builtins.open, os.open, os.path.join
  scratch = realpath(scratch)
  allowed = (scratch, "/dev/null")

  def inside(path):
    if isinstance(path, int):
      return True
    full = realpath(os.fsdecode(path))
    return any(full == a or full.startswith(a + "/") for a in allowed)

  def readable(path):
    if isinstance(path, int):
      return True
    parts = realpath(os.fsdecode(path)).split("/")
    return not (len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != str(getpid()))

  def refuse(what, path):
    raise PermissionError(1, "sandbox: %s is not allowed" % what, os.fsdecode(path) if path is not None else None)

  def guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not inside(file):
      refuse("writing outside the working directory", file)
    if not readable(file):
      refuse("reading another process's /proc entry", file)
    return orig_open(file, mode, *args, **kwargs)

  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

  def guarded_os_open(path, flags, *args, **kwargs):
    if flags & write_flags and not inside(path):
      refuse("writing outside the working directory", path)
    if not readable(path):
      refuse("reading another process's /proc entry", path)
    return orig_os_open(path, flags, *args, **kwargs)

  builtins.open = io.open = guarded_open
  os.open = posix.open = guarded_os_open

  def path_guard(name, positions):
    orig = getattr(os, name, None)
    if orig is None:
      return

    def guarded(*args, **kwargs):
      for i in positions:
        if i < len(args) and not inside(args[i]):
          refuse("changing paths outside the working directory", args[i])
      return orig(*args, **kwargs)

    setattr(os, name, guarded)
    if hasattr(posix, name):
      setattr(posix, name, guarded)

  for name in ("remove", "unlink", "rmdir", "mkdir", "chmod", "chown", "lchown", "truncate", "utime",
               "mkfifo", "mknod", "chflags", "lchmod", "removexattr", "setxattr"):
    path_guard(name, (0,))
  for name in ("rename", "replace", "link"):
    path_guard(name, (0, 1))
  path_guard("symlink", (1,))

  def descends_from_me(pid):
    me = getpid()
    for _ in range(64):
      if pid == me:
        return True
      try:
        with orig_open("/proc/%d/stat" % pid) as f:
          pid = int(f.read().rpartition(")")[2].split()[1])
      except (OSError, ValueError, IndexError):
        return False
      if pid <= 1:
        return False
    return False

  orig_kill = os.kill

  def guarded_kill(pid, sig):
    if pid <= 0 or not descends_from_me(pid):
      raise PermissionError(1, "sandbox: signals only to the code's own processes")
    return orig_kill(pid, sig)

  def refused(what):
    def f(*args, **kwargs):
      raise PermissionError(1, "sandbox: %s is not allowed" % what)
    return f

  os.kill = posix.kill = guarded_kill
  for name in ("killpg", "setsid", "setpgid", "setpgrp", "system", "popen", "execv", "execve", "execl",
               "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle",
               "spawnlp", "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp"):
    if hasattr(os, name):
      setattr(os, name, refused(name))
    if hasattr(posix, name):
      setattr(posix, name, refused(name))
  subprocess.Popen = refused("starting programs")
  sys = __import__("sys")
  sys.modules["_posixsubprocess"] = None

  def check_family(family):
    if family != socket.AF_UNIX:
      raise PermissionError(1, "sandbox: network sockets are not allowed")

  base_socket, base_c_socket = socket.socket, _socket.socket

  class GuardedSocket(base_socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
      check_family(family)
      super().__init__(family, type, proto, fileno)

  class GuardedCSocket(base_c_socket):
    def __init__(self, family=-1, *args, **kwargs):
      check_family(family)
      super().__init__(family, *args, **kwargs)

  socket.socket = socket.SocketType = GuardedSocket
  _socket.socket = _socket.SocketType = GuardedCSocket
  socket.create_connection = refused("network connections")
  socket.getaddrinfo = refused("name resolution")


_sandbox_code, _sandbox_path = _sandbox_prepare()
del _sandbox_prepare, _sandbox_guard
exec(_sandbox_code, {"__name__": "__main__", "__file__": _sandbox_path, "__builtins__": __builtins__})
"""

# Probe run in namespace mode; prints one JSON object describing what it could and could not do.
_PROBE = r"""
import errno, json, os, socket
r = {"pid": os.getpid()}
try:
  with open("/proc/self/status") as f:
    r["cap_eff"] = [l.split()[1] for l in f if l.startswith("CapEff:")][0]
except OSError as e:
  r["cap_eff"] = "unreadable"
r["interfaces"] = [name for _, name in socket.if_nameindex()]
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(1.0)
try:
  s.connect(("127.0.0.1", 9))
  r["connect"] = "connected"
except OSError as e:
  r["connect"] = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
r["writes"] = {}
for d in ("/", "/tmp", "/dev/shm", os.path.dirname(os.getcwd())):
  try:
    with open(os.path.join(d, ".mimo-sandbox-probe-%d" % os.getpid()), "w") as f:
      f.write("x")
    r["writes"][d] = "written"
    os.unlink(os.path.join(d, ".mimo-sandbox-probe-%d" % os.getpid()))
  except OSError as e:
    r["writes"][d] = errno.errorcode.get(e.errno, str(e.errno))
with open("probe", "w") as f:
  f.write("ok")
r["scratch_writable"] = True
r["proc_pids"] = sum(1 for p in os.listdir("/proc") if p.isdigit())
print(json.dumps(r))
"""


# ---- the trainer's side --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Identity:
  """Who runs the code and with which interpreter."""

  uid: int | None  # None: keep the trainer's uid (it is not root)
  gid: int | None
  python: str  # the interpreter C2 executes; must be runnable by ``uid``
  tmpdir: str | None = None  # where sandbox directories go (None: tempfile's default); reachable by ``uid``
  note: str = ""


_identity_lock = threading.Lock()
_identity: _Identity | None = None

_INTERPRETER_CHECK = "import ctypes, json, resource, selectors, socket, subprocess, sys; print(sys.version_info[:2])"


def _python_candidates() -> list[str]:
  """Interpreters to try, best first: this one, then a system one of the same minor version."""
  version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
  candidates = [sys.executable, os.path.realpath(sys.executable), getattr(sys, "_base_executable", "")]
  for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
    candidates.append(os.path.join(directory, version))
  seen: list[str] = []
  for c in candidates:
    if c and os.path.isabs(c) and c not in seen:
      seen.append(c)
  return seen


def _runs_as(python: str, uid: int, gid: int) -> bool:
  """Whether ``python`` runs, with the modules the sandbox needs, as ``uid`` and reports our minor version."""
  try:
    done = subprocess.run(
      [python, "-I", "-S", "-B", "-c", _INTERPRETER_CHECK],
      user=uid,
      group=gid,
      extra_groups=[],
      env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
      cwd="/",
      stdin=subprocess.DEVNULL,
      capture_output=True,
      timeout=30,
      check=False,
    )
  except (OSError, subprocess.SubprocessError):
    return False
  return done.returncode == 0 and done.stdout.strip() == str(tuple(sys.version_info[:2])).encode()


def _reachable_by_others(path: str) -> bool:
  """Whether every directory from ``/`` down to ``path`` can be traversed by any user."""
  path = os.path.realpath(path)
  while True:
    try:
      if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    except OSError:
      return False
    if path == os.path.dirname(path):
      return True
    path = os.path.dirname(path)


def _sandbox_tmpdir() -> str | None:
  """A parent for sandbox directories that another uid can reach: tempfile's default, else /tmp."""
  if _reachable_by_others(tempfile.gettempdir()):
    return None
  if _reachable_by_others("/tmp") and os.access("/tmp", os.W_OK):
    return "/tmp"
  raise SandboxError(f"the temporary directory {tempfile.gettempdir()!r} cannot be reached by the sandbox's uid")


def _sandbox_identity() -> _Identity:
  """The uid, gid and interpreter of the code (computed once per process).

  As root the code runs as nobody, with the first interpreter of
  :func:`_python_candidates` that nobody can run (a trainer's interpreter under a
  private directory such as ``/root`` is not); if there is none, it keeps root's uid and
  the note says so.
  """
  global _identity
  with _identity_lock:
    if _identity is not None:
      return _identity
    if not sys.executable:
      raise SandboxError("sys.executable is empty: cannot find a Python interpreter for the sandbox")
    if os.geteuid() != 0:
      _identity = _Identity(None, None, sys.executable)
      return _identity
    try:
      entry = pwd.getpwnam("nobody")
      uid, gid = entry.pw_uid, entry.pw_gid
    except KeyError:
      uid, gid = _NOBODY, _NOBODY
    tmpdir = _sandbox_tmpdir()
    for python in _python_candidates():
      if _runs_as(python, uid, gid):
        note = "" if python == sys.executable else f"{sys.executable} is not runnable by uid {uid}; using {python}"
        _identity = _Identity(uid, gid, python, tmpdir, note)
        return _identity
    _identity = _Identity(
      None,
      None,
      sys.executable,
      note=f"no Python {sys.version_info[0]}.{sys.version_info[1]} runnable by uid {uid}: the code keeps root's uid "
      "(RLIMIT_NPROC does not apply to root)",
    )
    return _identity


def _count_tasks(uid: int) -> int:
  """Number of tasks (threads included) whose real uid is ``uid``: what RLIMIT_NPROC counts."""
  total = 0
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
        status = f.read()
    except OSError:
      continue
    real_uid = threads = None
    for line in status.splitlines():
      if line.startswith("Uid:"):
        real_uid = int(line.split()[1])
      elif line.startswith("Threads:"):
        threads = int(line.split()[1])
    if real_uid == uid:
      total += threads or 1
  return total


def _kernel_counts_nproc_per_namespace() -> bool:
  """Whether RLIMIT_NPROC is counted per user namespace (Linux 5.14 and later)."""
  try:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
  except ValueError:
    return False
  return (major, minor) >= (5, 14)


def _rmtree(path: str) -> None:
  """Deletes a sandbox directory, even one whose subdirectories the code made unreadable."""
  shutil.rmtree(path, ignore_errors=True)
  if os.path.lexists(path):
    for root, dirs, _ in os.walk(path):  # top-down: a directory is fixed before it is entered
      for name in dirs:
        try:  # never through a symlink the code planted: it could point anywhere
          fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
          try:
            fd = os.open(os.path.join(root, name), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
          except OSError:
            continue
        try:
          os.fchmod(fd, 0o700)
        except OSError:
          pass
        finally:
          os.close(fd)
    shutil.rmtree(path, ignore_errors=True)


def _status_of(control: bytes) -> tuple[str, int] | None:
  """The last ``exit N`` / ``signal N`` line of the control stream, if any."""
  found = None
  for line in control.decode("utf-8", errors="replace").splitlines():
    kind, _, value = line.partition(" ")
    if kind in ("exit", "signal") and value.strip().lstrip("-").isdigit():
      found = (kind, int(value))
  return found


def _launcher_exited(pid: int) -> bool:
  """Whether the launcher has exited, without reaping it (its pid stays reserved as the group id)."""
  try:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:
    return True


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _stop(proc: subprocess.Popen[bytes], streams: _Streams) -> None:
  """Stops a run that timed out, letting the sandbox kill and reap its own processes.

  SIGTERM to the launcher is forwarded to C1, which kills the code (the whole PID
  namespace, or the code's process group) and reaps it, so nothing is left as a zombie
  for the host's init.  If the launcher has not exited within a second and a half, the
  caller kills the launcher's process group.
  """
  proc.send_signal(signal.SIGTERM)
  end = time.monotonic() + 1.5
  while time.monotonic() < end and not _launcher_exited(proc.pid):
    streams.step(0.01)


class _Streams:
  """Non-blocking reader of the launcher's stdout, stderr and control pipe (and writer of its stdin)."""

  def __init__(self, proc: subprocess.Popen[bytes], ctl_fd: int, stdin: bytes, max_bytes: int) -> None:
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    self.proc = proc
    self.out, self.err, self.ctl, self.in_fd = proc.stdout.fileno(), proc.stderr.fileno(), ctl_fd, proc.stdin.fileno()
    self.limits = {self.out: max_bytes, self.err: max_bytes, self.ctl: _CONTROL_LIMIT}
    self.data = {fd: bytearray() for fd in self.limits}
    self.truncated = dict.fromkeys(self.limits, False)
    self.stdin, self.sent = stdin, 0
    self.sel = selectors.DefaultSelector()
    for fd in self.limits:
      os.set_blocking(fd, False)
      self.sel.register(fd, selectors.EVENT_READ)
    if stdin:
      os.set_blocking(self.in_fd, False)
      self.sel.register(self.in_fd, selectors.EVENT_WRITE)
    else:
      proc.stdin.close()

  def open(self) -> bool:
    return bool(self.sel.get_map())

  def step(self, timeout: float) -> None:
    """Moves whatever data is ready, waiting at most ``timeout`` seconds for some."""
    for key, _ in self.sel.select(max(timeout, 0.0)):
      fd = key.fd
      if fd == self.in_fd:
        try:
          self.sent += os.write(fd, self.stdin[self.sent : self.sent + 65536])
        except (BlockingIOError, InterruptedError):
          continue
        except OSError:  # the code closed its stdin or exited
          self.sent = len(self.stdin)
        if self.sent >= len(self.stdin):
          self.sel.unregister(fd)
          assert self.proc.stdin is not None
          self.proc.stdin.close()
        continue
      try:
        chunk = os.read(fd, 65536)
      except (BlockingIOError, InterruptedError):
        continue
      if not chunk:
        self.sel.unregister(fd)
        continue
      room = self.limits[fd] - len(self.data[fd])
      if len(chunk) > room:
        self.truncated[fd] = True
      self.data[fd] += chunk[: max(room, 0)]

  def close(self) -> None:
    self.sel.close()


def _execute(
  code: str,
  mode: str,
  *,
  timeout_s: float,
  memory_mb: int,
  stdin: str,
  max_output_bytes: int,
  max_processes: int,
  file_size_mb: int,
) -> tuple[SandboxResult, list[str]]:
  """Runs ``code`` in ``mode``; returns the result and the launcher's informational control lines."""
  start = time.monotonic()
  deadline = start + timeout_s
  identity = _sandbox_identity()
  uid, gid = identity.uid, identity.gid
  root = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=identity.tmpdir)
  ctl_r = ctl_w = -1
  proc: subprocess.Popen[bytes] | None = None
  streams: _Streams | None = None
  try:
    scratch = os.path.join(root, "work")
    main_path = os.path.join(root, "main.py")
    os.mkdir(scratch, 0o700)
    with open(main_path, "w", encoding="utf-8") as f:
      f.write(code)
    os.chmod(root, 0o755)
    os.chmod(main_path, 0o644)
    if uid is not None:
      os.chown(root, uid, gid)
      os.chown(scratch, uid, gid)
    host_uid = uid if uid is not None else os.getuid()
    base = _OWN_TASKS
    if mode != "namespace" or not _kernel_counts_nproc_per_namespace():
      base += _count_tasks(host_uid)
    cpu = math.ceil(timeout_s) + 1
    env = {
      "PATH": "/usr/local/bin:/usr/bin:/bin",
      "HOME": scratch,
      "TMPDIR": scratch,
      "LANG": "C.UTF-8",
      "LC_ALL": "C.UTF-8",
    }
    ctl_r, ctl_w = os.pipe()
    cfg = {
      "mode": mode,
      "ctl_fd": ctl_w,
      "uid": uid,
      "gid": gid,
      "scratch": scratch,
      "scratch_mb": _SCRATCH_MB,
      "scratch_inodes": _SCRATCH_INODES,
      "rlimits": {
        "CPU": [cpu, cpu + 1],
        "AS": [memory_mb << 20, memory_mb << 20],
        "FSIZE": [file_size_mb << 20, file_size_mb << 20],
        "NOFILE": [_MAX_OPEN_FILES, _MAX_OPEN_FILES],
        "CORE": [0, 0],
        "NPROC": [base + max_processes, base + max_processes],
      },
      "argv": [identity.python, "-I", "-S", "-B", "-c", _RUNNER, main_path, mode, root, scratch],
      "env": env,
    }
    proc = subprocess.Popen(
      [sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(cfg)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      cwd=root,
      env={"PATH": env["PATH"], "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
      start_new_session=True,
      pass_fds=(ctl_w,),
    )
    os.close(ctl_w)
    ctl_w = -1
    streams = _Streams(proc, ctl_r, stdin.encode("utf-8"), max_output_bytes)
    exited_at: float | None = None
    timed_out = False
    while streams.open():
      now = time.monotonic()
      if now >= deadline:
        timed_out = _status_of(streams.data[ctl_r]) is None
        break
      if exited_at is None and _launcher_exited(proc.pid):
        exited_at = now
      if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
        break  # stragglers holding the pipes open; killed below
      streams.step(min(deadline - now, 0.05))
    if timed_out:
      _stop(proc, streams)
    _kill_group(proc.pid)  # stragglers; the launcher is not reaped yet, so its group id is still ours
    returncode = proc.wait()
    while streams.open() and time.monotonic() < deadline + 2.0:  # the last control lines
      before = sum(len(d) for d in streams.data.values())
      streams.step(0.01)
      if sum(len(d) for d in streams.data.values()) == before:
        break
    out, err, control = bytes(streams.data[streams.out]), bytes(streams.data[streams.err]), bytes(streams.data[ctl_r])
    out_cut, err_cut = streams.truncated[streams.out], streams.truncated[streams.err]
  finally:
    if streams is not None:
      streams.close()
    if proc is not None:
      if proc.returncode is None:
        _kill_group(proc.pid)
        proc.wait()
      for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
          stream.close()
    for fd in (ctl_r, ctl_w):
      if fd >= 0:
        os.close(fd)
    _rmtree(root)
  lines = control.decode("utf-8", errors="replace").splitlines()
  for line in lines:
    if line.startswith("setup-error "):
      raise SandboxError(f"sandbox set-up failed in {mode} mode: {line[len('setup-error ') :]}")
  exit_code: int | None = None
  sig: int | None = None
  status = _status_of(control)
  if timed_out:
    sig = signal.SIGKILL
  elif status is not None:
    if status[0] == "exit":
      exit_code = status[1]
    else:
      sig = status[1]
  elif returncode < 0:  # C1 died without reporting (killed): the launcher re-raised its signal
    sig = -returncode
  else:
    exit_code = returncode
  result = SandboxResult(
    exit_code=exit_code,
    signal=sig,
    stdout=out.decode("utf-8", errors="replace"),
    stderr=err.decode("utf-8", errors="replace"),
    stdout_truncated=out_cut,
    stderr_truncated=err_cut,
    timed_out=timed_out,
    wall_s=time.monotonic() - start,
    isolation=mode,
  )
  info = [line for line in lines if not line.startswith(("exit ", "signal "))]
  return result, info


# ---- isolation probe -----------------------------------------------------------------------

_probe_lock = threading.Lock()
_probed: SandboxIsolation | None = None


def _probe() -> SandboxIsolation:
  try:
    identity = _sandbox_identity()
  except SandboxError as e:
    return SandboxIsolation("guard", "python-guard", "python-guard", "process-group", "host", os.getuid(), "", str(e))
  host_uid = identity.uid if identity.uid is not None else os.getuid()
  guard = SandboxIsolation(
    "guard", "python-guard", "python-guard", "process-group", "host", host_uid, identity.python, notes=identity.note
  )
  if not sys.platform.startswith("linux"):
    return dataclasses.replace(guard, reason=f"namespaces need Linux, this is {sys.platform}")
  try:
    result, info = _execute(
      _PROBE,
      "namespace",
      timeout_s=20.0,
      memory_mb=256,
      stdin="",
      max_output_bytes=1 << 16,
      max_processes=8,
      file_size_mb=1,
    )
  except (SandboxError, OSError) as e:
    return dataclasses.replace(guard, reason=str(e))
  if not result.ok:
    return dataclasses.replace(
      guard, reason=f"probe failed: exit {result.exit_code}, signal {result.signal}: {result.stderr[-500:]}"
    )
  try:
    r = json.loads(result.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    return dataclasses.replace(guard, reason=f"probe printed no report: {result.stdout[-200:]!r}")
  problems = []
  if r.get("cap_eff") != "0" * 16:
    problems.append(f"capabilities not dropped (CapEff {r.get('cap_eff')})")
  if set(r.get("interfaces", ["?"])) - {"lo"} or r.get("connect") == "connected":
    problems.append(f"network not isolated (interfaces {r.get('interfaces')}, connect {r.get('connect')})")
  written = [d for d, outcome in r.get("writes", {}).items() if outcome == "written"]
  if written or not r.get("scratch_writable"):
    problems.append(f"filesystem not read-only (written: {written})")
  if r.get("pid") != 2:
    problems.append(f"no PID namespace (pid {r.get('pid')})")
  proc, failed_mounts = "host", "-"
  for line in info:
    if line.startswith("mounts "):
      fields = dict(item.partition("=")[::2] for item in line.split()[1:])
      proc, failed_mounts = fields.get("proc", "host"), fields.get("failed", "-")
  if proc == "host":
    problems.append("could not hide the host's /proc")
  if problems:
    return dataclasses.replace(guard, reason="; ".join(problems))
  notes = [identity.note] if identity.note else []
  if failed_mounts != "-":
    notes.append(f"mounts left writable (unreachable for the code or under /proc): {failed_mounts}")
  return SandboxIsolation(
    "namespace",
    "namespace",
    "read-only-mounts",
    "pid-namespace",
    proc,
    host_uid,
    identity.python,
    notes="; ".join(notes),
  )


def isolation() -> SandboxIsolation:
  """Returns the isolation :func:`run_python` uses here, probing it on the first call.

  The probe runs a small program in namespace mode and checks from the inside that it
  has no capabilities, no network interface but loopback and no connection to
  127.0.0.1, cannot write to ``/``, ``/tmp``, ``/dev/shm`` or the sandbox directory, and
  runs as PID 2 of its own PID namespace.  If any check fails, or namespaces cannot be
  created, the sandbox uses guard mode and ``reason`` says why.  The result is cached for
  the life of the process (about 0.1 s on the first call).
  """
  global _probed
  with _probe_lock:
    if _probed is None:
      _probed = _probe()
    return _probed


def network_isolation() -> str:
  """``"namespace"`` if sandboxed code runs in an empty network namespace (kernel-enforced), else ``"python-guard"``."""
  return isolation().network


def filesystem_isolation() -> str:
  """``"read-only-mounts"`` if writes outside the working directory are kernel-blocked, else ``"python-guard"``."""
  return isolation().filesystem


# ---- entry point ---------------------------------------------------------------------------


def run_python(
  code: str,
  *,
  timeout_s: float = 5.0,
  memory_mb: int = 512,
  stdin: str = "",
  max_output_bytes: int = 65536,
  max_processes: int = 32,
  file_size_mb: int = 10,
  mode: IsolationMode | None = None,
) -> SandboxResult:
  """Runs untrusted Python source in a sandboxed process and waits for it (see the module docstring).

  The code runs as ``__main__`` from ``<tmpdir>/main.py`` with ``<tmpdir>/work`` as its
  working directory (the only writable place), and the directory is deleted afterwards.
  Nothing the code does raises here: failures show in the result.

  Args:
    code: Python source.
    timeout_s: wall-clock limit in seconds, interpreter start-up included.
    memory_mb: address-space limit per process, in MiB (at least 32: the interpreter needs it).
    stdin: text fed to the code's standard input (UTF-8), which is then closed.
    max_output_bytes: bytes kept of each of stdout and stderr.
    max_processes: tasks (processes and threads) the code may create.
    file_size_mb: largest file the code may write, in MiB.
    mode: ``"namespace"`` or ``"guard"`` to force a mode (tests); by default the mode
      of :func:`isolation`.

  Returns:
    A :class:`SandboxResult`.

  Raises:
    ValueError: on an out-of-range limit or an unknown mode.
    SandboxError: if namespace mode is forced but unavailable, or the sandbox could not
      be set up (e.g. no temporary directory).
  """
  if not isinstance(code, str):
    raise TypeError(f"code must be a str, got {type(code).__name__}")
  if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
    raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
  if not isinstance(memory_mb, int) or memory_mb < 32:
    raise ValueError(f"memory_mb must be an int >= 32, got {memory_mb!r}")
  if not isinstance(max_output_bytes, int) or max_output_bytes < 0:
    raise ValueError(f"max_output_bytes must be a non-negative int, got {max_output_bytes!r}")
  if not isinstance(max_processes, int) or max_processes < 1:
    raise ValueError(f"max_processes must be a positive int, got {max_processes!r}")
  if not isinstance(file_size_mb, int) or file_size_mb < 0:
    raise ValueError(f"file_size_mb must be a non-negative int, got {file_size_mb!r}")
  if mode is None:
    mode = isolation().mode  # type: ignore[assignment]
  elif mode not in ("namespace", "guard"):
    raise ValueError(f"mode must be 'namespace', 'guard' or None, got {mode!r}")
  elif mode == "namespace" and isolation().mode != "namespace":
    raise SandboxError(f"namespace mode is unavailable here: {isolation().reason}")
  result, _ = _execute(
    code,
    mode,
    timeout_s=float(timeout_s),
    memory_mb=memory_mb,
    stdin=stdin,
    max_output_bytes=max_output_bytes,
    max_processes=max_processes,
    file_size_mb=file_size_mb,
  )
  return result
