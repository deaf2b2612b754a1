"""Tool calls and answers that raised out of an environment (ending the episode, or dropping its
group as a grader failure) or cost what they should not: each now comes back as an error the
model sees, or a grade of 0 with the reason. Each test names the mistake."""

import json
import logging
import os

import pytest

from rl.envs.base import MAX_TOOL_RESULT_CHARS, EnvContext, make_env
from rl.sandbox import SandboxUnavailable
from rl.tasks.generators import generate
from rl.tasks.schema import parse_task
from serving.types import ToolCall

HUGE_INT = "1" + "0" * 5000  # past Python's 4300-digit limit: json.loads raises a plain ValueError

_WEB = {"id": "w", "domain": "web", "prompt": "q", "answer": "x",
        "pages": [{"url": "a", "title": "A", "text": "hello"}]}


@pytest.fixture()
def ctx(tmp_path):
  return EnvContext(root=tmp_path / "root", allow_unsafe_sandbox=True, disk_mb=2)


def _env(task, ctx):
  env = make_env(task, ctx)
  env.reset()
  return env


def _call(env, name, **arguments):
  return env.execute(ToolCall("c", name, json.dumps(arguments)))


def test_an_integer_past_pythons_digit_limit_is_an_error_result_and_a_zero_grade(ctx):
  """json.loads raises ValueError (not JSONDecodeError) for it: execute raised (the episode ended as
  an error, its group dropped), and a CAD answer holding one was a grader failure, not a 0."""
  web = _env(parse_task(_WEB), ctx)
  result = web.execute(ToolCall("c", "open", '{"url": "a", "page": ' + HUGE_INT + "}"))
  assert result.error and "not valid JSON" in result.content
  assert len(result.content) < MAX_TOOL_RESULT_CHARS + 200
  cad = _env(parse_task({"id": "c", "domain": "cad", "prompt": "p", "target": {"box": [1, 2, 3]}}), ctx)
  grade = cad.grade('<answer>{"box": [1, 2, ' + HUGE_INT + "]}</answer>")
  assert grade.reward == 0.0 and not grade.success and "not valid JSON" in str(grade.details), grade


def test_error_results_are_clipped_like_results(ctx):
  """A schema error quotes the bad value and an OSError its file name: 100-200 KB error results
  went into the prompt unclipped."""
  web = _env(parse_task(_WEB), ctx)
  for name, args in (("open", {"url": "a", "page": "9" * 100_000}),
                     ("search", {"query": list(range(30_000))})):
    result = _call(web, name, **args)
    assert result.error and len(result.content) < MAX_TOOL_RESULT_CHARS + 200, (name, len(result.content))


def _workspace(ctx):
  return _env(generate("terminal", split="train", difficulty=0, n=1, seed=0)[0], ctx)


def test_a_write_that_does_not_fit_leaves_the_old_file_whole(ctx):
  """The file was opened with O_TRUNC before the write: a full task directory left it cut short
  while the result said it 'was not written'. The new file is written beside it and renamed."""
  env = _workspace(ctx)
  if not os.path.ismount(env.dir):
    pytest.skip("no tmpfs task directory here (needs root on Linux): nothing fills up")
  _call(env, "shell", command="printf 'echo hi' > run.sh && chmod 755 run.sh")
  assert not _call(env, "write_file", path="keep.txt", content="precious\n").error
  full = _call(env, "write_file", path="keep.txt", content="y" * (3 << 20))
  assert full.error and "was not written" in full.content, full
  assert (env.dir / "keep.txt").read_text() == "precious\n"
  assert sorted(p.name for p in env.dir.iterdir() if p.name.startswith(".write_file")) == []
  assert not _call(env, "write_file", path="run.sh", content="echo ok").error
  assert os.stat(env.dir / "run.sh").st_mode & 0o777 == 0o755  # a rewritten script stays executable
  env.close()


def test_ordinary_mistakes_are_tool_errors_not_internal_crashes(ctx, caplog):
  """A dangling symlink, a loop of links and a command over Linux's 128 KiB argument limit were
  'failed internally' with a host path, logged as tool crashes with a traceback."""
  env = _workspace(ctx)
  _call(env, "shell", command="ln -s nothere dangling && ln -s loop loop")
  with caplog.at_level(logging.ERROR):
    for name, args, says in (("read_file", {"path": "dangling"}, "a symlink that leads to no file"),
                             ("read_file", {"path": "loop"}, "a symlink that leads to no file"),
                             ("shell", {"command": "echo " + "x" * 200_000}, "Write a script")):
      result = _call(env, name, **args)
      assert result.error and says in result.content and "failed internally" not in result.content, result
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
  env.close()


def test_an_environment_whose_sandbox_cannot_start_leaves_no_directory(tmp_path, monkeypatch):
  """The task directory (a tmpfs where one can be mounted) was made before the sandbox: each failed
  start left a directory and a mount behind until the process ended."""
  monkeypatch.setenv("NSJAIL", "/nonexistent/nsjail")
  ctx = EnvContext(root=tmp_path / "root", memory_mb=93)  # a size no other test probes with
  task = generate("terminal", split="train", difficulty=0, n=1, seed=0)[0]
  for _ in range(2):
    with pytest.raises(SandboxUnavailable):
      make_env(task, ctx)
  assert list((tmp_path / "root").iterdir()) == []
