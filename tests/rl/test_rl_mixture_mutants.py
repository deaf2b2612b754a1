"""rl/train/mixture.py cases that mutation testing found unchecked (each test names the mistake)."""

import numpy as np
import pytest

from rl.train.mixture import AdaptiveWeights, MixtureSampler, parse_levels, parse_mixture


def test_source_picks_follow_sorted_names_whatever_the_mixture_order():
  """Prompt i's source is names[choice] of rng([seed, step, 7]) over the sorted source names with
  the normalised weights: the same mixture written in another order draws the same tasks."""
  picks = np.random.default_rng([5, 3, 7]).choice(2, size=12, p=[1 / 4, 3 / 4])  # math, terminal
  want = [("math", "terminal")[i] for i in picks]
  for mixture in ({"math": 1.0, "terminal": 3.0}, {"terminal": 3.0, "math": 1.0}):
    drawn = MixtureSampler(mixture, {"math": 0, "terminal": 0}, seed=5).draw(3, 12)
    assert [s for s, _ in drawn] == want, mixture
  assert set(want) == {"math", "terminal"}


def test_a_zero_weight_source_does_not_scale_the_others_progress():
  """Progress is scaled by the top progress among the drawn sources (weight > 0): a source of
  weight 0 with larger progress (observed, never drawn) must not shrink theirs."""
  w = AdaptiveWeights({"math": 1.0, "code": 1.0, "cad": 0.0}, enabled=True, floor=0.5)
  w.observe({"math": 0.0, "code": 0.0, "cad": 0.0})
  w.observe({"math": 0.4, "code": 0.0, "cad": 1.0})
  # math's progress |fast - slow| = 0.4 * (0.3 - 0.05) = 0.1 is the top of the drawn: 1 + 0.5 vs 0 + 0.5
  assert w.weights() == pytest.approx({"math": 0.75, "code": 0.25, "cad": 0.0})


def test_the_top_difficulty_level_is_accepted():
  assert parse_levels("math=4,code=3", ["math", "code"]) == {"math": 4, "code": 3}
  with pytest.raises(ValueError, match=r"math level 5 is outside 0\.\.4"):
    parse_levels("math=5", ["math"])


def test_a_file_path_may_hold_an_equals_sign():
  """The weight is after the last '=': a path with '=' in it is a source, not a bad weight."""
  assert parse_mixture("file:/data/lr=1e-4/t.jsonl=2,math=1") == {"file:/data/lr=1e-4/t.jsonl": 2.0,
                                                                  "math": 1.0}
  assert parse_mixture("math = 1, code =2") == {"math": 1.0, "code": 2.0}  # was "unknown source 'math '"


def test_levels_hold_the_generated_sources_only(tmp_path):
  """The held-out evaluation generates tasks for each source in `levels`: a file source has none."""
  from rl.tasks.generators import math as gen
  from rl.tasks.task_files import write_tasks
  path = tmp_path / "t.jsonl"
  write_tasks(gen.generate(split="train", difficulty=0, n=3), path)
  s = MixtureSampler({f"file:{path}": 1.0, "math": 1.0, "code": 1.0}, {"math": 2}, seed=0)
  assert s.levels == {"math": 2, "code": 0}
