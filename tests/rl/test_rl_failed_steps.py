"""An RL run whose every episode fails to play or be graded stops after config.rl.max_failed_steps
steps in a row (it ran every step without an update, only warning), naming the first failure."""

import types
import warnings

import pytest

from configs import rl as rl_configs
from rl.agent.episode import Episode
from rl.train.batch import first_failure
from rl.train.checks import FailedSteps


def _stats(groups, invalid):
  return {"groups": groups, "groups_invalid": invalid}


def test_the_run_stops_after_the_limit_of_steps_in_a_row_where_every_group_failed():
  failed = FailedSteps(3)
  failed.observe(0, _stats(0, 4), "boom")
  failed.observe(1, _stats(0, 4), "boom")
  failed.observe(2, _stats(1, 3), None)  # one group played: the streak starts again
  failed.observe(3, _stats(0, 0), None)  # every group dropped for equal rewards: not a failure
  failed.observe(4, _stats(0, 4), "x")
  failed.observe(5, _stats(0, 4), "x")
  with pytest.raises(RuntimeError, match=r"RL steps 4\.\.6: every group failed to play or be graded.*"
                                         r"max_failed_steps=3\); the first failure of step 6: "
                                         r"EndpointError: down\. Fix its cause"):
    failed.observe(6, _stats(0, 4), "EndpointError: down")
  never = FailedSteps(0)
  for step in range(10):
    never.observe(step, _stats(0, 4), "boom")
  assert never.streak == 10


def test_first_failure_names_the_policy_or_the_grader():
  ok = Episode("a", "math", None, end="answer")
  graded = Episode("b", "math", None, end="answer",
                   grade={"grader_failed": True, "error": "grading failed: X"})
  error = Episode("c", "math", None, end="error", error="environment failed to start: OSError: no")
  assert first_failure([ok]) is None
  assert first_failure([ok, graded, error]) == "grading failed: X"
  assert first_failure([error, graded]) == "environment failed to start: OSError: no"
  assert first_failure([Episode("d", "math", None, end="error")]) == "the episode ended 'error'"


def test_a_rollout_where_every_episode_failed_reports_its_first_failure(tmp_path):
  """No groups, every group invalid, the first failure named; played_success is NaN (no episode was
  played), without numpy's empty-mean warning."""
  from rl.train.trainer import RLRun

  config = rl_configs.get_config("grpo,tiny")
  config.rl.prompts_per_step = 2
  config.rl.samples_per_prompt = 2
  r = RLRun(config, str(tmp_path))
  r.executor = types.SimpleNamespace(busy_s=0.0)
  r._play = lambda jobs: [Episode(t.id, t.domain, tier, end="error", error=f"down {i}")
                          for i, (t, tier, _) in enumerate(jobs)]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    episodes, sources, stats = r.rollout(0)
  assert episodes == [] and sources == []
  assert (stats["groups"], stats["groups_invalid"], stats["first_failure"]) == (0, 2, "down 0")
  assert stats["played_success"] != stats["played_success"]  # NaN
  assert stats["rounds"] == 1 and stats["episodes_played"] == 0
