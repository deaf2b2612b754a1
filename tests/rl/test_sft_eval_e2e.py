"""SFT -> checkpoint -> evaluation in process and through both HTTP APIs (the README's path).

Slow: trains the tiny model for a few steps with experiments.sft, evaluates its checkpoint with
experiments.evaluate, then serves the same checkpoint with experiments.serve and evaluates it
through the OpenAI and the Anthropic API: greedy results must be the same episode for episode.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(args, **kw):
  # One CPU device, as on a user's machine: the SFT config's batch of 4 does not divide the 8 test
  # devices, which the training loop refuses (every device would compute the whole batch).
  env = subprocess_env(1)
  out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900, **kw)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _records(out_dir: Path) -> dict[str, dict]:
  return {r["key"]: r for r in map(json.loads, (out_dir / "results.jsonl").read_text().splitlines())}


def test_sft_checkpoint_evaluates_the_same_in_process_and_over_both_apis(tmp_path):
  work = tmp_path / "sft"
  sft = ["experiments.sft", "--config=configs/sft.py:tiny", f"--workdir={work}"]
  first = json.loads(_run([*sft, "--config.train.steps=10"]).strip().splitlines()[-1])
  assert first["latest_checkpoint"] == 10 and first["start_step"] == 0
  summary = json.loads(_run(sft).strip().splitlines()[-1])  # resumes at step 10
  assert summary["start_step"] == 10 and summary["latest_checkpoint"] == 20 and summary["sft_rows"] > 0
  assert len(summary["losses"]) == 10
  assert summary["losses"][-1] < first["losses"][0]
  tasks = tmp_path / "tasks.jsonl"
  _run(["experiments.make_tasks", "--domain=math", "--split=heldout", "--n=6", f"--out={tasks}"])
  common = ["experiments.evaluate", "--config=configs/sft.py:tiny", f"--tasks={tasks}", "--tiers=low,off"]
  ckpt = str(work / "checkpoints")
  local = _run([*common, f"--checkpoint={ckpt}", f"--out={tmp_path / 'local'}"])
  assert "| math | low | 6 |" in local and json.loads(local.strip().splitlines()[-1])["math/low"]["n"] == 6
  assert (tmp_path / "local" / "success_vs_thinking.png").stat().st_size > 1000

  port = _free_port()
  server = subprocess.Popen([sys.executable, "-m", "experiments.serve", f"--checkpoint={ckpt}",
                             "--config=configs/serve.py:tiny", f"--port={port}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 300
    while True:
      try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
          break
      except OSError:
        pass
      assert time.time() < deadline and server.poll() is None, "server did not come up"
      time.sleep(1)
    for api in ("openai", "anthropic"):
      _run([*common, f"--endpoint=http://127.0.0.1:{port}", f"--api={api}", f"--out={tmp_path / api}"])
  finally:
    server.terminate()
    server.wait(timeout=60)

  want = _records(tmp_path / "local")
  assert len(want) == 12
  for api in ("openai", "anthropic"):
    got = _records(tmp_path / api)
    assert set(got) == set(want)
    for key, r in want.items():
      assert (got[key]["final_text"], got[key]["success"], got[key]["reward"]) == \
          (r["final_text"], r["success"], r["reward"]), (api, key)
      assert got[key]["error"] is None
