"""Executors against references written out here: where a thread executor puts its environments, how
it shuts down, what TimedExecutor counts, and RayExecutor's own logic on a stand-in `ray` module (the
real cluster test in test_executor.py checks only that episodes succeed)."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest

from rl.agent.executor import EnvHandle, Executor, ThreadExecutor, TimedExecutor, make_executor
from rl.envs.base import EnvContext, ToolResult
from rl.tasks import generators
from serving.types import ToolCall


def _terminal_task():
  return generators.generate("terminal", split="train", difficulty=1, n=1, seed=3)[0]


def _open_reset_close(executor, task):
  """Opens and resets an environment; returns what its context root held then, and closes it."""

  async def go():
    handle = await executor.open(task)
    first, tools = await handle.reset()
    inside = sorted(p.name for p in executor.ctx.root.iterdir())
    await handle.close()
    return inside, first, tools

  return asyncio.run(go())


def test_thread_executors_put_task_directories_under_their_context(tmp_path):
  """Catches the context dropped (ThreadExecutor's or make_executor's): the task directory would
  go to a fresh temp root instead of config.env.root."""
  task = _terminal_task()
  for n, make in enumerate((lambda c: ThreadExecutor(c, workers=1), lambda c: make_executor("thread", c, 1))):
    root = tmp_path / f"r{n}"
    executor = make(EnvContext(root=root))
    try:
      assert executor.ctx.root == root
      inside, first, tools = _open_reset_close(executor, task)
    finally:
      executor.shutdown()
    assert len(inside) == 1 and first and tools  # one episode directory while it is open
    assert list(root.iterdir()) == []  # removed at close


def test_make_executor_defaults_and_refusals():
  """8 workers by default; only 'thread' and 'ray' are kinds (an empty kind is not 'thread')."""
  for executor in (make_executor("thread"), ThreadExecutor()):
    assert executor.pool._max_workers == 8
    executor.shutdown()
  for kind in ("", "Thread", "threads"):
    with pytest.raises(ValueError, match="expected 'thread' or 'ray'"):
      make_executor(kind)


def test_thread_shutdown_waits_for_running_calls_and_drops_queued_ones():
  executor = ThreadExecutor(workers=1)
  started, done = threading.Event(), []

  def slow():
    started.set()
    time.sleep(0.2)
    done.append("slow")

  executor.pool.submit(slow)
  queued = executor.pool.submit(done.append, "queued")
  assert started.wait(5)
  executor.shutdown()
  assert done == ["slow"] and queued.cancelled()


class _SlowHandle(EnvHandle):
  """Each call takes 0.05 s; grade then fails."""

  async def reset(self):
    return "q", []

  async def execute(self, call):
    await asyncio.sleep(0.05)
    return ToolResult("r")

  async def grade(self, final_text):
    await asyncio.sleep(0.05)
    raise ValueError("grader down")

  async def close(self):
    await asyncio.sleep(0.05)


class _Inner(Executor):
  def __init__(self):
    self.shutdowns = 0

  async def open(self, task):
    return _SlowHandle()

  def shutdown(self):
    self.shutdowns += 1


def test_timed_executor_counts_execute_close_and_failed_calls_and_forwards_shutdown():
  inner = _Inner()
  executor = TimedExecutor(inner)

  async def go():
    handle = await executor.open(None)
    assert await handle.execute(ToolCall("c", "echo", "{}")) == ToolResult("r")
    with pytest.raises(ValueError, match="grader down"):
      await handle.grade("a")
    await handle.close()

  t0 = time.perf_counter()
  asyncio.run(go())
  wall = time.perf_counter() - t0
  assert 0.14 <= executor.busy_s <= wall  # execute, the failed grade, close: 0.05 s each
  executor.shutdown()
  assert inner.shutdowns == 1


class _FakeRay:
  """What RayExecutor uses of `ray`; actors run in this process."""

  def __init__(self, initialized, fail_close=False):
    self.initialized, self.fail_close = initialized, fail_close
    self.inits, self.num_cpus, self.actors, self.killed, self.shutdowns = [], [], [], [], 0

  def is_initialized(self):
    return self.initialized

  def init(self, **kw):
    self.inits.append(kw)
    self.initialized = True

  def remote(self, *args, **kw):
    if args:  # used bare, as a decorator
      self.num_cpus.append(None)
      return self._actor_class(args[0])
    self.num_cpus.append(kw.get("num_cpus"))
    return self._actor_class

  def _actor_class(self, cls):
    fake = self

    def make(*args):
      body = cls(*args)
      if fake.fail_close:
        body.close = lambda: (_ for _ in ()).throw(RuntimeError("actor died"))
      actor = types.SimpleNamespace(body=body)
      for name in ("reset", "execute", "grade", "close"):
        actor.__dict__[name] = types.SimpleNamespace(remote=fake._method(body, name))
      fake.actors.append(actor)
      return actor

    return types.SimpleNamespace(remote=make)

  @staticmethod
  def _method(body, name):
    async def call(*args):
      return getattr(body, name)(*args)

    return call

  def kill(self, actor):
    self.killed.append(actor)

  def shutdown(self):
    self.shutdowns += 1
    self.initialized = False


def test_ray_executor_starts_ray_with_its_address_and_ships_the_context(tmp_path, monkeypatch):
  """Catches the address dropped, the actors' CPU share lost, the context's fields or root not
  shipped (the actor's task directory would not be under config.env.root), ray not shut down."""
  ray = _FakeRay(initialized=False)
  monkeypatch.setitem(__import__("sys").modules, "ray", ray)
  root = tmp_path / "root"
  executor = make_executor("ray", EnvContext(root=root, command_timeout_s=7.0), address="ray://head:10001")
  assert [kw["address"] for kw in ray.inits] == ["ray://head:10001"] and ray.num_cpus == [0.25]

  async def go():
    handle = await executor.open(_terminal_task())
    first, tools = await handle.reset()
    actor_ctx = ray.actors[0].body.env.ctx
    inside = [p.name for p in root.iterdir()]
    await handle.close()
    return first, tools, actor_ctx, inside

  first, tools, actor_ctx, inside = asyncio.run(go())
  assert first and tools and len(inside) == 1 and list(root.iterdir()) == []
  assert actor_ctx.root == root and actor_ctx.command_timeout_s == 7.0
  assert ray.killed == ray.actors  # the actor is killed at close
  executor.shutdown()
  assert ray.shutdowns == 1


def test_ray_executor_leaves_a_running_ray_alone(monkeypatch):
  ray = _FakeRay(initialized=True)
  monkeypatch.setitem(__import__("sys").modules, "ray", ray)
  executor = make_executor("ray", address="ray://elsewhere:1")
  executor.shutdown()
  assert (ray.inits, ray.shutdowns) == ([], 0)  # it joined the caller's ray and does not stop it


def test_ray_actor_is_killed_even_when_its_close_fails(tmp_path, monkeypatch):
  ray = _FakeRay(initialized=True, fail_close=True)
  monkeypatch.setitem(__import__("sys").modules, "ray", ray)
  executor = make_executor("ray", EnvContext(root=tmp_path))

  async def go():
    handle = await executor.open(_terminal_task())
    with pytest.raises(RuntimeError, match="actor died"):
      await handle.close()

  asyncio.run(go())
  assert len(ray.actors) == 1 and ray.killed == ray.actors
  ray.actors[0].body.env.close()  # this test's own clean-up
