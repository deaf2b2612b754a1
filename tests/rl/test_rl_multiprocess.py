"""Multi-process RL with the one launcher: 2 local processes x 2 CPU devices == 1 process x 4.

Each process plays its share of every step's groups on its own engine (a whole copy of the
policy), the episodes are exchanged, and the update runs on the global mesh: the per-step
episodes' token counts and rewards match the one-process run exactly, the losses to float
tolerance; process 0 alone writes metrics, trajectories and the summary.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import subprocess_env

pytestmark = pytest.mark.slow  # three JAX processes with engines: ~3 minutes on 2 cores

ROOT = Path(__file__).resolve().parents[2]
RL = [sys.executable, "-m", "experiments.rl", "--config=configs/rl.py:grpo,tiny_sharded",
      "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.expert=4", "--config.mesh.tensor=1",
      "--config.rl.steps=2", "--config.metrics.tensorboard=False", "--config.checkpoint.async_save=False"]
EXACT = ("tokens", "generated_tokens", "episodes_played", "reward", "played_success", "batch_rows")
CLOSE = ("loss", "policy_loss", "grad_norm", "abs_dlogp", "entropy")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _metrics(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_process(tmp_path):
  port = _free_port()
  env = subprocess_env(2)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # both compile, so they reach each collective together
  multi = tmp_path / "multi"
  procs = [subprocess.Popen(RL + [f"--workdir={multi}", f"--coordinator_address=127.0.0.1:{port}",
                                  "--num_processes=2", f"--process_id={i}"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    outs.append(out)
  assert json.loads(outs[0].strip().splitlines()[-1])["latest_checkpoint"] == 2
  assert not any(line.startswith("{") for line in outs[1].splitlines()), outs[1][-2000:]
  single = tmp_path / "single"
  run = subprocess.run(RL + [f"--workdir={single}"], cwd=ROOT, env=subprocess_env(4), text=True,
                       capture_output=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  m_multi, m_single = _metrics(multi), _metrics(single)
  assert [m["step"] for m in m_multi] == [m["step"] for m in m_single] == [0, 1]
  for a, b in zip(m_multi, m_single, strict=True):
    assert b["batch_rows"] == 8 and b["tokens"] > 0
    for k in EXACT:
      assert a[k] == b[k], (k, a[k], b[k])
    for k in CLOSE:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)
  lines = (multi / "trajectories.jsonl").read_text().splitlines()
  assert len(lines) == 2 * 2  # trajectories_per_step per step, written once (process 0)
