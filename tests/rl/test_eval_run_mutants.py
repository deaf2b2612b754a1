"""What an evaluation run writes, which tasks it draws and what its CLI refuses, against references
written out here (each test kills a mutant of rl/eval/run.py or experiments/evaluate.py that the
other evaluation tests let through). The policy is the oracle behind a patched endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from configs import sft
from rl.agent.oracle import OraclePolicy
from rl.eval import run
from rl.tasks.schema import parse_task
from tests.helpers import failing_session

ROOT = Path(__file__).resolve().parents[2]


def _tasks(n):
  return [parse_task({"id": f"m{i}", "domain": "math", "prompt": f"{i}+1?", "answer": str(i + 1),
                      "oracle": [{"content": f"<answer>{i + 1}</answer>"}]}) for i in range(n)]


class _Oracle(OraclePolicy):
  """The oracle, wrong on m1, and failing as a server that is down on the tasks in `down`."""

  def __init__(self, down=()):
    super().__init__({"m1": [{"content": "<answer>0</answer>"}]})
    self.down = set(down)

  def session(self, task, first, tools, tier, sampling):
    inner = super().session(task, first, tools, tier, sampling)
    if task.id not in self.down:
      return inner
    return failing_session(inner)


def _evaluate(monkeypatch, out, policy, **kw):
  monkeypatch.setattr(run, "make_http_policy", lambda *a, **k: policy)
  config = sft.get_config("tiny")
  config.env.seed = 7
  args = {"tasks": _tasks(3), "tiers": [None, "low"], "samples": 2, "concurrency": 2, **kw}
  return run.run_evaluation(config, out_dir=str(out), endpoint="http://127.0.0.1:9", model="m",
                            progress=False, **args)


def test_run_writes_table_summary_and_run_json(tmp_path, monkeypatch):
  res = _evaluate(monkeypatch, tmp_path, _Oracle())
  sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 7, "max_tokens_per_turn": 48}
  meta = json.loads((tmp_path / "run.json").read_text())
  assert meta.pop("wall_s") >= 0 and meta == {"policy": "openai:http://127.0.0.1:9:m", "tasks": 3,
                                              "tiers": ["off", "low"], "samples": 2, "temperature": 1.0,
                                              "sampling": sampling}
  signature = json.loads((tmp_path / "results.jsonl.signature.json").read_text())
  assert signature["policy"] == "openai:http://127.0.0.1:9:m" and signature["sampling"] == sampling
  assert signature["thinking_budgets"] == {"low": 8, "high": 32, "max": 96}  # the tiny preset's
  assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 12
  # m0 and m2 solved in both samples, m1 in neither: 4 / 6 per tier; pass@2 (1 + 0 + 1) / 3
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary == json.loads(res["json"])
  assert sorted(summary) == ["all/low", "all/off", "math/low", "math/off"]
  for row in summary.values():
    assert (row["n"], row["tasks"], row["success"], row["pass@2"]) == (6, 3, 0.6667, 0.6667)
  table = (tmp_path / "table.md").read_text()
  assert table == res["table"] + "\n" and "| math | off | 6 | 66.7 (30.0–90.3) | 66.7 | 0.667 |" in table
  assert res["not_played"] == {} and res["first_error"] is None
  assert (tmp_path / "success_vs_thinking.png").read_bytes()[:4] == b"\x89PNG"


def test_unplayed_episodes_are_counted_and_the_first_error_named(tmp_path, monkeypatch):
  res = _evaluate(monkeypatch, tmp_path, _Oracle(down={"m2"}), tiers=["high"], samples=1)
  assert res["not_played"] == {"math/high": 1}
  assert res["first_error"] == "ConnectionError: connection refused"
  assert "math/high 1" in (tmp_path / "table.md").read_text()
  # m0 right, m1 wrong; m2 not scored
  row = json.loads(res["json"])["math/high"]
  assert row["n"] == 2 and row["success"] == 0.5


def test_bad_flags_refused_first_and_endpoint_signature_ignores_overrides(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match=r"--samples=0: must be an int >= 1"):
    _evaluate(monkeypatch, tmp_path / "s", _Oracle(), samples=0)
  with pytest.raises(ValueError, match=r"--concurrency=0: must be an int >= 1"):
    _evaluate(monkeypatch, tmp_path / "c", _Oracle(), concurrency=0)
  with pytest.raises(ValueError, match=r"--temperature=inf: must be a finite number >= 0"):
    _evaluate(monkeypatch, tmp_path / "t", _Oracle(), temperature=float("inf"))
  with pytest.raises(ValueError, match=r"--samples=True: must be an int >= 1"):
    _evaluate(monkeypatch, tmp_path / "b", _Oracle(), samples=True)
  with pytest.raises(ValueError, match=r"--temperature=False: must be a finite number >= 0"):
    _evaluate(monkeypatch, tmp_path / "f", _Oracle(), temperature=False)
  assert not any((tmp_path / d).exists() for d in ("s", "c", "t", "b", "f"))
  # NumPy counts and temperatures (e.g. from a sweep's np.arange) run, recorded as plain numbers
  _evaluate(monkeypatch, tmp_path / "n", _Oracle(), samples=np.int64(2), concurrency=np.int32(1),
            temperature=np.float32(0.5))
  meta = json.loads((tmp_path / "n" / "run.json").read_text())
  assert (meta["samples"], meta["temperature"], meta["sampling"]["temperature"]) == (2, 0.5, 0.5)
  # model overrides do not change an endpoint's policy: they are not in its signature
  _evaluate(monkeypatch, tmp_path / "o", _Oracle(), samples=1, model_overrides={"dtype": "float32"})
  signature = json.loads((tmp_path / "o" / "results.jsonl.signature.json").read_text())
  assert sorted(signature) == ["loop", "policy", "sampling", "thinking_budgets"]


def test_generated_tasks_split_level_cap_and_domains():
  tasks = run.generated_tasks(["math", "code"], "train", 9, 2, seed=3)
  assert [t.id for t in tasks] == ["math-train-d4-s3-00000", "math-train-d4-s3-00001",
                                   "code-train-d3-s3-00000", "code-train-d3-s3-00001"]
  assert [t.id for t in run.generated_tasks(["math"], "heldout", 4, 1)] == ["math-heldout-d4-s0-00000"]
  with pytest.raises(ValueError, match=r"--domains: unknown domain 'maths'; domains: math, code"):
    run.generated_tasks(["maths"], "heldout", 0, 1)
  with pytest.raises(ValueError, match=r"--domains: 'math' is given twice"):
    run.generated_tasks(["math", "code", "math"], "heldout", 0, 1)


# The CLI's own checks, each run in-process by one driver (absl flags are globals, kept out of
# pytest's process) with run_evaluation replaced by a recorder.
_DRIVER = """
import json, sys
from absl import flags
from experiments import evaluate as cli
seen = []
def fake(config, **kw):
  seen.append(kw)
  return {"table": "T", "results": "R", "plot": "P", "json": "{}", "first_error": "EndpointError: down",
          "not_played": {"math/high": 2, "code/high": 1} if kw["endpoint"] == "http://down" else {}}
cli.run_evaluation = fake
for name, args in json.loads(sys.argv[1]).items():
  seen.clear()
  try:
    cli.main(flags.FLAGS(["evaluate", "--config=configs/sft.py:tiny", *args]))
    kw = seen[0]
    print(name, "|", json.dumps({"ids": [t.id for t in kw["tasks"]], "tiers": kw["tiers"],
          "samples": kw["samples"], "temperature": kw["temperature"], "concurrency": kw["concurrency"],
          "endpoint": kw["endpoint"]}))
  except BaseException as e:
    print(name, "|", type(e).__name__, e)
  flags.FLAGS.unparse_flags()
"""


def test_cli_picks_tasks_and_refuses_bad_flags(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  out = f"--out={tmp_path / 'o'}"
  cases = {
    "none": [out],
    "two": [out, "--endpoint=http://a", "--random_init"],
    "empty": [out, "--random_init", f"--tasks={empty}"],
    "gen": [out, "--endpoint=http://a", "--domains=math,code", "--split=train", "--difficulty=9", "--n=2",
            "--tiers=low,off", "--samples=3", "--temperature=0.5", "--concurrency=3"],
    "down": [out, "--endpoint=http://down", "--domains=math", "--n=1"],
  }
  res = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  said = dict(line.split(" | ", 1) for line in res.stdout.splitlines() if " | " in line)
  one = "UsageError give exactly one of --checkpoint, --endpoint or --random_init"
  assert said["none"] == said["two"] == one
  assert said["empty"] == f"UsageError --tasks={empty}: the file holds no tasks (one JSON task per line)."
  assert json.loads(said["gen"]) == {
    "ids": ["math-train-d4-s0-00000", "math-train-d4-s0-00001", "code-train-d3-s0-00000",
            "code-train-d3-s0-00001"],
    "tiers": ["low", None], "samples": 3, "temperature": 0.5, "concurrency": 3, "endpoint": "http://a"}
  assert said["down"].startswith("SystemExit 3 episodes were not played (the policy failed; the first: "
                                 "EndpointError: down)")
