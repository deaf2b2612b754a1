"""The terminal/code tools: `shell`, `read_file`, `write_file` over one task directory.

`shell` runs in the sandbox (rl/sandbox) with the task directory as its cwd. The file tools
run host-side, which is safe only with careful path resolution: a path must be relative,
must not climb out with '..', and every existing component is resolved through symlinks and
must stay inside the task directory (a symlink the agent made to /etc is refused, not
followed). Between tool calls nothing of the agent runs (the sandbox's PID namespace dies with
each command), so a path checked here cannot change before it is used.

Every file and directory written here is given to the sandbox uid as it is written (when we
are root, `rl.sandbox.sandbox.give_to_sandbox`), so a later command may change it; the
sandbox itself then never walks the task directory.
"""

from __future__ import annotations

import errno
import os
import posixpath
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from rl.envs.base import ToolError
from rl.sandbox import ExecResult, Sandbox, taskdir
from rl.sandbox.sandbox import give_to_sandbox
from serving.types import Tool

MAX_READ_BYTES = 1 << 20  # read_file reads at most this much (the result is clipped later anyway)
MAX_WRITE_BYTES = 4 << 20
MAX_COMMAND_BYTES = 1 << 17  # Linux's limit on one argument string (MAX_ARG_STRLEN), NUL included

SHELL = Tool(
  name="shell",
  description=("Run a bash command in the task directory (the current directory; no network; "
               "python3 available). Returns the exit code, stdout and stderr."),
  parameters={"type": "object", "properties": {"command": {"type": "string", "minLength": 1,
                                                           "description": "the bash command line"}},
              "required": ["command"], "additionalProperties": False})
READ_FILE = Tool(
  name="read_file",
  description="Read a text file of the task directory.",
  parameters={"type": "object", "properties": {"path": {
    "type": "string", "minLength": 1, "description": "path relative to the task directory, e.g. 'src/a.py'"}},
    "required": ["path"], "additionalProperties": False})
WRITE_FILE = Tool(
  name="write_file",
  description=("Create or overwrite a text file of the task directory with `content` (parent "
               "directories are created)."),
  parameters={"type": "object", "properties": {
    "path": {"type": "string", "minLength": 1, "description": "path relative to the task directory"},
    "content": {"type": "string", "description": "the complete new content of the file"}},
    "required": ["path", "content"], "additionalProperties": False})
FILE_TOOLS = (SHELL, READ_FILE, WRITE_FILE)


def resolve(root: Path, path: str) -> Path:
  """The host path of `path` inside `root`; raises ToolError (saying how to fix it) if it escapes.

  Args:
    root: the task directory.
    path: a path as the model wrote it ('a/b.txt', './a/b.txt', '/task/a/b.txt').

  Returns:
    The absolute host path; it need not exist, but its existing part resolves inside root.
  """
  if "\x00" in path:
    raise ToolError(f"path {path!r} contains a NUL byte; use a plain relative path like 'src/main.py'")
  if path == "/task" or path.startswith("/task/"):  # the directory as the sandbox names it
    path = path[len("/task"):].lstrip("/") or "."
  if path.startswith("/"):
    raise ToolError(f"absolute path {path!r} is outside the task directory; use a path relative to it, "
                    f"e.g. {posixpath.basename(path) or 'file.txt'!r}")
  norm = posixpath.normpath(path)
  if norm == ".." or norm.startswith("../"):
    raise ToolError(f"path {path!r} leaves the task directory through '..'; use a path inside it, "
                    "e.g. 'notes.txt' or 'src/main.py'")
  root = root.resolve()
  target = root / norm
  real = Path(os.path.realpath(target))
  if real != root and root not in real.parents:
    raise ToolError(f"path {path!r} goes through a symlink to {str(real)!r}, outside the task directory; "
                    "read or write the file by a path that stays inside it")
  return target


def read_text(root: Path, path: str) -> str:
  """read_file: the file's text (UTF-8, bad bytes replaced), with a note if it was cut."""
  target = resolve(root, path)
  if not os.path.lexists(target):
    raise ToolError(f"no file {path!r} in the task directory; list the files with shell('ls -R') first")
  if target.is_dir():
    raise ToolError(f"{path!r} is a directory; read a file in it (shell('ls {path}') lists them)")
  real = os.path.realpath(target)
  try:
    mode = os.stat(real).st_mode
  except OSError as e:  # a symlink to nothing, or a loop of links
    raise ToolError(f"{path!r} is a symlink that leads to no file ({e.strerror}); read its target "
                    f"instead (shell('ls -l {path}') shows it)") from None
  if not stat.S_ISREG(mode):  # a FIFO would block this thread for good
    raise ToolError(f"{path!r} is not a regular file (a pipe, socket or device); read it with shell")
  with open(real, "rb") as f:
    data = f.read(MAX_READ_BYTES + 1)
  text = data[:MAX_READ_BYTES].decode("utf-8", "replace")
  if len(data) > MAX_READ_BYTES:
    text += f"\n[file longer than {MAX_READ_BYTES} bytes: cut; use shell with head/tail/sed to read parts]"
  return text


def write_text(root: Path, path: str, content: str) -> str:
  """write_file: replaces the file at `path` (never through a symlink); returns a short receipt."""
  data = content.encode("utf-8")
  if len(data) > MAX_WRITE_BYTES:
    raise ToolError(f"content is {len(data)} bytes; the limit is {MAX_WRITE_BYTES}; write smaller files")
  target = resolve(root, path)
  if target.is_dir() and not target.is_symlink():
    raise ToolError(f"{path!r} is a directory; give a file path such as '{path.rstrip('/')}/file.txt'")
  try:
    _write_bytes(root, target, data)
  except OSError as e:
    if e.errno != errno.ENOSPC:
      raise
    raise ToolError(f"the task directory is full (No space left on device): {path!r} was not written; "
                    "remove files you no longer need first") from None
  return f"wrote {len(data)} bytes to {path}"


def write_tree(root: Path, files: Mapping[str, str]) -> None:
  """Writes {relative path: content} into root (task set-up and hidden files at grading).

  Whatever the agent left at a path (a file, a symlink, a directory) is replaced, so hidden
  test files cannot be redirected by a symlink the agent planted.
  """
  for path, content in files.items():
    target = resolve(root, path)
    if target.is_dir() and not target.is_symlink():
      taskdir.remove_tree(target)  # however deep the agent made it
    _write_bytes(root, target, content.encode("utf-8"), replace_parents=True)


def _make_parents(root: Path, target: Path, replace: bool) -> None:
  """Creates target's missing parent directories; a parent that is a file (or pipe, ...) is
  removed when `replace`, else refused. resolve() has checked that no component links out."""
  root = root.resolve()  # as resolve() built target
  current = root
  for part in target.relative_to(root).parts[:-1]:
    current = current / part
    if os.path.lexists(current) and not current.is_dir():
      if not replace:
        raise ToolError(f"{str(current.relative_to(root))!r} is a file, not a directory; write somewhere "
                        "else or remove it first with shell")
      current.unlink()
    if not os.path.lexists(current):
      os.mkdir(current)
      give_to_sandbox(current)


def _write_bytes(root: Path, target: Path, data: bytes, replace_parents: bool = False) -> None:
  """Writes a new file beside `target` and renames it over it, so a write that fails (a full task
  directory) leaves the old file whole; a link or FIFO at `target` is replaced itself, never
  followed or opened. An existing file's mode (an executable script's) is kept."""
  _make_parents(root, target, replace_parents)
  old = os.lstat(target) if os.path.lexists(target) else None
  tmp = target.with_name(f".write_file.{secrets.token_hex(6)}.tmp")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
  try:
    with os.fdopen(fd, "wb") as f:
      give_to_sandbox(fd)
      if old is not None and stat.S_ISREG(old.st_mode):
        os.fchmod(fd, stat.S_IMODE(old.st_mode))
      f.write(data)
    os.replace(tmp, target)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def format_exec(result: ExecResult, limit_note: int) -> str:
  """A command's result as the model sees it: exit code, stdout, stderr, and what went wrong."""
  parts = [f"exit code: {result.exit_code}"]
  if result.timed_out:
    parts.append(f"TIMEOUT: {result.killed_reason}; make the command faster or run less at once")
  elif result.killed_reason:
    parts.append(f"KILLED: {result.killed_reason}")
  if result.stdout:
    parts.append("stdout:\n" + result.stdout.rstrip("\n"))
  if result.stderr:
    parts.append("stderr:\n" + result.stderr.rstrip("\n"))
  if result.truncated:
    parts.append(f"[output past {limit_note} bytes was dropped; redirect it to a file and read parts]")
  return "\n".join(parts)


class FileTools:
  """The three tools bound to one task directory and one sandbox."""

  def __init__(self, root: Path, sandbox: Sandbox):
    self.root, self.sandbox = Path(root), sandbox

  def call(self, name: str, arguments: Mapping[str, str]) -> str:
    """Runs one validated call; raises ToolError for a bad one."""
    for key, value in arguments.items():  # JSON's "\ud800" parses to a lone surrogate
      if isinstance(value, str) and not value.isascii():
        try:
          value.encode("utf-8")
        except UnicodeEncodeError as e:
          raise ToolError(f"{key} holds {e.object[e.start:e.end]!r}, a lone UTF-16 surrogate that no file, "
                          "path or command line can hold; write the character itself or drop it") from None
    if name == "shell":
      if "\x00" in arguments["command"]:  # subprocess would raise ValueError (embedded null byte)
        raise ToolError("the command contains a NUL byte, which no shell command line can hold; remove it "
                        "(printf '\\0' writes one into a file)")
      if len(arguments["command"].encode()) >= MAX_COMMAND_BYTES:  # exec would fail with E2BIG
        raise ToolError(f"the command is {len(arguments['command'].encode())} bytes; a command line holds "
                        f"under {MAX_COMMAND_BYTES}. Write a script with write_file and run it with shell")
      result = self.sandbox.run(arguments["command"], self.root)
      text = format_exec(result, self.sandbox.output_limit_bytes)
      if result.timed_out:  # an error result: the model must see that nothing finished
        raise ToolError(text)
      return text
    if name == "read_file":
      return read_text(self.root, arguments["path"])
    if name == "write_file":
      return write_text(self.root, arguments["path"], arguments["content"])
    raise ToolError(f"unknown tool {name!r}; available: shell, read_file, write_file")
