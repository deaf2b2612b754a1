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
         "--config.rl.temperature=0", "--workdir=/nonexistent/never-made", *extra]
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
  ignored = _launch("--config.train.seq_len=64")
  assert ignored.returncode == 1 and "Traceback" not in ignored.stderr, ignored.stderr[-2000:]
  assert "FATAL ConfigError: --config.train.seq_len (set config.serving.max_context" in ignored.stderr


def _serve_config(**serving):
  from configs import serve
  config = serve.get_config("tiny")
  config.serving.update({"prefix_cache_mb": 4, **serving})
  return config


@pytest.mark.parametrize("field, value, says", [
  ("prefix_cache_block", 7, "prefix_cache_block=7 must be a positive divisor of prefill_chunk=32"),
  ("prefix_cache_mb", -1, "prefix_cache_mb=-1 must be a finite number >= 0"),
  ("slots", 0, "slots=0 must be a positive int"),
  ("decode_steps", 0, "decode_steps=0 must be a positive int"),
  ("prefill_chunk", 4096, "prefill_chunk=4096 > max_context"),
  ("default_max_tokens", 0, "config.serving.default_max_tokens=0: must be a positive int"),
])
def test_the_serve_config_is_checked_before_weights_load(field, value, says):
  """These failed after the model was built or loaded (minutes for a large checkpoint), with a
  ValueError's traceback."""
  from serving.build import check_serve_config
  with pytest.raises(ConfigError) as info:
    check_serve_config(_serve_config(**{field: value}))
  assert says in str(info.value)


@pytest.mark.parametrize("mb", [float("nan"), float("inf"), True])
def test_a_prefix_cache_size_that_is_not_a_finite_number_is_refused(mb):
  """An Engine built in Python with NaN or inf crashed in int(mb * 2**20) (configs type the field)."""
  from serving.admission import check_prefix_settings
  with pytest.raises(ConfigError, match=f"prefix_cache_mb={mb!r} must be a finite number >= 0"):
    check_prefix_settings(mb, 16, 32)


def test_a_good_serve_config_passes_and_a_block_does_not_matter_with_the_cache_off():
  from serving.build import check_serve_config
  check_serve_config(_serve_config())
  check_serve_config(_serve_config(prefix_cache_mb=0, prefix_cache_block=7))


def test_the_serve_launcher_refuses_a_prefix_block_in_one_line():
  cmd = [sys.executable, "-m", "experiments.serve", "--config=configs/serve.py:tiny",
         "--config.serving.prefix_cache_mb=4", "--config.serving.prefix_cache_block=7",
         "--workdir=/tmp/horizon_serve_refused"]
  env = {k: v for k, v in os.environ.items() if k != "HORIZON_TRACEBACK"}
  run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
  assert "FATAL ConfigError: Engine: prefix_cache_block=7 must be a positive divisor" in run.stderr
