"""rl/train/mixture.py against plain references: adaptive weights, stream seeds, levels, resume."""

import json

import pytest

from rl.train.mixture import AdaptiveWeights, MixtureSampler


def _ref_weights(base, history, fast_rate, slow_rate, floor):
  """The documented rule, written out: per-source fast/slow EMAs of success (started at the first
  observation), progress = |fast - slow| scaled so the top source has 1, + floor, only for sources
  of positive base weight, renormalised."""
  fast, slow = {}, {}
  for success in history:
    for s, rate in success.items():
      if s not in fast:
        fast[s] = slow[s] = rate
      else:
        fast[s] = fast[s] + fast_rate * (rate - fast[s])
        slow[s] = slow[s] + slow_rate * (rate - slow[s])
  live = [s for s in base if base[s] > 0]
  progress = {s: abs(fast.get(s, 0.0) - slow.get(s, 0.0)) for s in live}
  top = max(progress.values())
  raw = {s: 0.0 for s in base}
  for s in live:
    raw[s] = (progress[s] / top if top > 0 else 0.0) + floor
  total = sum(raw.values())
  return {s: v / total for s, v in raw.items()}


def test_adaptive_weights_match_a_plain_reference():
  """Exact weights (not just an ordering): progress is scaled by the top source's, the floor is
  added once, a source the mixture gives weight 0 stays at 0, and the weights sum to one."""
  base = {"math": 2.0, "code": 1.0, "cad": 0.0, "web": 1.0}
  history = [{"math": 0.1 * k, "code": 0.5 + 0.02 * (k % 3), "cad": 0.3 * (k % 2), "web": 0.0}
             for k in range(8)]
  w = AdaptiveWeights(dict(base), enabled=True, floor=0.2)
  assert w.weights() == pytest.approx({"math": 0.5, "code": 0.25, "cad": 0.0, "web": 0.25})  # no data yet
  for success in history:
    w.observe(success)
  want = _ref_weights(base, history, w.fast_rate, w.slow_rate, 0.2)
  got = w.weights()
  assert got == pytest.approx(want, rel=1e-12)
  assert got["cad"] == 0.0 and sum(got.values()) == pytest.approx(1.0)
  # no progress anywhere (every rate flat): the floor alone, uniform over the drawn sources
  flat = AdaptiveWeights(dict(base), enabled=True, floor=0.2)
  for _ in range(3):
    flat.observe({"math": 0.5, "code": 0.5, "cad": 0.5, "web": 0.5})
  assert flat.weights() == pytest.approx({"math": 1 / 3, "code": 1 / 3, "cad": 0.0, "web": 1 / 3})


def test_adaptive_sampler_never_draws_a_zero_weight_source():
  s = MixtureSampler({"math": 1.0, "terminal": 0.0}, {"math": 0, "terminal": 0}, seed=0, adaptive=True,
                     floor=0.5)
  s.adaptive.observe({"math": 0.0, "terminal": 0.0})
  s.adaptive.observe({"math": 1.0, "terminal": 1.0})
  assert s.adaptive.weights()["terminal"] == 0.0
  assert {src for src, _ in s.draw(0, 40)} == {"math"}


def test_streams_never_repeat_across_chunks_or_run_seeds():
  """Three 64-task chunks per stream: no task id twice within a run, and two run seeds share none
  (a seed formula without the chunk index repeats the first chunk; seed + k overlaps seed + 1)."""
  ids = {}
  for seed in (0, 1):
    sampler = MixtureSampler({"math": 1.0}, {"math": 0}, seed=seed)
    drawn = [t.id for step in range(3) for _, t in sampler.draw(step, 64)]
    assert len(set(drawn)) == len(drawn) == 192, seed
    ids[seed] = set(drawn)
  assert not ids[0] & ids[1]


def test_per_domain_levels_reach_the_streams():
  s = MixtureSampler({"math": 1.0, "terminal": 1.0}, {"math": 2, "terminal": 1}, seed=0)
  drawn = s.draw(0, 12)
  assert {src for src, _ in drawn} == {"math", "terminal"}
  for src, task in drawn:
    assert task.meta["difficulty"] == {"math": 2, "terminal": 1}[src], (src, task.id)
    assert task.domain == src


def test_source_picks_change_from_step_to_step():
  """Each step (and each refill round, step * 1000 + round) draws its own sources."""
  s = MixtureSampler({"math": 1.0, "terminal": 1.0}, {"math": 0, "terminal": 0}, seed=0)
  patterns = {tuple(src for src, _ in s.draw(step, 16)) for step in (0, 1, 2, 1000, 1001)}
  assert len(patterns) == 5


def test_adaptive_weights_survive_a_resume():
  """The EMAs are part of the checkpointed state: a resumed sampler has the same weights and
  draws the same sources as the uninterrupted one."""
  a = MixtureSampler({"math": 1.0, "terminal": 1.0}, {"math": 0, "terminal": 0}, seed=0, adaptive=True)
  for k in range(6):
    a.draw(k, 4)
    a.adaptive.observe({"math": 0.15 * k, "terminal": 0.5})
  state = json.loads(json.dumps(a.get_state()))
  b = MixtureSampler({"math": 1.0, "terminal": 1.0}, {"math": 0, "terminal": 0}, seed=0, adaptive=True)
  b.set_state(state)
  assert b.adaptive.weights() == pytest.approx(a.adaptive.weights(), rel=1e-12)
  assert a.adaptive.weights() != pytest.approx({"math": 0.5, "terminal": 0.5})  # adaptive, not the base
  assert [(s, t.id) for s, t in b.draw(6, 16)] == [(s, t.id) for s, t in a.draw(6, 16)]


def test_file_passes_are_reshuffled(tmp_path):
  """A file stream visits every task once per pass, in a new order each pass."""
  from rl.tasks.generators import math as gen
  from rl.tasks.task_files import write_tasks
  path = tmp_path / "t.jsonl"
  write_tasks(gen.generate(split="train", difficulty=0, n=8), path)
  s = MixtureSampler({f"file:{path}": 1.0}, {}, seed=0)
  ids = [t.id for _, t in s.draw(0, 24)]
  passes = [[i.rsplit("#p", 1)[0] for i in ids[8 * k:8 * k + 8]] for k in range(3)]
  assert all(sorted(p) == sorted(passes[0]) and len(set(p)) == 8 for p in passes)
  assert len({tuple(p) for p in passes}) == 3
