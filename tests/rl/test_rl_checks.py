"""RL launch checks (rl/train/checks.py): config values and resumes refused before a model is built."""

import logging

import pytest

from configs import rl as rl_config
from model.config import ModelConfig
from rl.train.checks import (
  DRAW_FIELDS,
  check_rl_config,
  check_rl_overrides,
  check_rl_resume,
  check_step_finite,
)
from tests._checkpoint_child import Small
from training.checkpoint import Checkpointer


def _config(**rl):
  config = rl_config.get_config("grpo,tiny")
  config.rl.update(**rl)
  return config


def test_values_that_failed_after_the_build_name_their_field():
  """An unknown eval tier failed at the first held-out evaluation (after steps of rollouts and
  before the checkpoint), a negative seed when the first prompts were drawn, and a task-file-only
  mixture with eval_every > 0 evaluated nothing, silently."""
  settings = check_rl_config(_config())
  assert settings.mixture == {"math": 1.0} and settings.levels == {"math": 0}
  # pad_multiple had no upper bound: every row was padded past the longest possible episode.
  too_wide = {"pad_multiple": _config().serving.max_context + 1}
  for rl, says in (({"eval_tiers": "hgh"}, "config.rl.eval_tiers"), ({"seed": -1}, "config.rl.seed"),
                   (too_wide, "config.rl.pad_multiple=.* above config.serving.max_context")):
    with pytest.raises(ValueError, match=says):
      check_rl_config(_config(**rl))


@pytest.mark.parametrize("serving, says", [
  ({"prefix_cache_mb": 4, "prefix_cache_block": 5}, "prefix_cache_block=5 must be a positive divisor"),
  ({"slots": 0}, "slots=0 must be a positive int"),
  ({"thinking_budgets": {"low": 8, "high": -1, "max": 64}}, "config.serving.thinking_budgets"),
])
def test_the_rollout_engine_settings_are_checked_before_the_build(serving, says):
  """They failed once the policy, reference model and engine had been built."""
  config = _config()
  config.serving.update(serving)
  with pytest.raises(ValueError, match=says):
    check_rl_config(config)


def test_file_only_mixture_with_evaluation_is_refused(tmp_path, monkeypatch):
  from rl.train import checks
  monkeypatch.setattr(checks, "parse_mixture", lambda text: {f"file:{tmp_path}/t.jsonl": 1.0})
  monkeypatch.setattr(checks, "parse_levels", lambda text, sources: {})
  with pytest.raises(ValueError, match=r"config.rl.eval_every=2: .* has none \(task files only\)"):
    check_rl_config(_config(eval_every=2))
  check_rl_config(_config(eval_every=0))


@pytest.fixture()
def run_dir(tmp_path):
  """A run's checkpoints at step 2, written with the tiny grpo config."""
  config = _config()
  with Checkpointer(tmp_path / "checkpoints", every=1, keep=1, async_save=False) as c:
    c.save(2, model=Small(0), config=config.to_dict(), force=True)
  return tmp_path / "checkpoints"


def test_a_resume_is_checked_before_anything_is_built(run_dir, caplog):
  """A resume with rl.steps below the checkpoint saved the last weights under a smaller step; a
  changed config.model trained on silently; changed draw fields continued another run's streams
  from this run's positions (the audit's step 2 played a level-2 task of seed 7)."""
  cfg = ModelConfig.from_config(_config().model)
  check_rl_resume(_config(steps=5), cfg, run_dir)
  with pytest.raises(ValueError, match=r"config.rl.steps=1 is below step 2"):
    check_rl_resume(_config(steps=1), cfg, run_dir)
  changed = _config(steps=5)
  changed.model.rope_theta = 500.0
  with pytest.raises(ValueError, match=r"config.model differs .*rope_theta"):
    check_rl_resume(changed, ModelConfig.from_config(changed.model), run_dir)
  with pytest.raises(ValueError, match=r"difficulty \(checkpoint '0', now '2'\); seed \(checkpoint 0, now 7"):
    check_rl_resume(_config(steps=5, seed=7, difficulty="2"), cfg, run_dir)
  with caplog.at_level(logging.WARNING):
    check_rl_resume(_config(steps=5, eval_every=3, budget_penalty=0.1), cfg, run_dir)
  assert "config.rl changed: budget_penalty 0.2 -> 0.1; eval_every 0 -> 3" in caplog.text
  assert {"seed", "mixture", "difficulty", "samples_per_prompt", "prompts_per_step"} <= set(DRAW_FIELDS)


def test_nan_policy_is_honoured(caplog):
  """RL raised on a non-finite loss whatever config.train.nan_policy said, and went on past
  non-finite gradients (the update skipped) under 'stop'."""
  check_step_finite(3, {"loss": 0.5, "finite": 1.0}, "stop")
  for m in ({"loss": float("nan"), "finite": 0.0}, {"loss": 0.5, "finite": 0.0}):
    with pytest.raises(FloatingPointError, match=r"RL step 3: .*nan_policy='skip'"):
      check_step_finite(3, m, "stop")
    with caplog.at_level(logging.WARNING):
      check_step_finite(3, m, "skip")
  assert caplog.text.count("the update was skipped") == 2


def test_train_fields_rl_does_not_read_are_refused_naming_what_does():
  """--config.train.global_batch=64 (or steps, seq_len, grad_accum) ran as if it had not been given."""
  with pytest.raises(ValueError, match=r"^--config.train.steps \(set config.rl.steps\): an RL run does not "
                                       r"read it; drop it.$"):
    check_rl_overrides({"train.steps": 100, "rl.steps": 3})
  with pytest.raises(ValueError, match=r"train.global_batch \(set config.rl.prompts_per_step x .*; "
                                       r"--config.train.grad_accum \(set config.rl.micro_batch .*them"):
    check_rl_overrides({"train.global_batch": 64, "train.grad_accum": 2})
  check_rl_overrides({"train.learning_rate": 1e-5, "rl.steps": 3, "serving.max_context": 512})
