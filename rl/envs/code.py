"""The code domain: repair a repository until its tests pass.

The task's `files` (the repository) are written at reset; the agent works with `shell`,
`read_file` and `write_file`. At grading the `hidden_files` (the real tests) are written over
whatever the agent left at those paths, every compiled `.pyc` the agent may have planted is
removed (Python would run an unchecked-hash one in place of a restored test module), then
`test_command` runs with `bash -c` in the repository root, sandboxed, with the task's
`timeout`. Reward 1 iff it exits 0 in time and, when the task has a `pass_marker`, printed it.
The generated tasks' hidden tests run their checks in a process that never imports the agent's
code (rl/tasks/generators/code_checker.py). A task file's own hidden tests that import the
solution into the process that prints the marker can be fooled by it (reading the marker from the
test file, patching unittest); write them as code_checker does.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rl.envs.base import Grade, ToolError, register
from rl.envs.workspace import WorkspaceEnvironment
from rl.tools.files import write_tree


@register
class CodeEnv(WorkspaceEnvironment):
  """A repository directory, the file tools over it, and a hidden-test grader."""

  domain = "code"

  def grade(self, final_text: str) -> Grade:
    try:
      write_tree(self.dir, self.task["hidden_files"])
    except (ToolError, OSError) as e:  # e.g. the agent turned a hidden file's directory into a link out
      return Grade(reward=0.0, success=False, details={"error": f"cannot place hidden files: {e}"})
    _remove_bytecode(self.dir)
    result = self.sandbox.run(self.task["test_command"], self.dir, timeout_s=self.task["timeout"])
    marker = self.task.fields.get("pass_marker")
    finished = marker is None or marker in result.stdout
    ok = result.exit_code == 0 and not result.timed_out and finished
    tail = (result.stdout + result.stderr)[-2000:]
    details = {"exit_code": result.exit_code, "timed_out": result.timed_out, "output_tail": tail}
    if not finished and result.exit_code == 0 and not result.timed_out:
      cap = ", or their output passed the cap" if result.truncated else ""
      details["error"] = f"the tests did not print the pass marker: they stopped early (an exit){cap}"
    return Grade(reward=float(ok), success=ok, details=details)


def _remove_bytecode(root: Path) -> None:
  """Removes every __pycache__ directory and .pyc file under root (iteratively: a deep tree must
  not exhaust the recursion limit); links are not followed."""
  stack = [str(root)]
  while stack:
    try:
      entries = list(os.scandir(stack.pop()))
    except OSError:
      continue
    for entry in entries:
      try:
        if entry.is_dir(follow_symlinks=False):
          if entry.name == "__pycache__":
            shutil.rmtree(entry.path, ignore_errors=True)
          else:
            stack.append(entry.path)
        elif entry.name.endswith(".pyc"):
          os.unlink(entry.path)
      except (OSError, RecursionError):  # rmtree recurses
        pass
