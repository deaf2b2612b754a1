"""rl/train/batch.py, mixture.py and checks.py cases that mutation testing found unchecked; expected
values are written out by hand (each test names the mistake it catches)."""

import numpy as np
import pytest

from rl.agent.episode import Episode, TurnSpan
from rl.train import batch as batch_lib
from rl.train import objectives as obj_lib
from rl.train.mixture import MixtureSampler, parse_levels, parse_mixture

THINK_END = 99


def _episode(ids, mask, turns=(), routing=None, task="t", tier="high"):
  ep = Episode(task_id=task, domain="math", tier=tier, token_ids=list(ids), loss_mask=list(mask),
               logprobs=[-0.5] * len(ids), turns=list(turns))
  ep.routing = routing
  return ep


def test_forced_think_end_as_the_last_token_of_a_turn():
  """The engine forced </think> as the turn's last token (the turn hit its limit right there): the
  budget penalty still applies; a </think> the model sampled itself (mask 1) gets none."""
  forced = _episode([1, 2, 3, 4, THINK_END], [0, 0, 1, 1, 0], [TurnSpan(0, 2, 5, "length")])
  sampled = _episode([1, 2, 3, 4, THINK_END], [0, 0, 1, 1, 1], [TurnSpan(0, 2, 5, "stop")])
  assert batch_lib.forced_think_end(forced, THINK_END) and not batch_lib.forced_think_end(sampled, THINK_END)
  _, parts = batch_lib.shape_rewards([forced, sampled], obj_lib.objective("grpo"), batch_lib.Shaping(0.3, 64),
                                     THINK_END)
  np.testing.assert_allclose(parts["budget"], [-0.3, 0.0])


def test_rows_fill_exactly_a_multiple_of_pad_multiple():
  """9 tokens = 8 positions, pad_multiple 8: T is 8, not 16 (no block of pure padding)."""
  b = batch_lib.to_batch([_episode(range(1, 10), [0, 0] + [1] * 7)], np.zeros(1), obj_lib.objective("grpo"),
                         pad_multiple=8)
  assert b["inputs"].shape == (1, 8) and b["mask"].sum() == 7


def test_episodes_too_short_to_learn_from_still_get_one_position():
  """An episode of 0 or 1 tokens fills one (empty) position: a batch of only such episodes is one
  block of padding with no sampled token, not a [B, 0] batch."""
  eps = [_episode([7], [0]), _episode([], []), _episode([1, 2, 3, 4, 5], [0, 1, 1, 1, 1])]
  assert batch_lib.row_lengths(eps) == [1, 1, 4]
  b = batch_lib.to_batch(eps[:2], np.zeros(2), obj_lib.objective("dapo"), pad_multiple=4)
  assert b["inputs"].shape == (2, 4) and b["mask"].sum() == 0 and np.all(b["weights"] == 0)


def test_to_batch_weights_follow_the_aggregation():
  """Rows of 2 and 4 sampled tokens: seq_mean weighs each token 1 / (its row's tokens x 2 rows);
  Dr. GRPO's constant 1 / (2 rows x norm_tokens 10); token_mean 1 / 6."""
  eps = [_episode([1, 2, 3], [0, 1, 1]), _episode([1, 2, 3, 4, 5], [0, 1, 1, 1, 1])]
  for o, row0, row1 in ((obj_lib.objective("grpo"), 0.25, 0.125),
                        (obj_lib.objective("dr_grpo", norm_tokens=10), 0.05, 0.05),
                        (obj_lib.objective("dapo"), 1 / 6, 1 / 6)):
    w = batch_lib.to_batch(eps, np.zeros(2), o, pad_multiple=8)["weights"]
    np.testing.assert_allclose(w, [[row0] * 2 + [0] * 6, [row1] * 4 + [0] * 4], rtol=1e-6)


def test_routing_only_when_every_episode_has_it():
  """One episode without recorded routing (an HTTP policy's, say): no routing arrays at all."""
  a = _episode([1, 2, 3], [0, 1, 1], routing=np.zeros((3, 1, 1), np.int32))
  b = batch_lib.to_batch([a, _episode([1, 2, 3], [0, 1, 1])], np.zeros(2), obj_lib.objective("grpo"),
                         pad_multiple=4)
  assert "routing" not in b and "routing_mask" not in b


def test_micro_batches_refuse_a_zero_pad_multiple():
  with pytest.raises(ValueError, match=r"pad_multiple=0 must be >= 1"):
    batch_lib.micro_batches([3, 5], 2, 0)


def test_cut_takes_the_rows_and_the_first_t_positions():
  arrays = {"mask": np.arange(12).reshape(3, 4), "advantages": np.array([0.5, -1.0, 2.0]),
            "routing": np.arange(24).reshape(3, 4, 2)}
  part = batch_lib.cut(arrays, np.array([2, 0]), 3)
  np.testing.assert_array_equal(part["mask"], [[8, 9, 10], [0, 1, 2]])
  np.testing.assert_array_equal(part["advantages"], [2.0, 0.5])
  np.testing.assert_array_equal(part["routing"], [[[16, 17], [18, 19], [20, 21]], [[0, 1], [2, 3], [4, 5]]])


def test_domain_means():
  assert batch_lib.domain_means(np.array([1.0, 0.0, 1.0, 0.5]), ["m", "c", "m", "c"]) == {"m": 1.0, "c": 0.25}


# ---- mixture ----------------------------------------------------------------------------------


def test_mixture_text_edge_cases():
  """A trailing comma is harmless; a file path holding '=' keeps it (the weight is after the last '=')."""
  assert parse_mixture("math=1,") == {"math": 1.0}
  assert parse_mixture("file:/data/a=b.jsonl=0.5,math=1") == {"file:/data/a=b.jsonl": 0.5, "math": 1.0}
  assert parse_mixture("math=2,terminal=0") == {"math": 2.0, "terminal": 0.0}  # a zero weight is allowed


def test_levels_edge_cases():
  """A level 0 given twice for every domain ('0,1') is refused like '1,2'; the top level is allowed."""
  with pytest.raises(ValueError, match=r"more than one level for every domain"):
    parse_levels("0,1", ["math"])
  assert parse_levels("4", ["math"]) == {"math": 4}  # math's levels are 0..4
  assert parse_levels("cad=0,2", ["math", "cad"]) == {"math": 2, "cad": 0}


@pytest.mark.parametrize("text", ["--1", "math=--2", "math=\u00b2"])
def test_levels_that_are_not_plain_integers_name_the_field(text):
  """'--1' and a superscript two passed the digit check and crashed in int() without naming the field."""
  with pytest.raises(ValueError, match=r"config\.rl\.difficulty: .* is not an integer level or domain=level"):
    parse_levels(text, ["math"])


def test_sampler_uses_its_floor():
  """math's success moves (progress 1 after scaling), terminal's is flat (0): weights 1 + floor and
  floor, renormalised: floor 0.5 gives 1.5 / 2 and 0.5 / 2."""
  s = MixtureSampler({"math": 1.0, "terminal": 1.0}, {}, seed=0, adaptive=True, floor=0.5)
  for rate in (0.0, 1.0):
    s.adaptive.observe({"math": rate, "terminal": 0.5})
  assert s.adaptive.weights() == pytest.approx({"math": 0.75, "terminal": 0.25}, rel=1e-12)



def test_falling_success_is_progress_too():
  """Absolute learning progress: math's success dropping 1 -> 0 (fast 0.7, slow 0.95) moves as much
  weight toward it as a rise would: 1 + floor and floor, renormalised."""
  s = MixtureSampler({"math": 1.0, "terminal": 1.0}, {}, seed=0, adaptive=True, floor=0.5)
  for rate in (1.0, 0.0):
    s.adaptive.observe({"math": rate, "terminal": 0.5})
  assert s.adaptive.weights() == pytest.approx({"math": 0.75, "terminal": 0.25}, rel=1e-12)


def test_an_empty_task_file_is_refused_when_the_sampler_is_built(tmp_path):
  path = tmp_path / "empty.jsonl"
  path.write_text("")
  with pytest.raises(ValueError, match=r"config\.rl\.mixture: file:.*empty\.jsonl holds no tasks"):
    MixtureSampler({f"file:{path}": 1.0}, {}, seed=0)
