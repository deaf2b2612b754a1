"""The environment interface: one episode of one task, its tools, its grader.

In the style of SkyRL-gym / rLLM: a small class per domain, registered by domain name.
`reset()` gives the first user message and the tools; `execute(call)` runs one tool call and
always returns a `ToolResult` (bad JSON, an unknown tool, arguments that break the schema,
a timeout or a crash inside the tool come back to the model as an error result, never as an
exception that ends the run); `grade(final_text)` scores the episode's end state. The agent
loop (rl/agent) owns the conversation; an environment owns only the task's world (a
directory, a site, a solid) and the tools over it.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import json
import logging
import os
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from model.config import ConfigError, is_int
from rl.sandbox import taskdir
from rl.sandbox.sandbox import check_mountable
from rl.tasks.schema import Task
from serving.grammar import validate_arguments
from serving.types import Tool, ToolCall
from training.knobs import check_int_knobs

_log = logging.getLogger(__name__)

MAX_TOOL_RESULT_CHARS = 8000  # what one tool result shows the model; the rest is cut with a note


@dataclasses.dataclass(frozen=True)
class Grade:
  """reward in [0, 1]; success: the domain's pass criterion; details: what the grader saw."""

  reward: float
  success: bool
  details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """What goes back to the model as the tool message; error marks a failed call."""

  content: str
  error: bool = False


class ToolError(Exception):
  """Raised inside a tool for a bad call: its message becomes the (error) tool result."""


# config.env's numeric knobs: (name, lowest allowed value, why). nsjail reads 0 as "no limit"
# for memory and pids, so 0 there would silently run commands unconfined.
_ENV_MINIMUMS = (
    ("workers", 1, "environment worker threads"),
    ("memory_mb", 1, "the cgroup memory limit of one command; nsjail reads 0 as no limit"),
    ("max_pids", 1, "the cgroup pids limit of one command; nsjail reads 0 as no limit"),
    ("output_limit_bytes", 1, "stdout + stderr kept from one command"),
    ("disk_mb", 1, "the size cap of one episode's task directory (a tmpfs)"),
    ("max_turns", 1, "assistant messages per episode"),
    ("max_tokens_per_turn", 1, "generated tokens per assistant message"),
)


def check_env_config(env) -> None:
  """A clear error naming the field for a bad config.env knob, before any episode is played."""
  check_int_knobs("env", env, _ENV_MINIMUMS)
  timeout = env.get("command_timeout_s")
  if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
    raise ConfigError(f"config.env.command_timeout_s={timeout!r}: must be a finite number of seconds > 0 "
                      "(the wall-time limit of one tool call).")
  if env.get("executor") not in ("thread", "ray"):
    raise ConfigError(f"config.env.executor={env.get('executor')!r}: choose 'thread' or 'ray'.")


@dataclasses.dataclass
class EnvContext:
  """What environments share: where task directories live and how commands are sandboxed.

  Attributes:
    root: parent of the per-episode task directories (default: a fresh temp dir, removed when
      the context is garbage-collected or the process exits).
    allow_unsafe_sandbox: run commands without nsjail when it cannot start (never silently).
    command_timeout_s: wall-time limit of one shell/python tool call.
    memory_mb, max_pids: cgroup limits of one sandboxed command.
    output_limit_bytes: stdout+stderr kept from one command (the rest is cut and said so).
    disk_mb: size cap of one episode's task directory: a tmpfs of this size, and of
      `taskdir.inode_cap(disk_mb)` files, where this process may mount one (root on Linux;
      rl/sandbox/taskdir.py), else an ordinary directory (logged once).
  """

  root: Path | None = None
  allow_unsafe_sandbox: bool = False
  command_timeout_s: float = 20.0
  memory_mb: int = 512
  max_pids: int = 64
  output_limit_bytes: int = 64 * 1024
  disk_mb: int = 256

  def __post_init__(self):
    if not is_int(self.disk_mb, numpy=True) or self.disk_mb < 1:
      raise ConfigError(f"EnvContext: disk_mb={self.disk_mb!r} must be an int >= 1 (config.env.disk_mb; "
                        "a tmpfs reads 0 as no limit).")
    self._mounts: set[Path] = set()
    root_is_ours = self.root is None
    where = Path(tempfile.gettempdir() if root_is_ours else self.root)
    # before any work: every sandboxed command under it would fail
    check_mountable(where.resolve(), f"{'TMPDIR' if root_is_ours else 'config.env.root'}={str(where)!r}")
    if root_is_ours:  # removed with this context (or at exit)
      self.root = Path(tempfile.mkdtemp(prefix=f"{taskdir.ROOT_PREFIX}{os.getpid()}_"))
    self.root = Path(self.root)
    self.root.mkdir(parents=True, exist_ok=True)
    # What processes killed with SIGKILL left mounted (a tmpfs holds its files in memory).
    swept = taskdir.sweep_stale(self.root, Path(tempfile.gettempdir()))
    if swept:
      _log.warning("removed %d task directories left by processes that no longer exist (e.g. %s)",
                   len(swept), swept[0])
    # Task directories still mounted when the context goes are unmounted then (else a tmpfs
    # would hold its files in memory after the run); our own root is removed too.
    weakref.finalize(self, _release, self._mounts, str(self.root) if root_is_ours else None)

  @classmethod
  def from_config(cls, env) -> "EnvContext":
    """From a config's `env` section (configs/sft.py), every knob checked (`check_env_config`)."""
    check_env_config(env)
    return cls(root=env.root or None, allow_unsafe_sandbox=bool(env.allow_unsafe_sandbox),
               command_timeout_s=float(env.command_timeout_s), memory_mb=int(env.memory_mb),
               max_pids=int(env.max_pids), output_limit_bytes=int(env.output_limit_bytes),
               disk_mb=int(env.disk_mb))

  def new_dir(self, name: str) -> Path:
    """A fresh, empty directory for one episode, a tmpfs of disk_mb where one can be mounted."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80] or "task"
    path = Path(tempfile.mkdtemp(prefix=taskdir.episode_prefix(safe), dir=self.root))
    why_not = taskdir.mount_tmpfs(path, self.disk_mb)
    if why_not is None:
      self._mounts.add(path)
    elif not _UNCAPPED_LOGGED:
      _UNCAPPED_LOGGED.append(why_not)
      _log.warning("task directories are not size-capped (%s): a command can fill %s's disk", why_not,
                   self.root)
    return path

  def remove_dir(self, path: Path) -> None:
    """Removes an episode's directory (unmounting its tmpfs first); never raises: what it
    cannot remove is logged (an episode's close must not end the run)."""
    if path in self._mounts:
      self._mounts.discard(path)
      try:
        taskdir.unmount(path)
      except OSError as e:  # the files still go below
        _log.warning("%s; removing its files instead", e)
    taskdir.remove_quietly(path)  # iterative: a tree of any depth the agent built


_UNCAPPED_LOGGED: list[str] = []  # why task directories are not capped, once logged


def _release(mounts: set[Path], root: str | None) -> None:
  for path in list(mounts):
    try:
      taskdir.unmount(path)
    except OSError:
      pass
  if root is not None:
    taskdir.remove_quietly(root)


class Environment(abc.ABC):
  """One episode of one task. Subclasses set `domain`, implement `tools`, `_call`, `grade`."""

  domain: ClassVar[str]

  def __init__(self, task: Task, ctx: EnvContext):
    if task.domain != self.domain:
      raise ValueError(f"task {task.id!r} is a {task.domain} task; {type(self).__name__} runs {self.domain}")
    self.task, self.ctx = task, ctx

  def reset(self) -> tuple[str, list[Tool]]:
    """The first user message (exactly as the schema's conventions fix it) and the tools."""
    return self.task.first_user_message(), list(self.tools())

  @abc.abstractmethod
  def tools(self) -> Sequence[Tool]:
    """The tools of this domain (JSON-schema functions); may be empty."""

  def _call(self, name: str, arguments: dict[str, Any]) -> str:
    """Runs a validated call of one of `tools()`; raises ToolError for a bad call."""
    raise ToolError(f"this environment has no tools (called {name!r})")

  @abc.abstractmethod
  def grade(self, final_text: str) -> Grade:
    """Scores the end of the episode: the final answer text and/or the world's state."""

  def close(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
    """Frees what the episode holds (directories, processes); idempotent."""

  def execute(self, call: ToolCall) -> ToolResult:
    """Runs one tool call; every failure comes back as an error ToolResult."""
    tools = {t.name: t for t in self.tools()}
    if call.name not in tools:
      known = ", ".join(sorted(tools)) or "none"
      return ToolResult(f"Error: unknown tool {call.name!r}; available tools: {known}.", error=True)
    try:
      arguments = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
    except json.JSONDecodeError as e:
      return ToolResult(f"Error: the arguments of {call.name} are not valid JSON ({e.msg}).", error=True)
    except RecursionError:
      return ToolResult(f"Error: the arguments of {call.name} are nested too deeply to read.", error=True)
    except ValueError as e:  # not a JSONDecodeError: an integer past Python's 4300-digit limit
      return ToolResult(clip(f"Error: the arguments of {call.name} are not valid JSON ({e})."), error=True)
    if not isinstance(arguments, dict):
      return ToolResult(f"Error: the arguments of {call.name} must be a JSON object.", error=True)
    try:
      problems = validate_arguments(tools[call.name].parameters, arguments)
    except RecursionError:
      return ToolResult(f"Error: the arguments of {call.name} are nested too deeply to check.", error=True)
    if problems:  # clipped: a message quotes the bad value, which may be 100 KB
      return ToolResult(clip(f"Error: bad arguments for {call.name}: " + "; ".join(problems[:5])), error=True)
    try:
      return ToolResult(clip(self._call(call.name, arguments)))
    except ToolError as e:
      return ToolResult(clip(f"Error: {e}"), error=True)
    except Exception as e:  # a tool bug must not end the episode; it is logged for us
      _log.exception("tool %s crashed on task %s", call.name, self.task.id)
      return ToolResult(clip(f"Error: {call.name} failed internally ({type(e).__name__}: {e})."), error=True)


class DirectoryEnvironment(Environment):
  """An environment whose world is a task directory, removed on close."""

  def __init__(self, task: Task, ctx: EnvContext):
    super().__init__(task, ctx)
    self.dir = ctx.new_dir(task.id)

  def close(self) -> None:
    if self.dir is not None:
      self.ctx.remove_dir(self.dir)
      self.dir = None


def clip(text: str, limit: int = MAX_TOOL_RESULT_CHARS) -> str:
  """Cuts a long tool result, saying how much was cut (the model must know it saw a part)."""
  if len(text) <= limit:
    return text
  return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


# ---- registry ------------------------------------------------------------------------------
_REGISTRY: dict[str, type[Environment]] = {}
_MODULES = {
  "math": "rl.envs.math",
  "code": "rl.envs.code",
  "terminal": "rl.envs.terminal",
  "web": "rl.envs.web",
  "docqa": "rl.envs.docqa",
  "cad": "rl.envs.cad",
}


def register(cls: type[Environment]) -> type[Environment]:
  """Class decorator: makes `cls` the environment of `cls.domain`."""
  _REGISTRY[cls.domain] = cls
  return cls


def environment_class(domain: str) -> type[Environment]:
  """The registered environment of `domain` (its module is imported on first use)."""
  if domain not in _REGISTRY:
    if domain not in _MODULES:
      raise ValueError(f"no environment for domain {domain!r}; known: {', '.join(_MODULES)}")
    importlib.import_module(_MODULES[domain])
  return _REGISTRY[domain]


def make_env(task: Task, ctx: EnvContext) -> Environment:
  return environment_class(task.domain)(task, ctx)


def oracle_calls(turn: Mapping[str, Any]) -> list[ToolCall]:
  """An oracle turn's tool calls as ToolCall objects (ids call_<i>)."""
  return [
    ToolCall(id=f"call_{i}", name=c["name"], arguments=json.dumps(c["arguments"]))
    for i, c in enumerate(turn.get("tool_calls", []))
  ]


def replay(
  task: Task,
  ctx: EnvContext,
  turns: Sequence[Mapping[str, Any]] | None = None,
  on_result: Callable[[ToolCall, ToolResult], None] | None = None,
) -> Grade:
  """Runs a trajectory (default: the task's oracle) through a fresh environment and grades it.

  Every tool call of every turn is executed in order; the last turn's content is the final
  text. Used by the oracle tests and as the simplest policy.
  """
  turns = task.oracle if turns is None else turns
  if not turns:
    raise ValueError(f"task {task.id!r} has no oracle trajectory to replay")
  env = make_env(task, ctx)
  try:
    env.reset()
    for turn in turns:
      for call in oracle_calls(turn):
        result = env.execute(call)
        if on_result is not None:
          on_result(call, result)
    return env.grade(turns[-1].get("content", ""))
  finally:
    env.close()
