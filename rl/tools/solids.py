"""Solids of the CAD task grammar as manifold3d meshes: build, measure, compare.

The grammar is the one `rl.tasks.schema.validate_solid` checks (boxes, z-axis cylinders and
spheres centred on the origin, an optional `at` translation on any node, union / difference /
intersection). Curved surfaces are polygonal: every cylinder has `RESOLUTION` sides and every
sphere is a geodesic polyhedron with `RESOLUTION` segments around, for the target and for the
answer alike, so a correct answer matches its target exactly and the approximation never
costs reward. Boolean operations are manifold3d's exact mesh booleans
(https://github.com/elalish/manifold).

The score of an answer is the volumetric intersection over union (Jaccard index)
vol(a ∩ b) / vol(a ∪ b): 1 for the same solid, 0 for disjoint ones, and it punishes both
missing and extra material. IoU alone does not say whether every feature is there: a plate
without its hole, a bracket without its drillings keep an IoU of 0.94-0.998, so a part is right
(`match`) when it is also closer to the target than its smallest feature (`smallest_feature`:
the least volume one part of the target adds or removes).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import manifold3d

from rl.tasks.schema import TaskError, validate_solid

# Sides of every cylinder and segments around every sphere. 96 keeps the polygonal volume
# within 0.1% of the round one (cylinder: sin(2π/n)/(2π/n) ≈ 1 - 7e-4) at a few thousand
# triangles per sphere, so a boolean of several parts still takes milliseconds.
RESOLUTION = 96
# Primitives (boxes, cylinders, spheres) in one solid. A mesh boolean holds the GIL (and so the
# whole event loop) while it runs, and its time grows faster than the primitives: near-coincident
# spheres measured 0.25 s for 16, 0.8 s for 32 and 15 s for a difference of 64. The largest
# generated part has 6 (rl/tasks/generators/cad.py: the bolted flange), so 16 leaves room for
# a looser answer while one measure or grade stays well under a second.
MAX_PRIMITIVES = 16
_PRIMITIVES = ("box", "cylinder", "sphere")

GRAMMAR = (
  'A solid is a JSON object: {"box": [sx, sy, sz]} (full edge lengths along x, y, z, centred on '
  'the origin), {"cylinder": [radius, height]} (axis along z, centred on the origin), '
  '{"sphere": radius} (centred on the origin). Any solid may carry "at": [x, y, z] to move its '
  'centre there. Combine solids with {"union": [s1, s2, ...]}, {"difference": [s1, s2, ...]} '
  '(s1 minus all the others) or {"intersection": [s1, s2, ...]}.'
)


class SolidError(ValueError):
  """A solid that is not valid JSON or breaks the grammar; the message names the path."""


@dataclasses.dataclass(frozen=True)
class Measure:
  """What `measure` reports about a solid.

  Attributes:
    volume: enclosed volume (0 for an empty solid).
    bbox_min, bbox_max: corners of the axis-aligned bounding box; None when empty.
    components: number of connected pieces.
  """
  volume: float
  bbox_min: tuple[float, float, float] | None
  bbox_max: tuple[float, float, float] | None
  components: int

  def to_json(self, digits: int = 4) -> dict[str, Any]:
    """A JSON report rounded to `digits` decimals (what the model sees)."""
    r = lambda xs: [round(x, digits) + 0.0 for x in xs]  # + 0.0 turns -0.0 into 0.0
    box = None
    if self.bbox_min is not None:
      box = {"min": r(self.bbox_min), "max": r(self.bbox_max),
             "size": r([hi - lo for lo, hi in zip(self.bbox_min, self.bbox_max, strict=True)])}
    return {"volume": round(self.volume, digits) + 0.0, "bounding_box": box, "components": self.components}


_TOO_DEEP = ("{field} is nested too deeply to read; a solid is a few primitives joined by union, "
             "difference or intersection, such as {{\"union\": [{{\"box\": [1, 1, 1]}}, {{\"sphere\": 1}}]}}")


def parse_solid(value: Any, field: str = "solid") -> dict[str, Any]:
  """A validated solid from a JSON object or a string holding one.

  Raises:
    SolidError: not JSON, not an object, or not in the grammar (names the path, e.g.
      `solid.union[1].box`, and what was expected there), or more than MAX_PRIMITIVES
      primitives (refused before any mesh is built).
  """
  if isinstance(value, str):
    text = _strip_fence(value)
    try:
      value = json.loads(text)
    except json.JSONDecodeError as e:
      raise SolidError(f"{field} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                       f"expected a solid such as {{\"box\": [1, 2, 3]}}") from None
    except RecursionError:
      raise SolidError(_TOO_DEEP.format(field=field)) from None
    except ValueError as e:  # not a JSONDecodeError: an integer past Python's 4300-digit limit
      raise SolidError(f"{field} is not valid JSON ({e}); expected a solid such as "
                       "{\"box\": [1, 2, 3]}") from None
  try:
    validate_solid(value, field, field)
  except RecursionError:
    raise SolidError(_TOO_DEEP.format(field=field)) from None
  except TaskError as e:
    # TaskError reads "<where>: field '<path>' <message>"; keep the path and the message.
    message = str(e).removeprefix(f"{field}: field '{e.field}' ")
    raise SolidError(f"invalid solid at '{e.field}': {message}") from None
  count = primitive_count(value)
  if count > MAX_PRIMITIVES:
    raise SolidError(f"{field} has {count} primitives (boxes, cylinders and spheres); the limit is "
                     f"{MAX_PRIMITIVES} per solid: model the part with fewer, larger primitives")
  return value


def primitive_count(solid: dict[str, Any]) -> int:
  """How many boxes, cylinders and spheres a solid of the grammar holds (however nested)."""
  count, stack = 0, [solid]
  while stack:
    node = stack.pop()
    kind = next(k for k in node if k != "at")
    if kind in _PRIMITIVES:
      count += 1
    else:
      stack.extend(node[kind])
  return count


def _strip_fence(text: str) -> str:
  """The text without a surrounding markdown code fence (```json ... ```), which models add."""
  s = text.strip()
  if s.startswith("```") and s.endswith("```") and len(s) >= 6:
    s = s[3:-3]
    first, _, rest = s.partition("\n")
    s = rest if first.strip().isalpha() or not first.strip() else s
  return s.strip()


def build(solid: Any, field: str = "solid") -> manifold3d.Manifold:
  """The manifold3d mesh of a solid (a JSON object or a string holding one); validates first."""
  return _build(parse_solid(solid, field))


def _build(node: dict[str, Any]) -> manifold3d.Manifold:
  kind = next(k for k in node if k != "at")
  arg = node[kind]
  if kind == "box":
    mesh = manifold3d.Manifold.cube(tuple(float(a) for a in arg), True)
  elif kind == "cylinder":
    radius, height = map(float, arg)
    mesh = manifold3d.Manifold.cylinder(height, radius, radius, RESOLUTION, True)
  elif kind == "sphere":
    mesh = manifold3d.Manifold.sphere(float(arg), RESOLUTION)
  else:
    parts = [_build(child) for child in arg]
    mesh = parts[0]
    if kind == "union":
      mesh = manifold3d.Manifold.batch_boolean(parts, manifold3d.OpType.Add) if len(parts) > 1 else mesh
    elif kind == "difference":
      for other in parts[1:]:
        mesh = mesh - other
    else:
      for other in parts[1:]:
        mesh = mesh ^ other
  if "at" in node:
    mesh = mesh.translate(tuple(float(a) for a in node["at"]))
  return mesh


def _mesh(solid: Any) -> manifold3d.Manifold:
  return solid if isinstance(solid, manifold3d.Manifold) else build(solid)


def measure(solid: Any) -> Measure:
  """Volume, bounding box and number of connected components of a solid or mesh."""
  mesh = _mesh(solid)
  if mesh.is_empty():
    return Measure(0.0, None, None, 0)
  box = mesh.bounding_box()
  return Measure(float(mesh.volume()), tuple(box[:3]), tuple(box[3:]), len(mesh.decompose()))


def canonical(solid: dict[str, Any]) -> str:
  """A solid as text that equal solids share (2 == 2.0, `at` [0, 0, 0] == no `at`)."""
  def norm(node):
    if isinstance(node, dict):
      return {k: norm(v) for k, v in node.items() if not (k == "at" and not any(v))}
    if isinstance(node, list):
      return [norm(v) for v in node]
    return float(node)
  return json.dumps(norm(solid), sort_keys=True)


def _volumes(ma: manifold3d.Manifold, mb: manifold3d.Manifold) -> tuple[float, float, float]:
  """(vol(a), vol(b), vol(a ∩ b))."""
  va, vb = float(ma.volume()), float(mb.volume())
  return va, vb, (float((ma ^ mb).volume()) if va > 0 and vb > 0 else 0.0)


def _jaccard(va: float, vb: float, inter: float) -> float:
  """IoU from the volumes: vol(a ∪ b) = vol(a) + vol(b) - vol(a ∩ b), one boolean instead of two;
  two empty solids are the same solid."""
  union = va + vb - inter
  return min(1.0, max(0.0, inter / union)) if union > 0 else float(va == vb == 0)


def _without_one_part(node: dict[str, Any]) -> list[dict[str, Any]]:
  """The solid with one part left out, for each part: every subtrahend of a difference (not the
  body it cuts) and every member of a union, at any depth."""
  kind = next(k for k in node if k != "at")
  if kind not in ("union", "difference", "intersection"):
    return []
  kids, out = node[kind], []
  removable = range(len(kids)) if kind == "union" else range(1, len(kids)) if kind == "difference" else ()
  for i in removable:
    rest = kids[:i] + kids[i + 1:]
    out.append({**node, kind: rest} if len(rest) > 1 else {**rest[0], "at": _shift(rest[0], node)})
  for i, kid in enumerate(kids):
    out += [{**node, kind: kids[:i] + [v] + kids[i + 1:]} for v in _without_one_part(kid)]
  return out


def _shift(child: dict[str, Any], parent: dict[str, Any]) -> list[float]:
  """The `at` of a lone child lifted out of its parent: the two translations added."""
  a, b = child.get("at", (0, 0, 0)), parent.get("at", (0, 0, 0))
  return [float(x) + float(y) for x, y in zip(a, b, strict=True)]


@functools.lru_cache(maxsize=256)
def _smallest_feature(text: str) -> float | None:
  # Built without the grammar's checks: the target passed them, and a lifted child's summed `at`
  # may leave the range an answer is held to.
  target = json.loads(text)
  volume = float(_build(target).volume())
  changes = [abs(float(_build(v).volume()) - volume) for v in _without_one_part(target)]
  changes = [c for c in changes if c > 1e-9 * max(volume, 1.0)]  # a part that changes nothing
  return min(changes) if changes else None


def smallest_feature(solid: dict[str, Any]) -> float | None:
  """The least volume one part of `solid` adds or removes (None: a single primitive, or no part
  changes anything). Cached by the solid's canonical form: a group of episodes grades one target."""
  return _smallest_feature(canonical(parse_solid(solid)))


@dataclasses.dataclass(frozen=True)
class Match:
  """An answer against its target: IoU, the volume in one but not the other (`apart`), the
  target's smallest feature, and whether the answer is the target part (`success`)."""
  iou: float
  success: bool
  answer_volume: float
  target_volume: float
  apart: float
  smallest_feature: float | None


# IoU a matching part needs besides its features (rl/envs/cad.py's success).
MATCH_IOU = 0.9


def match(answer: dict[str, Any], target: dict[str, Any]) -> Match:
  """Scores `answer` against `target`. It is the target part when IoU >= MATCH_IOU and the volume
  apart is below half the target's smallest feature: no hole, boss or drilling is missing or
  extra, while a slightly different radius or position still counts."""
  feature = smallest_feature(target)
  if canonical(parse_solid(answer)) == canonical(parse_solid(target)):
    volume = float(build(target).volume())
    return Match(1.0, True, volume, volume, 0.0, feature)  # no (slow, coincident) boolean
  va, vt, inter = _volumes(build(answer), build(target))
  score, apart = _jaccard(va, vt, inter), va + vt - 2 * inter
  success = score >= MATCH_IOU and (feature is None or apart < feature / 2)
  return Match(score, success, va, vt, apart, feature)


def iou(a: Any, b: Any) -> float:
  """Volumetric intersection over union of two solids (or meshes), in [0, 1].

  Two empty solids are the same solid (1.0); one empty and one not share nothing (0.0).
  Two solids written the same way score 1.0 without a boolean: coincident meshes are the
  slowest case of a mesh boolean (every face overlaps), and every oracle replay is one.
  """
  if isinstance(a, dict) and isinstance(b, dict) and canonical(parse_solid(a)) == canonical(parse_solid(b)):
    return 1.0
  return _jaccard(*_volumes(_mesh(a), _mesh(b)))
