"""Terminal tasks: the oracle's commands reach the checked state and the near miss does not,
run here in plain bash on a temporary directory (the sandboxed replay tests draw only a few
tasks per level; each test names the mistake it catches)."""

import shutil
import subprocess

import pytest

from rl.tasks.generators import terminal


def _run(commands, files, tmp):
  """The state after `commands` on `files`: True iff it passes the check (files, absent, command)."""
  work = tmp / "work"
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir()
  for path, content in files.items():
    (work / path).parent.mkdir(parents=True, exist_ok=True)
    (work / path).write_text(content)
  env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
  for command in commands:
    subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, timeout=30)
  return work


def _passes(task, work, scratch):
  check = task["check"]
  for path, content in check.get("files", {}).items():
    if not (work / path).is_file() or (work / path).read_text() != content:
      return False
  if any((work / path).exists() for path in check.get("absent", [])):
    return False
  if "command" in check:  # its scratch folder /tmp/x moved under pytest's tmp_path
    command = check["command"].replace("/tmp/x", str(scratch))
    return subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, timeout=30).returncode == 0
  return True


@pytest.mark.parametrize("level", range(terminal.MAX_DIFFICULTY + 1))
def test_oracle_reaches_the_checked_state_and_the_near_miss_does_not(level, tmp_path):
  """Catches a check that expects another count than the log holds, a CSV column with its header
  line, a count of rows for a count of distinct values, a config still holding the removed key,
  repeated lines in a `sort -u` result: the oracle then fails its own task."""
  if any(shutil.which(tool) is None for tool in ("bash", "tar", "sed", "sort", "grep")):
    pytest.skip("needs bash, tar, sed, sort and grep")
  templates = set()
  for split in ("train", "heldout"):
    for task in terminal.generate(split=split, difficulty=level, n=16, seed=1):
      solve = [c["arguments"]["command"] for turn in task.oracle for c in turn["tool_calls"]]
      work = _run(solve, task["files"], tmp_path)
      assert _passes(task, work, tmp_path / "x"), (task.id, solve)
      work = _run([task.meta["near_miss"]], task["files"], tmp_path)
      assert not _passes(task, work, tmp_path / "x"), (task.id, task.meta["near_miss"])
      templates.add(task.meta["template"])
  assert len(templates) >= 3, templates  # every level mixes its templates
