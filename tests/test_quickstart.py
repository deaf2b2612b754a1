"""The README's main command, shortened (slow: it trains for real)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_trains_below_unigram_and_samples(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "experiments.quickstart", "--config=configs/pretrain.py:tiny",
                        f"--workdir={tmp_path}"], cwd=ROOT, env=env, text=True, capture_output=True,
                       timeout=1800)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["loss_over_unigram"] < 0.8, out
  assert out["decode_max_logit_diff"] < 1e-3 and out["sample"] and out["steps"] == 300
  assert out["steps_this_launch"] == 300 and "trained 300 steps" in run.stdout
  # INFO chatter (orbax, absl) goes to <workdir>/logs; the console keeps progress, results, warnings.
  assert len(run.stderr.splitlines()) < 20, run.stderr[-3000:]
  assert any(p.name.startswith("quickstart") for p in (tmp_path / "logs").iterdir())
  assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoints" / "300").is_dir()


def test_bad_quickstart_arguments_fail_before_training(tmp_path):
  """These trained for minutes and then failed in the sampler (or on a missing config section)."""
  from configs import horizon, pretrain
  from training import quickstart

  def refused(config, match, **kw):
    args = {"prompt": "def f():", "new_tokens": 8, "temperature": 1.0, **kw}
    with pytest.raises(ValueError, match=match):
      quickstart.run(config, str(tmp_path), **args)

  refused(pretrain.get_config("tiny"), r"--new_tokens=300: the prompt \(\d+ tokens\) \+ new tokens \+ 1 "
          r"must fit config.model.max_seq_len=256", new_tokens=300)
  refused(pretrain.get_config("tiny"), "--prompt is empty", prompt="")
  refused(horizon.get_config("tiny"), r"no data, metrics, checkpoint section\(s\).*configs/pretrain.py:tiny")
  assert not any(tmp_path.iterdir())  # nothing trained, prepared or saved
