"""Code tasks: generation contract, mutant validity, oracle/near-miss grading, hidden tests."""

import json

import pytest

from rl.envs.base import EnvContext, make_env, replay
from rl.sandbox import Sandbox, SandboxUnavailable
from rl.tasks.generators import code as gen
from rl.tasks.generators import generate
from rl.tasks.schema import parse_task
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
