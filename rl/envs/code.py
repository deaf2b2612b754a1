"""The code domain: repair a repository until its tests pass.

The task's `files` (the repository) are written at reset; the agent works with `shell`,
`read_file` and `write_file`. At grading the `hidden_files` (the real tests) are written over
whatever the agent left at those paths, then `test_command` runs with `bash -c` in the
repository root, sandboxed, with the task's `timeout`. Reward 1 iff it exits 0 in time and, when
the task has a `pass_marker`, printed it (the hidden tests do as their last act, so a solution
that exits the process early with code 0 does not pass).
"""

from __future__ import annotations

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
