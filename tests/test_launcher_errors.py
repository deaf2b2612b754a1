"""A user error raised while a launcher runs ends with its one-line message, not a traceback."""

import importlib
import os
import subprocess
import sys

import pytest

from experiments import config_util
from model.config import ConfigError
from training.checkpoint_meta import CheckpointNotFoundError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("module,name", config_util.USER_ERRORS)
def test_every_listed_user_error_is_an_exception_class(module, name):
  """The table names classes by module; a renamed class would silently leave it."""
  cls = getattr(importlib.import_module(module), name)
  assert isinstance(cls, type) and issubclass(cls, Exception)
  assert cls in config_util.user_error_classes()


def _run(exc, env=None):
  with pytest.MonkeyPatch.context() as mp:
    mp.delenv("HORIZON_TRACEBACK", raising=False)
    for k, v in (env or {}).items():
      mp.setenv(k, v)
    with config_util.user_errors_in_one_line():
      raise exc


def test_a_config_error_becomes_one_line_and_exit_status_1():
  with pytest.raises(SystemExit) as info:
    _run(ConfigError("config.rl.kl_coef=0: set it > 0"))
  assert info.value.code == ("FATAL ConfigError: config.rl.kl_coef=0: set it > 0\n"
                             "(HORIZON_TRACEBACK=1 shows where it was raised)")


def test_a_subclass_counts_and_names_itself():
  with pytest.raises(SystemExit) as info:
    _run(CheckpointNotFoundError("/tmp/x: no checkpoint; train first"))
  assert str(info.value.code).startswith("FATAL CheckpointNotFoundError: /tmp/x: no checkpoint")


@pytest.mark.parametrize("exc", [ValueError("shapes (3,) and (4,) do not match"), KeyError("w_q"),
                                 RuntimeError("XLA failed")])
def test_any_other_error_keeps_its_traceback(exc):
  with pytest.raises(type(exc)):
    _run(exc)


def test_horizon_traceback_keeps_it_for_user_errors_too():
  with pytest.raises(ConfigError):
    _run(ConfigError("config.x=1: bad"), env={"HORIZON_TRACEBACK": "1"})


def _launch(*extra, env=None):
  cmd = [sys.executable, "-m", "experiments.rl", "--config=configs/rl.py:grpo,tiny",
         "--config.rl.temperature=0", "--workdir=/nonexistent/never-made"]
  full_env = {k: v for k, v in os.environ.items() if k != "HORIZON_TRACEBACK"} | (env or {})
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=full_env)


def test_the_rl_launcher_refuses_a_knob_in_one_line():
  """It printed a 40-line traceback ending in the message (the check ran inside main)."""
  run = _launch()
  assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
  assert "FATAL ConfigError: config.rl.temperature=0: greedy samples" in run.stderr
  traced = _launch(env={"HORIZON_TRACEBACK": "1"})
  assert traced.returncode == 1 and "Traceback" in traced.stderr
  assert "model.config.ConfigError: config.rl.temperature=0" in traced.stderr
