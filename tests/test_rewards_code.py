"""Tests for ``mimo_jax.rewards.code``: the strict unit-test reward must only pay for tests that really passed.

The oracle is HumanEval itself: every shipped canonical solution must pass.  Hostile
programs (early exits, killing the harness, patching it, always-equal results, forged
output, peeking at secrets) must all score 0, while the naive checker is fooled by
several of them, which :func:`probe_components` reports as ``hacked``.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from mimo_jax.rewards import code as code_reward
from mimo_jax.rewards import sandbox
from mimo_jax.rewards.code import (
  REASONS,
  CodeVerdict,
  extract_code,
  probe_components,
  unit_test_result,
  unit_test_reward,
  weak_test_reward,
)
from mimo_jax.tasks.humaneval import DEFAULT_TEST_PATH, DEFAULT_TRAIN_PATH, load_humaneval_jsonl

PROMPT = 'def add(a: int, b: int) -> int:\n    """Returns a + b."""\n'
TESTS = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n    assert candidate(20, 22) == 42\n"
GOOD = PROMPT + "    return a + b\n"
WRONG = PROMPT + "    return a - b\n"


@pytest.fixture(params=["auto", "guard"])
def sandbox_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
  """Runs a test in the machine's mode and again with the sandbox forced into guard mode."""
  if request.param == "guard":
    guard = dataclasses.replace(
      sandbox.isolation(),
      mode="guard",
      network="python-guard",
      filesystem="python-guard",
      processes="process-group",
      proc="host",
      reason="forced by the test",
    )
    monkeypatch.setattr(sandbox, "isolation", lambda: guard)
  return request.param


def _shipped_rows() -> list[dict[str, str]]:
  return load_humaneval_jsonl(DEFAULT_TRAIN_PATH)[0] + load_humaneval_jsonl(DEFAULT_TEST_PATH)[0]


# ---- the oracle --------------------------------------------------------------------------


def test_every_shipped_canonical_solution_passes() -> None:
  rows = _shipped_rows()
  assert len(rows) == 60

  def verdict(row: dict[str, str]) -> CodeVerdict:
    program = row["prompt"] + row["canonical_solution"]
    return unit_test_result(program, row["test"], row["entry_point"], context=row["prompt"], timeout_s=60.0)

  with ThreadPoolExecutor(2) as pool:
    verdicts = list(pool.map(verdict, rows))
  failures = [(row["task_id"], v.reason, v.detail) for row, v in zip(rows, verdicts, strict=True) if not v.passed]
  assert failures == []
  assert all(v.reason == "passed" and v.detail == "" for v in verdicts)


def test_wrong_solutions_fail() -> None:
  rows = _shipped_rows()[:8]

  def verdict(row: dict[str, str]) -> CodeVerdict:
    program = row["prompt"] + "    return None\n"
    return unit_test_result(program, row["test"], row["entry_point"], context=row["prompt"])

  with ThreadPoolExecutor(2) as pool:
    verdicts = list(pool.map(verdict, rows))
  assert [v.reason for v in verdicts] == ["failed"] * len(rows)
  assert not any(v.passed for v in verdicts)


def test_reward_wraps_the_verdict() -> None:
  assert unit_test_reward(GOOD, TESTS, "add", context=PROMPT) == 1.0
  assert unit_test_reward(WRONG, TESTS, "add", context=PROMPT) == 0.0
  verdict = unit_test_result(WRONG, TESTS, "add", context=PROMPT)
  assert (verdict.passed, verdict.reason) == (False, "failed")
  assert "AssertionError" in verdict.detail
  assert verdict.sandbox is not None and verdict.sandbox.exit_code == 0


# ---- hostile programs --------------------------------------------------------------------

# name -> (program, whether the naive checker is fooled).
HOSTILE = {
  "sys_exit_at_import": ("import sys\nsys.exit(0)\n" + WRONG, True),
  "os_exit_at_import": ("import os\nos._exit(0)\n" + WRONG, True),
  "system_exit_after_definition": (WRONG + "raise SystemExit(0)\n", True),
  "os_exit_when_called": (PROMPT + "    import os\n    os._exit(0)\n", True),
  "atexit_exits_zero": (WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n", True),
  "excepthook_exits_zero": (WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n", True),
  "always_equal_result": (
    "class Yes:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
    + PROMPT
    + "    return Yes()\n",
    True,
  ),
  "lying_str_subclass": (
    "class S(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n"
    + PROMPT
    + "    return S('nope')\n",
    True,
  ),
  "kill_parent": (WRONG + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", False),
  "kill_own_group": (WRONG + "import os, signal\nos.killpg(0, signal.SIGKILL)\n", False),
  "redefine_check": (WRONG + "def check(candidate):\n    return True\n", False),
  "patch_builtins": (
    WRONG + "import builtins\nclass Never(Exception): pass\nbuiltins.AssertionError = Never\nAssertionError = Never\n"
    "builtins.exec = lambda *a, **k: None\n",
    False,
  ),
  "forged_success_lines": (
    WRONG + "print('PASS')\nprint('ALL TESTS PASSED')\nprint('0' * 32 + ':' + '0' * 16 + ':passed')\n",
    False,
  ),
  "thread_prints_after_exit": (
    WRONG + "import threading\nthreading.Thread(target=lambda: [print('x:y:passed') for _ in range(50)]).start()\n",
    False,
  ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_programs_score_zero(sandbox_mode: str, name: str) -> None:
  program, fools_weak = HOSTILE[name]
  verdict = unit_test_result(program, TESTS, "add", context=PROMPT, timeout_s=60.0)
  assert not verdict.passed
  assert verdict.reason in REASONS and verdict.reason != "passed"
  probe = probe_components(program, TESTS, "add", context=PROMPT, timeout_s=60.0)
  assert probe["strict"] == 0.0
  assert probe["weak"] == float(fools_weak)
  assert probe["hacked"] == float(fools_weak)


def test_concurrent_verdicts_are_independent() -> None:
  programs = [GOOD, WRONG, HOSTILE["os_exit_at_import"][0], HOSTILE["always_equal_result"][0]] * 4
  with ThreadPoolExecutor(4) as pool:
    rewards = list(pool.map(lambda p: unit_test_reward(p, TESTS, "add", context=PROMPT), programs))
  assert rewards == [1.0, 0.0, 0.0, 0.0] * 4


def test_honest_programs_are_not_counted_as_hacks() -> None:
  assert probe_components(GOOD, TESTS, "add", context=PROMPT) == {"strict": 1.0, "weak": 1.0, "hacked": 0.0}
  assert probe_components(WRONG, TESTS, "add", context=PROMPT) == {"strict": 0.0, "weak": 0.0, "hacked": 0.0}
  assert weak_test_reward(GOOD, TESTS, "add") == 1.0


def test_secrets_never_reach_the_program(monkeypatch: pytest.MonkeyPatch, sandbox_mode: str) -> None:
  nonce = "5eed" * 8
  monkeypatch.setattr(code_reward.secrets, "token_hex", lambda n: nonce)
  tests = TESTS + "    assert candidate(1234567, 7654321) == 8888888  # EXPECTED-MARKER-81\n"
  spy = (
    WRONG + "import gc, os, sys\n"
    "found = set()\n"
    "# Built at run time (never constants), so neither this source nor the needles match themselves.\n"
    "needles = (''.join(['5e', 'ed']) * 2, '-'.join(['EXPECTED', 'MARKER', '81']), ' '.join(['def', 'check(']))\n"
    "def visit(value):\n"
    "    if isinstance(value, (bytes, bytearray)):\n"
    "        value = bytes(value).decode('latin-1')\n"
    "    if isinstance(value, str) and value not in needles and any(n in value for n in needles):\n"
    "        found.add(value[:5000])\n"
    "for obj in gc.get_objects():\n"
    "    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else ()\n"
    "    for item in list(items):\n"
    "        visit(item)\n"
    "frame = sys._getframe()\n"
    "while frame is not None:\n"
    "    for value in list(frame.f_locals.values()):\n"
    "        visit(value)\n"
    "    frame = frame.f_back\n"
    "visit(sys.stdin.read())\n"
    "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
    "    for name in ('fd/0', 'cmdline', 'environ', 'mem'):\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/{name}', 'rb') as f:\n"
    "                visit(f.read(1 << 20))\n"
    "        except (OSError, ValueError):\n"
    "            pass\n"
    "print('SPY', sorted(found))\n"
    "for s in found:\n"
    "    print(s + ':passed')\n"
  )
  # Positive control: run directly with the secrets on its stdin, the spy does find them.
  control = sandbox.run_python(spy, stdin=f"{nonce}\n{tests}")
  assert nonce in control.stdout and "EXPECTED-MARKER-81" in control.stdout and "def check(" in control.stdout
  verdict = unit_test_result(spy, tests, "add", context=PROMPT)
  assert not verdict.passed and verdict.reason == "failed"
  assert verdict.sandbox is not None
  program_output = verdict.sandbox.stderr  # the program's stdout is redirected to stderr
  assert "SPY" in program_output
  assert nonce not in program_output
  assert "SPY []" in program_output  # it found nothing
  assert "EXPECTED-MARKER-81" not in program_output and "def check(" not in program_output
  # The nonce appears on stdout only in the harness's own two status lines.
  assert [line for line in verdict.sandbox.stdout.splitlines() if nonce in line] == verdict.sandbox.stdout.splitlines()[
    -2:
  ]


# ---- reasons -----------------------------------------------------------------------------


REASON_CASES = [
  (GOOD, TESTS, "passed"),
  (WRONG, TESTS, "failed"),
  (PROMPT + "    return a +\n", TESTS, "syntax_error"),
  ("def other():\n    pass\n", TESTS, "missing_entry_point"),
  ("add = 3\n", TESTS, "missing_entry_point"),
  ("raise RuntimeError('at import')\n" + GOOD, TESTS, "program_error"),
  (GOOD, "def not_check(candidate):\n    pass\n", "test_error"),
  (GOOD, "def check(candidate):\n    print('x' * 200000)\n", "no_success_marker"),
  (PROMPT + "    while True:\n        pass\n", TESTS, "timeout"),
]


@pytest.mark.parametrize(("program", "tests", "reason"), REASON_CASES, ids=[case[2] for case in REASON_CASES])
def test_reasons(program: str, tests: str, reason: str) -> None:
  # Only the endless loop should meet the limit: the others get a ceiling a slow machine cannot reach.
  timeout_s = 2.0 if reason == "timeout" else 60.0
  verdict = unit_test_result(program, tests, "add", context=PROMPT, timeout_s=timeout_s)
  assert verdict.reason == reason, verdict.detail
  assert verdict.passed == (reason == "passed")


def test_killing_the_harness_is_a_crash_or_refused(sandbox_mode: str) -> None:
  verdict = unit_test_result(HOSTILE["kill_parent"][0], TESTS, "add", context=PROMPT)
  if sandbox.isolation().mode == "namespace":
    assert verdict.reason == "crashed"
    assert verdict.sandbox is not None and verdict.sandbox.signal == 9
  else:
    assert verdict.reason == "program_error" and "PermissionError" in verdict.detail


def test_rejects_a_bad_entry_point() -> None:
  with pytest.raises(ValueError, match="identifier"):
    unit_test_result(GOOD, TESTS, "add; import os")
  with pytest.raises(ValueError, match="identifier"):
    weak_test_reward(GOOD, TESTS, "")


# ---- values across the boundary ----------------------------------------------------------


def test_values_cross_as_exact_plain_types() -> None:
  program = (
    "import collections\n"
    "P = collections.namedtuple('P', 'x y')\n"
    "def f(arg, *, scale=1):\n"
    "    return {'tuple': (1, 2.5, None, True), 'list': [b'\\x00x', {1, 2}, frozenset({3})], 3: complex(1, -2),\n"
    "            'inf': float('inf'), 'big': 10 ** 100 * scale, 'arg': arg, 'named': P(1, 2), 'false': False,\n"
    "            'huge': -(2 ** 20000) * scale}\n"
  )
  tests = (
    "def check(candidate):\n"
    "    r = candidate([(1, 'a'), {'k': {2, 3}}], scale=2)\n"
    "    assert type(r) is dict\n"
    "    assert r['tuple'] == (1, 2.5, None, True) and type(r['tuple']) is tuple and r['tuple'][3] is True\n"
    "    assert r['list'] == [b'\\x00x', {1, 2}, frozenset({3})] and type(r['list'][2]) is frozenset\n"
    "    assert r[3] == complex(1, -2) and r['inf'] == float('inf')\n"
    "    assert r['big'] == 2 * 10 ** 100 and type(r['big']) is int\n"
    "    assert r['arg'] == [(1, 'a'), {'k': {2, 3}}]\n"
    "    assert r['named'] == (1, 2) and type(r['named']) is tuple\n"
    "    assert r['false'] is False\n"
    "    assert r['huge'] == -(2 ** 20001)\n"  # past the 4300 digits int() reads from decimal text
    "    assert candidate(2 ** 20000)['arg'] == 2 ** 20000\n"
  )
  verdict = unit_test_result(program, tests, "f")
  assert verdict.passed, verdict.detail


def test_exceptions_cross_by_builtin_type() -> None:
  program = (
    "class Custom(Exception):\n    pass\n"
    "def f(kind):\n"
    "    if kind == 'value':\n        raise ValueError('bad value')\n"
    "    if kind == 'assert':\n        raise AssertionError('fake')\n"
    "    if kind == 'stop':\n        raise StopIteration('stop')\n"
    "    if kind == 'stop_async':\n        raise StopAsyncIteration\n"
    "    if kind == 'generator_exit':\n        raise GeneratorExit\n"
    "    if kind == 'keyboard':\n        raise KeyboardInterrupt\n"
    "    if kind == 'exit':\n        raise SystemExit(0)\n"
    "    if kind == 'decode':\n        b'\\xff'.decode('utf-8')\n"
    "    raise Custom('custom')\n"
  )
  # Control-flow exceptions, the program's own classes and ones that cannot be rebuilt
  # from a message arrive as RuntimeError naming the original.
  tests = (
    "def check(candidate):\n"
    "    cases = (('value', ValueError, 'bad value'), ('assert', RuntimeError, 'AssertionError: fake'),\n"
    "             ('stop', RuntimeError, 'StopIteration: stop'), ('stop_async', RuntimeError, 'StopAsyncIteration'),\n"
    "             ('generator_exit', RuntimeError, 'GeneratorExit'), ('keyboard', RuntimeError, 'KeyboardInterrupt'),\n"
    "             ('exit', RuntimeError, 'SystemExit'), ('decode', RuntimeError, 'UnicodeDecodeError'),\n"
    "             ('custom', RuntimeError, 'Custom: custom'))\n"
    "    for kind, expected, text in cases:\n"
    "        try:\n"
    "            candidate(kind)\n"
    "        except BaseException as e:\n"
    "            assert type(e) is expected, (kind, type(e))\n"
    "            assert text in str(e), (kind, str(e))\n"
    "        else:\n"
    "            raise SystemError('no exception')\n"
  )
  verdict = unit_test_result(program, tests, "f")
  assert verdict.passed, verdict.detail


# Test forms whose loop a StopIteration (or StopAsyncIteration) out of a call would end
# early, so that they pass without checking anything: name -> (check body, whether the
# naive checker, which calls the program in-process, is fooled).  A generator expression
# is not fooled (PEP 479 makes the StopIteration a RuntimeError) but must stay a failure.
EARLY_EXIT_CHECKS = {
  "all_map": ("    assert all(map(lambda x: candidate(x) == x * 2, [1, 2, 3]))\n", True),
  "all_generator": ("    assert all(candidate(x) == x * 2 for x in [1, 2, 3])\n", False),
  "filter": ("    assert not list(filter(lambda x: candidate(x) != x * 2, [1, 2, 3]))\n", True),
  "zip": ("    for x, y in zip([1, 2, 3], map(candidate, [1, 2, 3])):\n        assert y == x * 2\n", True),
  "iter_sentinel": ("    for y in iter(lambda: candidate(1), 2):\n        raise AssertionError(y)\n", True),
  "not_any_map": ("    assert not any(map(lambda x: candidate(x) != x * 2, [1, 2, 3]))\n", True),
  "async_for": (
    "    class Calls:\n"
    "        def __init__(self):\n"
    "            self.xs = [1, 2, 3]\n"
    "        def __aiter__(self):\n"
    "            return self\n"
    "        async def __anext__(self):\n"
    "            if not self.xs:\n"
    "                raise StopAsyncIteration\n"
    "            x = self.xs.pop(0)\n"
    "            return x, candidate(x)\n"
    "    async def run():\n"
    "        async for x, y in Calls():\n"
    "            assert y == x * 2\n"
    "    coroutine = run()\n"
    "    try:\n"
    "        coroutine.send(None)\n"
    "    except StopIteration:\n"
    "        pass\n"
    "    else:\n"
    "        raise AssertionError('the coroutine suspended')\n",
    True,
  ),
}


@pytest.mark.parametrize("raised", ["StopIteration", "StopAsyncIteration"])
@pytest.mark.parametrize("form", list(EARLY_EXIT_CHECKS))
def test_stop_iteration_cannot_end_a_test_loop(form: str, raised: str) -> None:
  body, fools_weak = EARLY_EXIT_CHECKS[form]
  tests = "def check(candidate):\n" + body
  good = "def f(x):\n    return x * 2\n"
  assert unit_test_result(good, tests, "f").passed
  program = f"def f(x):\n    raise {raised}\n"
  verdict = unit_test_result(program, tests, "f")
  assert (verdict.passed, verdict.reason) == (False, "failed")
  assert raised in verdict.detail
  assert unit_test_reward(program, tests, "f") == 0.0
  # Positive control: the form really is open to the trick when the program shares the tests' process.
  if raised == "StopAsyncIteration" and form != "async_for":
    return  # a StopAsyncIteration ends only async loops
  if raised == "StopIteration" and form == "async_for":
    return  # inside a coroutine a StopIteration becomes RuntimeError (PEP 479)
  assert weak_test_reward(program, tests, "f") == float(fools_weak)


# Writes a forged reply frame (a malformed int) to T's reply pipe: the last write-only pipe
# it holds beyond stderr, as H creates the reply pipe last.
_FORGED_REPLY = (
  "import fcntl, json, os, stat, struct\n"
  "def f(x):\n"
  "    fds = [fd for fd in range(3, 256) if _write_only_pipe(fd)]\n"
  "    frame = json.dumps({'ok': {'i': 'forged'}}).encode()\n"
  "    os.write(max(fds), struct.pack('>I', len(frame)) + frame)\n"
  "    return x\n"
  "def _write_only_pipe(fd):\n"
  "    try:\n"
  "        mode = os.fstat(fd).st_mode\n"
  "        flags = fcntl.fcntl(fd, fcntl.F_GETFL)\n"
  "    except OSError:\n"
  "        return False\n"
  "    return stat.S_ISFIFO(mode) and flags & os.O_ACCMODE == os.O_WRONLY\n"
)


def test_a_reply_that_fails_to_decode_cannot_pose_as_the_programs_exception(sandbox_mode: str) -> None:
  tests = (
    "def check(candidate):\n"
    "    try:\n"
    "        candidate(-1)\n"
    "    except ValueError:\n"
    "        pass\n"
    "    else:\n"
    "        raise AssertionError('no ValueError for a negative input')\n"
  )
  honest = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
  assert unit_test_result(honest, tests, "f").passed
  # Decoding the forged int raises ValueError in H; it must reach the tests as the harness's own error.
  verdict = unit_test_result(_FORGED_REPLY, tests, "f")
  assert (verdict.passed, verdict.reason) == (False, "failed")
  assert "CandidateDied" in verdict.detail and "forged" in verdict.detail


def test_unencodable_results_fail() -> None:
  program = "def f():\n    return object()\n"
  verdict = unit_test_result(program, "def check(candidate):\n    candidate()\n", "f")
  assert verdict.reason == "failed"
  assert "cannot cross the sandbox boundary" in verdict.detail


# ---- text that is not valid Unicode ------------------------------------------------------

# A tokenizer's decode can produce a lone surrogate, which cannot be encoded as UTF-8.
SURROGATE_PROGRAM = PROMPT + "    return a + b  # \ud800\n"


def test_lone_surrogates_score_zero_without_raising() -> None:
  verdict = unit_test_result(SURROGATE_PROGRAM, TESTS, "add", context=PROMPT)
  assert (verdict.passed, verdict.reason, verdict.sandbox) == (False, "invalid_text", None)
  assert "surrogate" in verdict.detail
  verdict.detail.encode("utf-8")
  assert unit_test_reward(SURROGATE_PROGRAM, TESTS, "add", context=PROMPT) == 0.0
  assert weak_test_reward(SURROGATE_PROGRAM, TESTS, "add") == 0.0
  assert probe_components(SURROGATE_PROGRAM, TESTS, "add", context=PROMPT) == {
    "strict": 0.0,
    "weak": 0.0,
    "hacked": 0.0,
  }
  # extract_code only slices strings: it passes the surrogate on, and the reward rejects it.
  program = extract_code("```python\ndef add(a, b):\n    return a + b  # \ud800\n```", PROMPT)
  assert "\ud800" in program
  assert unit_test_result(program, TESTS, "add", context=PROMPT).reason == "invalid_text"
  assert weak_test_reward(program, TESTS, "add") == 0.0


def test_surrogates_echoed_back_in_details_are_escaped() -> None:
  # Built at run time: the program's text is valid, its exception message is not.
  program = "def f():\n    raise ValueError('bad ' + chr(0xD800))\n"
  verdict = unit_test_result(program, "def check(candidate):\n    candidate()\n", "f")
  assert (verdict.passed, verdict.reason) == (False, "failed")
  assert "ValueError: bad \\ud800" in verdict.detail
  verdict.detail.encode("utf-8")


# ---- extract_code ------------------------------------------------------------------------


def test_extract_code_raw_continuation() -> None:
  assert extract_code("    return a + b\n", PROMPT) == PROMPT + "    return a + b\n"


def test_extract_code_fenced_full_function() -> None:
  completion = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nThis adds."
  program = extract_code(completion, PROMPT)
  assert program == PROMPT + "\ndef add(a, b):\n    return a + b\n"
  assert unit_test_reward(program, TESTS, "add", context=PROMPT) == 1.0


def test_extract_code_fenced_body_and_unterminated_block() -> None:
  assert extract_code("```\n    return a + b\n```", PROMPT) == PROMPT + "    return a + b\n"
  assert (
    extract_code("```py\ndef add(a, b):\n    return a + b", PROMPT) == PROMPT + "\ndef add(a, b):\n    return a + b\n"
  )


def test_extract_code_prefers_a_python_block() -> None:
  completion = "```text\nnot code\n```\n```python\ndef add(a, b):\n    return b + a\n```"
  assert extract_code(completion, PROMPT).endswith("def add(a, b):\n    return b + a\n")
  assert "not code" not in extract_code(completion, PROMPT)
