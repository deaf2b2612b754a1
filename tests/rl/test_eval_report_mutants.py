"""Evaluation report rows, table, plot and JSON line, and the pairing of two runs, against references
written out here (each test kills a mutant of rl/eval/report.py or rl/eval/compare.py that the other
evaluation tests let through)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.axes
import pytest

from rl.eval import compare, report

ROOT = Path(__file__).resolve().parents[2]


def _rec(task_id, success, *, thinking=0.0, tool_errors=0.0, domain="math", tier="low"):
  return {"domain": domain, "tier": tier, "task_id": task_id, "success": success, "reward": float(success),
          "thinking_tokens": thinking, "turns": 1.0, "tool_errors": tool_errors, "wall_s": 1.0,
          "end": "answer"}


def test_means_per_episode_over_every_record():
  recs = [_rec("t0", True, thinking=10.0, tool_errors=3.0), _rec("t1", False, thinking=20.0, tool_errors=0.0),
          _rec("t2", False, thinking=60.0, tool_errors=1.0)]
  row = report.aggregate(recs)[0]
  assert (row["domain"], row["tier"], row["n"]) == ("math", "low", 3)
  assert row["thinking_tokens"] == pytest.approx(30.0) and row["tool_errors"] == pytest.approx(4 / 3)


def test_summary_json_line_exactly():
  recs = [_rec("t0", True), _rec("t1", False), _rec("t2", False),
          _rec("c0", True, domain="code", tier="high")]
  line = report.summary_json(report.aggregate(recs))
  # one sample per task: no pass@k; success 1/3 to 4 places; Wilson(1, 3) = 0.0615..0.7923,
  # Wilson(1, 1) = 0.2065..1; keys sorted
  common = ('"grader_failed": 0, "latency_p50": 1.0, "latency_p95": 1.0, "malformed_calls": 0.0')
  assert line == (
    '{"all/high": {"ci_high": 1.0, "ci_low": 0.2065, ' + common + ', "n": 1, "reward": 1.0, "success": 1.0, '
    '"tasks": 1, "thinking_tokens": 0.0, "tool_errors": 0.0, "turns": 1.0}, '
    '"all/low": {"ci_high": 0.7923, "ci_low": 0.0615, ' + common + ', "n": 3, "reward": 0.3333, '
    '"success": 0.3333, "tasks": 3, "thinking_tokens": 0.0, "tool_errors": 0.0, "turns": 1.0}, '
    '"code/high": {"ci_high": 1.0, "ci_low": 0.2065, ' + common + ', "n": 1, "reward": 1.0, "success": 1.0, '
    '"tasks": 1, "thinking_tokens": 0.0, "tool_errors": 0.0, "turns": 1.0}, '
    '"math/low": {"ci_high": 0.7923, "ci_low": 0.0615, ' + common + ', "n": 3, "reward": 0.3333, '
    '"success": 0.3333, "tasks": 3, "thinking_tokens": 0.0, "tool_errors": 0.0, "turns": 1.0}}')


def test_a_row_without_pass_at_k_keeps_its_columns():
  # math: two samples per task (pass@2); code: one (no pass@k): its cell is a dash, not dropped
  recs = [_rec("t0", True), _rec("t0", False), _rec("c0", True, domain="code")]
  lines = report.markdown(report.aggregate(recs)).splitlines()
  assert lines[0].startswith("| domain | tier | n | success % (95% CI) | pass@2 | reward |")
  assert lines[2] == ("| code | low | 1 | 100.0 (20.7–100.0) | – | 1.000 | 0.0 | 1.00 | 0.00 | 0.00 "
                      "| 1.000 | 1.000 |")
  assert lines[3].startswith("| math | low | 2 | 50.0 (9.5–90.5) | 100.0 | 0.500 |")
  assert all(line.count("|") == 13 for line in lines)


def test_plot_draws_one_line_per_domain_through_its_tiers(tmp_path, monkeypatch):
  drawn = []
  real = matplotlib.axes.Axes.errorbar

  def errorbar(self, xs, ys, *a, label=None, **kw):
    drawn.append((label, list(xs), list(ys)))
    return real(self, xs, ys, *a, label=label, **kw)

  monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", errorbar)
  recs = [_rec("t0", True, thinking=40.0, tier="high"), _rec("t0", False, thinking=5.0, tier="low"),
          _rec("t0", False, thinking=0.0, tier="off"), _rec("c0", True, thinking=7.0, domain="code")]
  report.plot(report.aggregate(recs), str(tmp_path / "p.png"))
  # no 'all' line; each domain's points in tier order off, low, high
  assert drawn == [("code", [7.0], [100.0]), ("math", [0.0, 5.0, 40.0], [0.0, 0.0, 100.0])]


def _run(tmp_path, name, records, sampling=None):
  d = tmp_path / name
  d.mkdir()
  (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (d / "run.json").write_text(json.dumps({"sampling": sampling or {"temperature": 0.0, "seed": 0}}))
  return d


def _key(task, tier, success, domain="math"):
  return {"key": f"{task}|{tier}|0", "domain": domain, "tier": tier, "success": success}


def test_compare_rows_in_tier_order_and_run_json_sampling_first(tmp_path):
  tiers = ("max", "off", "high", "low")
  b = _run(tmp_path, "b", [_key("t0", t, False) for t in tiers])
  a = _run(tmp_path, "a", [_key("t0", t, t in ("off", "max")) for t in tiers])
  # the signature written at the start of a later, interrupted resume does not outrank run.json
  (a / "results.jsonl.signature.json").write_text(json.dumps({"sampling": {"temperature": 1.0, "seed": 0}}))
  rows, counts = compare.compare_dirs(b, a)
  assert [(r["domain"], r["tier"], r["up"]) for r in rows] == [
    ("math", "off", 1), ("math", "low", 0), ("math", "high", 0), ("math", "max", 1),
    ("all", "off", 1), ("all", "low", 0), ("all", "high", 0), ("all", "max", 1)]
  assert counts == {"only_before": 0, "only_after": 0, "unplayed_before": 0, "unplayed_after": 0}


def test_compare_refuses_records_that_are_not_episodes(tmp_path):
  b = _run(tmp_path, "b", [_key("t0", "low", True)])
  for name, line in (("list", "[1, 2]"), ("number", "5"), ("text", '"t0|low|0"')):
    d = tmp_path / name
    d.mkdir()
    (d / "results.jsonl").write_text(json.dumps(_key("t0", "low", True)) + "\n" + line + "\n")
    with pytest.raises(compare.CompareError, match=r"results.jsonl:2: not an evaluation record"):
      compare.compare_dirs(b, d)
  # one key in another tier in each run: not the same task list
  moved = dict(_key("t0", "low", True), tier="high")
  with pytest.raises(compare.CompareError, match=r"'t0\|low\|0' is math/low in one run and math/high"):
    compare.compare({"t0|low|0": _key("t0", "low", True)}, {"t0|low|0": moved})


# experiments.compare_evals run in-process by one driver (absl flags are globals, kept out of pytest's
# process); each case prints what it printed, or the exception that ended it.
_DRIVER = """
import contextlib, io, json, sys
from absl import flags
from experiments import compare_evals as cli
for name, args in json.loads(sys.argv[1]).items():
  out = io.StringIO()
  try:
    with contextlib.redirect_stdout(out):
      cli.main(flags.FLAGS(["compare_evals", *args]))
    print(name, "|", json.dumps(out.getvalue().splitlines()[-2:]))
  except BaseException as e:
    print(name, "|", type(e).__name__, e)
  flags.FLAGS.unparse_flags()
"""


def test_compare_cli_refuses_other_sampling_and_names_unplayed(tmp_path):
  """t1 is unplayed in --before (end 'error') and scored in --after: it is in both files, so it is
  counted once, as not played in --before, and not also as 'only in --after' (which was false: the
  same episode counted twice, and a 'not compared' line claiming the runs' task lists differ)."""
  b = _run(tmp_path, "b", [_key("t0", "low", False), dict(_key("t1", "low", False), end="error")])
  a = _run(tmp_path, "a", [_key("t0", "low", True), _key("t1", "low", True)])
  hot = _run(tmp_path, "hot", [_key("t0", "low", True)], sampling={"temperature": 1.0, "seed": 0})
  cases = {"played": [f"--before={b}", f"--after={a}"], "hot": [f"--before={b}", f"--after={hot}"],
           "allowed": [f"--before={b}", f"--after={hot}", "--allow_different_sampling"]}
  res = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  said = dict(line.split(" | ", 1) for line in res.stdout.splitlines() if " | " in line)
  unplayed, last = json.loads(said["played"])
  assert unplayed == ("not played (policy errors, not scored; rerun that evaluation's command to replay "
                      "them): 1 in --before, 0 in --after")
  counts = {k: v for k, v in json.loads(last).items() if k != "rows"}
  assert counts == {"only_before": 0, "only_after": 0, "unplayed_before": 1, "unplayed_after": 0}
  assert said["hot"].startswith("UsageError the runs sampled differently (temperature: 0.0 vs 1.0)")
  assert json.loads(json.loads(said["allowed"])[-1])["rows"][0]["up"] == 1
