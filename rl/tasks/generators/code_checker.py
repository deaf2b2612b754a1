"""The hidden tests of the code tasks: the checks run in a process that never imports the agent's code.

A hidden test that imports the agent's code runs it in its own process, and then nothing it
prints or returns can be trusted. An audit passed every level without fixing anything: a
`solution.py` that read the pass marker from `__main__.__file__` and printed it; an `__all__`
that exported its own `_plain_results` over the star import; a package module that replaced
`unittest.TestCase.assertEqual`; an unchecked-hash `.pyc` planted for the test module. So the
hidden test is two processes:

  * the checker (this test file) first re-executes itself isolated, `python3 -I -B`: neither the
    script's directory nor the working directory is on sys.path, PYTHON* variables are ignored
    and no bytecode is read, so no module the agent planted can shadow what the checker imports
    (before the re-exec it imports only `os` and `sys`, which Python has loaded at start-up);
  * it then starts `python3 -B -c RUNNER` in the repository, which imports the agent's code and
    answers calls, one line `repr((module, function, args))` in, one line out: `ok <repr of the
    result>` or `raise <exception name>`, on a descriptor of its own (the agent's prints go to
    stderr).

The checker reads each result back with `ast.literal_eval`, so only plain values reach its
comparisons (numbers, strings, bytes, None, and lists, tuples, sets and dicts of them): no
`__eq__` of the agent's runs there. Its exit code is the verdict (the grader's sandbox run), and
it prints the task's pass marker last; the runner cannot change the checker's exit code, and
ending the runner early ends its answers, which fails the check.

The runner cannot reach into the checker either: the sandbox's seccomp policy refuses ptrace and
process_vm_writev and its /proc is read-only, whatever the host's Yama setting
(tests/rl/test_sandbox.py: test_a_command_cannot_tamper_with_its_parent). What stays possible:
a solution that returns the expected values by looking them up (the visible tests hold them), as
with any test-based grade.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Start of every hidden test: re-run isolated (see the module docstring).
_ISOLATE = '''import os
import sys

if not sys.flags.isolated:  # re-run isolated: modules planted in the repository cannot shadow ours
    os.execv(sys.executable, [sys.executable, "-I", "-B", os.path.abspath(__file__)])

import ast
import builtins
import subprocess

'''

# The agent's side: imports its modules and answers calls (runs in the repository root).
RUNNER = r'''import ast, importlib, os, sys
_answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # the agent's prints go to stderr, not among the answers
_modules = {}
for _line in sys.stdin:
    _module, _name, _args = ast.literal_eval(_line)
    try:
        if _module not in _modules:
            _modules[_module] = importlib.import_module(_module)
        _text = repr(getattr(_modules[_module], _name)(*_args))
        _answer = "ok " + _text if not {"\n", "\r"} & set(_text) else "raise NotPlainData"
    except BaseException as _e:  # the agent's code may raise anything, SystemExit included
        _answer = "raise " + type(_e).__name__
    _answers.write(_answer + "\n")
    _answers.flush()
'''

# The checker's side: calls into the runner and reads plain values back.
_CALLER = '''RUNNER = {runner!r}


class Solution:
    """The agent's functions, called in a process of their own; results come back as plain data."""

    def __init__(self, root):
        self.proc = subprocess.Popen([sys.executable, "-B", "-c", RUNNER], cwd=root, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, errors="replace")

    def call(self, module, name, args):
        self.proc.stdin.write(repr((module, name, tuple(args))) + "\\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the solution's process ended (exit code {{self.proc.wait()}})")
        kind, _, payload = line.rstrip("\\n").partition(" ")
        if kind != "ok":
            error = getattr(builtins, payload, None)
            if isinstance(error, type) and issubclass(error, Exception):
                raise error(f"{{name}} raised {{payload}}")
            raise RuntimeError(f"{{name}} raised {{payload}}")
        try:
            return ast.literal_eval(payload)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise AssertionError(f"{{name}} returned {{payload[:80]}}, not plain data") from None


'''


def _head(root: str) -> str:
  return _ISOLATE + _CALLER.format(runner=RUNNER) + f"ROOT = {root}\n"


def humaneval_test(problem: dict[str, Any], marker: str) -> str:
  """The hidden test_solution.py of a HumanEval task: the problem's prompt (its imports and helper
  functions, which `check` may use; ours, not the agent's), the entry point as a call into the
  runner, the problem's `check`, then the marker."""
  entry = problem["entry_point"]
  return (_head("os.path.dirname(os.path.abspath(__file__))") + "\n" + problem["prompt"].rstrip() + "\n\n\n"
          f"_solution = Solution(ROOT)\n\n\ndef {entry}(*args):  # noqa: F811\n"
          f"    return _solution.call(\"solution\", {entry!r}, args)\n\n\n{problem['test'].strip()}\n\n\n"
          f"if __name__ == \"__main__\":\n    check({entry})\n    print(\"all tests passed\")\n"
          f"    print({marker!r})\n")


def package_test(cases: Sequence[tuple[str, str, tuple, str]], marker: str) -> str:
  """The hidden tests/test_<pkg>.py of a package task: (module, function, args, repr of the
  expected value) cases, each result compared as plain data; failures are listed, then the marker
  when every case passed."""
  lines = "".join(f"    ({m!r}, {f!r}, {tuple(a)!r}, {want}),\n" for m, f, a, want in cases)
  return (_head("os.path.dirname(os.path.dirname(os.path.abspath(__file__)))")
          + f"CASES = [\n{lines}]\n\n\n"
          "def main():\n"
          "    solution, failed = Solution(ROOT), 0\n"
          "    for module, name, args, want in CASES:\n"
          "        try:\n"
          "            got = solution.call(module, name, args)\n"
          "        except Exception as e:\n"
          "            got = e\n"
          "        if isinstance(got, Exception) or got != want:\n"
          "            failed += 1\n"
          "            print(f\"FAIL {module}.{name}{args!r} = {got!r}, expected {want!r}\")\n"
          "    print(f\"{len(CASES) - failed}/{len(CASES)} tests passed\")\n"
          "    if failed:\n"
          "        sys.exit(1)\n"
          f"    print({marker!r})\n\n\n"
          "main()\n")
