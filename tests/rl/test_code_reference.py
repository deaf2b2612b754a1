"""Code tasks against the files they ship (each test names the mistake it catches): the line a
prompt names is the one line where the buggy solution.py differs from the problem's canonical
solution, and the oracle writes that canonical solution back."""

import random
import re
import types

import pytest

from rl.tasks.generators import code


@pytest.mark.parametrize("level", [0, 1])
def test_the_named_line_is_the_one_that_differs(level):
  """Catches a prompt naming the line before or after the bug (the line count off by one), and a
  level-0 hint with the buggy and the fixed token swapped."""
  problems = {p["task_id"]: p for p in code.load_problems()}
  for split in ("train", "heldout"):
    for task in code.generate(split=split, difficulty=level, n=40, seed=2):
      problem = problems[task.meta["source"]]
      fixed = (problem["prompt"] + problem["canonical_solution"]).splitlines()
      buggy = task["files"]["solution.py"].splitlines()
      assert len(buggy) == len(fixed), task.id
      differ = [i + 1 for i, (a, b) in enumerate(zip(buggy, fixed, strict=True)) if a != b]
      named = int(re.search(r"on line (\d+)", task.prompt)[1])
      assert differ == [named], (task.id, differ, named)
      if level == 0:
        wrong, right = re.search(r"`([^`]+)` there should be `([^`]+)`", task.prompt).groups()
        line = buggy[named - 1]
        starts = [i for i in range(len(line)) if line.startswith(wrong, i)]
        patched = [line[:i] + right + line[i + len(wrong):] for i in starts]
        assert fixed[named - 1] in patched, (task.id, wrong, right)
      writes = [c["arguments"] for turn in task.oracle for c in turn["tool_calls"]
                if c["name"] == "write_file"]
      assert writes == [{"path": "solution.py", "content": problem["prompt"] + problem["canonical_solution"]}]


def _results(source, module, calls):
  """Each visible test's (got == want) with `module` built from `source` (our template code)."""
  namespace = {}
  exec(source, namespace)
  scope = {module: types.SimpleNamespace(**namespace)}
  out = []
  for call, want in calls:
    try:
      out.append(eval(call, scope) == eval(want))
    except Exception:  # a test that raises fails, as unittest counts it
      out.append(False)
  return out


def test_every_package_bug_is_caught_by_the_visible_tests():
  """Catches a level-3 bug that no visible test exposes (the buggy package passed its own tests):
  each buggy module fails a test of its own, and the oracle's fixed modules pass all of theirs."""
  for split in ("train", "heldout"):
    for task in code.generate(split=split, difficulty=3, n=25, seed=2):
      test = next(c for p, c in task["files"].items() if p.startswith("tests/test_"))
      calls = re.findall(r"self\.assertEqual\((\w+\.\w+\(.*\)), (.+)\)\n", test)
      fixes = {c["arguments"]["path"]: c["arguments"]["content"] for turn in task.oracle
               for c in turn["tool_calls"] if c["name"] == "write_file"}
      assert len(fixes) == 2, task.id
      for path, source in task["files"].items():
        module = path.rsplit("/", 1)[-1].removesuffix(".py")
        mine = [(call, want) for call, want in calls if call.startswith(f"{module}.")]
        if path.startswith("tests/") or not mine:
          continue
        assert all(_results(fixes.get(path, source), module, mine)), (task.id, path)
        if path in fixes:
          assert not all(_results(source, module, mine)), (task.id, path)


def test_the_same_draws_give_each_split_its_own_packages():
  """Catches package instances not assigned to a split: from one RNG state both splits built the
  same package."""
  train = [code._package_task(random.Random(seed), "train")["files"] for seed in range(12)]
  heldout = [code._package_task(random.Random(seed), "heldout")["files"] for seed in range(12)]
  assert all(a != b for a, b in zip(train, heldout, strict=True))
