"""CAD tasks: a part described in words and dimensions, answered as a solid of the grammar.

The model reads a description ("a plate 40 × 30 × 5 mm with a through hole of radius 4 mm
centred at (10, -5)") and answers with a JSON solid; the grader scores the volumetric IoU
with the target (rl/envs/cad.py). Levels grow from one primitive at the origin to parts of
several primitives under nested boolean operations:

  0  one primitive centred on the origin (box, cylinder, sphere)
  1  one moved primitive, or a cylinder standing on a box (a union)
  2  one boolean of two primitives: plate with a hole, tube, rounded block, L-block
  3  three primitives: plate with two holes, flange with a boss and bore, dimpled block,
     dumbbell
  4  four or more under nested booleans: bolted flange, table, drilled bracket, open box

Dimensions are integers in millimetres drawn per task. Split hygiene: an instance is the
template name with its parameters, assigned to one split by `common.split_of`; a generator
redraws until the instance belongs to its split, so train and heldout never share a part.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from typing import Any

from rl.tasks.generators import common
from rl.tasks.schema import Task, parse_task
from rl.tools import solids

DOMAIN = "cad"
MAX_DIFFICULTY = 4
MAX_TURNS = 6
_MAX_DRAWS = 1000
# corrupt_oracle's wrong dimension: the first primitive shrinks to this fraction along one
# axis; if that still overlaps too much (a small part of a big solid) the whole solid moves.
_CORRUPT_SCALE = 0.6
_CORRUPT_MAX_IOU = 0.8


@dataclasses.dataclass(frozen=True)
class Instance:
  """One drawn part: its template, the parameters that identify it, the solid, the words."""
  template: str
  params: dict[str, Any]
  solid: dict[str, Any]
  description: str
  plan: str


def _n(x: float) -> int | float:
  """A coordinate as the JSON number a person would write (2, not 2.0; 2.5 stays)."""
  x = round(float(x), 6)
  return int(x) if x == int(x) else x


def _at(node: dict[str, Any], x: float, y: float, z: float) -> dict[str, Any]:
  """The node moved to (x, y, z); no `at` when that is the origin (the simplest answer)."""
  if (x, y, z) == (0, 0, 0):
    return node
  return {**node, "at": [_n(x), _n(y), _n(z)]}


def _xyz(p) -> str:
  return "(" + ", ".join(str(_n(v)) for v in p) + ")"


# ---- level 0: one primitive centred on the origin -----------------------------------------


def _words(solid: dict[str, Any]) -> tuple[str, str]:
  """A primitive in words, and the plan that builds it (without its position)."""
  if "box" in solid:
    sx, sy, sz = solid["box"]
    return (f"A rectangular box {sx} mm long along x, {sy} mm along y and {sz} mm along z",
            f"One box with full edge lengths {sx}, {sy}, {sz}")
  if "cylinder" in solid:
    r, h = solid["cylinder"]
    return (f"A solid cylinder of radius {r} mm and height {h} mm with its axis along z",
            f"One cylinder of radius {r} and height {h}; the grammar's cylinders already lie along z")
  return f"A solid ball of radius {solid['sphere']} mm", f"One sphere of radius {solid['sphere']}"


def _primitive(rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any]]:
  kind = rng.choice(("box", "cylinder", "sphere"))
  if kind == "box":
    size = [rng.randint(1, 12) for _ in range(3)]
    return kind, {"size": tuple(size)}, {"box": size}
  if kind == "cylinder":
    r, h = rng.randint(1, 8), rng.randint(1, 15)
    return kind, {"r": r, "h": h}, {"cylinder": [r, h]}
  r = rng.randint(1, 10)
  return kind, {"r": r}, {"sphere": r}


def _centred(rng: random.Random) -> Instance:
  kind, params, solid = _primitive(rng)
  words, plan = _words(solid)
  return Instance(kind, params, solid, f"{words}, centred on the origin.",
                  f"{plan}. Primitives are centred on the origin already, so no 'at' is needed.")


# ---- level 1 ------------------------------------------------------------------------------


def _moved(rng: random.Random) -> Instance:
  kind, params, solid = _primitive(rng)
  p = tuple(rng.randint(-10, 10) for _ in range(3))
  if p == (0, 0, 0):
    p = (1, 0, 0)
  words, plan = _words(solid)
  return Instance(f"moved_{kind}", {**params, "at": p}, _at(solid, *p),
                  f"{words}, with its centre at {_xyz(p)}.",
                  f"{plan}, moved with 'at': {list(p)} so that its centre is there.")


def _post_on_base(rng: random.Random) -> Instance:
  sx, sy, sz = rng.randint(6, 20), rng.randint(6, 20), rng.randint(1, 5)
  r, h = rng.randint(1, min(sx, sy) // 2 - 1), rng.randint(2, 15)
  zc = sz / 2 + h / 2
  solid = {"union": [{"box": [sx, sy, sz]}, _at({"cylinder": [r, h]}, 0, 0, zc)]}
  return Instance("post_on_base", {"base": (sx, sy, sz), "r": r, "h": h}, solid,
                  f"A base block {sx} × {sy} × {sz} mm (x × y × z) centred on the origin, with a round "
                  f"post of radius {r} mm and height {h} mm standing on the middle of its top face.",
                  f"Union of the block and a cylinder. The block's top face is at z = {_n(sz / 2)}, so the "
                  f"post (height {h}) has its centre at z = {_n(sz / 2)} + {_n(h / 2)} = {_n(zc)}.")


# ---- level 2: one boolean of two primitives -----------------------------------------------


def _plate_hole(rng: random.Random) -> Instance:
  w, d, t = rng.randint(10, 40), rng.randint(10, 40), rng.randint(1, 6)
  r = rng.randint(1, min(w, d) // 4)
  hx = rng.randint(-(w // 2 - r - 1), w // 2 - r - 1)
  hy = rng.randint(-(d // 2 - r - 1), d // 2 - r - 1)
  solid = {"difference": [{"box": [w, d, t]}, _at({"cylinder": [r, t + 2]}, hx, hy, 0)]}
  return Instance("plate_hole", {"plate": (w, d, t), "r": r, "hole": (hx, hy)}, solid,
                  f"A flat plate {w} × {d} × {t} mm (x × y × z) centred on the origin, with a round "
                  f"through hole of radius {r} mm whose axis runs along z through (x, y) = ({hx}, {hy}).",
                  f"Difference: the plate box minus a cylinder of radius {r} at ({hx}, {hy}, 0). I make the "
                  f"cylinder {t + 2} tall, longer than the plate thickness {t}, so it cuts cleanly through.")


def _tube(rng: random.Random) -> Instance:
  outer = rng.randint(3, 12)
  inner, h = rng.randint(1, outer - 1), rng.randint(2, 20)
  solid = {"difference": [{"cylinder": [outer, h]}, {"cylinder": [inner, h + 2]}]}
  return Instance("tube", {"outer": outer, "inner": inner, "h": h}, solid,
                  f"A tube (hollow cylinder) {h} mm long with outer radius {outer} mm and inner radius "
                  f"{inner} mm, its axis along z, centred on the origin, open at both ends.",
                  f"Difference: a cylinder of radius {outer}, height {h}, minus a coaxial cylinder of "
                  f"radius {inner} made taller ({h + 2}) so both ends are open.")


def _rounded_block(rng: random.Random) -> Instance:
  a = 2 * rng.randint(2, 8)
  # a/2 < R < a·√3/2: the ball trims the corners but not the faces' middles.
  R = rng.randint(a // 2 + 1, max(a // 2 + 1, int(a * 0.866) - 1))
  solid = {"intersection": [{"box": [a, a, a]}, {"sphere": R}]}
  return Instance("rounded_block", {"a": a, "R": R}, solid,
                  f"A cube of side {a} mm centred on the origin whose corners are rounded off by a ball: "
                  f"the part is the material common to the cube and a ball of radius {R} mm centred on "
                  "the origin.",
                  f"Intersection of the cube ({a} on every side) and the sphere of radius {R}.")


def _l_block(rng: random.Random) -> Instance:
  w, d, t = rng.randint(8, 20), rng.randint(4, 12), rng.randint(2, 4)
  h = rng.randint(6, 20)
  # A foot along x at the bottom and an upright at its -x end, both d deep along y.
  foot, upright = (w, d, t), (t, d, h)
  upright_at = (-w / 2 + t / 2, 0, -t / 2 + h / 2)
  solid = {"union": [{"box": list(foot)}, _at({"box": list(upright)}, *upright_at)]}
  return Instance("l_block", {"w": w, "d": d, "t": t, "h": h}, solid,
                  f"An L-shaped block: a foot {w} × {d} × {t} mm (x × y × z) centred on the origin, and "
                  f"an upright wall {t} mm thick (x), {d} mm deep (y) and {h} mm tall (z) whose -x face is "
                  f"flush with the foot's -x end and whose bottom is level with the foot's bottom, so the "
                  f"upright spans z from {_n(-t / 2)} to {_n(-t / 2 + h)}.",
                  f"Union of two boxes. The upright's x centre is {_n(-w / 2)} + {_n(t / 2)} = "
                  f"{_n(upright_at[0])}; its z centre is {_n(-t / 2)} + {_n(h / 2)} = {_n(upright_at[2])}.")


# ---- level 3: three primitives ------------------------------------------------------------


def _plate_two_holes(rng: random.Random) -> Instance:
  w, d, t = rng.randint(20, 50), rng.randint(10, 30), rng.randint(2, 6)
  r = rng.randint(1, max(1, min(d // 4, (w // 2 - 3) // 2)))
  off = rng.randint(r + 2, w // 2 - r - 1)
  solid = {"difference": [{"box": [w, d, t]}, _at({"cylinder": [r, t + 2]}, -off, 0, 0),
                          _at({"cylinder": [r, t + 2]}, off, 0, 0)]}
  return Instance("plate_two_holes", {"plate": (w, d, t), "r": r, "off": off}, solid,
                  f"A plate {w} × {d} × {t} mm (x × y × z) centred on the origin with two round through "
                  f"holes of radius {r} mm along z, centred at x = -{off} and x = {off} on the y = 0 line.",
                  f"Difference: the plate minus two cylinders of radius {r} at (±{off}, 0, 0), each {t + 2} "
                  f"tall so they pass through the {t} mm plate.")


def _boss_flange(rng: random.Random) -> Instance:
  s, t = rng.randint(12, 30), rng.randint(2, 5)
  boss_r, boss_h = rng.randint(3, s // 2 - 1), rng.randint(3, 12)
  bore = rng.randint(1, boss_r - 1)
  zc = t / 2 + boss_h / 2
  total = t + boss_h
  solid = {"difference": [{"union": [{"box": [s, s, t]}, _at({"cylinder": [boss_r, boss_h]}, 0, 0, zc)]},
                          _at({"cylinder": [bore, total + 2]}, 0, 0, (boss_h) / 2)]}
  return Instance("boss_flange", {"s": s, "t": t, "boss": (boss_r, boss_h), "bore": bore}, solid,
                  f"A square plate {s} × {s} × {t} mm (x × y × z) centred on the origin with a round boss "
                  f"of radius {boss_r} mm rising {boss_h} mm from the middle of its top face, and a bore of "
                  f"radius {bore} mm along z through both boss and plate.",
                  f"Difference of (union of plate and boss cylinder at z = {_n(t / 2)} + {_n(boss_h / 2)} = "
                  f"{_n(zc)}) minus a bore cylinder. The part spans z from {_n(-t / 2)} to "
                  f"{_n(t / 2 + boss_h)}, so a bore {total + 2} tall centred at z = {_n(boss_h / 2)} cuts "
                  "through all of it.")


def _dimpled_block(rng: random.Random) -> Instance:
  sx, sy, sz = rng.randint(10, 30), rng.randint(10, 30), rng.randint(6, 16)
  r = rng.randint(2, max(2, min((sx // 2 - 1) // 2, sy // 2 - 1, sz - 1)))
  off = rng.randint(r, sx // 2 - r - 1)  # two distinct dimples, both inside the top face
  solid = {"difference": [{"box": [sx, sy, sz]}, _at({"sphere": r}, -off, 0, sz / 2),
                          _at({"sphere": r}, off, 0, sz / 2)]}
  return Instance("dimpled_block", {"size": (sx, sy, sz), "r": r, "off": off}, solid,
                  f"A block {sx} × {sy} × {sz} mm (x × y × z) centred on the origin with two hemispherical "
                  f"dimples of radius {r} mm cut into its top face, the balls' centres on the top face at "
                  f"(x, y) = (-{off}, 0) and ({off}, 0).",
                  f"Difference: the block minus two spheres of radius {r} centred at (±{off}, 0, "
                  f"{_n(sz / 2)}) on the top face (z = {_n(sz / 2)}); half of each ball is inside.")


def _dumbbell(rng: random.Random) -> Instance:
  R, length = rng.randint(2, 6), rng.randint(6, 30)
  r = rng.randint(1, R - 1)
  solid = {"union": [_at({"sphere": R}, 0, 0, -length / 2), {"cylinder": [r, length]},
                     _at({"sphere": R}, 0, 0, length / 2)]}
  return Instance("dumbbell", {"R": R, "r": r, "len": length}, solid,
                  f"A dumbbell along z centred on the origin: a rod of radius {r} mm and length {length} mm, "
                  f"with a ball of radius {R} mm centred on each end of the rod.",
                  f"Union of a cylinder (radius {r}, height {length}) and two spheres of radius {R} at "
                  f"z = ±{_n(length / 2)}, the rod's end faces.")


# ---- level 4: nested booleans of four or more primitives ----------------------------------


def _bolted_flange(rng: random.Random) -> Instance:
  R, t = rng.randint(12, 30), rng.randint(2, 6)
  bore = rng.randint(2, R // 3)
  hole = rng.randint(1, 3)
  bolt = rng.randint(bore + hole + 1, R - hole - 1)
  holes = [(bolt, 0), (0, bolt), (-bolt, 0), (0, -bolt)]
  solid = {"difference": [{"cylinder": [R, t]}, {"cylinder": [bore, t + 2]}]
           + [_at({"cylinder": [hole, t + 2]}, x, y, 0) for x, y in holes]}
  return Instance("bolted_flange", {"R": R, "t": t, "bore": bore, "hole": hole, "bolt": bolt}, solid,
                  f"A round flange: a disc of radius {R} mm and thickness {t} mm, axis along z, centred on "
                  f"the origin, with a central bore of radius {bore} mm and four bolt holes of radius {hole} "
                  f"mm on a bolt circle of radius {bolt} mm, at the +x, +y, -x and -y positions; all holes "
                  "go through.",
                  f"Difference: the disc minus the bore and four cylinders of radius {hole} at (±{bolt}, 0) "
                  f"and (0, ±{bolt}), each {t + 2} tall to pass through.")


def _table(rng: random.Random) -> Instance:
  w, d, t = rng.randint(20, 60), rng.randint(20, 40), rng.randint(2, 4)
  leg, h = rng.randint(2, 4), rng.randint(10, 40)
  inset = rng.randint(0, 4)
  lx, ly = w / 2 - inset - leg / 2, d / 2 - inset - leg / 2
  lz = -t / 2 - h / 2
  legs = [_at({"box": [leg, leg, h]}, sx * lx, sy * ly, lz) for sx in (-1, 1) for sy in (-1, 1)]
  solid = {"union": [{"box": [w, d, t]}] + legs}
  return Instance("table", {"top": (w, d, t), "leg": leg, "h": h, "inset": inset}, solid,
                  f"A table: a top {w} × {d} × {t} mm (x × y × z) centred on the origin and four square legs "
                  f"{leg} × {leg} mm in section and {h} mm long hanging straight down from the top's bottom "
                  f"face, each leg {inset} mm in from the two nearest edges of the top.",
                  f"Union of the top and four leg boxes. Leg centres: x = ±({_n(w / 2)} - {inset} - "
                  f"{_n(leg / 2)}) = ±{_n(lx)}, y = ±{_n(ly)}, z = {_n(-t / 2)} - {_n(h / 2)} = {_n(lz)}.")


def _drilled_bracket(rng: random.Random) -> Instance:
  w, d, t = rng.randint(20, 40), rng.randint(10, 20), rng.randint(2, 5)
  h = rng.randint(10, 30)
  r = rng.randint(1, max(1, min(d, h) // 5))
  base = {"box": [w, d, t]}
  wall_at = (-w / 2 + t / 2, 0, -t / 2 + h / 2)
  wall = _at({"box": [t, d, h]}, *wall_at)
  hx = rng.randint(-w // 2 + t + r + 1, w // 2 - r - 1)
  wall_hole_z = rng.randint(int(t / 2) + r + 1, int(-t / 2 + h) - r - 1) if h - t > 2 * r + 3 else None
  cuts = [_at({"cylinder": [r, t + 2]}, hx, 0, 0)]
  words = f"a vertical hole of radius {r} mm through the foot at (x, y) = ({hx}, 0)"
  if wall_hole_z is not None:
    # Cylinders only lie along z in this grammar, so the upright gets a square window instead.
    cuts.append(_at({"box": [t + 2, 2 * r, 2 * r]}, wall_at[0], 0, wall_hole_z))
    words += (f", and a square window {2 * r} × {2 * r} mm (y × z) through the upright, centred at "
              f"y = 0, z = {wall_hole_z}")
  solid = {"difference": [{"union": [base, wall]}] + cuts}
  return Instance("drilled_bracket", {"w": w, "d": d, "t": t, "h": h, "r": r, "hx": hx,
                                      "wz": wall_hole_z}, solid,
                  f"An angle bracket: a foot {w} × {d} × {t} mm (x × y × z) centred on the origin and an "
                  f"upright {t} mm thick (x), {d} mm deep (y), {h} mm tall (z) flush with the foot's -x end, "
                  f"both starting at the foot's bottom face (z = {_n(-t / 2)}); {words}.",
                  f"Difference of (union of foot and upright at ({_n(wall_at[0])}, 0, {_n(wall_at[2])})) "
                  f"minus the cuts, each longer than the {t} mm it passes through.")


def _open_box(rng: random.Random) -> Instance:
  w, d, h = rng.randint(10, 40), rng.randint(10, 40), rng.randint(6, 25)
  wall = rng.randint(1, 3)
  inner = [w - 2 * wall, d - 2 * wall, h]
  # Within the floor along x as well as y: a hole wider than a narrow tray cut both side walls.
  slot = rng.randint(1, max(1, min(w - 2 * wall, d - 2 * wall, h) // 4))
  solid = {"difference": [{"box": [w, d, h]}, _at({"box": inner}, 0, 0, wall),
                          _at({"cylinder": [slot, h + 2]}, 0, 0, 0)]}
  return Instance("open_box", {"size": (w, d, h), "wall": wall, "hole": slot}, solid,
                  f"An open-topped box (a tray): outside {w} × {d} × {h} mm (x × y × z) centred on the "
                  f"origin, walls and floor {wall} mm thick, no lid, and a round drain hole of radius "
                  f"{slot} mm through the middle of the floor.",
                  f"Difference: the outer box minus an inner box {inner[0]} × {inner[1]} × {h} raised by "
                  f"{wall} (bottom at z = {_n(-h / 2 + wall)}, top above the rim so the top is open), minus "
                  f"a cylinder of radius {slot} through the floor.")


Template = Callable[[random.Random], Instance]
LEVELS: tuple[tuple[Template, ...], ...] = (
  (_centred,),
  (_moved, _post_on_base),
  (_plate_hole, _tube, _rounded_block, _l_block),
  (_plate_two_holes, _boss_flange, _dimpled_block, _dumbbell),
  (_bolted_flange, _table, _drilled_bracket, _open_box),
)
assert len(LEVELS) == MAX_DIFFICULTY + 1


def instance_key(inst: Instance) -> tuple:
  """What identifies a part for split assignment: its template and parameters."""
  return (DOMAIN, inst.template, json.dumps(inst.params, sort_keys=True))


def prompt_of(inst: Instance) -> str:
  return (f"Model this part as a solid. Lengths are in millimetres.\n\n{inst.description}\n\n"
          f"{solids.GRAMMAR} You may call the `measure` tool on a candidate solid to see its volume, "
          "bounding box and number of separate pieces. Give the final solid as JSON inside "
          "<answer></answer>.")


def _answer(solid: dict[str, Any]) -> str:
  return f"<answer>{json.dumps(solid, separators=(', ', ': '))}</answer>"


def _oracle(inst: Instance, difficulty: int) -> list[dict[str, Any]]:
  """Plan, then (from level 2) check the candidate with `measure`, then answer."""
  if difficulty < 2:
    return [common.turn(thinking=inst.plan, content=_answer(inst.solid))]
  m = solids.measure(inst.solid).to_json()
  size = " × ".join(str(_n(v)) for v in m["bounding_box"]["size"])
  pieces = "one piece" if m["components"] == 1 else f"{m['components']} pieces"
  check = (f"measure: volume {m['volume']}, bounding box {size}, {pieces}. The bounding box matches "
           "the described outside dimensions, so the solid is right.")
  return [common.turn(thinking=inst.plan + " Let me measure the candidate before answering.",
                      calls=[("measure", {"solid": inst.solid})]),
          common.turn(thinking=check, content=_answer(inst.solid))]


def draw(split: str, difficulty: int, seed: int, index: int) -> Instance:
  """The part of one task: drawn from the level's templates until it belongs to `split`."""
  rng = common.task_rng(DOMAIN, split, difficulty, seed, index)
  for _ in range(_MAX_DRAWS):
    inst = rng.choice(LEVELS[difficulty])(rng)
    if common.split_of(instance_key(inst)) == split:
      return inst
  raise RuntimeError(f"no {split} instance at cad level {difficulty} after {_MAX_DRAWS} draws")


def generate(*, split: str, difficulty: int, n: int, seed: int = 0) -> list[Task]:
  """`n` CAD tasks; deterministic in (split, difficulty, seed)."""
  common.check_args(DOMAIN, split, difficulty, MAX_DIFFICULTY, seed, n)
  tasks = []
  for i in range(n):
    inst = draw(split, difficulty, seed, i)
    obj = {"id": common.task_id(DOMAIN, split, difficulty, seed, i), "domain": DOMAIN,
           "prompt": prompt_of(inst), "target": inst.solid, "max_turns": MAX_TURNS,
           "oracle": _oracle(inst, difficulty),
           "meta": common.meta(DOMAIN, split, difficulty, seed, template=inst.template, index=i)}
    tasks.append(parse_task(obj, obj["id"]))
  return tasks


def _first_primitive(node: dict[str, Any]) -> dict[str, Any]:
  kind = next(k for k in node if k != "at")
  return node if kind in ("box", "cylinder", "sphere") else _first_primitive(node[kind][0])


def corrupted_solid(target: dict[str, Any]) -> dict[str, Any]:
  """A solid with IoU < 0.8 against `target`: a wrong dimension, else the part misplaced.

  The first primitive (the main body of every template) shrinks along one axis; where that
  changes too little (a small first part of a big solid) the whole solid moves by its own
  width, which leaves no overlap at all.
  """
  wrong = json.loads(json.dumps(target))
  prim = _first_primitive(wrong)
  kind = next(k for k in prim if k != "at")
  if kind == "sphere":
    prim["sphere"] = _n(prim["sphere"] * _CORRUPT_SCALE)
  else:
    prim[kind] = [_n(prim[kind][0] * _CORRUPT_SCALE)] + prim[kind][1:]
  if solids.iou(wrong, target) < _CORRUPT_MAX_IOU:
    return wrong
  m = solids.measure(target)
  width = m.bbox_max[0] - m.bbox_min[0]
  return {"union": [target], "at": [_n(width + 1), 0, 0]}


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """The oracle with a wrong final solid (IoU < 0.8), which must not count as a success."""
  turns = [dict(t) for t in task.oracle]
  turns[-1] = {**turns[-1], "content": _answer(corrupted_solid(task["target"]))}
  return turns
