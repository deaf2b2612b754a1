"""experiments.rl end to end on the tiny model: metrics, trajectories, checkpoints, exact resume.

Slow (three launcher processes, ~4 minutes on 2 cores): `python -m pytest -q -m slow`.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import kill_once_saved, subprocess_env
from tests.test_pretrain import _params

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _cmd(workdir, algorithm="grpo", *extra):
  # held-out evaluation every 2 steps: part of every run, and of what a resume must replay
  return [sys.executable, "-m", "experiments.rl", f"--config=configs/rl.py:{algorithm},tiny",
          f"--workdir={workdir}", f"--config.rl.steps={STEPS}", "--config.metrics.tensorboard=False",
          "--config.rl.eval_every=2", "--config.rl.eval_n=2", *extra]


def _records(workdir):
  return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  base = tmp_path_factory.mktemp("rl")
  run = subprocess.run(_cmd(base / "straight"), cwd=ROOT, env=subprocess_env(1), text=True,
                       capture_output=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  # the console keeps progress and the summary; absl/orbax INFO lines go to <workdir>/logs
  assert "checkpoint_manager.py" not in run.stderr
  assert "step 4/4" in run.stdout and "played_success" in run.stdout
  assert "checkpoint_manager.py" in (base / "straight" / "logs" / "rl.INFO").read_text()
  return base, json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_run_logs_domains_trajectories_and_checkpoints(straight):
  base, summary = straight
  assert summary["start_step"] == 0 and summary["latest_checkpoint"] == STEPS
  records = _records(base / "straight")
  assert [r["step"] for r in records] == list(range(STEPS))
  for r in records:
    for key in ("reward/math", "success/math", "response_tokens/math", "thinking_tokens/math", "turns/math",
                "tool_errors/math", "malformed_calls/math", "truncated/math", "entropy/math",
                "groups_dropped", "mix/math",
                "abs_dlogp", "rollout_kl", "tis_clip_frac", "clip_frac", "grad_norm", "rollout_s",
                "update_s", "played_success/math", "grader_failed/math", "groups_invalid"):
      assert key in r and math.isfinite(r[key]), (key, r.get(key))
    assert r["episodes_played"] == 8 and r["finite"] == 1.0 and r["staleness"] == 0.0
    evaluated = "eval/success/math/high" in r
    assert evaluated == (r["step"] % 2 == 1), r["step"]  # after steps 2 and 4
    if evaluated:
      assert r["eval/ci_low/math/high"] <= r["eval/success/math/high"] <= r["eval/ci_high/math/high"]
      table = (base / "straight" / "eval" / f"step_{r['step'] + 1}" / "table.md").read_text()
      assert "| math | high | 2 |" in table, table
  lines = (base / "straight" / "trajectories.jsonl").read_text().splitlines()
  assert len(lines) == 2 * STEPS
  first = json.loads(lines[0])
  assert first["messages"][0]["role"] == "user" and first["messages"][1]["role"] == "assistant"


@pytest.mark.slow
def test_sigkill_mid_step_and_resume_is_identical(straight):
  base, _ = straight
  work = base / "killed"
  proc = subprocess.Popen(_cmd(work), cwd=ROOT, env=subprocess_env(1), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  kill_once_saved(proc, work / "checkpoints" / "2", after_s=0.5)  # 0.5 s into step 2's rollouts
  done = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
  assert STEPS not in done, f"the run finished before the kill ({done}); the test proves nothing"
  run = subprocess.run(_cmd(work), cwd=ROOT, env=subprocess_env(1), text=True, capture_output=True,
                       timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads(run.stdout.strip().splitlines()[-1])
  assert summary["start_step"] in done and summary["start_step"] >= 2
  a, b = _params(base / "straight", STEPS), _params(work, STEPS)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(b[k], a[k], err_msg=k)
  straight_records = {r["step"]: r for r in _records(base / "straight")}
  for r in _records(work):  # every step's rollouts and update, replayed after the resume too
    s = straight_records[r["step"]]
    for key in ("reward", "response_tokens", "loss", "grad_norm"):
      assert r[key] == s[key], (r["step"], key)


@pytest.mark.slow
def test_rl_checkpoint_serves(straight):
  """experiments.serve's engine loads the RL workdir's checkpoint and generates."""
  from configs import serve
  from serving.build import build_engine
  from serving.engine import Request
  from serving.types import SamplingParams
  base, _ = straight
  engine = build_engine(serve.get_config("tiny"), str(base / "straight" / "checkpoints"))
  ids, reason, usage = engine.generate(Request(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=5)))
  assert len(ids) >= 1 and reason in ("length", "stop") and usage.prompt_tokens == 3


@pytest.mark.slow
def test_dapo_with_reference_kl_and_dynamic_sampling(tmp_path):
  """DAPO's knobs through the launcher: groups with equal rewards are dropped and refilled, the
  k3 KL to the frozen start is 0 at the first step and positive after an update."""
  cmd = [sys.executable, "-m", "experiments.rl", "--config=configs/rl.py:dapo,tiny", f"--workdir={tmp_path}",
         "--config.rl.steps=2", "--config.rl.kl=k3", "--config.rl.kl_coef=0.05",
         "--config.metrics.tensorboard=False"]
  run = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(1), text=True, capture_output=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  first, second = _records(tmp_path)
  assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6) and second["kl_ref"] > 0
  for r in (first, second):
    assert r["rounds"] >= 1 and r["episodes_played"] == 8 * r["rounds"]
    assert r["groups_dropped"] <= r["groups"] and 0.0 <= r["played_success/math"] <= 1.0


@pytest.mark.slow
def test_async_rollouts_are_one_update_stale(straight):
  """config.rl.async_rollouts: step 0 is the synchronous run's step exactly; later batches were
  generated with the weights before the previous update (staleness 1), so the rollout and
  trainer policies now differ by a whole update, far more than numerics."""
  base, _ = straight
  work = base / "async"
  run = subprocess.run(_cmd(work, "grpo", "--config.rl.async_rollouts=true"), cwd=ROOT,
                       env=subprocess_env(1), text=True, capture_output=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  records, straight_records = _records(work), _records(base / "straight")
  assert [r["staleness"] for r in records] == [0.0] + [1.0] * (STEPS - 1)
  for key in ("reward", "loss", "grad_norm", "abs_dlogp"):
    assert records[0][key] == straight_records[0][key], key
  for r in records:
    assert r["finite"] == 1.0 and math.isfinite(r["loss"]) and r["sync_s"] >= 0.0
  stale = np.mean([r["abs_dlogp"] for r in records[1:]])
  fresh = np.mean([r["abs_dlogp"] for r in straight_records[1:]])
  assert stale > 10 * fresh, (stale, fresh)
  assert (work / "checkpoints" / str(STEPS)).is_dir()
