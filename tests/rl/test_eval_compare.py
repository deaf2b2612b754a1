"""Paired comparison of two evaluation runs (rl/eval/compare.py, experiments/compare_evals.py)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl.eval.compare import CompareError, compare, compare_dirs, mcnemar_p, paired_row

ROOT = Path(__file__).resolve().parents[2]
BEFORE = [1, 1, 0, 0, 0, 1, 0, 0, 1, 0]
AFTER = [1, 0, 1, 1, 0, 1, 1, 0, 1, 0]


def _write_run(d: Path, successes, domain="math", tier="high", temperature=0.0, start=0):
  d.mkdir(parents=True)
  with (d / "results.jsonl").open("w") as f:
    for i, s in enumerate(successes, start):
      key = f"{domain}-heldout-{i:05d}|{tier}|0"
      f.write(json.dumps({"key": key, "task_id": key.split("|")[0], "domain": domain, "tier": tier,
                          "success": bool(s), "reward": float(s)}) + "\n")
  (d / "run.json").write_text(json.dumps({"sampling": {"temperature": temperature, "top_p": 1.0, "top_k": 0,
                                                       "seed": 0, "max_tokens_per_turn": 256}}))
  return d


def test_paired_statistics_match_the_per_task_differences():
  pairs = list(zip(map(bool, BEFORE), map(bool, AFTER), strict=True))
  row = paired_row(pairs)
  d = np.array(AFTER, float) - np.array(BEFORE, float)
  assert row["n"] == 10 and row["up"] == 3 and row["down"] == 1
  assert row["diff"] == pytest.approx(d.mean())
  # the SE of a mean of per-task differences (population variance, as n pairs are the population)
  assert row["se_paired"] == pytest.approx(np.sqrt(d.var() / len(d)))
  assert row["z_paired"] == pytest.approx(d.mean() / np.sqrt(d.var() / len(d)))
  assert row["se_unpaired"] == pytest.approx(np.sqrt(0.4 * 0.6 / 10 + 0.6 * 0.4 / 10))
  assert row["p_mcnemar"] == pytest.approx(10 / 16)  # 2 * P(X <= 1), X ~ Binomial(4, 1/2)


def test_mcnemar_exact_values():
  assert mcnemar_p(0, 0) == 1.0
  assert mcnemar_p(0, 6) == pytest.approx(2 / 64)
  assert mcnemar_p(6, 15) == pytest.approx(2 * sum(math.comb(21, i) for i in range(7)) / 2**21)
  assert mcnemar_p(5, 5) == 1.0


def test_compare_dirs_groups_by_domain_and_tier(tmp_path):
  b = _write_run(tmp_path / "b", BEFORE)
  a = _write_run(tmp_path / "a", AFTER + [1])  # one extra episode, not compared
  rows, unmatched = compare_dirs(b, a)
  assert [(r["domain"], r["tier"]) for r in rows] == [("math", "high"), ("all", "high")]
  assert rows[0]["n"] == 10 and rows[0]["up"] == 3
  assert unmatched == {"only_before": 0, "only_after": 1, "unplayed_before": 0, "unplayed_after": 0}


def test_bad_inputs_are_named(tmp_path):
  b = _write_run(tmp_path / "b", BEFORE)
  with pytest.raises(CompareError, match="share no episode keys"):
    compare_dirs(b, _write_run(tmp_path / "other", AFTER, start=100))
  with pytest.raises(CompareError, match="temperature"):
    compare_dirs(b, _write_run(tmp_path / "hot", AFTER, temperature=1.0))
  rows, _ = compare_dirs(b, tmp_path / "hot", allow_different_sampling=True)
  assert rows[0]["n"] == 10
  with pytest.raises(CompareError, match="no results.jsonl"):
    compare_dirs(b, tmp_path / "missing")
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "results.jsonl").write_text('{"key": 1}\n')
  with pytest.raises(CompareError, match="results.jsonl:1"):
    compare_dirs(b, tmp_path / "bad")
  (tmp_path / "hot" / "run.json").write_text("{")
  with pytest.raises(CompareError, match="run.json: not JSON"):
    compare_dirs(b, tmp_path / "hot")
  before = {"k|high|0": {"domain": "math", "tier": "high", "success": True}}
  with pytest.raises(CompareError, match="not the same task list"):
    compare(before, {"k|high|0": {"domain": "web", "tier": "high", "success": True}})


def test_cli_prints_a_table_and_json(tmp_path):
  b = _write_run(tmp_path / "b", BEFORE)
  a = _write_run(tmp_path / "a", AFTER)
  out = subprocess.run([sys.executable, "-m", "experiments.compare_evals", f"--before={b}", f"--after={a}"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip().splitlines()
  assert out[0].startswith("| domain | tier | n |")
  assert "| math | high | 10 | 40.0 | 60.0 | +20.0 | 3 / 1 |" in out[2]
  assert json.loads(out[-1])["rows"][0]["up"] == 3


def test_interrupted_runs_compare_by_their_signature_and_torn_lines(tmp_path):
  b = _write_run(tmp_path / "b", BEFORE)
  a = _write_run(tmp_path / "a", AFTER)
  sampling = json.loads((a / "run.json").read_text())["sampling"]
  (a / "run.json").unlink()  # interrupted: only the signature the harness wrote at the start
  (a / "results.jsonl.signature.json").write_text(json.dumps({"policy": "x", "sampling": sampling}))
  with (a / "results.jsonl").open("a") as f:
    f.write('{"key": "math-heldout-00099|hi')  # a crash mid-line: the harness skips it, and so does compare
  rows, _ = compare_dirs(b, a)
  assert rows[0]["n"] == 10
  (a / "results.jsonl.signature.json").write_text(json.dumps({"sampling": dict(sampling, temperature=1.0)}))
  with pytest.raises(CompareError, match="temperature: 0.0 vs 1.0"):
    compare_dirs(b, a)
  (a / "results.jsonl.signature.json").write_text("{")
  with pytest.raises(CompareError, match="signature.json: not JSON"):
    compare_dirs(b, a)
  (a / "results.jsonl.signature.json").unlink()
  with pytest.raises(CompareError, match="the after run records no sampling settings"):
    compare_dirs(b, a)
  assert compare_dirs(b, a, allow_different_sampling=True)[0][0]["n"] == 10
  # A resume ends a torn line and appends after it, so a torn line may sit mid-file; the harness
  # skips it wherever it is, and so does compare (it refused such a resumed run).
  lines = (a / "results.jsonl").read_text().splitlines()
  torn = '{"key": "math-heldout-00003|hi'
  (a / "results.jsonl").write_text("\n".join(lines[:3] + [torn] + lines[3:]) + "\n")
  assert compare_dirs(b, a, allow_different_sampling=True)[0][0]["n"] == 10


def test_unplayed_episodes_are_not_scores(tmp_path):
  """An episode the policy failed to play (end 'error': a server down) is left out and counted, and
  a later record of its key (the resume's replay) counts instead."""
  b = _write_run(tmp_path / "b", BEFORE)
  a = _write_run(tmp_path / "a", AFTER)
  lines = (a / "results.jsonl").read_text().splitlines()
  errored = [json.dumps({**json.loads(x), "success": False, "end": "error"}) for x in lines[:4]]
  (a / "results.jsonl").write_text("\n".join(errored + lines[4:]) + "\n")
  rows, counts = compare_dirs(b, a)
  assert rows[0]["n"] == 6 and counts["unplayed_after"] == 4 and counts["unplayed_before"] == 0
  with (a / "results.jsonl").open("a") as f:  # the resume replays them
    f.write("\n".join(lines[:4]) + "\n")
  rows, counts = compare_dirs(b, a)
  assert rows[0]["n"] == 10 and rows[0]["up"] == 3 and counts["unplayed_after"] == 0


def test_zero_paired_se_has_no_z(tmp_path):
  """Every pair moving the same way has no discordant variance: z was +inf (and 'Infinity' in the
  JSON line, which strict parsers refuse); now it is null / '–' beside McNemar's exact p."""
  row = paired_row([(False, True)] * 3)
  assert row["se_paired"] == 0 and row["z_paired"] is None and row["p_mcnemar"] == pytest.approx(0.25)
  assert paired_row([(True, True)] * 3)["z_paired"] is None
  b = _write_run(tmp_path / "b", [0, 0, 0])
  a = _write_run(tmp_path / "a", [1, 1, 1])
  out = subprocess.run([sys.executable, "-m", "experiments.compare_evals", f"--before={b}", f"--after={a}"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip().splitlines()
  assert "| +100.0 | 3 / 0 | 0.00 | – | 0.25 |" in out[2]
  assert json.loads(out[-1], parse_constant=lambda c: pytest.fail(c))["rows"][0]["z_paired"] is None
  stray = subprocess.run([sys.executable, "-m", "experiments.compare_evals", f"--before={b}", f"--after={a}",
                          "--allow_different_sampling", "false"], cwd=ROOT, capture_output=True, text=True)
  assert stray.returncode and "unexpected arguments ['false']" in stray.stderr


def _write_records(d: Path, records, sampling=None):
  d.mkdir(parents=True)
  (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (d / "run.json").write_text(json.dumps({"sampling": sampling or {"temperature": 0.0, "seed": 0}}))
  return d


def _rec(task, success, **kw):
  return {"key": f"{task}|high|0", "domain": "math", "tier": "high", "success": success, **kw}


def test_success_that_is_not_a_json_bool_is_refused_with_its_line(tmp_path):
  """"success": "false" was scored by truthiness (a success); 1 and null were scored too. A record's
  success must be a JSON bool, else the line is named, as for a missing field."""
  b = _write_records(tmp_path / "b", [_rec("t0", True), _rec("t1", False)])
  for i, bad in enumerate(("false", "true", 0, 1, None, [])):
    a = _write_records(tmp_path / f"a{i}", [_rec("t0", True), _rec("t1", bad)])
    with pytest.raises(CompareError, match=rf"a{i}/results.jsonl:2: not an evaluation record: 'success' is "
                                           rf"{re.escape(repr(bad))} \(\w+\), not a JSON bool"):
      compare_dirs(b, a, allow_different_sampling=True)
  # an unplayed record's success is checked too (it may be the latest record of its key)
  a = _write_records(tmp_path / "err", [_rec("t0", True), _rec("t1", "false", end="error")])
  with pytest.raises(CompareError, match=r"err/results.jsonl:2: .*'success' is 'false'"):
    compare_dirs(b, a)
  rows, _ = compare_dirs(b, _write_records(tmp_path / "ok", [_rec("t0", False), _rec("t1", False)]))
  assert (rows[0]["before"], rows[0]["after"], rows[0]["down"]) == (0.5, 0.0, 1)


def test_malformed_key_fields_and_sampling_are_named(tmp_path):
  """A list-valued key (TypeError: unhashable), a list domain or tier, and a run.json 'sampling' that is
  not an object (AttributeError: .get) were tracebacks; each is a CompareError naming file and field."""
  b = _write_records(tmp_path / "b", [_rec("t0", True), _rec("t1", False)])
  for i, (field, bad) in enumerate((("key", ["x"]), ("key", 3), ("domain", ["math"]), ("tier", None))):
    a = _write_records(tmp_path / f"a{i}", [_rec("t0", True), dict(_rec("t1", True), **{field: bad})])
    with pytest.raises(CompareError, match=rf"a{i}/results.jsonl:2: not an evaluation record: '{field}' is "
                                           rf"{re.escape(repr(bad))}"):
      compare_dirs(b, a)
  a = _write_records(tmp_path / "greedy", [_rec("t0", True)], sampling="greedy")
  for allow in (False, True):
    with pytest.raises(CompareError, match=r"greedy/run.json: field 'sampling' is 'greedy', not an object"):
      compare_dirs(b, a, allow_different_sampling=allow)
  # an interrupted run's signature is read the same way, and named when it is the source
  (a / "run.json").unlink()
  (a / "results.jsonl.signature.json").write_text(json.dumps({"sampling": [0.0]}))
  with pytest.raises(CompareError, match=r"signature.json: field 'sampling' is \[0.0\]"):
    compare_dirs(b, a)
  for name, text in (("results.jsonl.signature.json", '["sampling"]'), ("run.json", '"x"')):
    (a / name).write_text(text)
    with pytest.raises(CompareError, match=rf"{re.escape(name)}: not a JSON object"):
      compare_dirs(b, a)


def test_an_episode_unplayed_in_one_run_is_not_only_in_the_other(tmp_path):
  """t1 unplayed in one run and scored in the other is in both files: counted once, as unplayed in the
  run that failed to play it, never also as 'only in' the other. t2, in one file only, still is."""
  b = _write_records(tmp_path / "b", [_rec("t0", True), _rec("t1", True, end="error"), _rec("t2", False)])
  a = _write_records(tmp_path / "a", [_rec("t0", False), _rec("t1", False)])
  rows, counts = compare_dirs(b, a)
  assert rows[0]["n"] == 1 and rows[0]["down"] == 1
  assert counts == {"only_before": 1, "only_after": 0, "unplayed_before": 1, "unplayed_after": 0}
  rows, counts = compare_dirs(a, b)
  assert counts == {"only_before": 0, "only_after": 1, "unplayed_before": 0, "unplayed_after": 1}
  # unplayed in both: counted in each run's unplayed, in neither "only in"
  c = _write_records(tmp_path / "c", [_rec("t0", True), _rec("t1", False, end="error")])
  counts = compare_dirs(b, c)[1]
  assert counts == {"only_before": 1, "only_after": 0, "unplayed_before": 1, "unplayed_after": 1}
