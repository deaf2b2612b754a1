"""Evaluation statistics and harness behaviour against references written out here (each test kills
a mutant of rl/eval that tests/rl/test_eval.py and test_eval_compare.py let through).

Wilson intervals: Newcombe (1998), "Two-sided confidence intervals for the single proportion",
Table I, method 3 (score, no continuity correction), to 4 places; the full-precision values agree
with scipy.stats.binomtest(k, n).proportion_ci(method="wilson"). McNemar: the exact binomial tail
from math.comb. pass@k: 1 - C(n - c, k) / C(n, k).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rl.agent.executor import ThreadExecutor
from rl.agent.oracle import OraclePolicy
from rl.agent.policy import Sampling
from rl.eval import compare, harness, report, stats
from rl.tasks.schema import parse_task

ROOT = Path(__file__).resolve().parents[2]

# (k, n) -> (low, high): Newcombe 1998 (0.2553-0.3662, 0.0624-0.1605, 0-0.1611, 0.0061-0.1718),
# at full precision as scipy prints them
WILSON_95 = {
  (81, 263): (0.2552885198782742, 0.36620957698280004),
  (15, 148): (0.06238639953073629, 0.16048724172330803),
  (0, 20): (0.0, 0.16112515805281935),
  (1, 29): (0.006113214292762667, 0.17175521879320282),
  (3, 10): (0.10779126740630102, 0.6032218525388546),
  (2, 9): (0.06322510711784673, 0.5474110308930111),
}


@pytest.mark.parametrize("k, n", sorted(WILSON_95))
def test_wilson_matches_published_values(k, n):
  lo, hi = stats.wilson(k, n)
  assert (lo, hi) == pytest.approx(WILSON_95[(k, n)], rel=1e-9, abs=1e-15)


def test_wilson_constant_ends_and_empty_sample():
  assert stats.Z95 == pytest.approx(1.959963984540054, rel=1e-15)  # the 0.975 normal quantile
  assert stats.wilson(0, 0) == (0.0, 1.0)
  assert stats.wilson(0, 20)[0] == 0.0 and stats.wilson(20, 20)[1] == 1.0
  assert stats.wilson(20, 20)[0] == pytest.approx(1 - 0.16112515805281935, rel=1e-9)


def test_pass_at_k_refuses_impossible_counts():
  for n, c, k in ((5, 2, 0), (5, 6, 1), (5, -1, 1), (3, 1, 4)):
    with pytest.raises(ValueError, match="pass_at_k needs 0 <= c <= n and 1 <= k <= n"):
      stats.pass_at_k(n, c, k)


def _rec(task_id, success, reward, wall, *, domain="math", tier="low", end="answer"):
  return {"domain": domain, "tier": tier, "task_id": task_id, "success": success, "reward": reward,
          "thinking_tokens": 13.0, "turns": 2.0, "tool_errors": 0.0, "wall_s": wall, "end": end}


def _records():
  # math/low: t0 four samples (one pass), t1 two (none), t2 three (one): pass@2 over the least
  # samples per task (2), each from its own n
  outcomes = [("t0", 1, 0.5, 0.7), ("t0", 0, 0.25, 2.9), ("t0", 0, 0.0, 1.3), ("t0", 0, 0.0, 5.1),
              ("t1", 0, 0.75, 0.4), ("t1", 0, 0.0, 3.3),
              ("t2", 1, 1.0, 2.2), ("t2", 0, 0.0, 9.6), ("t2", 0, 0.5, 1.8)]
  recs = [_rec(t, bool(s), r, w) for t, s, r, w in outcomes]
  recs.append(_rec("t1", True, 1.0, 0.1, end="error"))  # not played: no score anywhere
  recs += [_rec("c0", True, 1.0, 4.0, domain="code", tier="high"), _rec("c1", False, 0.0, 6.0, domain="code",
                                                                       tier="high")]
  return recs


def test_aggregate_against_hand_computed_rows():
  rows = report.aggregate(_records())
  assert [(r["domain"], r["tier"]) for r in rows] == [("code", "high"), ("math", "low"), ("all", "low"),
                                                      ("all", "high")]
  math_low = rows[1]
  assert math_low["n"] == 9 and math_low["tasks"] == 3 and math_low["success"] == pytest.approx(2 / 9)
  assert (math_low["ci_low"], math_low["ci_high"]) == pytest.approx(WILSON_95[(2, 9)], rel=1e-9)
  assert math_low["reward"] == pytest.approx(3.0 / 9)
  # wall sorted: 0.4 0.7 1.3 1.8 2.2 2.9 3.3 5.1 9.6; p50 at 4 -> 2.2, p95 at 7.6 -> 5.1 + 0.6 * 4.5
  assert math_low["latency_p50"] == pytest.approx(2.2) and math_low["latency_p95"] == pytest.approx(7.8)
  # pass@2: t0 1 - C(3,2)/C(4,2) = 1/2, t1 0, t2 1 - C(2,2)/C(3,2) = 2/3
  assert math_low["pass@2"] == pytest.approx((1 / 2 + 0 + 2 / 3) / 3)
  assert not any(k.startswith("pass@") for k in rows[0])  # one sample per task: pass@1 is success
  row = "| math | low | 9 | 22.2 (6.3–54.7) | 38.9 | 0.333 | 13.0 | 2.00 | 0.00 | 0.00 | 2.200 | 7.800 |"
  assert row in report.markdown(rows)


def test_grader_failures_are_named_per_domain_not_twice():
  recs = _records()
  recs[0]["grade"] = {"grader_failed": True}
  table = report.markdown(report.aggregate(recs))
  assert table.endswith("(scored 0; `grade.error` in results.jsonl says why): math/low 1")


def test_compare_refuses_each_sampling_field_that_differs():
  sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "max_tokens_per_turn": 256}
  for field, other in (("temperature", 0.7), ("top_p", 0.9), ("top_k", 40), ("seed", 3),
                       ("max_tokens_per_turn", 128)):
    with pytest.raises(compare.CompareError, match=f"{field}: "):
      compare.check_comparable({"sampling": sampling}, {"sampling": dict(sampling, **{field: other})})
  compare.check_comparable({"sampling": sampling}, {"sampling": dict(sampling)})


def _write(d: Path, records):
  d.mkdir()
  (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (d / "run.json").write_text(json.dumps({"sampling": {"temperature": 0.0}}))
  return d


def test_load_run_latest_record_counts_even_when_unplayed(tmp_path):
  rec = {"key": "t0|high|0", "domain": "math", "tier": "high", "success": True}
  d = _write(tmp_path / "a", [rec, dict(rec, success=False, end="error")])
  records, meta = compare.load_run(d)
  assert records == {} and meta["unplayed"] == ["t0|high|0"]


def test_compare_table_row_by_hand(tmp_path):
  # 10 pairs: 3 up, 1 down; d mean 0.2, var 0.4 - 0.04 = 0.36: SE sqrt(0.036) = 0.18974,
  # z = 1.054; McNemar 2 * (1 + 4) / 16 = 0.625; unpaired sqrt(0.024 + 0.024) = 0.21909
  before = [1, 1, 0, 0, 0, 1, 0, 0, 1, 0]
  after = [1, 0, 1, 1, 0, 1, 1, 0, 1, 0]
  rows = [{"domain": "math", "tier": "high", **compare.paired_row(
    [(bool(b), bool(a)) for b, a in zip(before, after, strict=True)])}]
  assert compare.markdown(rows).splitlines()[2] == (
    "| math | high | 10 | 40.0 | 60.0 | +20.0 | 3 / 1 | 18.97 | +1.05 | 0.625 | 21.91 |")


def test_mcnemar_is_symmetric_and_exact():
  tail = lambda b, n: sum(math.comb(n, i) for i in range(b + 1)) / 2**n  # noqa: E731
  assert compare.mcnemar_p(15, 6) == pytest.approx(2 * tail(6, 21), rel=1e-12)
  assert compare.mcnemar_p(15, 6) == pytest.approx(0.0783538818359375, rel=1e-12)
  assert compare.mcnemar_p(9, 2) == pytest.approx(0.0654296875, rel=1e-12)
  assert compare.mcnemar_p(1, 0) == 1.0 and compare.mcnemar_p(7, 7) == 1.0


def test_cli_names_episodes_only_in_one_run(tmp_path):
  rec = lambda i: {"key": f"t{i}|high|0", "domain": "math", "tier": "high", "success": bool(i % 2)}  # noqa: E731
  b = _write(tmp_path / "b", [rec(i) for i in range(4)])
  a = _write(tmp_path / "a", [rec(i) for i in range(3)])
  out = subprocess.run([sys.executable, "-m", "experiments.compare_evals", f"--before={b}", f"--after={a}"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert "not compared: 1 episodes only in --before, 0 only in --after" in out


def _tasks(n, **extra):
  return [parse_task({"id": f"m{i}", "domain": "math", "prompt": f"{i}+1?", "answer": str(i + 1),
                      "oracle": [{"content": f"<answer>{i + 1}</answer>"}], **extra}) for i in range(n)]


class _Seeds(OraclePolicy):
  def __init__(self):
    super().__init__()
    self.seen = []

  def session(self, task, first, tools, tier, sampling):
    self.seen.append((task.id, tier, sampling.seed, sampling.temperature))
    return super().session(task, first, tools, tier, sampling)


def test_each_sample_has_its_own_seed_and_tasks_their_tier(tmp_path):
  executor = ThreadExecutor(workers=2)
  policy = _Seeds()
  harness.evaluate(_tasks(2), policy, executor, tiers=["low"], samples=3,
                   sampling=Sampling(temperature=0.7, seed=11), results=tmp_path / "r.jsonl", progress=False)
  assert sorted(policy.seen) == [(f"m{i}", "low", s, 0.7) for i in range(2) for s in (11, 12, 13)]
  policy = _Seeds()
  harness.evaluate(_tasks(1, tier="max"), policy, executor, tiers=["low"], results=tmp_path / "own.jsonl",
                   progress=False)
  assert [t for _, t, _, _ in policy.seen] == ["low"]  # without task_tier_wins the run's tiers hold
  policy = _Seeds()
  harness.evaluate(_tasks(1, tier="max"), policy, executor, tiers=["low"], results=tmp_path / "wins.jsonl",
                   progress=False, task_tier_wins=True)
  assert [t for _, t, _, _ in policy.seen] == ["max"]
  executor.shutdown()


def test_bad_job_lists_are_refused(tmp_path):
  executor = ThreadExecutor(workers=1)
  with pytest.raises(ValueError, match="samples must be >= 1; got 0"):
    harness.evaluate(_tasks(1), OraclePolicy(), executor, tiers=["low"], samples=0,
                     results=tmp_path / "r.jsonl", progress=False)
  with pytest.raises(ValueError, match="task ids must be unique"):
    harness.evaluate(_tasks(1) * 2, OraclePolicy(), executor, tiers=["low"], results=tmp_path / "r.jsonl",
                     progress=False)
  executor.shutdown()


def test_resume_of_a_subset_old_records_and_signatures(tmp_path):
  executor = ThreadExecutor(workers=2)
  results = tmp_path / "r.jsonl"
  sig = {"policy": "p", "loop": {"stop": ("a", "b")}}  # a tuple is stored as a list: still the same
  run = lambda tasks, s=sig: harness.evaluate(tasks, OraclePolicy(), executor, tiers=["low"],  # noqa: E731
                                              results=results, progress=False, signature=s)
  assert len(run(_tasks(3))) == 3 and len(run(_tasks(3))) == 3
  # a subset returns its own episodes only, and other tasks' records (m2 changed) are not checked
  t2 = _tasks(3)[2]
  changed = _tasks(3)[:2] + [t2.with_(fields=dict(t2.fields, answer="99"))]
  assert [r["key"] for r in run(changed[:2])] == ["m0|low|0", "m1|low|0"]
  # records written before task hashes were kept are accepted
  lines = [json.loads(x) for x in results.read_text().splitlines()]
  results.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "task_hash"}) + "\n"
                             for r in lines))
  assert len(run(_tasks(3))) == 3
  # the results file deleted (its signature left behind): a fresh start, signed anew
  results.unlink()
  assert len(run(_tasks(1), {"policy": "q"})) == 1
  assert json.loads(harness.signature_path(results).read_text()) == {"policy": "q"}
  executor.shutdown()


def test_run_evaluation_default_and_greedy_temperature(tmp_path):
  """The sampling a run settles on, read from the refusal of a resume signed otherwise (raised before
  any policy is built): greedy for one sample, 1.0 for several, and an explicit 0 accepted."""
  from configs import sft
  from rl.eval.run import run_evaluation

  def sampling_of(samples, temperature=None):
    out = tmp_path / f"{samples}-{temperature}"
    out.mkdir()
    (out / "results.jsonl").write_text('{"key": "m0|off|0"}\n')
    harness.signature_path(out / "results.jsonl").write_text('{"policy": "old"}')
    with pytest.raises(ValueError, match="holds episodes played with other settings") as e:
      run_evaluation(sft.get_config("tiny"), tasks=_tasks(1), out_dir=str(out), tiers=[None], samples=samples,
                     concurrency=1, endpoint="http://127.0.0.1:9", temperature=temperature, progress=False)
    return str(e.value).split("sampling: None there, ")[1].split("}")[0] + "}"

  assert "'temperature': 0.0" in sampling_of(1)
  assert "'temperature': 1.0" in sampling_of(2)
  assert "'temperature': 0.0" in sampling_of(2, 0.0)
