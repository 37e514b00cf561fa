"""Unit-test rewards for generated code, designed so that a program cannot fake a pass.

:func:`unit_test_result` runs a program and a HumanEval-style test suite (source that
defines ``check(candidate)``) in the :mod:`~mimo_jax.rewards.sandbox`, and reports a pass
only if ``check`` really returned normally on the program's entry point.

Design: the program and the tests never share a process.  Inside the sandbox a trusted
harness process ``H`` forks a child ``T`` *before* it learns anything secret:

1. ``T`` points its stdin at ``/dev/null`` and its stdout at stderr, executes the program
   in a fresh namespace and then serves calls to the entry point over a pair of pipes.
   Arguments and results cross as data in a tagged JSON encoding of plain values
   (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes`` and ``list``,
   ``tuple``, ``dict``, ``set``, ``frozenset`` of them); ``H`` rebuilds them as exact
   built-in types.  So a result can never be an object whose ``__eq__`` always returns
   True, and nothing the program does (``sys.exit``, ``os._exit``, patching ``builtins``,
   ``AssertionError`` or ``check``, ``atexit`` hooks, threads) can reach the test code.
   Nor can its exceptions steer the tests' control flow: a call reaches the tests as a
   return value, as a built-in ``Exception`` of the program's exception's name, or as a
   ``RuntimeError`` (see below), and ``H`` dies on ``SIGINT`` rather than raise
   ``KeyboardInterrupt`` into the tests.
2. Only after the fork does ``H`` read, from its stdin, a fresh random nonce and the
   test suite (with its trusted ``context``, e.g. the HumanEval prompt whose helper
   functions some tests call).  ``T`` therefore never has the nonce or the expected
   values in its memory, and ``H`` is non-dumpable, so ``T`` cannot read them from
   ``/proc`` or attach to ``H``.
3. ``H`` runs ``check`` with a proxy for the entry point and writes
   ``<nonce>:<digest>:<status>`` as the last line of stdout, where ``digest`` hashes the
   test suite it received.

The trainer counts a pass only if that line is the last line of stdout, carries this
call's nonce, the expected digest and ``passed``, and the sandbox exited with status 0
in time.  Printing a forged line, exiting early, killing ``H`` or timing out all read as
a failure, with a reason (:class:`CodeVerdict`).

Semantics differ from the reference HumanEval harness in two deliberate ways: the tests
see the entry point only through calls (arguments are copies, so a test that inspects an
argument the candidate mutated in place would fail; no shipped HumanEval test does), and
helpers the tests use come from the trusted ``context`` rather than from the program, so
a program cannot redefine them (the entry point's own name is bound to the program's
function, which HumanEval/33's test calls directly).  Equality is ordinary Python ``==`` on the rebuilt values
(``1 == 1.0``, as in the reference harness).

An exception the program raises reaches the tests as the built-in ``Exception`` of the
same name (so ``try: candidate(bad) except ValueError`` works), except that
``AssertionError``, ``StopIteration``, ``StopAsyncIteration``, non-``Exception``
exceptions (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``) and the program's
own classes arrive as ``RuntimeError``.  A ``StopIteration`` out of the proxy would
silently end a ``map``, ``filter``, ``zip`` or ``iter(f, sentinel)`` loop in ``check``
(PEP 479 covers only generators), so ``assert all(map(lambda x: candidate(x) == 2 * x, xs))``
would pass a program that raises it; ``RuntimeError`` is what Python itself makes of a
``StopIteration`` escaping a generator.  A reply that cannot be read or rebuilt is a
``RuntimeError`` too, never an exception of the decoder's making.

A program that is not valid Unicode text (a lone surrogate such as ``"\\ud800"``, which a
tokenizer's decode can produce) cannot be encoded as UTF-8 for the sandbox: both checkers
score it 0 (reason ``invalid_text``) without running it.  Details echoed back from the
sandbox are made UTF-8-safe (lone surrogates become ``\\udXXX`` escapes), so a verdict
can always be logged.

:func:`weak_test_reward` is the naive checker (program, tests and ``check(entry)`` in one
script; pass if the exit status is 0) kept as a reward-hacking probe:
:func:`probe_components` reports where it and the strict checker disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets

from mimo_jax.rewards.sandbox import SandboxResult, run_python

__all__ = [
  "REASONS",
  "CodeVerdict",
  "extract_code",
  "probe_components",
  "program_timeout_s",
  "unit_test_result",
  "unit_test_reward",
  "weak_test_reward",
]

# Reasons a verdict can carry.  "passed" is the only passing one.
REASONS = (
  "passed",
  "failed",  # check() raised (an assertion, an exception, or the program's process died mid-test)
  "timeout",  # the wall-clock limit ran out
  "syntax_error",  # the program does not compile
  "program_error",  # the program raised or exited while being loaded
  "missing_entry_point",  # the program defines no callable with the entry point's name
  "test_error",  # the trusted context or tests failed to load, or define no check()
  "no_success_marker",  # exit status 0 but no valid status line (e.g. stdout flooded and cut)
  "crashed",  # the harness was killed or exited non-zero
  "invalid_text",  # the program is not valid Unicode text (a lone surrogate): it cannot be encoded to run
)

# Runs in the sandbox as __main__; the trainer appends the program and entry point.
_HARNESS = r'''
import builtins, hashlib, json, os, signal, struct, sys, traceback

_MAX_FRAME = 64 << 20
_MAX_DEPTH = 200


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def _send(fd, obj):
  data = json.dumps(obj).encode("utf-8")
  _write_all(fd, struct.pack(">I", len(data)) + data)


def _read_exact(fd, n):
  parts = []
  while n:
    chunk = os.read(fd, min(n, 1 << 20))
    if not chunk:
      return None
    parts.append(chunk)
    n -= len(chunk)
  return b"".join(parts)


def _recv(fd):
  head = _read_exact(fd, 4)
  if head is None:
    return None
  (n,) = struct.unpack(">I", head)
  if n > _MAX_FRAME:
    raise ValueError("message of %d bytes is too large" % n)
  body = _read_exact(fd, n)
  if body is None:
    return None
  return json.loads(body)


def _encode(v, depth=0):
  if depth > _MAX_DEPTH:
    raise ValueError("value nested too deeply")
  t = type(v)
  if v is None or t is bool or t is str:
    return v
  if t is int:  # hexadecimal: no digit limit (int <-> decimal str stops at 4300 digits), linear time
    return {"i": format(v, "x")}
  if t is float:
    return {"f": repr(v)}
  if t is list:
    return [_encode(x, depth + 1) for x in v]
  if t is tuple:
    return {"t": [_encode(x, depth + 1) for x in v]}
  if t is dict:
    return {"d": [[_encode(k, depth + 1), _encode(x, depth + 1)] for k, x in v.items()]}
  if t is set or t is frozenset:
    return {"s" if t is set else "fs": [_encode(x, depth + 1) for x in v]}
  if t is bytes:
    return {"b": v.hex()}
  if t is complex:
    return {"c": [repr(v.real), repr(v.imag)]}
  # Subclasses of plain types (a str subclass, a namedtuple) cross as their plain value.
  for base in (bool, int, float, complex, str, bytes, tuple, list, dict, frozenset, set):
    if isinstance(v, base):
      return _encode(base(v), depth + 1)
  raise TypeError("a %s cannot cross the sandbox boundary" % t.__name__)


def _decode(v, depth=0):
  if depth > _MAX_DEPTH:
    raise ValueError("value nested too deeply")
  if v is None or v is True or v is False or type(v) is str:
    return v
  if type(v) is list:
    return [_decode(x, depth + 1) for x in v]
  if type(v) is dict and len(v) == 1:
    ((tag, x),) = v.items()
    if tag == "i" and type(x) is str:
      return int(x, 16)
    if tag == "f" and type(x) is str:
      return float(x)
    if tag == "b" and type(x) is str:
      return bytes.fromhex(x)
    if tag == "c" and type(x) is list and len(x) == 2 and all(type(p) is str for p in x):
      return complex(float(x[0]), float(x[1]))
    if type(x) is list:
      items = [_decode(e, depth + 1) for e in x]
      if tag == "t":
        return tuple(items)
      if tag == "s":
        return set(items)
      if tag == "fs":
        return frozenset(items)
      if tag == "d" and all(type(p) is list and len(p) == 2 for p in x):
        return {k: val for k, val in items}
  raise ValueError("malformed value")


def _describe(exc):
  try:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
  except BaseException:
    return type(exc).__name__


def _flush():
  """Flushes the program's prints (to stderr) before T reports: T never exits normally."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except BaseException:
      pass


def _serve(program, entry, requests, responses):
  """The child T: loads the program, then answers calls.  Never returns."""
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  os.dup2(2, 1)
  try:
    code = compile(program, "<program>", "exec")
  except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError) as e:
    _send(responses, {"load": "syntax_error", "detail": _describe(e)})
    os._exit(0)
  namespace = {"__name__": "__candidate__", "__builtins__": builtins}
  try:
    exec(code, namespace)
  except BaseException as e:
    _flush()
    _send(responses, {"load": "program_error", "detail": _describe(e)})
    os._exit(0)
  _flush()
  fn = namespace.get(entry)
  if not callable(fn):
    _send(responses, {"load": "missing_entry_point", "detail": "no callable %r" % entry})
    os._exit(0)
  _send(responses, {"load": "ok"})
  while True:
    request = _recv(requests)
    if request is None:
      os._exit(0)
    try:
      result = fn(*_decode(request["a"]), **_decode(request["k"]))
      reply = {"ok": _encode(result)}
    except BaseException as e:
      try:
        message = str(e)[-2000:]
      except BaseException:
        message = ""
      reply = {"exc": type(e).__name__, "msg": message}
    _flush()
    _send(responses, reply)


class CandidateDied(RuntimeError):
  pass


# Built-in exceptions that do not cross as themselves.  To the tests these mean control flow
# or a test's own verdict, not an error of the candidate: a StopIteration (or
# StopAsyncIteration) out of the proxy silently ends a map(), filter(), zip() or
# iter(f, sentinel) loop in check, so all(map(...)) would read as true; an AssertionError
# would look like the test's own failure.
_NOT_CROSSING = (AssertionError, StopIteration, StopAsyncIteration)


def _program_exception(name, msg):
  """The exception H raises into the tests for one the program raised (see the module docstring).

  A built-in Exception subclass of that name, unless it is in _NOT_CROSSING or cannot be
  built from a message; otherwise RuntimeError (what Python makes of a StopIteration that
  escapes a generator, PEP 479), naming the original.  Only Exception subclasses cross, so
  SystemExit, KeyboardInterrupt and GeneratorExit never do.
  """
  name = name[:200]
  cls = getattr(builtins, name, None)
  if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _NOT_CROSSING):
    try:
      exc = cls(msg)
    except Exception:  # e.g. UnicodeDecodeError and ExceptionGroup need more arguments
      exc = None
    if type(exc) is cls:
      return exc
  return RuntimeError("the program raised %s: %s" % (name, msg) if msg else "the program raised %s" % name)


def _main(program, entry):
  # The sandbox made this process non-dumpable (inherited by T across fork): T can neither
  # read H's memory nor open H's file descriptors through /proc.
  requests_r, requests_w = os.pipe()
  responses_r, responses_w = os.pipe()
  sys.stdout.flush()
  sys.stderr.flush()
  # T may signal H (namespace mode allows it): Python's SIGINT handler would raise
  # KeyboardInterrupt wherever check happens to be, e.g. into a test's except clause.  H
  # dies instead, which reads as a crash; set before the fork, so there is no window.
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  child = os.fork()
  if child == 0:
    os.close(requests_w)
    os.close(responses_r)
    try:
      _serve(program, entry, requests_r, responses_w)
    finally:
      os._exit(0)
  os.close(requests_r)
  os.close(responses_w)
  # Only now, in H alone, read the secrets: the nonce line, then the test suite.
  data = sys.stdin.buffer.read()
  os.close(0)
  nonce, _, spec_bytes = data.partition(b"\n")
  nonce = nonce.decode("ascii").strip()
  digest = hashlib.sha256(spec_bytes).hexdigest()[:16]

  def finish(status, detail=""):
    sys.stdout.flush()
    line = "%s:detail:%s\n%s:%s:%s\n" % (nonce, json.dumps(detail[-4000:]), nonce, digest, status)
    _write_all(1, b"\n" + line.encode("utf-8"))
    try:
      os.kill(child, signal.SIGKILL)
      os.waitpid(child, 0)
    except OSError:
      pass
    os._exit(0)

  try:
    loaded = _recv(responses_r)
  except Exception as e:
    finish("program_error", "unreadable load report: " + _describe(e))
  if loaded is None:
    finish("program_error", "the program's process exited or died while loading")
  if type(loaded) is not dict or loaded.get("load") != "ok":
    status = loaded.get("load") if type(loaded) is dict else None
    if status not in ("syntax_error", "program_error", "missing_entry_point"):
      status = "program_error"
    detail = loaded.get("detail") if type(loaded) is dict else None
    finish(status, detail if type(detail) is str else "")

  def candidate(*args, **kwargs):
    # The tests' own arguments: an argument that cannot cross is the tests' error, raised as is.
    request = {"a": _encode(list(args)), "k": _encode(dict(kwargs))}
    # Everything from here on is driven by T's data, so whatever goes wrong sending the call
    # or reading and rebuilding the reply is CandidateDied: an exception of the decoder's
    # making (in principle any type) never reaches the tests.
    try:
      _send(requests_w, request)
      reply = _recv(responses_r)
      if reply is None:
        outcome = CandidateDied("the program's process exited or died during the call")
      elif type(reply) is dict and "ok" in reply:
        return _decode(reply["ok"])
      elif type(reply) is dict and type(reply.get("exc")) is str:
        msg = reply.get("msg") if type(reply.get("msg")) is str else ""
        outcome = _program_exception(reply["exc"], msg)
      else:
        outcome = CandidateDied("malformed reply from the program")
    except Exception as e:
      outcome = CandidateDied("the call to the program failed or its reply was unusable: " + _describe(e))
    raise outcome

  try:
    spec = json.loads(spec_bytes)
    tests_namespace = {"__name__": "__tests__", "__builtins__": builtins}
    exec(compile(spec["context"], "<context>", "exec"), tests_namespace)
    exec(compile(spec["tests"], "<tests>", "exec"), tests_namespace)
    # Tests may call the entry point by name (HumanEval/33 does), meaning the program's version.
    tests_namespace[entry] = candidate
    check = tests_namespace["check"]
  except BaseException as e:
    finish("test_error", _describe(e))
  try:
    check(candidate)
  except BaseException as e:
    finish("failed", _describe(e))
  finish("passed")
'''


@dataclasses.dataclass(frozen=True)
class CodeVerdict:
  """The outcome of :func:`unit_test_result`.

  Attributes:
    passed: whether the tests ran to completion and passed.
    reason: one of :data:`REASONS` (``"passed"`` iff ``passed``).
    detail: a short human-readable explanation (an assertion or exception, or what was
      missing); empty on a pass.
    sandbox: the raw sandbox result of the harness run.
  """

  passed: bool
  reason: str
  detail: str
  sandbox: SandboxResult | None


def _unencodable(text: str) -> str | None:
  """Why ``text`` cannot be encoded as UTF-8 (to be written or piped to the sandbox), or None.

  Only a lone surrogate (``"\\ud800"``, which a tokenizer's decode can produce) makes a
  ``str`` unencodable: such text is not valid Unicode, and Python cannot compile it either.
  """
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    return f"not valid Unicode text: lone surrogate {text[e.start]!r} at character {e.start}"
  return None


def _utf8_safe(text: str) -> str:
  """``text`` with lone surrogates (e.g. from a program's exception message) as ``\\udXXX`` escapes."""
  return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_entry_point(entry_point: str) -> None:
  if not isinstance(entry_point, str) or not entry_point.isidentifier():
    raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")


def unit_test_result(
  program: str,
  tests: str,
  entry_point: str,
  *,
  context: str = "",
  timeout_s: float = 5.0,
  memory_mb: int = 512,
) -> CodeVerdict:
  """Runs HumanEval-style tests against a program in the sandbox (see the module docstring).

  Args:
    program: the untrusted program; it must define ``entry_point``.
    tests: trusted test source defining ``check(candidate)``, which raises on failure.
    entry_point: name of the function under test.
    context: trusted source executed before ``tests`` in the tests' namespace, for
      helpers the tests call (for HumanEval, the problem's prompt).
    timeout_s: wall-clock limit of the whole run (start-up, loading and tests).
    memory_mb: address-space limit per sandbox process, in MiB.

  Returns:
    A :class:`CodeVerdict`; ``passed`` only if ``check`` returned normally.  A program
    that is not valid Unicode text (a lone surrogate) is not run: reason
    ``"invalid_text"``, ``sandbox`` None.

  Raises:
    ValueError: if ``entry_point`` is not an identifier.
    SandboxError: if the sandbox cannot be set up.
  """
  _check_entry_point(entry_point)
  # The sandbox writes and pipes text as UTF-8, and T would compile the program anyway:
  # reject unencodable text here, with its own reason, instead of raising or running it.
  invalid = _unencodable(program)
  if invalid is not None:
    return CodeVerdict(False, "invalid_text", f"the program is {invalid}", None)
  nonce = secrets.token_hex(16)
  spec = json.dumps({"context": context, "tests": tests}).encode("utf-8")
  digest = hashlib.sha256(spec).hexdigest()[:16]
  harness = f"{_HARNESS}\n_main({program!r}, {entry_point!r})\n"
  result = run_python(
    harness,
    timeout_s=timeout_s,
    memory_mb=memory_mb,
    stdin=nonce + "\n" + spec.decode("utf-8"),
  )
  if result.timed_out:
    return CodeVerdict(False, "timeout", f"no result within {timeout_s:g} s", result)
  lines = [line for line in result.stdout.splitlines() if line.strip()]
  status = None
  detail = ""
  if lines and lines[-1].startswith(f"{nonce}:{digest}:"):
    status = lines[-1][len(nonce) + len(digest) + 2 :]
    detail_prefix = f"{nonce}:detail:"
    if len(lines) > 1 and lines[-2].startswith(detail_prefix):
      try:
        # The JSON escapes may carry a lone surrogate from the program's exception message.
        detail = _utf8_safe(str(json.loads(lines[-2][len(detail_prefix) :])))
      except ValueError:
        detail = ""
  how = f"signal {result.signal}" if result.signal is not None else f"exit status {result.exit_code}"
  if status is None:
    if result.exit_code == 0:
      cut = " (stdout was truncated)" if result.stdout_truncated else ""
      return CodeVerdict(False, "no_success_marker", f"exit status 0 but no valid status line{cut}", result)
    return CodeVerdict(False, "crashed", f"the harness ended with {how}: {result.stderr[-500:]}", result)
  if status not in REASONS:
    return CodeVerdict(False, "crashed", f"unknown status {status!r}", result)
  if result.exit_code != 0:
    return CodeVerdict(False, "crashed", f"status {status!r} but the harness ended with {how}", result)
  return CodeVerdict(status == "passed", status, detail, result)


def unit_test_reward(
  program: str,
  tests: str,
  entry_point: str,
  *,
  context: str = "",
  timeout_s: float = 5.0,
  memory_mb: int = 512,
) -> float:
  """1.0 if the tests really ran to completion and passed (:func:`unit_test_result`), else 0.0."""
  verdict = unit_test_result(program, tests, entry_point, context=context, timeout_s=timeout_s, memory_mb=memory_mb)
  return 1.0 if verdict.passed else 0.0


def weak_test_reward(
  program: str,
  tests: str,
  entry_point: str,
  *,
  timeout_s: float = 5.0,
  memory_mb: int = 512,
) -> float:
  """A deliberately naive checker, for measuring reward hacking; never train on it.

  Runs ``program + tests + "check(entry_point)"`` as one script (the reference HumanEval
  recipe without its process isolation) and passes if the script exits with status 0.
  ``sys.exit(0)`` or ``os._exit(0)`` before the tests, an ``atexit`` hook that exits 0
  after a failure, or an always-equal result object all fool it.  A script that is not
  valid Unicode text (a lone surrogate) cannot be written for the sandbox and scores 0.

  Args:
    program: the untrusted program.
    tests: test source defining ``check(candidate)``.
    entry_point: name of the function under test.
    timeout_s: wall-clock limit.
    memory_mb: address-space limit per process, in MiB.

  Returns:
    1.0 or 0.0.
  """
  _check_entry_point(entry_point)
  script = f"{program}\n\n{tests}\n\ncheck({entry_point})\n"
  # run_python writes the script as UTF-8, which a lone surrogate makes raise.
  if _unencodable(script) is not None:
    return 0.0
  return 1.0 if run_python(script, timeout_s=timeout_s, memory_mb=memory_mb).ok else 0.0


# What ending a timed-out sandbox run may add to its clock: SIGTERM to the launcher, 1.5 s for it to kill
# and reap the code, then its process group killed (``sandbox._stop``); rounded up.
PROGRAM_TEARDOWN_S = 2.0


def program_timeout_s(reward_timeout_s: float) -> float:
  """The wall clock of one sandboxed program run under a reward call limited to ``reward_timeout_s``.

  A reward component may run two programs (the hacking probe: strict and weak), each of which may take
  its clock plus :data:`PROGRAM_TEARDOWN_S` to end; both must fit inside the call's limit.  Otherwise a
  program that never ends outlives the call: the pool reports an outage (a failed component, counted as 0
  and left out of the reward statistics) where the sandbox would have given a failing verdict, and under
  running normalisation an infinite loop would earn more than a wrong answer.
  """
  return (reward_timeout_s - PROGRAM_TEARDOWN_S) / 2


def probe_components(
  program: str,
  tests: str,
  entry_point: str,
  *,
  context: str = "",
  timeout_s: float = 5.0,
  memory_mb: int = 512,
) -> dict[str, float]:
  """Strict and weak verdicts of one program, to track reward hacking as a metric.

  Args:
    program: the untrusted program.
    tests: test source defining ``check(candidate)``.
    entry_point: name of the function under test.
    context: trusted helper source for the strict checker (see :func:`unit_test_result`).
    timeout_s: wall-clock limit of each run.
    memory_mb: address-space limit per process, in MiB.

  Returns:
    ``{"strict": s, "weak": w, "hacked": h}`` with values 0.0 or 1.0, where ``hacked``
    is 1.0 iff the naive checker passes a program the strict one rejects.  Averaged over
    a batch, ``hacked`` is the rate at which completions exploit a naive verifier.  A
    program that is not valid Unicode text scores 0 on both (not a hack).
  """
  strict = unit_test_reward(program, tests, entry_point, context=context, timeout_s=timeout_s, memory_mb=memory_mb)
  weak = weak_test_reward(program, tests, entry_point, timeout_s=timeout_s, memory_mb=memory_mb)
  return {"strict": strict, "weak": weak, "hacked": float(weak == 1.0 and strict == 0.0)}


# A fenced block: an optional language tag, then everything up to the closing fence (or the
# end of the text, for a completion cut off by the token limit).
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "python3", "py", "py3"})


def extract_code(completion: str, prompt: str) -> str:
  """Turns a completion into the program to test.

  * A completion with a fenced code block: the first block tagged as Python (or the
    first untagged one).  A block whose first line is indented continues the prompt's
    function body (``prompt + block``); otherwise it is full code, appended after the
    prompt (``prompt + "\\n" + block``) so that the prompt's imports and helpers stay
    available and the block's definitions replace the prompt's stub.
  * Otherwise the completion is a raw continuation of the prompt (the HumanEval
    convention): ``prompt + completion``.

  Args:
    completion: the decoded completion.
    prompt: the prompt it continues.

  Returns:
    Python source (not checked for syntax: a broken program fails in the sandbox).  Only
    string operations happen here, so a completion with a lone surrogate does not raise;
    the rewards score the resulting program 0 (``"invalid_text"``).
  """
  blocks = [(tag.lower(), body) for tag, body in _FENCE_RE.findall(completion)]
  chosen = next((body for tag, body in blocks if tag in _PYTHON_TAGS), None)
  if chosen is None:
    chosen = next((body for tag, body in blocks if not tag), None)
  if chosen is None:
    return prompt + completion
  chosen = chosen.rstrip() + "\n"
  first = next((line for line in chosen.splitlines() if line.strip()), "")
  if first[:1] in (" ", "\t"):
    return prompt + chosen
  separator = "" if prompt.endswith("\n") or not prompt else "\n"
  return prompt + separator + "\n" + chosen
