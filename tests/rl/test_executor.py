"""Environment executors: the default thread pool and Ray actors on a local Ray cluster."""

from __future__ import annotations

import asyncio

import pytest

from rl.agent.executor import ThreadExecutor, make_executor
from rl.agent.loop import run_episodes
from rl.agent.oracle import OraclePolicy
from rl.agent.policy import Sampling
from rl.envs.base import EnvContext
from rl.tasks import generators


def _play(executor, tasks, trajectories=None):
  jobs = [(t, None, Sampling()) for t in tasks]
  return asyncio.run(run_episodes(jobs, OraclePolicy(trajectories), executor, concurrency=4))


def test_thread_executor_plays_tool_episodes(tmp_path):
  tasks = generators.generate("terminal", split="train", difficulty=1, n=4, seed=3)
  executor = ThreadExecutor(EnvContext(root=tmp_path), workers=4)
  try:
    eps = _play(executor, tasks)
  finally:
    executor.shutdown()
  assert all(ep.success and ep.tool_calls >= 1 and ep.tool_errors == 0 for ep in eps)
  assert list(tmp_path.iterdir()) == []  # every task directory was removed at close


def test_ray_executor_runs_environments_as_actors(tmp_path):
  ray = pytest.importorskip("ray")
  tasks = generators.generate("terminal", split="train", difficulty=0, n=3, seed=5)
  tasks += generators.generate("math", split="train", difficulty=0, n=2, seed=5)
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
  try:
    executor = make_executor("ray", EnvContext(root=tmp_path))
    eps = _play(executor, tasks)
    wrong = {tasks[0].id: generators.corrupt_oracle(tasks[0])}
    bad = _play(executor, tasks[:1], wrong)
    executor.shutdown()
  finally:
    ray.shutdown()
  assert [ep.success for ep in eps] == [True] * 5
  assert not bad[0].success
  assert eps[0].tool_calls >= 1 and eps[0].messages[2].role == "tool"


def test_unknown_executor():
  with pytest.raises(ValueError, match="'thread' or 'ray'"):
    make_executor("k8s")
