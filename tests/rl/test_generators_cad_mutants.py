"""Mutation audit of the CAD task generator (rl/tasks/generators/cad.py): each template's part against
the geometry its description states, worked out here from the described dimensions (each test
names the mistake it catches). Parts are probed by the volume of their intersection with a box
written out by hand: a region the part fills measures the region's volume, an empty one 0."""

import math
import random

import pytest

from rl.tasks.generators import cad
from rl.tools import solids


def _filled(solid, size, at):
  """The volume of `solid` inside the box of edge lengths `size` centred at `at`."""
  return solids.measure({"intersection": [solid, {"box": list(size), "at": list(at)}]}).volume


def test_level_0_boxes_have_three_edge_lengths_of_their_own():
  """Catches one edge length drawn for all three (every box a cube)."""
  boxes = [inst.solid["box"] for inst in (cad._centred(random.Random(s)) for s in range(60))
           if "box" in inst.solid]
  assert len(boxes) >= 10
  assert any(len(set(b)) == 3 for b in boxes), boxes


class _LowRng:
  """Draws the first choice and the lowest non-negative value of every range: a moved part at 0."""

  def choice(self, seq):
    return seq[0]

  def randint(self, a, b):
    return max(a, 0)


def test_a_moved_part_drawn_at_the_origin_is_moved_to_1_0_0():
  """Catches the origin draw kept: a `moved_box` task whose part sits at (0, 0, 0), the level-0 task."""
  inst = cad._moved(_LowRng())
  assert inst.template == "moved_box" and inst.params["at"] == (1, 0, 0)
  assert inst.solid == {"box": [1, 1, 1], "at": [1, 0, 0]}
  assert "with its centre at (1, 0, 0)." in inst.description


def test_rounded_block_ball_trims_the_corners_and_not_the_faces():
  """a/2 < R < a·√3/2: catches a ball inside the cube (R <= a/2: the part is the ball) and a ball
  past the corners (R >= a·√3/2: the part is the plain cube)."""
  for seed in range(150):
    inst = cad._rounded_block(random.Random(seed))
    a, big = inst.params["a"], inst.params["R"]
    assert a / 2 < big < a * math.sqrt(3) / 2, inst.params


def test_l_block_upright_stands_on_the_minus_x_end():
  """Catches the upright set on the +x end (the same volume and bounding box as the described part)."""
  for seed in range(4):
    inst = cad._l_block(random.Random(seed))
    w, d, t, h = (inst.params[k] for k in ("w", "d", "t", "h"))
    above = h - t  # the upright's part above the foot's top face z = t/2
    assert _filled(inst.solid, (t, d, above), (-w / 2 + t / 2, 0, t / 2 + above / 2)) == pytest.approx(
      t * d * above, rel=1e-9), inst.params
    assert _filled(inst.solid, (t, d, above), (w / 2 - t / 2, 0, t / 2 + above / 2)) == pytest.approx(
      0, abs=1e-9), inst.params


def test_dimples_are_cut_into_the_top_face_not_the_bottom():
  """Catches the dimples centred on the bottom face (the same volume and bounding box)."""
  for seed in range(4):
    inst = cad._dimpled_block(random.Random(seed))
    (sx, sy, sz), off = inst.params["size"], inst.params["off"]
    thin = 0.5  # a slab 0.5 deep under the top and above the bottom face, across the dimple centres
    top = _filled(inst.solid, (sx, sy, thin), (0, 0, sz / 2 - thin / 2))
    bottom = _filled(inst.solid, (sx, sy, thin), (0, 0, -sz / 2 + thin / 2))
    assert bottom == pytest.approx(sx * sy * thin, rel=1e-9) and top < sx * sy * thin - 1, inst.params
    assert _filled(inst.solid, (0.2, 0.2, 0.2), (off, 0, sz / 2 - 0.2)) == 0, inst.params


def test_open_box_is_open_at_the_top_and_has_a_floor():
  """Catches the inner box lowered instead of raised (a lidded box open at the bottom)."""
  for seed in range(4):
    inst = cad._open_box(random.Random(seed))
    (w, d, h), wall = inst.params["size"], inst.params["wall"]
    inside = (w - 2 * wall - 0.2, d - 2 * wall - 0.2, 0.5)
    assert _filled(inst.solid, inside, (0, 0, h / 2 - 0.25)) == 0, inst.params  # no lid
    floor = _filled(inst.solid, (w, d, wall), (0, 0, -h / 2 + wall / 2))
    assert floor > 0.5 * w * d * wall, inst.params


def test_the_drain_hole_stays_inside_the_floor():
  """The drain hole of radius up to min(d - 2·wall, h) / 4 was wider than a narrow tray's floor
  (2.3% of trays: 10 × 39 × 20 with 2 mm walls had a hole of radius 5): it cut both side walls
  through their whole height and the 'tray' fell into two pieces."""
  for seed in range(400):
    inst = cad._open_box(random.Random(seed))
    (w, d, _), wall, hole = inst.params["size"], inst.params["wall"], inst.params["hole"]
    assert 1 <= hole and 2 * hole <= w - 2 * wall and 2 * hole <= d - 2 * wall, inst.params
  narrow = next(inst for inst in (cad._open_box(random.Random(s)) for s in range(400))
                if inst.params["size"][0] - 2 * inst.params["wall"] <= 6)
  assert solids.measure(narrow.solid).components == 1, narrow.params


CAD_LEVELS = {0: {"box", "cylinder", "sphere"},
              1: {"moved_box", "moved_cylinder", "moved_sphere", "post_on_base"},
              2: {"plate_hole", "tube", "rounded_block", "l_block"},
              3: {"plate_two_holes", "boss_flange", "dimpled_block", "dumbbell"},
              4: {"bolted_flange", "table", "drilled_bracket", "open_box"}}


def test_each_level_draws_the_parts_its_docstring_lists():
  """Catches a template moved to another level (the post on a base at level 2, the table at 3)."""
  for level, names in CAD_LEVELS.items():
    assert {cad.draw("train", level, 0, i).template for i in range(40)} == names, level


def test_the_oracle_measures_its_candidate_from_level_2():
  """Catches the measure call dropped at level 2 or made at level 1 (one answer turn below level 2)."""
  for level, calls in [(1, [[]]), (2, [["measure"], []])]:
    task = cad.generate(split="train", difficulty=level, n=1, seed=0)[0]
    assert [[c["name"] for c in turn["tool_calls"]] for turn in task.oracle] == calls, level
    measure = [{"name": "measure", "arguments": {"solid": task["target"]}}]
    assert task.oracle[0]["tool_calls"] == (measure if level == 2 else [])
    assert task.max_turns == 6


def _nodes(node):
  yield node
  for key, value in node.items():
    if key in ("union", "difference", "intersection"):
      for child in value:
        yield from _nodes(child)


def test_no_part_is_moved_to_the_origin():
  """Catches `"at": [0, 0, 0]` written out (a hole or tube at the centre): the simplest answer has none."""
  seen = 0
  for level in (2, 3, 4):
    for i in range(30):
      for node in _nodes(cad.draw("heldout", level, 1, i).solid):
        assert node.get("at", [1]) != [0, 0, 0], node
        seen += "at" not in node
  assert seen > 100
