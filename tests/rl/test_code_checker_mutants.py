"""The code tasks' checker (rl/tasks/generators/code_checker.py) run directly on small packages
written here, outside the sandbox: its exit code, its FAIL lines and its marker against values
written out here (each test names the mistake it catches: a failure not counted, an exception
taken for a result, the checker importing a module the agent planted)."""

import subprocess
import sys

import pytest

from rl.tasks.generators import code_checker

MARKER = "CHECKER-MARKER-0123"
GOOD = "def add(a, b):\n    return a + b\n\n\ndef neg(a):\n    return -a\n"
CASES = [("pkg.calc", "add", (1, 2), "3"), ("pkg.calc", "neg", (4,), "-4"),
         ("pkg.calc", "add", ("a", "b"), "'ab'")]


def _package(tmp_path, source, cases=CASES, extra=None):
  for folder in ("tests", "pkg"):
    (tmp_path / folder).mkdir(parents=True)
  (tmp_path / "pkg" / "__init__.py").write_text("")
  (tmp_path / "pkg" / "calc.py").write_text(source)
  (tmp_path / "tests" / "test_calc.py").write_text(code_checker.package_test(cases, MARKER))
  for path, text in (extra or {}).items():
    (tmp_path / path).write_text(text)
  run = subprocess.run([sys.executable, "tests/test_calc.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
  return run.returncode, run.stdout.splitlines()


def test_a_right_package_passes_and_prints_the_marker_last(tmp_path):
  assert _package(tmp_path, GOOD) == (0, ["3/3 tests passed", MARKER])


def test_an_import_time_print_goes_to_stderr_not_among_the_answers(tmp_path):
  assert _package(tmp_path, "print('ok 99')\n" + GOOD) == (0, ["3/3 tests passed", MARKER])


def test_each_wrong_result_is_a_failure_and_no_marker(tmp_path):
  wrong = GOOD.replace("return -a", "return a")
  assert _package(tmp_path, wrong) == (1, ["FAIL pkg.calc.neg(4,) = 4, expected -4", "2/3 tests passed"])
  wrong = wrong.replace("return a + b", "return b + a")
  assert _package(tmp_path / "two", wrong) == (1, [
    "FAIL pkg.calc.neg(4,) = 4, expected -4", "FAIL pkg.calc.add('a', 'b') = 'ba', expected 'ab'",
    "1/3 tests passed"])


@pytest.mark.parametrize("body,shown", [
  ("raise ValueError('no')", "ValueError('neg raised ValueError')"),
  ("raise SystemExit(0)", "RuntimeError('neg raised SystemExit')"),
  ("raise KeyboardInterrupt", "RuntimeError('neg raised KeyboardInterrupt')"),
])
def test_an_exception_is_a_failure_and_the_next_call_still_answers(tmp_path, body, shown):
  source = GOOD.replace("return -a", body)
  assert _package(tmp_path, source) == (1, [f"FAIL pkg.calc.neg(4,) = {shown}, expected -4",
                                            "2/3 tests passed"])


@pytest.mark.parametrize("cls", [
  "class R:\n    def __eq__(self, other):\n        return True\n"
  "    def __repr__(self):\n        return '-4'\n",
  "class R(int):\n    def __repr__(self):\n        return '-4\\nok -4'\n",
  "class R(int):\n    def __repr__(self):\n        return '-4\\rok -4'\n",  # read as two lines too
  "class R(int):\n    def __repr__(self):\n        return \"__import__('os').getpid() and -4\"\n",
])
def test_only_plain_data_comes_back(tmp_path, cls):
  """A repr that reads as the right value but spans two lines (the second a forged answer) is no
  result; an object equal to everything is compared by its repr's value."""
  source = cls + GOOD.replace("return -a", "return R(4)" if "int" in cls else "return R()")
  code, lines = _package(tmp_path, source)
  if "getpid" in cls:  # an expression, never evaluated by the checker
    plain = ("FAIL pkg.calc.neg(4,) = AssertionError(\"neg returned __import__('os').getpid() and -4, "
             "not plain data\"), expected -4")
    assert (code, lines) == (1, [plain, "2/3 tests passed"])
  elif "int" in cls:
    plain = "FAIL pkg.calc.neg(4,) = RuntimeError('neg raised NotPlainData'), expected -4"
    assert (code, lines) == (1, [plain, "2/3 tests passed"])
  else:
    assert (code, lines) == (0, ["3/3 tests passed", MARKER])  # '-4' read back as the plain -4


def test_ending_the_solutions_process_fails_every_later_case(tmp_path):
  code, lines = _package(tmp_path, GOOD.replace("return -a", "import os\n    os._exit(0)"))
  assert code == 1 and lines[-1] == "1/3 tests passed", lines
  ended = "FAIL pkg.calc.neg(4,) = AssertionError(\"the solution's process ended (exit code 0)"
  assert lines[0].startswith(ended), lines


def test_a_module_planted_beside_the_test_is_not_imported_by_the_checker(tmp_path):
  """Without the isolated re-run, tests/subprocess.py shadowed the standard library's in the
  checker and printed the marker over a wrong package."""
  plant = f"import sys\nprint('3/3 tests passed')\nprint({MARKER!r})\nsys.exit(0)\n"
  wrong = GOOD.replace("return -a", "return a")
  code, lines = _package(tmp_path, wrong, extra={"tests/subprocess.py": plant, "tests/ast.py": plant})
  assert (code, lines) == (1, ["FAIL pkg.calc.neg(4,) = 4, expected -4", "2/3 tests passed"])


def _humaneval(tmp_path, solution):
  problem = {"prompt": "import math\n\n\ndef hyp(a, b):\n    \"\"\"The hypotenuse.\"\"\"\n",
             "test": "def check(candidate):\n    assert candidate(3, 4) == 5\n"
                     "    assert candidate(0, 0) == 0\n",
             "entry_point": "hyp"}
  (tmp_path / "solution.py").write_text(solution)
  (tmp_path / "test_solution.py").write_text(code_checker.humaneval_test(problem, MARKER))
  run = subprocess.run([sys.executable, "test_solution.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
  return run.returncode, run.stdout.splitlines(), run.stderr


def test_a_humaneval_check_passes_right_code_and_fails_wrong_code(tmp_path):
  right = "import math\n\n\ndef hyp(a, b):\n    return math.hypot(a, b)\n"
  assert _humaneval(tmp_path, right)[:2] == (0, ["all tests passed", MARKER])
  code, lines, err = _humaneval(tmp_path, right.replace("math.hypot(a, b)", "a + b"))
  assert (code, lines) == (1, []) and "AssertionError" in err, err
