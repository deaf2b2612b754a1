"""The evaluation harness's job list, records and resume against references written out here (each
test kills a mutant of rl/eval/harness.py that test_eval.py and test_eval_mutants.py let through)."""

from __future__ import annotations

import json

import pytest

from rl.agent.executor import ThreadExecutor
from rl.agent.oracle import OraclePolicy
from rl.eval import harness
from rl.tasks.schema import parse_task
from tests.helpers import failing_session


def _tasks(n, **extra):
  return [parse_task({"id": f"m{i}", "domain": "math", "prompt": f"{i}+1?", "answer": str(i + 1),
                      "oracle": [{"thinking": f"{i} plus 1", "content": f"<answer>{i + 1}</answer>"}],
                      **extra})
          for i in range(n)]


@pytest.fixture
def executor():
  ex = ThreadExecutor(workers=1)
  yield ex
  ex.shutdown()


def test_parse_tiers_aliases_blanks_and_empty():
  assert harness.parse_tiers("none") == [None]  # 'none' is another name for thinking off
  assert harness.parse_tiers("low,high,") == ["low", "high"]  # a stray comma is no tier
  assert harness.parse_tiers(" max , ,off") == ["max", None]
  for text in ("", " , ,"):
    with pytest.raises(ValueError, match=r"^config.rl.eval_tiers is empty; e.g. config.rl.eval_tiers=low"):
      harness.parse_tiers(text, "config.rl.eval_tiers")


def test_duplicate_tiers_are_refused_not_played_twice(tmp_path, executor):
  """'--tiers=low,low' (or off,none) played each episode twice under one key, and the report counted
  both: n doubled and the interval narrowed on the same evidence."""
  for text, tier in (("low,low", "low"), ("off,none", "off"), ("high,max,high", "high")):
    with pytest.raises(ValueError, match=f"--tiers: tier {tier!r} is given twice"):
      harness.parse_tiers(text)
  with pytest.raises(ValueError, match=r"tiers must be unique; got \['low', 'low'\]"):
    harness.evaluate(_tasks(1), OraclePolicy(), executor, tiers=["low", "low"], results=tmp_path / "r.jsonl",
                     progress=False)
  assert not (tmp_path / "r.jsonl").exists()


def test_keys_name_thinking_off_and_records_their_sample(tmp_path, executor):
  assert harness.job_key("m0", None, 2) == "m0|off|2"
  results = tmp_path / "r.jsonl"
  records = harness.evaluate(_tasks(2), OraclePolicy(), executor, tiers=[None], samples=3, results=results,
                             progress=False)
  assert [(r["key"], r["sample"], r["tier"]) for r in records] == [
    ("m0|off|0", 0, "off"), ("m0|off|1", 1, "off"), ("m0|off|2", 2, "off"),
    ("m1|off|0", 0, "off"), ("m1|off|1", 1, "off"), ("m1|off|2", 2, "off")]
  # a resume that plays only m2's episodes still numbers their samples 0..2
  more = harness.evaluate(_tasks(3), OraclePolicy(), executor, tiers=[None], samples=3, results=results,
                          progress=False)
  assert [(r["key"], r["sample"]) for r in more[6:]] == [("m2|off|0", 0), ("m2|off|1", 1), ("m2|off|2", 2)]
  assert len(results.read_text().splitlines()) == 9


def test_transcripts_kept_by_default_and_left_out_when_asked(tmp_path, executor):
  kept = harness.evaluate(_tasks(1), OraclePolicy(), executor, tiers=["low"], results=tmp_path / "a.jsonl",
                          progress=False)
  assistant = {"role": "assistant", "content": "<answer>1</answer>", "thinking": "0 plus 1"}
  assert kept[0]["messages"] == [{"role": "user", "content": "0+1?"}, assistant]
  bare = harness.evaluate(_tasks(1), OraclePolicy(), executor, tiers=["low"], results=tmp_path / "b.jsonl",
                          progress=False, transcripts=False)
  assert "messages" not in bare[0] and "messages" not in json.loads((tmp_path / "b.jsonl").read_text())


class _Watcher(OraclePolicy):
  """The oracle, noting how many lines the results file holds as each episode starts."""

  def __init__(self, results, down=()):
    super().__init__()
    self.results, self.down, self.lines = results, set(down), []

  def session(self, task, first, tools, tier, sampling):
    self.lines.append(len(self.results.read_text().splitlines()) if self.results.exists() else 0)
    inner = super().session(task, first, tools, tier, sampling)
    if task.id not in self.down:
      return inner
    return failing_session(inner)


def test_each_record_is_on_disk_before_the_next_episode_starts(tmp_path, executor):
  """Records are flushed as episodes finish: a run killed mid-way keeps every finished episode."""
  results = tmp_path / "r.jsonl"
  policy = _Watcher(results)
  harness.evaluate(_tasks(3), policy, executor, tiers=["low"], concurrency=1, results=results, progress=False)
  assert policy.lines == [0, 1, 2]


def test_records_come_back_in_job_order_after_a_replay(tmp_path, executor):
  results = tmp_path / "r.jsonl"
  first = harness.evaluate(_tasks(3)[1:], _Watcher(results, down={"m2"}), executor, tiers=["low"],
                           concurrency=1, results=results, progress=False)
  assert [(r["key"], r["end"]) for r in first] == [("m1|low|0", "answer"), ("m2|low|0", "error")]
  again = harness.evaluate(_tasks(3), OraclePolicy(), executor, tiers=["low"], results=results,
                           progress=False)
  # the file now holds m1, m2 (unplayed), then m0 and m2's replay; the job order is m0, m1, m2
  on_disk = [json.loads(x)["key"] for x in results.read_text().splitlines()]
  assert sorted(on_disk[:2]) == ["m1|low|0", "m2|low|0"] and sorted(on_disk[2:]) == ["m0|low|0", "m2|low|0"]
  assert [(r["key"], r["end"]) for r in again] == [("m0|low|0", "answer"), ("m1|low|0", "answer"),
                                                   ("m2|low|0", "answer")]


def test_a_changed_task_may_be_played_at_a_tier_it_has_no_episode_of(tmp_path, executor):
  """Only recorded episodes this run would resume over are checked against the task's content."""
  results = tmp_path / "r.jsonl"
  harness.evaluate(_tasks(2), OraclePolicy(), executor, tiers=["low"], results=results, progress=False)
  t1 = _tasks(2)[1]
  changed = _tasks(1) + [t1.with_(fields=dict(t1.fields, answer="7"),
                                  oracle=[{"content": "<answer>7</answer>"}])]
  high = harness.evaluate(changed, OraclePolicy(), executor, tiers=["high"], results=results, progress=False)
  assert [(r["key"], r["success"]) for r in high] == [("m0|high|0", True), ("m1|high|0", True)]
  with pytest.raises(ValueError, match="task 'm1' has changed since its episode was recorded"):
    harness.evaluate(changed, OraclePolicy(), executor, tiers=["low"], results=results, progress=False)
