"""A task directory with the shell and file tools over it: what `code` and `terminal` share.

The task's `files` are written at reset; `shell` runs sandboxed in the directory and
`read_file` / `write_file` stay inside it (rl/tools/files.py). Subclasses add the grader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl.envs.base import DirectoryEnvironment, EnvContext
from rl.sandbox import Sandbox
from rl.tasks.schema import Task
from rl.tools.files import FILE_TOOLS, FileTools, write_tree
from serving.types import Tool


class WorkspaceEnvironment(DirectoryEnvironment):
  """A directory seeded with the task's `files`, and shell/read_file/write_file over it."""

  def __init__(self, task: Task, ctx: EnvContext):
    sandbox = Sandbox.from_context(ctx)  # first: a sandbox that cannot start leaves no directory behind
    super().__init__(task, ctx)
    self.sandbox = sandbox
    self.files = FileTools(self.dir, self.sandbox)

  def reset(self) -> tuple[str, list[Tool]]:
    write_tree(self.dir, self.task["files"])
    return super().reset()

  def tools(self) -> Sequence[Tool]:
    return FILE_TOOLS

  def _call(self, name: str, arguments: dict[str, Any]) -> str:
    return self.files.call(name, arguments)
