"""Code tasks: generation contract, mutant validity, oracle/near-miss grading, hidden tests."""

import json
import re

import pytest

from rl.envs.base import make_env, replay
from rl.tasks.generators import code as gen
from rl.tasks.generators import generate
from rl.tasks.schema import TaskError, parse_task
from serving.types import ToolCall
from tests.rl.replay import replay_scores, sandboxed_context

LEVELS = range(gen.MAX_DIFFICULTY + 1)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return sandboxed_context(tmp_path_factory, "code")


@pytest.mark.parametrize("level", LEVELS)
def test_schema_round_trip_and_determinism(level):
  tasks = generate("code", split="train", difficulty=level, n=10, seed=3)
  for task in tasks:
    assert parse_task(json.loads(json.dumps(task.to_json()))) == task
    assert task["hidden_files"] and set(task["hidden_files"]) <= set(task["files"])
  again = generate("code", split="train", difficulty=level, n=10, seed=3)
  assert [t.to_json() for t in again] == [t.to_json() for t in tasks]


def test_splits_share_no_problem_or_package():
  def sources(split, level):
    return {t.meta["source"] for t in generate("code", split=split, difficulty=level, n=150, seed=0)}

  for level in range(3):
    train, heldout = sources("train", level), sources("heldout", level)
    assert train and heldout and not train & heldout

  def packages(split):
    return {json.dumps(t["files"], sort_keys=True) for t in generate("code", split=split, difficulty=3, n=100,
                                                                       seed=0)}
  assert not packages("train") & packages("heldout")


def test_mutant_cache_matches_the_rules():
  """Every cached mutant is one the current rules produce and applies to its solution."""
  problems = {p["task_id"]: p for p in gen.load_problems()}
  cache = gen.load_cache()
  assert len(cache) >= 150 and sum(map(len, cache.values())) >= 1000
  for pid, mutants in cache.items():
    solution = problems[pid]["canonical_solution"]
    allowed = set(gen.candidate_mutants(solution))
    for mutant in mutants:
      assert mutant in allowed
      assert gen.apply(solution, mutant) != solution


@pytest.mark.parametrize("level", LEVELS)
def test_oracle_scores_1_and_near_miss_0(level, ctx):
  oracle, corrupt = replay_scores("code", level, ctx, n_train=2, n_heldout=1, seed=0)
  assert oracle == [1.0] * 3
  assert corrupt == [0.0] * 3


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_oracle_and_near_miss_200_per_level(level, ctx):
  oracle, corrupt = replay_scores("code", level, ctx, n_train=100, n_heldout=100, seed=11)
  print(f"code level {level}: oracle {sum(oracle):.0f}/200, near miss 0 on {corrupt.count(0.0)}/200")
  assert oracle == [1.0] * 200
  assert corrupt == [0.0] * 200


def test_editing_the_tests_does_not_pass(ctx):
  task = generate("code", split="train", difficulty=2, n=1, seed=0)[0]
  test_path = next(iter(task["hidden_files"]))
  cheat = [{"thinking": "", "content": "", "tool_calls": [
             {"name": "write_file", "arguments": {"path": test_path, "content": "print('ok')\n"}}]},
           {"thinking": "", "content": "done", "tool_calls": []}]
  assert replay(task, ctx, cheat).reward == 0.0
  link = [{"thinking": "", "content": "", "tool_calls": [
            {"name": "shell",
             "arguments": {"command": f"rm {test_path} && ln -s /etc/hostname {test_path}"}}]},
          {"thinking": "", "content": "done", "tool_calls": []}]
  assert replay(task, ctx, link).reward == 0.0


def test_a_hanging_solution_times_out(ctx):
  task = generate("code", split="train", difficulty=0, n=1, seed=0)[0]
  task = task.with_(fields=dict(task.fields, timeout=1.0))
  env = make_env(task, ctx)
  try:
    env.reset()
    result = env.execute(ToolCall(id="c", name="write_file", arguments=json.dumps(
      {"path": "solution.py", "content": "while True:\n    pass\n"})))
    assert not result.error
    grade = env.grade("done")
    assert grade.reward == 0.0 and grade.details["timed_out"]
  finally:
    env.close()


def _write_then_done(path: str, content: str) -> list[dict]:
  return [{"thinking": "", "content": "", "tool_calls": [
            {"name": "write_file", "arguments": {"path": path, "content": content}}]},
          {"thinking": "", "content": "done", "tool_calls": []}]


@pytest.mark.parametrize("level,path,content", [
    (2, "solution.py", "import os\nos._exit(0)\n"),  # the process ends before any test runs
    (2, "solution.py", "import sys\nsys.exit(0)\n"),  # SystemExit from the test's import
    (3, "unittest.py", "import sys\nsys.exit(0)\n"),  # shadows the standard library's unittest
    (3, "tests/__init__.py", "import os\nos._exit(0)\n"),  # restored at grading: the tests run, fail
])
def test_exiting_early_with_code_0_does_not_pass(level, path, content, ctx):
  """Each of these scored 1 when the grade read the exit code alone; the checks now run in a
  process the agent's code does not run in, so ending that code early fails them."""
  task = generate("code", split="train", difficulty=level, n=1, seed=0)[0]
  assert task["pass_marker"] and not any(task["pass_marker"] in t for t in task["files"].values())
  grade = replay(task, ctx, _write_then_done(path, content))
  assert grade.reward == 0.0 and grade.details["exit_code"] == 1, grade.details
  assert replay(task, ctx, [dict(t) for t in task.oracle]).reward == 1.0  # the real fix still passes


def test_a_test_command_that_exits_0_without_the_marker_fails(ctx):
  """A task file's own hidden test that stops early with code 0 (its marker unprinted) scores 0."""
  task = parse_task({"id": "own", "domain": "code", "prompt": "p", "files": {"a.py": "x = 1\n"},
                     "test_command": "python3 t.py", "pass_marker": "OWN-MARKER-1",
                     "hidden_files": {"t.py": "import sys\nsys.exit(0)\nprint('OWN-MARKER-1')\n"}})
  grade = replay(task, ctx, [{"thinking": "", "content": "done", "tool_calls": []}])
  assert grade.reward == 0.0 and "did not print the pass marker" in grade.details["error"], grade.details


@pytest.mark.parametrize("cls", [
    "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n",
    "class Anything(int):\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
    "        return False\n    __hash__ = int.__hash__\n",
])
def test_an_always_equal_result_does_not_pass(cls, ctx):
  """HumanEval's `check` compares with ==: a function returning an object whose __eq__ is always
  true passed every assert (and printed the marker). The checks see plain data only."""
  from rl.tasks.generators import code
  task = generate("code", split="train", difficulty=2, n=1, seed=0)[0]
  entry = code._problems()[task.meta["source"]]["entry_point"]
  hack = f"{cls}\n\ndef {entry}(*args, **kwargs):\n    return Anything()\n"
  grade = replay(task, ctx, _write_then_done("solution.py", hack))
  assert grade.reward == 0.0 and grade.details["exit_code"] == 1, grade.details
  assert replay(task, ctx, [dict(t) for t in task.oracle]).reward == 1.0
  # Level 3 (unittest's assertEqual compares with == too): every function of the package hacked.
  task = generate("code", split="train", difficulty=3, n=1, seed=0)[0]
  writes = _package_sources(task, lambda names: cls + "".join(
      f"\n\ndef {name}(*args, **kwargs):\n    return Anything()\n" for name in names))
  grade = replay(task, ctx, [{"thinking": "", "content": "", "tool_calls": writes},
                             {"thinking": "", "content": "done", "tool_calls": []}])
  assert grade.reward == 0.0 and grade.details["exit_code"] == 1, grade.details


_MARKER_RE = "HORIZON-TESTS-PASSED-[0-9a-f]{16}"
# Reads the marker from the hidden test, writes it where the grader reads (the sandbox's stdout:
# its own, then its parent's), and ends with code 0 before any check runs.
_PRINT_MARKER = """import glob, os, re
for _p in glob.glob("*.py") + glob.glob("tests/*.py"):
    _m = re.search(r"%s", open(_p).read())
    if _m:
        for _fd in ("/proc/self/fd/1", "/proc/%%d/fd/1" %% os.getppid()):
            try:
                open(_fd, "w").write(_m.group(0) + "\\n")
            except OSError:
                pass
os._exit(0)
""" % _MARKER_RE
_PLANT_PYC = """import glob, importlib.util, py_compile
test = glob.glob("tests/test_*.py")[0]
open("/tmp/fake.py", "w").write(%r)
py_compile.compile("/tmp/fake.py", cfile=importlib.util.cache_from_source(test),
                   invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
""" % _PRINT_MARKER
_STAR_GUARD = """class A:
    def __eq__(self, other):
        return True


def _plain_results(f):
    return f


def __getattr__(name):
    return lambda *args, **kwargs: A()


__all__ = ["_plain_results", "%s"]
"""


def _package_sources(task, body):
  """write_file calls replacing every package module by `body` (a string, or a function of the
  module's function names)."""
  return [{"name": "write_file", "arguments": {
            "path": path, "content": body(re.findall(r"^def (\w+)", text, re.M)) if callable(body) else body}}
          for path, text in task["files"].items() if not path.startswith("tests/") and "def " in text]


def _hacks():
  """(level, tool calls): each scored 1 without fixing anything, as an audit found."""
  patch = "import unittest\nunittest.TestCase.assertEqual = lambda self, a, b, msg=None: None\n"
  return [
    (2, [{"name": "write_file", "arguments": {"path": "solution.py", "content": _PRINT_MARKER}}]),
    (2, lambda task: [{"name": "write_file", "arguments": {"path": "solution.py", "content": _STAR_GUARD % (
        gen._problems()[task.meta["source"]]["entry_point"])}}]),
    (3, lambda task: _package_sources(task, patch + _PRINT_MARKER)),
    (3, [{"name": "write_file", "arguments": {"path": "plant.py", "content": _PLANT_PYC}},
         {"name": "shell", "arguments": {"command": "python3 plant.py && ls tests/__pycache__"}}]),
  ]


@pytest.mark.parametrize("case", range(4))
def test_code_that_skips_the_checks_scores_0(case, ctx):
  """Each scored 1 while the checks ran in the agent's process: the marker read from the hidden
  test and printed before an exit, `__all__` exporting its own guard over the star import, a
  patched unittest, an unchecked-hash .pyc planted for the test module."""
  level, calls = _hacks()[case]
  task = generate("code", split="train", difficulty=level, n=1, seed=0)[0]
  calls = calls(task) if callable(calls) else calls
  grade = replay(task, ctx, [{"thinking": "", "content": "", "tool_calls": calls},
                             {"thinking": "", "content": "done", "tool_calls": []}])
  assert grade.reward == 0.0 and grade.details["exit_code"] != 0, grade.details


def test_pass_marker_must_be_hidden_and_printed():
  task = generate("code", split="train", difficulty=0, n=1, seed=0)[0].to_json()
  marker = task["pass_marker"]
  with pytest.raises(TaskError, match="pass_marker' appears in no hidden file"):
    parse_task(task | {"pass_marker": "NOT-PRINTED"})
  with pytest.raises(TaskError, match="pass_marker' appears in 'prompt'"):
    parse_task(task | {"prompt": task["prompt"] + marker})
  with pytest.raises(TaskError, match="appears in 'solution.py'"):
    parse_task(task | {"files": task["files"] | {"solution.py": f"# {marker}\n"}})
  legacy = {k: v for k, v in task.items() if k != "pass_marker"}  # task files without it: exit code only
  assert parse_task(legacy)["pass_marker"] is None


def test_a_hidden_file_whose_directory_became_a_file_is_restored(ctx):
  task = generate("code", split="train", difficulty=3, n=1, seed=0)[0]
  oracle = [dict(t) for t in task.oracle]
  wreck = {"name": "shell", "arguments": {"command": "rm -rf tests && touch tests"}}
  first = dict(oracle[0], tool_calls=[wreck])
  assert replay(task, ctx, [first] + oracle[1:]).reward == 1.0  # grading puts tests/ back whole
