"""Math domain: reasoning-gym generators, worked-solution oracles, the exact grader, splits."""

import ast
import json
from fractions import Fraction

import pytest

from rl.envs.base import EnvContext, make_env, replay
from rl.tasks import generators
from rl.tasks.answers import answers_match, extract_answer
from rl.tasks.generators import math as gen
from rl.tasks.schema import parse_task
from rl.tasks.task_files import load_tasks, write_tasks
from serving.types import ToolCall

LEVELS = range(gen.MAX_DIFFICULTY + 1)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return EnvContext(root=tmp_path_factory.mktemp("math_envs"))


@pytest.fixture(scope="module")
def tasks_by_level():
  """A few tasks of both splits at every level, shared by the cheap tests."""
  return {(split, d): gen.generate(split=split, difficulty=d, n=6, seed=3)
          for split in generators.SPLITS for d in LEVELS}


def _check_oracles(tasks, ctx):
  for task in tasks:
    good = replay(task, ctx)
    assert good.success and good.reward == 1.0, (task.id, task.prompt, good.details)
    bad = replay(task, ctx, generators.corrupt_oracle(task))
    assert not bad.success and bad.reward == 0.0, (task.id, bad.details)


def test_oracle_replay_scores_one_and_corruption_zero(tasks_by_level, ctx):
  for tasks in tasks_by_level.values():
    _check_oracles(tasks, ctx)


@pytest.mark.slow
@pytest.mark.parametrize("difficulty", LEVELS)
def test_oracle_replay_200_per_level(difficulty, ctx):
  for split in generators.SPLITS:
    _check_oracles(gen.generate(split=split, difficulty=difficulty, n=200, seed=0), ctx)


def test_reasoning_gym_scores_our_oracle_answer(tasks_by_level):
  """The item rebuilt from the task's meta is the question; reasoning-gym accepts our answer."""
  for tasks in tasks_by_level.values():
    for task in tasks:
      meta = task.meta
      dataset, item = gen.rg_item(meta["source"], meta["rg_config"], meta["rg_seed"])
      assert task.prompt.startswith(item["question"].rstrip())
      ours = extract_answer(task.oracle[-1]["content"])
      assert dataset.score_answer(ours, item) == 1.0, (task.id, ours, item["answer"])
      assert answers_match(item["answer"], task["answer"])


def test_schema_round_trip(tasks_by_level, tmp_path):
  tasks = [t for ts in tasks_by_level.values() for t in ts]
  for task in tasks:
    assert parse_task(json.loads(json.dumps(task.to_json()))) == task
    assert isinstance(task["answer"], str) and task.domain == "math"
    assert task.oracle[-1]["content"] == f"<answer>{task['answer']}</answer>"
  path = tmp_path / "math.jsonl"
  assert write_tasks(tasks, path) == len(tasks)
  assert load_tasks(path) == tasks


def test_deterministic_and_seed_dependent():
  a = [t.to_json() for t in gen.generate(split="train", difficulty=2, n=10, seed=5)]
  b = [t.to_json() for t in gen.generate(split="train", difficulty=2, n=10, seed=5)]
  c = [t.to_json() for t in gen.generate(split="train", difficulty=2, n=10, seed=6)]
  assert a == b
  assert [t["prompt"] for t in a] != [t["prompt"] for t in c]


@pytest.mark.parametrize("difficulty", [0, 1, 3])
def test_splits_share_no_seed_or_question(difficulty):
  """Level 0 has only a few thousand questions: without the split filter they would collide."""
  train = gen.generate(split="train", difficulty=difficulty, n=300, seed=0)
  heldout = gen.generate(split="heldout", difficulty=difficulty, n=300, seed=0)
  questions = lambda ts: {t.prompt for t in ts}
  seeds = lambda ts: {t.meta["rg_seed"] for t in ts}
  assert not questions(train) & questions(heldout)
  assert not seeds(train) & seeds(heldout)
  assert {s % 2 for s in seeds(train)} == {0} and {s % 2 for s in seeds(heldout)} == {1}


def test_splits_share_no_problem_written_another_way():
  """12 + 7 and 7 + 12, 4 * 5 and 5 * 4, gcd(26, 6) and gcd(6, 26) are one problem: keyed by the
  question text, 35% of held-out level-0 sums and 21% of held-out level-1 questions were a train
  question with its operands swapped."""
  def problems(split, level):
    out = set()
    for t in gen.generate(split=split, difficulty=level, n=300, seed=0):
      metadata = gen.rg_item(t.meta["source"], t.meta["rg_config"], t.meta["rg_seed"])[1]["metadata"]
      if t.meta["source"] in ("gcd", "lcm"):
        out.add((t.meta["source"], tuple(sorted(metadata["numbers"]))))
      elif t.meta["source"] == "products":
        out.add(("products", tuple(sorted(int(x) for x in metadata["expression"].split("*")))))
      elif t.meta["source"] == "chain_sum" and "-" not in metadata["expression"]:
        out.add(("sum", tuple(sorted(int(x) for x in metadata["expression"].split("+")))))
    return out
  for level in (0, 1):
    train, heldout = problems("train", level), problems("heldout", level)
    assert len(heldout) > 50 and not train & heldout, (level, sorted(train & heldout)[:5])


def test_level_zero_is_small_addition_subtraction(tasks_by_level):
  for split in generators.SPLITS:
    for task in tasks_by_level[(split, 0)]:
      assert task.meta["source"] == "chain_sum"
      expression = task.prompt.split(":", 1)[1].split("=")[0]
      numbers = [int(n) for n in expression.replace("+", " ").replace("-", " ").split()]
      assert len(numbers) == 2 and all(0 <= n < 100 for n in numbers)


def test_weights_choose_the_mix_and_errors_name_the_fix():
  tasks = gen.generate(split="train", difficulty=2, n=8, seed=0, weights={"gcd": 1.0})
  assert {t.meta["source"] for t in tasks} == {"gcd"}
  with pytest.raises(ValueError, match="offers chain_sum"):
    gen.generate(split="train", difficulty=0, n=1, seed=0, weights={"gcd": 1.0})
  with pytest.raises(ValueError, match="unknown math dataset"):
    gen.level_weights(1, {"gdc": 1.0})
  assert set(gen.level_weights(4)) == set(gen.LEVELS[4])


def test_expression_steps_follow_precedence():
  steps = []
  value = gen._eval(ast.parse("-( 3 - 5 ) * 2 + 12 / 4", mode="eval").body, steps)
  assert value == Fraction(7)
  assert steps == ["3 - 5 = -(5 - 3); 5 - 3, digit by digit from the right:", "5 - 3 = 2 -> 2", "5 - 3 = 2",
                   "3 - 5 = -2", "-(-2) = 2", "2 * 2 = 4", "12 / 4 = 3",
                   "4 + 3, digit by digit from the right:", "4 + 3 = 7 -> 7", "4 + 3 = 7"]


def _last_digits(line: str) -> str:
  return line.split("-> ")[1].split()[0]


def test_column_working_is_exact():
  """Every column line is true arithmetic and the last line's digits are the sum / difference."""
  rng = __import__("random").Random(0)
  pairs = [(rng.randrange(10**rng.randint(1, 5)), rng.randrange(10**rng.randint(1, 5))) for _ in range(3000)]
  for a, b in pairs + [(0, 0), (999, 1), (1000, 1), (10, 10), (5, 95)]:
    add = gen._column_add(a, b)
    assert _last_digits(add[-1]) == str(a + b)
    hi, lo = max(a, b), min(a, b)
    sub = gen._column_sub(hi, lo)
    assert int(_last_digits(sub[-1])) == hi - lo and len(sub) == len(str(hi))
    for line in add + sub:  # "x + y + 1 = s", "x - 1 - y + 10 = d": each an identity
      lhs, rhs = line.split(" -> ")[0].split(" = ")
      assert eval(lhs) == int(rhs), line  # noqa: S307 (our own digits and + -)


def test_column_working_in_the_oracle():
  """+ and - of whole numbers think digit by digit (carry, borrow, a negative difference), one
  digit each too (one column of the table); the steps still end in the value."""
  def thinking(expr):
    steps = []
    value = gen._eval(ast.parse(expr, mode="eval").body, steps)
    return steps, value
  steps, value = thinking("57 + 65")
  assert steps == ["57 + 65, digit by digit from the right:", "7 + 5 = 12 -> 2 carry 1",
                   "5 + 6 + 1 = 12 -> 122", "57 + 65 = 122"] and value == 122
  steps, value = thinking("57 - 65")
  assert steps == ["57 - 65 = -(65 - 57); 65 - 57, digit by digit from the right:",
                   "5 - 7 + 10 = 8 -> 8 borrow 1", "6 - 1 - 5 = 0 -> 08", "65 - 57 = 8", "57 - 65 = -8"]
  assert thinking("3 + 6")[0] == ["3 + 6, digit by digit from the right:", "3 + 6 = 9 -> 9", "3 + 6 = 9"]
  assert thinking("1 - 9") == (["1 - 9 = -(9 - 1); 9 - 1, digit by digit from the right:", "9 - 1 = 8 -> 8",
                                "9 - 1 = 8", "1 - 9 = -8"], -8)
  assert thinking("12 * 3")[0] == ["12 * 3 = 36"]


def test_max_tier_counts_every_column():
  """At max each + / - column is counted unit by unit (numbered successor steps) and the column
  line that follows holds the count's end; without the count lines it is the high working."""
  rng = __import__("random").Random(1)
  pairs = [(rng.randrange(10**rng.randint(1, 4)), rng.randrange(10**rng.randint(1, 4))) for _ in range(500)]
  for a, b in pairs:
    hi, lo = max(a, b), min(a, b)
    for lines, sign in ((gen._column_add(a, b, count=True), 1), (gen._column_sub(hi, lo, count=True), -1)):
      plain = [line for line in lines if not line.startswith("count ")]
      assert plain == (gen._column_add(a, b) if sign > 0 else gen._column_sub(hi, lo))
      for i, line in enumerate(lines):
        if not line.startswith("count "):
          continue
        head, marks = line.split(": ")
        start, n = int(head.split()[3]), int(head.split()[5])
        values = [int(m.split(" (")[0]) for m in marks.split(", ")]
        assert values == [start + sign * k for k in range(1, n + 1)] and n > 0
        assert lines[i + 1].split(" = ")[1].split(" ->")[0] == str(values[-1])  # the column's result
  tiers = [t.oracle[0]["thinking_by_tier"] for t in gen.generate(split="train", difficulty=0, n=40, seed=2)]
  assert all("count " not in t["high"] for t in tiers)
  assert sum("count " in t["max"] for t in tiers) >= 36  # all but sums like 30 + 0, with nothing to count
  worked = "gcd(12, 8) by Euclid's algorithm:\n12 = 1 × 8 + 4\n8 = 2 × 4 + 0\nso gcd = 4"
  assert "Check, working it again" in gen.thinking_by_tier(worked, "4")["max"]  # no columns: a second pass


def test_wrong_answer_differs():
  for answer in ["0", "-24", "7", "3/4", "12.5"]:
    assert not answers_match(gen.wrong_answer(answer), answer)


def test_grader_known_good_and_bad(tasks_by_level, ctx):
  task = tasks_by_level[("train", 1)][0].with_(fields={"answer": "1062"})
  env = make_env(task, ctx)
  assert env.reset() == (task.prompt, [])
  cases = {"<answer>1062</answer>": 1.0, "<answer>1,062</answer>": 1.0, "1062": 1.0,
           "<answer>1061</answer> wait <answer>1062</answer>": 1.0,
           "<answer>1062</answer> no: <answer>1063</answer>": 0.0, "<answer>1062.5</answer>": 0.0,
           "": 0.0, "<answer>about a thousand</answer>": 0.0}
  for text, want in cases.items():
    assert env.grade(text).reward == want, text
  result = env.execute(ToolCall(id="c0", name="python", arguments="{}"))
  assert result.error and "available tools: none" in result.content
