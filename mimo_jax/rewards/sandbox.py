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
    anything, the host's 127.0.0.1 included, is possible; abstract unix sockets belong to
    the network namespace, so the host's are out of reach too.  A kernel guarantee.
  * Filesystem: a root of its own (``pivot_root``; the host's tree is detached): a
    read-only tmpfs holding read-only binds of the system directories (``/usr`` and, as the
    host has them, ``/bin``, ``/sbin``, ``/lib*``), the interpreter's prefix, the dynamic
    loader's cache and ``/dev/{null,zero,full,random,urandom}``; every site-packages tree
    and this package's directory masked by an empty tmpfs; the code at ``/main.py``; its
    working directory ``/work``, a fresh tmpfs of at most 64 MiB and 4096 inodes (the only
    writable place); a new ``/proc`` of the PID namespace, read-only.  No host ``/tmp``,
    ``/run``, ``/dev/shm``, ``/etc``, home, data or run directory exists in there, so no
    pathname unix socket of the host (the reward pool's forkserver among them) can be
    reached and no file outside the system directories can be read.  A kernel guarantee.
  * Privileges: the code runs as namespace root with an empty capability bounding set,
    no capabilities and ``no_new_privs``, so it cannot undo the mounts.

In both modes, a seccomp filter (:func:`seccomp_program`; x86_64 and aarch64) refuses
with EPERM: ``socket``/``connect`` (``socketpair`` stays), ``memfd_create``, SysV shared
memory, semaphores and message queues, POSIX message queues, ``io_uring``, ``userfaultfd``, ``bpf``,
``perf_event_open``, ``ptrace``, cross-process memory access, the keyring,
``pidfd_send_signal``, every namespace, mount and root change (``clone`` with a namespace
flag included; ``clone3`` reads as absent) and ``kexec``.  The launcher sets
``oom_score_adj`` to 1000, so under memory pressure the kernel kills sandboxed code
before the trainer.

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

Memory without cgroups (this project's machines have cgroup v1 only, and an unprivileged
trainer could not use them anyway): in namespace mode everything the code can hold is
bounded by ``max_processes`` x ``RLIMIT_AS`` plus the 64 MiB working tmpfs: the filter
denies the shared-memory calls whose pages no address-space limit counts, and there is no
``/dev/shm`` or other writable tmpfs.  Pipe and socketpair buffers are bounded by the
kernel's per-user pipe limits and socket buffer sizes.

Not covered: CPU time of other workloads is not isolated (``RLIMIT_CPU`` bounds each
process), the system directories (``/usr``) stay readable, timing side channels exist, and
guard mode is not containment (the trainer refuses it unless told otherwise, see
``--allow_weak_sandbox``).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
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
import sysconfig
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
# The same two inside the sandbox's own root (namespace mode).
_INNER_MAIN = "/main.py"
_INNER_SCRATCH = "/work"


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
    filesystem: ``"minimal-root"`` (verified: ``/`` is read-only and the host's ``/tmp``,
      ``/run``, ``/dev/shm``, home, the trainer's directories and this package are not
      there) or ``"python-guard"``.
    processes: ``"pid-namespace"`` or ``"process-group"``.
    proc: ``"private"`` (a new ``/proc`` of the PID namespace), ``"hidden"`` (an empty
      tmpfs over ``/proc``) or ``"host"``.
    uid: the host uid the code runs as.
    python: the interpreter that runs the code.
    reason: why namespace mode is not used (empty in namespace mode).
    notes: anything else worth knowing (paths not bound, a substitute interpreter,
      root's uid kept).
    syscalls: ``"seccomp"`` (the filter of :func:`seccomp_program` is loaded) or why not.
    memory: how the code's memory is bounded in this mode.
    oom_score_adj: the sandboxed processes' OOM score adjustment.
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
  syscalls: str = "none"
  memory: str = ""
  oom_score_adj: int = 1000


# How memory is bounded in each mode (no cgroup: see the module docstring).
_MEMORY_NAMESPACE = (
  "RLIMIT_AS per process x max_processes, plus the 64 MiB working tmpfs; no shared memory outside them "
  "(memfd_create, SysV shared memory, semaphores and message queues, POSIX message queues denied by the syscall "
  "filter, no /dev/shm)"
)
_MEMORY_GUARD = "RLIMIT_AS per process x max_processes; the host's /dev/shm and /tmp stay writable (not counted)"


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
libc.syscall.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 36, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, MNT_DETACH = 22, 2, 2
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


def prctl(option, arg, arg2=0):
  call(libc.prctl(option, arg, arg2, 0, 0), "prctl(%d)" % option)


def mount(source, target, fstype, flags, data):
  enc = lambda s: None if s is None else s.encode()
  call(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)


def quiet_stdio():
  null = os.open("/dev/null", os.O_RDWR)
  for fd in (0, 1, 2):
    os.dup2(null, fd)
  os.close(null)


def mount_flags():
  # Locked flags (which a remount inside a user namespace must keep) of every mount, by target.
  flags_of = {}
  with open("/proc/self/mountinfo") as f:
    for line in f:
      fields = line.split()
      target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
      flags = 0
      for opt in fields[5].split(","):
        flags |= LOCKED.get(opt, 0)
      flags_of[target] = flags
  return flags_of


def flags_for(path, flags_of):
  # The locked flags of the mount that holds ``path`` (the longest mount target above it).
  best = "/"
  for target in flags_of:
    if (path == target or path.startswith(target.rstrip("/") + "/")) and len(target) > len(best):
      best = target
  return flags_of.get(best, 0)


def bind_read_only(source, target, flags_of):
  mount(source, target, None, MS_BIND, None)  # not recursive: mounts below ``source`` stay out
  mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags_for(source, flags_of), None)


def setup_mounts():
  # Builds the sandbox's root: a read-only tmpfs holding only what the interpreter needs.
  #
  # Host paths bound read-only: the system directories of ``cfg["layout"]`` (``/usr`` and
  # the interpreter's prefix; ``/lib``, ``/bin`` ... as the host has them), the dynamic
  # loader's cache and a few device nodes.  Masked by empty tmpfs: site-packages trees
  # (third-party code and any data shipped inside packages).  Then the code's own file,
  # its tmpfs working directory ``/work`` and a new ``/proc``; after ``pivot_root`` the host's
  # tree is detached, so ``/tmp``, ``/run``, home directories, data, run directories and
  # every pathname socket on the host are out of reach.
  flags_of = mount_flags()
  mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing below propagates to the host
  new = cfg["newroot"]
  mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
  for kind, path, arg in cfg["layout"]:
    target = new + path
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
      os.makedirs(parent, 0o755)
    if kind == "link":
      os.symlink(arg, target)
    elif kind == "dir":
      os.makedirs(target, 0o755, exist_ok=True)
      bind_read_only(path, target, flags_of)
    elif kind == "file":
      os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o444))
      try:
        bind_read_only(path, target, flags_of)
      except OSError as e:
        os.unlink(target)
        say("bind-skipped %s:%s" % (path, errno_name(e.errno)))
    elif kind == "mask" and os.path.isdir(target):
      mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,nr_inodes=8,mode=0555")
  code = new + cfg["inner_main"]
  os.close(os.open(code, os.O_WRONLY | os.O_CREAT, 0o444))
  bind_read_only(cfg["main"], code, flags_of)
  scratch = new + cfg["inner_scratch"]
  os.mkdir(scratch, 0o700)
  mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV,
        "size=%dm,nr_inodes=%d,mode=0700" % (cfg["scratch_mb"], cfg["scratch_inodes"]))
  os.mkdir(new + "/proc", 0o555)
  try:
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, None)
    proc = "private"
  except OSError:
    mount("tmpfs", new + "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0555")
    proc = "hidden"
  os.chdir(new)
  if cfg["sys_pivot_root"] is not None:
    # pivot_root(".", "."): the old root is stacked under the new one; detach it.
    call(libc.syscall(cfg["sys_pivot_root"], b".", b"."), "pivot_root")
    call(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    root = "pivot_root"
  else:
    os.chroot(".")  # no capability survives into the code, so the chroot cannot be undone
    root = "chroot"
  os.chdir("/")
  mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
  say("mounts proc=%s root=%s" % (proc, root))


def install_seccomp():
  # Loads the syscall filter of ``cfg["seccomp"]`` (assembled by the trainer; inherited by every child).
  prog = cfg["seccomp"]
  if not prog:
    return

  class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

  class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

  filters = (Filter * len(prog))(*[Filter(*ins) for ins in prog])
  program = Program(len(prog), filters)
  prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program))


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
    os.chdir(cfg["inner_scratch"] if namespace else cfg["scratch"])
    install_seccomp()  # last: after it, the launcher's own set-up calls would be refused too
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
  # The OOM killer's first choice, before the trainer (raising one's own score needs no privilege).
  with open("/proc/self/oom_score_adj", "w") as f:
    f.write("1000")
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
      # Not super(): socket.socket (a subclass of the original C class) calls this on its own instances.
      base_c_socket.__init__(self, family, *args, **kwargs)

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
import errno, json, os, socket, sys
host_paths = json.loads(sys.stdin.read())
def name(e):
  return errno.errorcode.get(e.errno, str(e.errno)) if getattr(e, "errno", None) else type(e).__name__
r = {"pid": os.getpid()}
status = {}
try:
  with open("/proc/self/status") as f:
    status = dict(line.split(":", 1) for line in f if ":" in line)
except OSError:
  pass
r["cap_eff"] = status.get("CapEff", "unreadable").strip()
r["seccomp"] = status.get("Seccomp", "?").strip()
try:
  with open("/proc/self/oom_score_adj") as f:
    r["oom_score_adj"] = int(f.read())
except (OSError, ValueError):
  r["oom_score_adj"] = None
try:
  with open("/proc/self/net/dev") as f:
    r["interfaces"] = [line.split(":")[0].strip() for line in f.readlines()[2:]]
except OSError:
  r["interfaces"] = ["?"]
r["connect"] = {}
for family, address in ((socket.AF_INET, ("127.0.0.1", 9)), (socket.AF_UNIX, "/tmp/.X11-unix/X0")):
  try:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(1.0)
    s.connect(address)
    r["connect"][str(int(family))] = "connected"
  except OSError as e:
    r["connect"][str(int(family))] = name(e)
try:
  os.close(os.memfd_create("probe"))
  r["memfd"] = "created"
except OSError as e:
  r["memfd"] = name(e)
r["writes"] = {}
for d in ("/", "/tmp", "/dev/shm", os.path.dirname(os.getcwd())):
  try:
    with open(os.path.join(d, ".mimo-sandbox-probe-%d" % os.getpid()), "w") as f:
      f.write("x")
    r["writes"][d] = "written"
    os.unlink(os.path.join(d, ".mimo-sandbox-probe-%d" % os.getpid()))
  except OSError as e:
    r["writes"][d] = name(e)
r["host_paths_seen"] = [p for p in host_paths if os.path.lexists(p)]
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


# ---- the sandbox's root and syscall filter ----------------------------------------------------

# Per architecture: audit arch, the x32 syscall bit (x86_64), and syscall numbers (from the
# kernel's asm/unistd_64.h and asm-generic/unistd.h).
# fmt: off
_SYSCALLS = {
  "x86_64": {
    "arch": 0xC000003E,
    "x32_bit": 0x40000000,
    "clone": 56,
    "clone3": 435,
    "pivot_root": 155,
    "deny": {
      "socket": 41, "connect": 42, "shmget": 29, "shmat": 30, "mq_open": 240, "memfd_create": 319,
      "memfd_secret": 447, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
      "io_uring_register": 427, "bpf": 321, "perf_event_open": 298, "ptrace": 101, "process_vm_readv": 310,
      "process_vm_writev": 311, "add_key": 248, "request_key": 249, "keyctl": 250, "pidfd_send_signal": 424,
      "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
      "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsmount": 432, "mount_setattr": 442,
      "kexec_load": 246, "kexec_file_load": 320,
      # SysV semaphores and message queues: kernel memory outside RLIMIT_AS (hundreds of MiB per run).
      "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
      "msgctl": 71,
    },
  },
  "aarch64": {
    "arch": 0xC00000B7,
    "x32_bit": 0,
    "clone": 220,
    "clone3": 435,
    "pivot_root": 41,
    "deny": {
      "socket": 198, "connect": 203, "shmget": 194, "shmat": 196, "mq_open": 180, "memfd_create": 279,
      "memfd_secret": 447, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
      "io_uring_register": 427, "bpf": 280, "perf_event_open": 241, "ptrace": 117, "process_vm_readv": 270,
      "process_vm_writev": 271, "add_key": 217, "request_key": 218, "keyctl": 219, "pidfd_send_signal": 424,
      "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
      "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsmount": 432, "mount_setattr": 442,
      "kexec_load": 104, "kexec_file_load": 294,
      "semget": 190, "semop": 193, "semctl": 191, "semtimedop": 192, "msgget": 186, "msgsnd": 189, "msgrcv": 188,
      "msgctl": 187,
    },
  },
}
# fmt: on
# clone() flags that create namespaces (a nested user namespace would give the code capabilities
# over fresh mounts, e.g. a tmpfs outside every memory limit).
_CLONE_NAMESPACE_FLAGS = 0x7E020000
# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_BPF_LD_ABS, _BPF_JEQ, _BPF_JGE, _BPF_JSET, _BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _ENOSYS = 1, 38


def _machine() -> str:
  return os.uname().machine


def seccomp_program(machine: str | None = None) -> list[tuple[int, int, int, int]] | None:
  """The sandbox's syscall filter as classic BPF ``(code, jt, jf, k)`` instructions, or None.

  Denied with EPERM: creating sockets and connecting (``socketpair`` stays: pipes between
  the code's own processes), shared memory outside the address-space limit (``memfd_create``,
  SysV shared memory, semaphores and message queues, POSIX message queues), ``io_uring`` (whose operations bypass this
  filter), ``userfaultfd``, ``bpf``, ``perf_event_open``, ``ptrace`` and cross-process memory
  access, the kernel keyring, ``pidfd_send_signal``, every namespace, mount and root change,
  and ``kexec``.  ``clone`` with a namespace flag is denied too, and ``clone3`` reads as
  absent (ENOSYS: the C library falls back to ``clone``, whose flags the filter can see).
  Another architecture's calling convention (i386 on x86_64, x32) kills the process.

  Args:
    machine: ``os.uname().machine``; this machine's by default.

  Returns:
    The program, or None on an architecture without a table here (the isolation report says so).
  """
  table = _SYSCALLS.get(machine or _machine())
  if table is None:
    return None
  # Assemble with symbolic forward jumps, then resolve them to offsets.
  code: list[tuple[int, object, object, int]] = [
    (_BPF_LD_ABS, 0, 0, 4),  # seccomp_data.arch
    (_BPF_JEQ, 0, "kill", table["arch"]),
    (_BPF_LD_ABS, 0, 0, 0),  # seccomp_data.nr
  ]
  if table["x32_bit"]:
    code.append((_BPF_JGE, "eperm", 0, table["x32_bit"]))
  code.append((_BPF_JEQ, "clone", 0, table["clone"]))
  code.append((_BPF_JEQ, "enosys", 0, table["clone3"]))
  for nr in sorted(set(table["deny"].values())):
    code.append((_BPF_JEQ, "eperm", 0, nr))
  code.append((_BPF_RET, 0, 0, _RET_ALLOW))
  labels = {"clone": len(code)}
  code += [
    (_BPF_LD_ABS, 0, 0, 16),  # low 32 bits of seccomp_data.args[0] (little-endian): the clone flags
    (_BPF_JSET, "eperm", 0, _CLONE_NAMESPACE_FLAGS),
    (_BPF_RET, 0, 0, _RET_ALLOW),
  ]
  labels["eperm"] = len(code)
  code.append((_BPF_RET, 0, 0, _RET_ERRNO | _EPERM))
  labels["enosys"] = len(code)
  code.append((_BPF_RET, 0, 0, _RET_ERRNO | _ENOSYS))
  labels["kill"] = len(code)
  code.append((_BPF_RET, 0, 0, _RET_KILL_PROCESS))
  program = []
  for i, (op, jt, jf, k) in enumerate(code):
    jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
    jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
    assert 0 <= jt < 256 and 0 <= jf < 256
    program.append((op, jt, jf, k))
  return program


def _under(path: str, directory: str) -> bool:
  return path == directory or path.startswith(directory.rstrip("/") + "/")


@functools.lru_cache(maxsize=4)
def _root_layout(python: str) -> list[tuple[str, str, str]]:
  """What the sandbox's root holds besides the code: ``(kind, host path, symlink target)`` rows.

  ``dir``/``file``: bound read-only at the same path; ``link``: a symlink; ``mask``: an
  empty read-only tmpfs over a directory the binds brought in.  The system directories
  (``/usr`` and, as the host has them, ``/bin``, ``/sbin`` and ``/lib*``), the
  interpreter's prefix, the dynamic loader's cache and the harmless device nodes; masked:
  every site-packages/dist-packages tree and this package's own directory (third-party
  code, and any data installed with a package, stay out of reach).
  """
  rows: list[tuple[str, str, str]] = []
  dirs: list[str] = []
  for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(top):
      rows.append(("link", top, os.readlink(top)))
    elif os.path.isdir(top):
      rows.append(("dir", top, ""))
      dirs.append(top)
  prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
  if not any(_under(prefix, d) for d in dirs):
    rows.append(("dir", prefix, ""))
    dirs.append(prefix)
  for path in ("/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"):
    if os.path.exists(path) and not os.path.islink(path):
      rows.append(("file", path, ""))
  for name, target in (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
  ):
    rows.append(("link", "/dev/" + name, target))
  masks: set[str] = set()
  for d in dirs:
    for pattern in (
      "lib/python3*/site-packages",
      "lib/python3*/dist-packages",
      "lib/python3/dist-packages",
      "local/lib/python3*/site-packages",
      "local/lib/python3*/dist-packages",
    ):
      masks.update(glob.glob(os.path.join(d, pattern)))
  own = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the mimo_jax package
  for path in (own, *(sysconfig.get_paths().get(k, "") for k in ("purelib", "platlib"))):
    if path and any(_under(os.path.realpath(path), d) for d in dirs):
      masks.add(os.path.realpath(path))
  rows += [("mask", m, "") for m in sorted(masks) if os.path.isdir(m)]
  return rows


_SECCOMP = seccomp_program()


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


def remove_leftovers(pid: int) -> int:
  """Deletes the sandbox directories of process ``pid``, which was killed while it ran code (its own
  clean-up never ran); returns how many there were.  Call it only once ``pid`` is dead and reaped."""
  prefix = f"{_DIR_PREFIX}{int(pid)}-"
  removed = 0
  for parent in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
    try:
      names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
      continue
    for name in names:
      path = os.path.join(parent, name)
      if os.path.isdir(path) and not os.path.islink(path):
        _rmtree(path)
        removed += 1
  return removed


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
  # Named by this process: if it is killed mid-run (a reward worker past its time limit), the pool that
  # killed it removes what it left (remove_leftovers).
  root = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=identity.tmpdir)
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
    namespace = mode == "namespace"
    # In namespace mode the code sees its own root: the code at /main.py, its directory /work.
    python = os.path.realpath(identity.python) if namespace else identity.python
    work, code_path, code_root = (_INNER_SCRATCH, _INNER_MAIN, "/") if namespace else (scratch, main_path, root)
    newroot = os.path.join(root, "root")
    if namespace:
      os.mkdir(newroot, 0o755)
    env = {
      "PATH": "/usr/local/bin:/usr/bin:/bin",
      "HOME": work,
      "TMPDIR": work,
      "LANG": "C.UTF-8",
      "LC_ALL": "C.UTF-8",
    }
    ctl_r, ctl_w = os.pipe()
    table = _SYSCALLS.get(_machine())
    cfg = {
      "mode": mode,
      "ctl_fd": ctl_w,
      "uid": uid,
      "gid": gid,
      "scratch": scratch,
      "main": main_path,
      "newroot": newroot,
      "layout": _root_layout(identity.python) if namespace else [],
      "inner_main": _INNER_MAIN,
      "inner_scratch": _INNER_SCRATCH,
      "sys_pivot_root": table["pivot_root"] if table else None,
      "seccomp": _SECCOMP,
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
      "argv": [python, "-I", "-S", "-B", "-c", _RUNNER, code_path, mode, code_root, work],
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


def _host_paths() -> list[str]:
  """Host paths the probe must not see from inside: temporary, runtime, home and this process's directories."""
  paths = ["/tmp", "/run", "/root", "/home", "/etc/passwd", "/dev/shm", "/var", "/opt", "/mnt", "/srv"]
  paths += [tempfile.gettempdir(), os.getcwd(), os.path.expanduser("~"), sys.prefix]
  paths.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # the mimo_jax package
  seen: list[str] = []
  for path in paths:
    if path and os.path.isabs(path) and path != "/" and path not in seen and not path.startswith("/proc"):
      seen.append(path)
  return seen


def _probe() -> SandboxIsolation:
  syscalls = "seccomp" if _SECCOMP else f"none (no syscall table for {_machine()})"
  try:
    identity = _sandbox_identity()
  except SandboxError as e:
    return SandboxIsolation(
      "guard", "python-guard", "python-guard", "process-group", "host", os.getuid(), "", str(e), syscalls=syscalls
    )
  host_uid = identity.uid if identity.uid is not None else os.getuid()
  guard = SandboxIsolation(
    "guard",
    "python-guard",
    "python-guard",
    "process-group",
    "host",
    host_uid,
    identity.python,
    notes=identity.note,
    syscalls=syscalls,
    memory=_MEMORY_GUARD,
  )
  if not sys.platform.startswith("linux"):
    return dataclasses.replace(guard, reason=f"namespaces need Linux, this is {sys.platform}")
  host_paths = [p for p in _host_paths() if os.path.lexists(p)]
  try:
    result, info = _execute(
      _PROBE,
      "namespace",
      timeout_s=20.0,
      memory_mb=256,
      stdin=json.dumps(host_paths),
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
  connected = [family for family, outcome in r.get("connect", {}).items() if outcome == "connected"]
  if set(r.get("interfaces", ["?"])) - {"lo"} or connected:
    problems.append(f"network not isolated (interfaces {r.get('interfaces')}, connect {r.get('connect')})")
  written = [d for d, outcome in r.get("writes", {}).items() if outcome == "written"]
  if written or not r.get("scratch_writable"):
    problems.append(f"filesystem not read-only (written: {written})")
  if r.get("host_paths_seen"):
    problems.append(f"host paths visible: {r['host_paths_seen']}")
  if r.get("pid") != 2:
    problems.append(f"no PID namespace (pid {r.get('pid')})")
  if r.get("oom_score_adj") != 1000:
    problems.append(f"oom_score_adj not raised ({r.get('oom_score_adj')})")
  if _SECCOMP and (r.get("seccomp") != "2" or r.get("memfd") == "created"):
    problems.append(f"syscall filter not in force (Seccomp {r.get('seccomp')}, memfd_create {r.get('memfd')})")
  proc, root = "host", "?"
  for line in info:
    if line.startswith("mounts "):
      fields = dict(item.partition("=")[::2] for item in line.split()[1:])
      proc, root = fields.get("proc", "host"), fields.get("root", "?")
  if proc == "host":
    problems.append("could not hide the host's /proc")
  if problems:
    return dataclasses.replace(guard, reason="; ".join(problems))
  notes = [identity.note] if identity.note else []
  skipped = [line.split(" ", 1)[1] for line in info if line.startswith("bind-skipped ")]
  if skipped:
    notes.append(f"not bound into the sandbox: {', '.join(skipped)}")
  if root != "pivot_root":
    notes.append(f"root changed with {root}")
  return SandboxIsolation(
    "namespace",
    "namespace",
    "minimal-root",
    "pid-namespace",
    proc,
    host_uid,
    identity.python,
    notes="; ".join(notes),
    syscalls=syscalls,
    memory=_MEMORY_NAMESPACE,
    oom_score_adj=1000,
  )


def isolation() -> SandboxIsolation:
  """Returns the isolation :func:`run_python` uses here, probing it on the first call.

  The probe runs a small program in namespace mode and checks from the inside that it
  has no capabilities, no network interface but loopback and no connection to
  127.0.0.1 or a unix socket, cannot write to ``/``, sees none of the host's ``/tmp``,
  ``/run``, ``/dev/shm``, home and the trainer's directories, runs as PID 2 of its own PID
  namespace with ``oom_score_adj`` 1000, and (where the filter exists) under seccomp with
  ``memfd_create`` refused.  If any check fails, or namespaces cannot be
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
  """``"minimal-root"`` if the code sees only its own read-only root (kernel-enforced), else ``"python-guard"``."""
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
  working directory (the only writable place; in namespace mode the code sees them as
  ``/main.py`` and ``/work`` in a root of its own), and the directory is deleted afterwards.
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
