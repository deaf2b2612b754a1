"""Where environments run: a thread pool by default, Ray actors when sandboxes outgrow a host.

Tool calls block (a sandboxed command can take seconds), and generation must not wait on
them: the agent loop awaits `EnvHandle` methods, which run the environment in a worker.

  * `ThreadExecutor` (default, no Ray): environments live in this process; calls run on a
    thread pool (the work is subprocesses and I/O, which release the GIL).
  * `RayExecutor` (`config.rl.env_executor=ray`): each episode's environment is a Ray actor,
    so it may live on any node of a Ray cluster; ObjectRefs are awaited without blocking.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Any

from rl.envs.base import EnvContext, Grade, ToolResult, make_env
from rl.tasks.schema import Task, parse_task
from serving.types import Tool, ToolCall


class EnvHandle(abc.ABC):
  """An environment running somewhere; every method is awaited."""

  @abc.abstractmethod
  async def reset(self) -> tuple[str, list[Tool]]: ...

  @abc.abstractmethod
  async def execute(self, call: ToolCall) -> ToolResult: ...

  @abc.abstractmethod
  async def grade(self, final_text: str) -> Grade: ...

  @abc.abstractmethod
  async def close(self) -> None: ...


class Executor(abc.ABC):
  @abc.abstractmethod
  async def open(self, task: Task) -> EnvHandle: ...

  def shutdown(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
    """Stops the workers."""


class _ThreadHandle(EnvHandle):
  def __init__(self, env, pool):
    self.env, self.pool = env, pool

  async def _run(self, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

  async def reset(self):
    return await self._run(self.env.reset)

  async def execute(self, call):
    return await self._run(self.env.execute, call)

  async def grade(self, final_text):
    return await self._run(self.env.grade, final_text)

  async def close(self):
    await self._run(self.env.close)


class ThreadExecutor(Executor):
  """Environments in this process, their calls on `workers` threads."""

  def __init__(self, ctx: EnvContext | None = None, workers: int = 8):
    self.ctx = ctx or EnvContext()
    self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env")

  async def open(self, task: Task) -> EnvHandle:
    env = await asyncio.get_running_loop().run_in_executor(self.pool, make_env, task, self.ctx)
    return _ThreadHandle(env, self.pool)

  def shutdown(self) -> None:
    self.pool.shutdown(wait=True, cancel_futures=True)


class _EnvActor:
  """The Ray actor body: one environment (tasks cross as JSON, results as dataclasses)."""

  def __init__(self, task_json: dict[str, Any], ctx_fields: dict[str, Any]):
    self.env = make_env(parse_task(task_json), EnvContext(**ctx_fields))

  def reset(self):
    return self.env.reset()

  def execute(self, call):
    return self.env.execute(call)

  def grade(self, final_text):
    return self.env.grade(final_text)

  def close(self):
    self.env.close()


class _RayHandle(EnvHandle):
  def __init__(self, actor, ray):
    self.actor, self.ray = actor, ray

  async def reset(self):
    return await self.actor.reset.remote()

  async def execute(self, call):
    return await self.actor.execute.remote(call)

  async def grade(self, final_text):
    return await self.actor.grade.remote(final_text)

  async def close(self):
    try:
      await self.actor.close.remote()
    finally:
      self.ray.kill(self.actor)


class RayExecutor(Executor):
  """One Ray actor per episode. `address`: a Ray cluster (None: start or join a local one)."""

  def __init__(self, ctx: EnvContext | None = None, address: str | None = None, num_cpus: float = 0.25):
    try:
      import ray  # optional dependency: pip install 'horizon[ray]'
    except ImportError as e:
      raise RuntimeError(
        "config.rl.env_executor='ray' needs Ray: pip install 'ray>=2.40' (or use the "
        "default env_executor='thread')."
      ) from e
    self.ray = ray
    self.ctx = ctx or EnvContext()
    self._owns = not ray.is_initialized()
    if self._owns:
      ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        ignore_reinit_error=True,
      )
    self._actor_cls = ray.remote(num_cpus=num_cpus)(_EnvActor)
    self._ctx_fields = {f.name: getattr(self.ctx, f.name) for f in dataclasses.fields(EnvContext)}
    self._ctx_fields["root"] = str(self.ctx.root)

  async def open(self, task: Task) -> EnvHandle:
    actor = self._actor_cls.remote(task.to_json(), self._ctx_fields)
    return _RayHandle(actor, self.ray)

  def shutdown(self) -> None:
    if self._owns and self.ray.is_initialized():
      self.ray.shutdown()


def make_executor(kind: str, ctx: EnvContext | None = None, workers: int = 8, address: str | None = None):
  """`kind` = 'thread' (default) | 'ray' (config.rl.env_executor)."""
  if kind == "thread":
    return ThreadExecutor(ctx, workers)
  if kind == "ray":
    return RayExecutor(ctx, address)
  raise ValueError(f"env_executor={kind!r}: expected 'thread' or 'ray'")


class _TimedHandle(EnvHandle):
  def __init__(self, inner: EnvHandle, owner: "TimedExecutor"):
    self.inner, self.owner = inner, owner

  async def _timed(self, coro):
    t0 = time.perf_counter()
    try:
      return await coro
    finally:
      self.owner.busy_s += time.perf_counter() - t0

  async def reset(self):
    return await self._timed(self.inner.reset())

  async def execute(self, call):
    return await self._timed(self.inner.execute(call))

  async def grade(self, final_text):
    return await self._timed(self.inner.grade(final_text))

  async def close(self):
    return await self._timed(self.inner.close())


class TimedExecutor(Executor):
  """Another executor, counting the seconds episodes spend waiting on environments (`busy_s`:
  summed over episodes, so it overlaps generation and other episodes)."""

  def __init__(self, inner: Executor):
    self.inner, self.busy_s = inner, 0.0

  async def open(self, task: Task) -> EnvHandle:
    t0 = time.perf_counter()
    handle = await self.inner.open(task)
    self.busy_s += time.perf_counter() - t0
    return _TimedHandle(handle, self)

  def shutdown(self) -> None:
    self.inner.shutdown()
