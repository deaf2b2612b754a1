"""The terminal domain: file-system chores in a task directory, graded by its final state.

The task's `files` are written at reset; the agent works with `shell`, `read_file` and
`write_file` (rl/tools/files.py). Grading ignores the final text and checks the directory:
every `check.files` entry exists with exactly those bytes, every `check.absent` path (file or
directory) is gone, and `check.command` (bash -c in the task directory, sandboxed) exits 0.
Reward is 1 iff all given checks pass.
"""

from __future__ import annotations

import os

from rl.envs.base import Grade, ToolError, register
from rl.envs.workspace import WorkspaceEnvironment
from rl.tools.files import resolve


@register
class TerminalEnv(WorkspaceEnvironment):
  """A task directory, the file tools over it, and a state grader."""

  domain = "terminal"

  def grade(self, final_text: str) -> Grade:
    check = self.task["check"]
    failures = []
    for path, want in check.get("files", {}).items():
      got = _read_bytes(self.dir, path)
      if got is None:
        failures.append(f"missing file {path}")
      elif got != want.encode("utf-8"):
        failures.append(f"wrong content in {path}")
    for path in check.get("absent", []):
      if os.path.lexists(self.dir / path):
        failures.append(f"{path} still exists")
    if "command" in check:
      result = self.sandbox.run(check["command"], self.dir)
      if result.exit_code != 0:
        failures.append(f"check command exited {result.exit_code}")
    ok = not failures
    return Grade(reward=float(ok), success=ok, details={"failures": failures})


def _read_bytes(root, path: str) -> bytes | None:
  """The bytes at `path` inside root, or None (missing, a directory, or a link out of root)."""
  try:
    target = resolve(root, path)
  except ToolError:
    return None
  if not target.is_file():
    return None
  return target.read_bytes()
