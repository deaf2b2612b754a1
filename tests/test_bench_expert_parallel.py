"""Smoke test of experiments/bench/expert_parallel.py (EP=8 vs EP=1 MoE train step).

Runs the benchmark as its users do, `python -m ...`, in a subprocess (it sets
its own XLA_FLAGS and parses absl flags), on the `tiny_sharded` config with a
few tokens, and checks what it promises: the last line is JSON, the two
layouts computed the same losses without drops, and expert weights per device
shrink to 1/8.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import compile_cache_env

ROOT = Path(__file__).resolve().parents[1]
MODULE = "experiments.bench.expert_parallel"


def _run(*args: str, xla_flags: str = "") -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags, **compile_cache_env())
  return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def test_bench_runs_and_reports_ratios():
  proc = _run("--quick", "--config=configs/horizon.py:tiny_sharded", "--seq=16", "--reps=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  out = json.loads(lines[-1])
  for key in ("time_ratio", "param_bytes_ratio", "expert_param_bytes_ratio", "opt_state_bytes_ratio",
              "ep8_step_s", "ep1_step_s", "ep8_param_bytes", "ep1_param_bytes", "ep8_temp_bytes",
              "loss0_rel_diff", "loss1_rel_diff"):
    assert key in out, f"missing {key!r} in {sorted(out)}"
  assert out["layouts_agree"] is True
  assert out["ep8_dropped"] == 0 and out["ep1_dropped"] == 0
  assert out["param_bytes_ratio"] < 0.5
  assert out["expert_param_bytes_ratio"] == 0.125  # 8 experts over 8 devices, exactly
  assert out["ep8_step_s"] > 0 and out["ep1_step_s"] > 0
  assert any(line.startswith("ep8 ") for line in lines) and any(line.startswith("ep1 ") for line in lines)


def test_bench_refuses_wrong_device_count():
  proc = _run("--quick", xla_flags="--xla_force_host_platform_device_count=4")
  assert proc.returncode != 0
  assert "needs exactly 8 devices" in proc.stderr and "found 4" in proc.stderr
