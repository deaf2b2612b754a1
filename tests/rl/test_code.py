"""Code tasks: generation contract, mutant validity, oracle/near-miss grading, hidden tests."""

import json
import re

import pytest

from rl.envs.base import EnvContext, make_env, replay
from rl.sandbox import Sandbox, SandboxUnavailable
from rl.tasks.generators import code as gen
from rl.tasks.generators import generate
from rl.tasks.schema import TaskError, parse_task
from serving.types import ToolCall
from tests.rl.replay import replay_scores

LEVELS = range(gen.MAX_DIFFICULTY + 1)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  try:
    Sandbox()
  except SandboxUnavailable as e:
    pytest.skip(f"nsjail cannot run here: {e}")
  return EnvContext(root=tmp_path_factory.mktemp("code"))


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


@pytest.mark.parametrize("level,path,content,exit_code", [
    (2, "solution.py", "import os\nos._exit(0)\n", 0),  # the process ends before any test runs
    (2, "solution.py", "import sys\nsys.exit(0)\n", 0),  # SystemExit from the test's import
    (3, "unittest.py", "import sys\nsys.exit(0)\n", 0),  # shadows the standard library's unittest
    (3, "tests/__init__.py", "import os\nos._exit(0)\n", 1),  # restored at grading: the tests run, fail
])
def test_exiting_early_with_code_0_does_not_pass(level, path, content, exit_code, ctx):
  """Each of these scored 1 when the grade read the exit code alone."""
  task = generate("code", split="train", difficulty=level, n=1, seed=0)[0]
  assert task["pass_marker"] and not any(task["pass_marker"] in t for t in task["files"].values())
  grade = replay(task, ctx, _write_then_done(path, content))
  assert grade.reward == 0.0 and grade.details["exit_code"] == exit_code, grade.details
  assert ("pass marker" in grade.details.get("error", "")) == (exit_code == 0)
  assert replay(task, ctx, [dict(t) for t in task.oracle]).reward == 1.0  # the real fix still passes


@pytest.mark.parametrize("cls", [
    "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n",
    "class Anything(int):\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
    "        return False\n    __hash__ = int.__hash__\n",
])
def test_an_always_equal_result_does_not_pass(cls, ctx):
  """HumanEval's `check` compares with ==: a function returning an object whose __eq__ is always
  true passed every assert (and printed the marker). The hidden test wants plain values."""
  from rl.tasks.generators import code
  task = generate("code", split="train", difficulty=2, n=1, seed=0)[0]
  entry = code._problems()[task.meta["source"]]["entry_point"]
  hack = f"{cls}\n\ndef {entry}(*args, **kwargs):\n    return Anything()\n"
  grade = replay(task, ctx, _write_then_done("solution.py", hack))
  assert grade.reward == 0.0 and grade.details["exit_code"] == 1, grade.details
  assert replay(task, ctx, [dict(t) for t in task.oracle]).reward == 1.0
  # Level 3 (unittest's assertEqual compares with == too): every function of the package hacked.
  task = generate("code", split="train", difficulty=3, n=1, seed=0)[0]
  writes = [{"name": "write_file", "arguments": {"path": path, "content": cls + "".join(
              f"\n\ndef {name}(*args, **kwargs):\n    return Anything()\n"
              for name in re.findall(r"^def (\w+)", text, re.M))}}
            for path, text in task["files"].items() if not path.startswith("tests/") and "def " in text]
  grade = replay(task, ctx, [{"thinking": "", "content": "", "tool_calls": writes},
                             {"thinking": "", "content": "done", "tool_calls": []}])
  assert grade.reward == 0.0 and grade.details["exit_code"] == 1, grade.details


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
