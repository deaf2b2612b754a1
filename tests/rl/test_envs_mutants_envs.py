"""Environments (rl/envs): the tool-call contract of `execute`, `clip`, `replay`, and the
terminal and code graders, against results written out here; each test names the mistake it
catches."""

import asyncio
import json
import os
import types

import pytest

from rl.agent import executor as executors
from rl.envs import base
from rl.envs.base import EnvContext, Environment, ToolError, make_env, replay
from rl.tasks.schema import parse_task
from serving.types import Tool, ToolCall
from tests.rl.replay import sandboxed_context

ECHO = Tool(name="echo", description="n x's", parameters={
  "type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "additionalProperties": False})


class _Echo(Environment):
  """A math-domain environment (not registered) whose one tool returns n x's, or fails on cue."""

  domain = "math"

  def tools(self):
    return (ECHO,)

  def _call(self, name, arguments):
    n = arguments.get("n", 3)
    if n == 13:
      raise ToolError("unlucky")
    if n == 7:
      raise RuntimeError("tool bug")
    return "x" * n

  def grade(self, final_text):
    return base.Grade(0.0, False)


def _math_task(answer="7"):
  return parse_task({"id": "m", "domain": "math", "prompt": "p", "answer": answer})


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return EnvContext(root=tmp_path_factory.mktemp("envs_mutants"))


def _call(env, arguments, name="echo"):
  raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
  return env.execute(ToolCall(id="c", name=name, arguments=raw))


def test_clip_keeps_the_limit_and_counts_the_rest():
  """Catches `<` for `<=`, a cut one short, and the note counting the whole text."""
  assert base.clip("a" * 10, 10) == "a" * 10
  assert base.clip("a" * 11, 10) == "a" * 10 + "\n[... 1 more characters cut]"
  assert base.clip("ab" * 10, 5) == "ababa\n[... 15 more characters cut]"


def test_execute_clips_results_and_marks_every_failure(ctx):
  """Catches a result shown unclipped, a ToolError or a crashing tool returned as a success,
  a crash of another type escaping, an unknown tool or a non-object not marked an error."""
  env = _Echo(_math_task(), ctx)
  limit = base.MAX_TOOL_RESULT_CHARS
  assert limit == 8000
  ok = _call(env, {"n": 9000})
  assert not ok.error and ok.content == "x" * 8000 + "\n[... 1000 more characters cut]"
  exact = _call(env, {"n": 8000})
  assert not exact.error and exact.content == "x" * 8000
  assert _call(env, {}).content == "xxx"
  assert _call(env, {"n": 13}).content == "Error: unlucky" and _call(env, {"n": 13}).error
  crash = _call(env, {"n": 7})
  assert crash.error and crash.content == "Error: echo failed internally (RuntimeError: tool bug)."
  unknown = _call(env, {}, name="python")
  assert unknown.error and unknown.content == "Error: unknown tool 'python'; available tools: echo."
  for raw in ("[1]", "null", '"n"', "3"):
    result = _call(env, raw)
    assert result.error and result.content == "Error: the arguments of echo must be a JSON object.", raw
  for bad in ({"n": -1}, {"n": "3"}, {"n": 1.5}, {"n": True}, {"m": 1}):
    result = _call(env, bad)
    assert result.error and result.content.startswith("Error: bad arguments for echo: "), bad


@pytest.mark.parametrize("timeout", [0, 0.0, -1, float("inf"), float("nan"), True, "10"])
def test_env_config_refuses_a_command_timeout_that_is_no_positive_number(timeout):
  """Catches `0 <=` for `0 <`: a zero timeout passed the check (every tool call would time out)."""
  from configs import sft
  env = sft.get_config("tiny").env.to_dict()  # a dict: a ConfigDict would coerce True, refuse "10"
  env["command_timeout_s"] = timeout
  with pytest.raises(ValueError, match=r"config\.env\.command_timeout_s=.*: must be a finite number"):
    base.check_env_config(env)
  env["command_timeout_s"] = 0.5
  base.check_env_config(env)


def test_an_environment_refuses_a_task_of_another_domain(ctx):
  task = parse_task({"id": "d", "domain": "docqa", "document": "# R", "prompt": "p", "answer": 1,
                     "tolerance": 0.0})
  with pytest.raises(ValueError, match="task 'd' is a docqa task; _Echo runs math"):
    _Echo(task, ctx)


def test_replay_runs_every_turn_and_grades_the_last(ctx):
  """Catches the grade read from the first turn, only the last turn's calls run, and call ids
  not numbered per turn."""
  turns = [{"content": "<answer>5</answer>", "tool_calls": [{"name": "a", "arguments": {}},
                                                               {"name": "b", "arguments": {"x": 1}}]},
           {"content": "<answer>7</answer>", "tool_calls": [{"name": "c", "arguments": {}}]}]
  seen = []
  grade = replay(_math_task("7"), ctx, turns, on_result=lambda call, result: seen.append(
    (call.id, call.name, call.arguments, result.error)))
  assert grade.success and grade.reward == 1.0
  assert seen == [("call_0", "a", "{}", True), ("call_1", "b", '{"x": 1}', True), ("call_0", "c", "{}", True)]
  assert not replay(_math_task("5"), ctx, turns).success


def test_math_and_web_grades_are_exact_and_fail_a_near_miss(ctx):
  """Catches the math grade at a looser tolerance than 1e-9 (1062.0001 passed for 1062), and a
  web grade reporting success with reward 0."""
  env = make_env(_math_task("1062"), ctx)
  assert [env.grade(t).reward for t in ("<answer>1062.0001</answer>", "<answer>1062.0</answer>",
                                        "<answer>1,062</answer>", "<answer>1063</answer>")] == [0, 1, 1, 0]
  web = make_env(parse_task({"id": "w", "domain": "web", "prompt": "p", "answer": 1234, "pages": [
    {"url": "https://t.local/A", "title": "A", "text": "Population: 1,234"}]}), ctx)
  for text, want in (("<answer>1,234</answer>", True), ("<answer>1235</answer>", False),
                     ("<answer>1234.5</answer>", False)):
    grade = web.grade(text)
    assert (grade.reward, grade.success) == (float(want), want), text


# ---- terminal and code graders (sandboxed commands) ------------------------------------------


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory):
  return sandboxed_context(tmp_path_factory, "envs_mutants_sandboxed", command_timeout_s=10.0)


def _graded(ctx, task, setup=None):
  """Resets an episode of `task`, lets `setup(task_dir)` play the agent, grades it."""
  env = make_env(task, ctx)
  try:
    env.reset()
    if setup is not None:
      setup(env.dir)
    return env.grade("done")
  finally:
    env.close()


def _terminal(check, files=None):
  return parse_task({"id": "t", "domain": "terminal", "prompt": "p", "check": check,
                     "files": files if files is not None else {"a.txt": "hi\n", "old.txt": "x", "b": "y"}})


def test_terminal_grade_compares_bytes_and_lists_every_failure(sandboxed):
  """Catches content compared after stripping whitespace, a directory at a checked path read
  (IsADirectoryError), a dangling symlink counted as gone, only the first absent path checked,
  and one failure among several forgiven."""
  check = {"files": {"a.txt": "hi\n"}, "absent": ["old.txt", "b"]}
  task = _terminal(check)

  def clean(d):
    os.remove(d / "old.txt")
    os.remove(d / "b")

  assert _graded(sandboxed, task, clean).success
  assert _graded(sandboxed, task).details["failures"] == ["old.txt still exists", "b still exists"]

  def trailing_space(d):
    clean(d)
    (d / "a.txt").write_text("hi\n ")

  grade = _graded(sandboxed, task, trailing_space)
  assert (grade.reward, grade.details["failures"]) == (0.0, ["wrong content in a.txt"])

  def dangling_link(d):
    clean(d)
    os.symlink("nowhere", d / "b")

  assert _graded(sandboxed, task, dangling_link).details["failures"] == ["b still exists"]

  def directory(d):
    clean(d)
    os.remove(d / "a.txt")
    os.mkdir(d / "a.txt")

  grade = _graded(sandboxed, task, directory)
  assert (grade.reward, grade.details["failures"]) == (0.0, ["missing file a.txt"])


def test_terminal_check_command_must_exit_0(sandboxed):
  task = _terminal({"command": "test -f done && grep -qx ok done"})
  assert _graded(sandboxed, task).details["failures"] == ["check command exited 1"]
  assert _graded(sandboxed, task, lambda d: (d / "done").write_text("ok\n")).success


def _code(hidden, timeout=60.0):
  return parse_task({"id": "c", "domain": "code", "prompt": "p",
                     "files": {"a.py": "def value():\n  return 1\n"},
                     "test_command": "python3 t.py", "pass_marker": "OWN-MARKER-1", "timeout": timeout,
                     "hidden_files": {"t.py": hidden}})


CHECK = "import sys\nimport a\nif a.value() != 2:\n  sys.exit(1)\nprint('OWN-MARKER-1')\n"


def test_code_pass_marker_must_be_on_stdout(sandboxed):
  """Catches the marker looked for in stderr too: the agent's module, imported by the tests,
  wrote it there while the tests themselves never printed it."""
  task = _code("import sys\nimport a\nif a.value() != 2:\n  sys.exit(1)\nif a.value() == 3:\n"
               "  print('OWN-MARKER-1')\n")
  cheat = "import sys\nsys.stderr.write('OWN-MARKER-1\\n')\ndef value():\n  return 2\n"
  grade = _graded(sandboxed, task, lambda d: (d / "a.py").write_text(cheat))
  assert grade.reward == 0.0 and "did not print the pass marker" in grade.details["error"], grade.details
  fixed = _graded(sandboxed, _code(CHECK), lambda d: (d / "a.py").write_text("def value():\n  return 2\n"))
  assert fixed.success and fixed.details["exit_code"] == 0


def test_code_grade_needs_exit_0_even_after_the_marker(sandboxed):
  """Catches the exit code ignored (or some codes other than 0 accepted) once the marker is out."""
  task = _code("import sys\nimport a\nprint('OWN-MARKER-1')\nsys.exit(0 if a.value() == 2 else 5)\n")
  grade = _graded(sandboxed, task)
  assert (grade.reward, grade.details["exit_code"], grade.details["timed_out"]) == (0.0, 5, False)
  assert _graded(sandboxed, task, lambda d: (d / "a.py").write_text("def value():\n  return 2\n")).success


def test_code_grade_uses_the_task_timeout(sandboxed):
  """Catches the test command run under the context's 10 s limit instead of the task's 1 s."""
  task = _code("import time\ntime.sleep(3)\n" + CHECK, timeout=1.0)
  grade = _graded(sandboxed, task, lambda d: (d / "a.py").write_text("def value():\n  return 2\n"))
  assert grade.reward == 0.0 and grade.details["timed_out"], grade.details


def test_code_grade_removes_bytecode_only_inside_the_task_directory(sandboxed, tmp_path):
  """Catches a directory link followed out of the task directory (the grader deleted the host's
  .pyc files there) and a stray .pyc outside __pycache__ left in place."""
  outside = tmp_path / "host"
  (outside / "__pycache__").mkdir(parents=True)
  (outside / "keep.pyc").write_bytes(b"host")
  (outside / "__pycache__" / "keep.cpython-312.pyc").write_bytes(b"host")

  def plant(d):
    (d / "a.py").write_text("def value():\n  return 2\n")
    os.symlink(outside, d / "link")
    (d / "pkg" / "__pycache__").mkdir(parents=True)
    (d / "pkg" / "__pycache__" / "m.cpython-312.pyc").write_bytes(b"x")
    (d / "pkg" / "stray.pyc").write_bytes(b"x")
    (d / "pkg" / "keep.py").write_text("x = 1\n")

  env = make_env(_code(CHECK), sandboxed)
  try:
    env.reset()
    plant(env.dir)
    assert env.grade("done").success
    left = sorted(os.path.relpath(os.path.join(top, name), env.dir)
                  for top, dirs, files in os.walk(env.dir) for name in dirs + files)
  finally:
    env.close()
  assert left == ["a.py", "link", "pkg", "pkg/keep.py", "t.py"]
  assert (outside / "keep.pyc").read_bytes() == b"host"
  assert (outside / "__pycache__" / "keep.cpython-312.pyc").read_bytes() == b"host"


# ---- executors ---------------------------------------------------------------------------------


def test_thread_executor_passes_the_final_text_and_its_worker_count(ctx):
  """Catches the grade run on another text than the one given, and `workers` ignored."""
  pool = executors.make_executor("thread", ctx, workers=3)
  assert pool.pool._max_workers == 3

  async def play():
    handle = await pool.open(_math_task("7"))
    try:
      assert (await handle.reset())[1] == []
      result = await handle.execute(ToolCall(id="c", name="python", arguments="{}"))
      assert result.error and "available tools: none" in result.content
      return await handle.grade("<answer>7</answer>"), await handle.grade("<answer>8</answer>")
    finally:
      await handle.close()

  try:
    right, wrong = asyncio.run(play())
  finally:
    pool.shutdown()
  assert (right.success, wrong.success) == (True, False)
  with pytest.raises(RuntimeError):  # the pool is shut down
    pool.pool.submit(int)


class _Ticking(executors.EnvHandle):
  """A handle whose every method moves a fake clock by its own amount (1, 2, 4, 8 s)."""

  def __init__(self, clock):
    self.clock = clock

  async def _tick(self, seconds, value=None):
    self.clock.now += seconds
    return value

  async def reset(self):
    return await self._tick(1, ("p", []))

  async def execute(self, call):
    return await self._tick(2, base.ToolResult("r"))

  async def grade(self, final_text):
    return await self._tick(4, base.Grade(1.0, True))

  async def close(self):
    return await self._tick(8)


class _TickingExecutor(executors.Executor):
  def __init__(self, clock):
    self.clock, self.stopped = clock, False

  async def open(self, task):
    self.clock.now += 16
    return _Ticking(self.clock)

  def shutdown(self):
    self.stopped = True


def test_timed_executor_sums_every_wait(monkeypatch):
  """Catches a handle's time assigned instead of added, and open or execute not counted."""
  clock = types.SimpleNamespace(now=0.0)
  monkeypatch.setattr(executors, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
  inner = _TickingExecutor(clock)
  timed = executors.TimedExecutor(inner)

  async def play():
    handle = await timed.open(None)
    await handle.reset()
    await handle.execute(ToolCall(id="c", name="x", arguments="{}"))
    await handle.execute(ToolCall(id="d", name="x", arguments="{}"))
    assert (await handle.grade("done")).success
    await handle.close()

  asyncio.run(play())
  assert timed.busy_s == 16 + 1 + 2 + 2 + 4 + 8
  timed.shutdown()
  assert inner.stopped
