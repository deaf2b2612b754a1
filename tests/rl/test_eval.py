"""The evaluation harness: statistics against closed forms, resume, report."""

from __future__ import annotations

import json
import math
from itertools import combinations

import pytest

from rl.agent.executor import ThreadExecutor
from rl.agent.oracle import OraclePolicy
from rl.eval import harness, report, stats
from rl.tasks.schema import parse_task
from tests.helpers import failing_session


@pytest.mark.parametrize("k, n", [(0, 10), (3, 10), (10, 10), (1, 1), (57, 200)])
def test_wilson_matches_closed_form(k, n):
  lo, hi = stats.wilson(k, n)
  z, p = stats.Z95, k / n
  # the interval's ends are the roots of (p - x)^2 = z^2 x (1 - x) / n
  for x in (lo, hi):
    if 0 < x < 1:
      assert (p - x) ** 2 == pytest.approx(z * z * x * (1 - x) / n, rel=1e-9, abs=1e-12)
  assert 0 <= lo <= p <= hi <= 1


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (7, 3, 2), (4, 4, 4), (10, 1, 10)])
def test_pass_at_k_is_the_subset_average(n, c, k):
  outcomes = [True] * c + [False] * (n - c)
  subsets = list(combinations(range(n), k))
  exact = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
  assert stats.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_percentile():
  assert stats.percentile([3, 1, 2], 50) == 2
  assert stats.percentile([0, 10], 95) == pytest.approx(9.5)
  assert math.isnan(stats.percentile([], 50))


def _tasks(n):
  out = []
  for i in range(n):
    oracle = [{"thinking": f"{i}+1", "content": f"<answer>{i + 1}</answer>"}]
    out.append(
      parse_task(
        {"id": f"m{i}", "domain": "math", "prompt": f"{i}+1?", "answer": str(i + 1), "oracle": oracle}
      )
    )
  return out


def test_evaluate_resumes_and_reports(tmp_path):
  tasks = _tasks(6)
  wrong = {"m0": [{"content": "<answer>7</answer>"}], "m3": [{"content": "no idea"}]}
  results = tmp_path / "res.jsonl"
  executor = ThreadExecutor(workers=2)
  first = harness.evaluate(
    tasks[:4], OraclePolicy(wrong), executor, tiers=[None, "low"], samples=2, results=results, progress=False
  )
  assert len(first) == 16 and len(results.read_text().splitlines()) == 16
  with open(results, "a") as f:
    f.write('{"key": "torn')  # a crash mid-line
  records = harness.evaluate(
    tasks, OraclePolicy(wrong), executor, tiers=[None, "low"], samples=2, results=results, progress=False
  )
  assert len(records) == 24
  assert sum(1 for line in results.read_text().splitlines() if line.startswith('{"key": "m')) == 24
  assert {r["key"] for r in records} == {
    harness.job_key(t.id, tier, s) for t in tasks for tier in (None, "low") for s in range(2)
  }
  rows = {(r["domain"], r["tier"]): r for r in report.aggregate(records)}
  math_low = rows[("math", "low")]
  assert math_low["n"] == 12 and math_low["success"] == pytest.approx(4 / 6)
  assert math_low["pass@2"] == pytest.approx(4 / 6)
  assert (math_low["ci_low"], math_low["ci_high"]) == pytest.approx(stats.wilson(8, 12))
  assert rows[("all", "off")]["n"] == 12
  table = report.markdown(report.aggregate(records))
  assert "| math | low | 12 | 66.7 (" in table and "pass@2" in table
  png = tmp_path / "plot.png"
  report.plot(report.aggregate(records), str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  last = json.loads(report.summary_json(report.aggregate(records)))
  assert last["math/low"]["n"] == 12 and last["math/low"]["grader_failed"] == 0
  assert "Grading failed" not in table
  # Episodes the grader could not score (rl.agent.loop scores them 0) are counted and named
  # under the table: the success column undercounts them.
  for r in records[:3]:
    r["grade"] = {"error": "grading failed: OSError: boom", "grader_failed": True}
  rows = report.aggregate(records)
  failed = {(r["domain"], r["tier"]): r["grader_failed"] for r in rows}
  assert sum(v for (d, _), v in failed.items() if d == "math") == 3
  assert failed[("all", "off")] + failed[("all", "low")] == 3
  assert "**Grading failed** (scored 0" in report.markdown(rows)
  executor.shutdown()


class _Down(OraclePolicy):
  """The oracle, except that sessions of the tasks in `down` fail as a server that is down."""

  def __init__(self, down):
    super().__init__()
    self.down = down

  def session(self, task, first, tools, tier, sampling):
    inner = super().session(task, first, tools, tier, sampling)
    if task.id not in self.down:
      return inner
    return failing_session(inner)


def test_unplayed_episodes_are_replayed_on_resume_and_not_scored(tmp_path):
  """An episode the policy failed to play (a server down) was scored as a failure and, being in
  results.jsonl, never played again: a resume kept the outage as the model's 0%."""
  tasks = _tasks(4)
  results = tmp_path / "res.jsonl"
  executor = ThreadExecutor(workers=2)
  first = harness.evaluate(tasks, _Down({"m1", "m2"}), executor, tiers=["low"], results=results,
                           progress=False)
  assert sorted(r["task_id"] for r in first if r["end"] == "error") == ["m1", "m2"]
  rows = {(r["domain"], r["tier"]): r for r in report.aggregate(first)}
  assert rows[("math", "low")]["n"] == 2 and rows[("math", "low")]["success"] == 1.0
  assert report.unplayed(first) == {"math/low": 2}
  table = report.markdown(report.aggregate(first), report.unplayed(first))
  assert "**Not played** (the policy failed" in table and "math/low 2" in table
  again = harness.evaluate(tasks, _Down(set()), executor, tiers=["low"], results=results, progress=False)
  assert len(again) == 4 and all(r["success"] for r in again) and report.unplayed(again) == {}
  assert len(results.read_text().splitlines()) == 6  # the two replays appended; the latest counts
  executor.shutdown()


def test_parse_tiers():
  assert harness.parse_tiers("low, max,off") == ["low", "max", None]
  with pytest.raises(ValueError, match="unknown tier 'medium'"):
    harness.parse_tiers("medium")


def test_resume_refuses_results_played_with_other_settings(tmp_path):
  tasks = _tasks(3)
  results = tmp_path / "res.jsonl"
  executor = ThreadExecutor(workers=2)
  signed = {"policy": "checkpoint:/ck", "sampling": {"max_tokens_per_turn": 0, "temperature": 0.0}}
  run = lambda sig: harness.evaluate(tasks, OraclePolicy(), executor, tiers=["low"], results=results,  # noqa: E731
                                     progress=False, signature=sig)
  assert len(run(signed)) == 3
  assert json.loads(harness.signature_path(results).read_text()) == signed
  assert len(run(dict(signed))) == 3  # the same settings resume (nothing left to play)
  other = {"policy": "checkpoint:/ck", "sampling": {"max_tokens_per_turn": 256, "temperature": 0.0}}
  with pytest.raises(ValueError, match=r"res.jsonl holds episodes played with other settings \(sampling: "
                     r"\{'max_tokens_per_turn': 0, 'temperature': 0.0\} there, \{'max_tokens_per_turn': 256"):
    run(other)
  lines = results.read_text()
  assert len(lines.splitlines()) == 3 and json.loads(harness.signature_path(results).read_text()) == signed
  # A results file from before signatures were kept resumes as it is, then is signed.
  harness.signature_path(results).unlink()
  assert len(run(other)) == 3 and json.loads(harness.signature_path(results).read_text()) == other
  # A fresh file is signed by whatever run starts it.
  fresh = tmp_path / "fresh.jsonl"
  harness.evaluate(tasks[:1], OraclePolicy(), executor, tiers=["low"], results=fresh, progress=False,
                   signature=other)
  assert json.loads(harness.signature_path(fresh).read_text()) == other
  executor.shutdown()


def test_resume_refuses_a_task_changed_under_the_same_id(tmp_path):
  """Before, a regenerated task file with another answer for m1 kept m1's old (now wrong) grade."""
  tasks = _tasks(3)
  results = tmp_path / "res.jsonl"
  executor = ThreadExecutor(workers=2)
  first = harness.evaluate(tasks, OraclePolicy(), executor, tiers=["low"], results=results, progress=False)
  assert all(r["success"] for r in first) and all(r["task_hash"] == harness.task_hash(tasks[int(r["key"][1])])
                                                  for r in first)
  again = _tasks(3)  # the same content: resumes with nothing to play
  assert len(harness.evaluate(again, OraclePolicy(), executor, tiers=["low"], results=results,
                              progress=False)) == 3
  changed = tasks[:1] + [tasks[1].with_(fields=dict(tasks[1].fields, answer="99"))] + tasks[2:]
  with pytest.raises(ValueError, match="task 'm1' has changed since its episode was recorded"):
    harness.evaluate(changed, OraclePolicy(), executor, tiers=["low"], results=results, progress=False)
  with_meta = [t.with_(meta={"note": "meta decides nothing"}) for t in tasks]
  assert len(harness.evaluate(with_meta, OraclePolicy(), executor, tiers=["low"], results=results,
                              progress=False)) == 3
  executor.shutdown()


def test_evaluate_cli_refuses_bad_sampling_and_exits_nonzero_on_unplayed(tmp_path):
  """--temperature=-1 was refused per request, and every episode scored 0 in a finished report;
  an evaluation against a server that is down reported 0% and exited 0."""
  import subprocess
  import sys
  from pathlib import Path

  from configs import sft
  from rl.eval.run import run_evaluation
  with pytest.raises(ValueError, match=r"--temperature=-1.0: must be a finite number >= 0"):
    run_evaluation(sft.get_config("tiny"), tasks=_tasks(1), out_dir=str(tmp_path / "t"), tiers=[None],
                   samples=1, concurrency=1, temperature=-1.0)
  assert not (tmp_path / "t").exists()
  root = Path(__file__).resolve().parents[2]
  down = subprocess.run([sys.executable, "-m", "experiments.evaluate", "--endpoint=http://127.0.0.1:9",
                         "--config=configs/sft.py:tiny", "--domains=math", "--n=2", "--tiers=off",
                         f"--out={tmp_path / 'down'}"], cwd=root, capture_output=True, text=True, timeout=300)
  assert down.returncode == 1, down.stderr[-2000:]
  assert "2 episodes were not played" in down.stderr and "Run the same command again" in down.stderr
  assert "**Not played**" in down.stdout
