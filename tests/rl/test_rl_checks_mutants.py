"""rl/train/checks.py cases that mutation testing found unchecked (each test names the mistake)."""

import logging
import re

import pytest

from configs import rl as rl_config
from model.config import ModelConfig
from rl.train.checks import check_rl_config, check_rl_resume, check_run_knobs, check_step_finite
from tests._checkpoint_child import Small
from training.checkpoint import Checkpointer


def _config(**rl):
  config = rl_config.get_config("grpo,tiny")
  config.rl.update(**rl)
  return config


def test_pad_multiple_up_to_max_context_and_rollout_quantization():
  """pad_multiple == max_context is the largest that pads no row past an episode (accepted); an
  unknown rollout_quantization fails here, not when the first weights are synced."""
  max_context = _config().serving.max_context
  check_rl_config(_config(pad_multiple=max_context))
  with pytest.raises(ValueError, match=r"config\.rl\.pad_multiple=.* above config\.serving\.max_context"):
    check_rl_config(_config(pad_multiple=max_context + 1))
  for ok in ("none", "experts", "all-linear"):
    check_rl_config(_config(rollout_quantization=ok))
  with pytest.raises(ValueError, match=r"config\.rl\.rollout_quantization='fp4': choose none, experts"):
    check_rl_config(_config(rollout_quantization="fp4"))


def test_constant_aggregation_keeps_a_chosen_norm_tokens():
  """Dr. GRPO's divisor defaults to the episode's generation budget (tiny: 48 tokens x 8 turns); a
  norm_tokens the run sets is kept, not overwritten by that default."""
  assert check_rl_config(_config(algorithm="dr_grpo")).objective.norm_tokens == 48 * 8
  assert check_rl_config(_config(algorithm="dr_grpo", norm_tokens=1000)).objective.norm_tokens == 1000
  assert check_rl_config(_config()).objective.norm_tokens == 0  # grpo: seq_mean, no divisor


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run's checkpoints at step 2, written with the tiny grpo config."""
  path = tmp_path_factory.mktemp("run") / "checkpoints"
  with Checkpointer(path, every=1, keep=1, async_save=False) as c:
    c.save(2, model=Small(0), config=_config().to_dict(), force=True)
  return path


@pytest.mark.parametrize("field, value, before", [
  ("tiers", "low=1,high=1", "'high'"),  # each prompt's thinking tier
  ("temperature", 0.7, "1.0"),  # the samples themselves
  ("adaptive", True, "False"),  # which sources the prompts come from
  ("adaptive_floor", 0.3, "0.1"),
  ("max_refills", 0, "2"),  # how many rounds of prompts a step plays
  ("dynamic_sampling", True, "None"),  # whether refill rounds are played at all (None: the preset's)
])
def test_resume_refuses_every_field_that_decides_the_episodes(run_dir, field, value, before):
  cfg = ModelConfig.from_config(_config().model)
  with pytest.raises(ValueError, match=re.escape(f"{field} (checkpoint {before}, now {value!r})")):
    check_rl_resume(_config(steps=5, **{field: value}), cfg, run_dir)


def test_resume_with_more_steps_logs_no_change(run_dir, caplog):
  """config.rl.steps is meant to grow on a resume: it is not reported as a changed field."""
  with caplog.at_level(logging.WARNING):
    check_rl_resume(_config(steps=9), ModelConfig.from_config(_config().model), run_dir)
  assert "config.rl changed" not in caplog.text


def test_a_nan_loss_with_finite_gradients_still_stops():
  with pytest.raises(FloatingPointError, match=r"RL step 4: loss nan, finite gradients 1\.0"):
    check_step_finite(4, {"loss": float("nan"), "finite": 1.0}, "stop")
  with pytest.raises(FloatingPointError, match=r"RL step 4: loss inf"):
    check_step_finite(4, {"loss": float("inf"), "finite": 1.0}, "stop")


def test_a_nan_adaptive_floor_is_refused():
  """NaN passed the `floor <= 0` check and made every adaptive weight NaN at the first draw."""
  with pytest.raises(ValueError, match=r"config\.rl\.adaptive_floor=nan: must be a finite number >= 0"):
    check_run_knobs(_config(adaptive=True, adaptive_floor=float("nan")).rl)
