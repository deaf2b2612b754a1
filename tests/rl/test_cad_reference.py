"""CAD targets against the part their description states (each test names the mistake it catches).

The oracle answers the target itself, so its replay scores 1 whatever the target is; here each
template's solid is measured and compared with the volume and extent worked out by hand from the
dimensions it describes. A cylinder is the inscribed 96-gon prism (area 48 r² sin(π/48), see
tests/rl/test_cad.py); a ball lies between the polyhedron bounds cos³(2π/96) and 1 of (4/3)πR³.
"""

import math
import random

import pytest

from rl.tasks.generators import cad
from rl.tools import solids

SEEDS = range(12)


def _cyl(r, h):
  return 48 * r * r * math.sin(math.pi / 48) * h


def _ball_bounds(r):
  exact = 4 / 3 * math.pi * r ** 3
  return exact * math.cos(2 * math.pi / 96) ** 3, exact


def _expected_volume(name, p):
  """The part's volume by hand from its described dimensions (holes and cuts lie wholly inside)."""
  if name == "post_on_base":
    sx, sy, sz = p["base"]
    return sx * sy * sz + _cyl(p["r"], p["h"])
  if name == "plate_hole":
    w, d, t = p["plate"]
    return w * d * t - _cyl(p["r"], t)
  if name == "tube":
    return _cyl(p["outer"], p["h"]) - _cyl(p["inner"], p["h"])
  if name == "l_block":
    return p["w"] * p["d"] * p["t"] + p["t"] * p["d"] * (p["h"] - p["t"])
  if name == "plate_two_holes":
    w, d, t = p["plate"]
    return w * d * t - 2 * _cyl(p["r"], t)
  if name == "boss_flange":
    (boss_r, boss_h), t = p["boss"], p["t"]
    return p["s"] ** 2 * t + _cyl(boss_r, boss_h) - _cyl(p["bore"], t + boss_h)
  if name == "bolted_flange":
    t = p["t"]
    return _cyl(p["R"], t) - _cyl(p["bore"], t) - 4 * _cyl(p["hole"], t)
  if name == "table":
    w, d, t = p["top"]
    return w * d * t + 4 * p["leg"] ** 2 * p["h"]
  if name == "drilled_bracket":
    w, d, t, h, r = p["w"], p["d"], p["t"], p["h"], p["r"]
    window = t * (2 * r) ** 2 if p["wz"] is not None else 0
    return w * d * t + t * d * (h - t) - _cyl(r, t) - window
  if name == "open_box":
    (w, d, h), wall = p["size"], p["wall"]
    return w * d * h - (w - 2 * wall) * (d - 2 * wall) * (h - wall) - _cyl(p["hole"], wall)
  return None


def _expected_box(name, p):
  """(min, max) corners by hand, for templates whose extent is set by boxes and discs."""
  if name == "post_on_base":
    sx, sy, sz = p["base"]
    return (-sx / 2, -sy / 2, -sz / 2), (sx / 2, sy / 2, sz / 2 + p["h"])
  if name == "l_block":
    w, d, t = p["w"], p["d"], p["t"]
    return (-w / 2, -d / 2, -t / 2), (w / 2, d / 2, -t / 2 + p["h"])
  if name == "boss_flange":
    s, t = p["s"], p["t"]
    return (-s / 2, -s / 2, -t / 2), (s / 2, s / 2, t / 2 + p["boss"][1])
  if name == "table":
    w, d, t = p["top"]
    return (-w / 2, -d / 2, -t / 2 - p["h"]), (w / 2, d / 2, t / 2)
  if name == "drilled_bracket":
    w, d, t = p["w"], p["d"], p["t"]
    return (-w / 2, -d / 2, -t / 2), (w / 2, d / 2, -t / 2 + p["h"])
  if name == "open_box":
    w, d, h = p["size"]
    return (-w / 2, -d / 2, -h / 2), (w / 2, d / 2, h / 2)
  return None


def _instances(make):
  for seed in SEEDS:
    yield make(random.Random(seed))


@pytest.mark.parametrize("make", [m for level in cad.LEVELS[1:] for m in level if m.__name__ not in
                                  ("_moved", "_rounded_block", "_dimpled_block", "_dumbbell")],
                         ids=lambda m: m.__name__)
def test_box_and_cylinder_parts_have_the_described_volume_and_extent(make):
  """Catches a bore that stops short of the plate's bottom, legs or a post sunk into the body, a
  tray without its floor, an upright hanging off the foot's end, a window cut into empty air, two
  holes drilled in one place, legs set outside the top."""
  for inst in _instances(make):
    name = inst.template
    m = solids.measure(inst.solid)
    assert m.components == 1, (name, inst.params)
    assert m.volume == pytest.approx(_expected_volume(name, inst.params), rel=1e-9), (name, inst.params)
    box = _expected_box(name, inst.params)
    if box is not None:
      assert m.bbox_min == pytest.approx(box[0], abs=1e-9), (name, inst.params)
      assert m.bbox_max == pytest.approx(box[1], abs=1e-9), (name, inst.params)


def test_dimples_are_half_balls_cut_from_the_top_face():
  """Catches the dimple balls centred inside the block (a hidden void, twice the volume removed)."""
  for inst in _instances(cad._dimpled_block):
    (sx, sy, sz), r = inst.params["size"], inst.params["r"]
    lo, hi = _ball_bounds(r)  # two half balls: one ball's volume
    m = solids.measure(inst.solid)
    assert sx * sy * sz - hi <= m.volume <= sx * sy * sz - lo, inst.params
    assert m.bbox_max[2] == pytest.approx(sz / 2, abs=1e-9) and m.components == 1


def test_dumbbell_balls_sit_on_the_rod_ends():
  """Catches balls off the rod's end faces (the length along z is the rod plus a radius each end)."""
  for inst in _instances(cad._dumbbell):
    big, length = inst.params["R"], inst.params["len"]
    m = solids.measure(inst.solid)
    assert m.bbox_min[2] == pytest.approx(-length / 2 - big, abs=1e-9), inst.params
    assert m.bbox_max[2] == pytest.approx(length / 2 + big, abs=1e-9) and m.components == 1


def test_moved_primitive_is_centred_where_described():
  """Catches a moved primitive left at the origin or moved to another point."""
  for inst in _instances(cad._moved):
    p, m = inst.params["at"], solids.measure(inst.solid)
    centre = [(a + b) / 2 for a, b in zip(m.bbox_min, m.bbox_max, strict=True)]
    assert centre == pytest.approx(list(p), abs=1e-9) and p != (0, 0, 0), inst.params
