"""Mutation audit of experiments.sft: --init_checkpoint reaches config.checkpoint.init_from."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]

# The launcher with run_sft replaced by one that reports what it was given (no model is built).
_DRIVER = """
import json, sys
import experiments.sft as launcher
from experiments.config_util import run_app
launcher.run_sft = lambda config, workdir: {"init_from": config.checkpoint.init_from, "workdir": workdir}
run_app(launcher.main)
"""


def _run(tmp_path, *flags):
  cmd = [sys.executable, "-c", _DRIVER, "--config=configs/sft.py:tiny", f"--workdir={tmp_path / 'w'}", *flags]
  return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=300)


def _launch(tmp_path, *flags):
  run = _run(tmp_path, *flags)
  assert run.returncode == 0, run.stderr[-2000:]
  return json.loads(run.stdout.strip().splitlines()[-1])


def test_init_checkpoint_sets_init_from(tmp_path):
  """Catches --init_checkpoint dropped (the run trained from random weights, its summary the last line)."""
  assert _launch(tmp_path, "--init_checkpoint=/pre/checkpoints") == {"init_from": "/pre/checkpoints",
                                                                     "workdir": str(tmp_path / "w")}


def test_init_checkpoint_and_a_different_config_init_from_are_refused(tmp_path):
  """Both on one command line: refused naming both (--init_checkpoint won silently); the same path
  twice is one request."""
  run = _run(tmp_path, "--init_checkpoint=/a", "--config.checkpoint.init_from=/b")
  assert run.returncode == 1 and run.stdout == "", run.stderr[-2000:]
  assert run.stderr.strip().splitlines()[0] == (
      "FATAL ConfigError: --init_checkpoint='/a' and --config.checkpoint.init_from='/b' name different "
      "starting weights; give one of them.")
  assert _launch(tmp_path, "--init_checkpoint=/a", "--config.checkpoint.init_from=/a")["init_from"] == "/a"
