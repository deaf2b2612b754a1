"""CAD domain: solid maths against closed forms, IoU, the measure tool, the grader, generators."""

import json
import math
import random

import manifold3d
import pytest

from rl.envs.base import EnvContext, make_env, replay
from rl.tasks import generators
from rl.tasks.generators import cad as gen
from rl.tasks.generators import common
from rl.tasks.schema import parse_task
from rl.tasks.task_files import load_tasks, write_tasks
from rl.tools import solids
from serving.types import ToolCall

LEVELS = range(gen.MAX_DIFFICULTY + 1)
N = solids.RESOLUTION
CUBE = {"box": [2, 2, 2]}
SHIFTED = {"box": [2, 2, 2], "at": [1, 0, 0]}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return EnvContext(root=tmp_path_factory.mktemp("cad_envs"))


@pytest.fixture(scope="module")
def tasks_by_level():
  return {(split, d): gen.generate(split=split, difficulty=d, n=3, seed=1)
          for split in generators.SPLITS for d in LEVELS}


# ---- solids maths ----------------------------------------------------------------------------


def test_box_volume_bbox_components_exact():
  m = solids.measure({"box": [2, 3, 4], "at": [1, -1, 0.5]})
  assert m.volume == pytest.approx(24, rel=1e-12)
  assert m.bbox_min == pytest.approx((0, -2.5, -1.5)) and m.bbox_max == pytest.approx((2, 0.5, 2.5))
  assert m.components == 1


def test_cylinder_is_the_inscribed_polygon_prism():
  r, h = 3.0, 5.0
  m = solids.measure({"cylinder": [r, h]})
  # A regular N-gon inscribed in the circle has area (N/2) r² sin(2π/N) ...
  assert m.volume == pytest.approx(N / 2 * r * r * math.sin(2 * math.pi / N) * h, rel=1e-9)
  # ... which is below πr² by at most (2π/N)²/6 relatively (sin x >= x - x³/6).
  exact = math.pi * r * r * h
  assert exact * (1 - (2 * math.pi / N) ** 2 / 6) <= m.volume <= exact
  assert m.bbox_min == pytest.approx((-r, -r, -h / 2)) and m.bbox_max == pytest.approx((r, r, h / 2))


def test_sphere_within_inscribed_polyhedron_bounds():
  r = 4.0
  m = solids.measure({"sphere": r})
  exact = 4 / 3 * math.pi * r**3
  # Vertices lie on the sphere (volume below the ball); faces span at most 2π/N of arc, so
  # every face plane is at least r·cos(2π/N) from the centre (volume above that ball).
  assert exact * math.cos(2 * math.pi / N) ** 3 <= m.volume <= exact
  assert m.bbox_max == pytest.approx((r, r, r), rel=1e-9)


def test_booleans_of_boxes_are_exact():
  assert solids.measure({"union": [CUBE, SHIFTED]}).volume == pytest.approx(12, rel=1e-12)
  assert solids.measure({"difference": [CUBE, SHIFTED]}).volume == pytest.approx(4, rel=1e-12)
  assert solids.measure({"intersection": [CUBE, SHIFTED]}).volume == pytest.approx(4, rel=1e-12)
  three = {"difference": [{"box": [10, 10, 1]}, {"box": [2, 2, 3], "at": [3, 0, 0]},
                          {"box": [2, 2, 3], "at": [-3, 0, 0]}]}
  assert solids.measure(three).volume == pytest.approx(100 - 8, rel=1e-12)
  apart = solids.measure({"union": [CUBE, {"box": [2, 2, 2], "at": [5, 0, 0]}]})
  assert apart.components == 2 and apart.volume == pytest.approx(16, rel=1e-12)


def test_empty_solid_measures_zero():
  empty = {"difference": [CUBE, {"box": [3, 3, 3]}]}
  m = solids.measure(empty)
  assert (m.volume, m.bbox_min, m.components) == (0.0, None, 0)
  assert m.to_json()["bounding_box"] is None
  assert solids.iou(empty, {"intersection": [CUBE, {"box": [1, 1, 1], "at": [9, 0, 0]}]}) == 1.0
  assert solids.iou(empty, CUBE) == 0.0


def test_iou_identical_disjoint_partial():
  # Meshes skip the same-JSON shortcut, so the boolean path is tested too.
  a, b = solids.build(CUBE), solids.build({"box": [2, 2, 2]})
  assert solids.iou(a, b) == pytest.approx(1.0, abs=1e-9)
  ball = solids.build({"sphere": 2})
  assert solids.iou(ball, solids.build({"sphere": 2.0})) == pytest.approx(1.0, abs=1e-9)
  assert solids.iou(CUBE, {"box": [2.0, 2, 2], "at": [0, 0, 0]}) == 1.0
  assert solids.iou(CUBE, {"box": [2, 2, 2], "at": [2, 0, 0]}) == pytest.approx(0.0, abs=1e-12)
  assert solids.iou(CUBE, {"box": [2, 2, 2], "at": [5, 0, 0]}) == 0.0
  assert solids.iou(CUBE, SHIFTED) == pytest.approx(4 / 12, rel=1e-12)
  assert solids.iou(CUBE, {"box": [1, 1, 1]}) == pytest.approx(1 / 8, rel=1e-12)


def test_bad_solids_name_the_path():
  with pytest.raises(solids.SolidError, match=r"solid\.union\[1\]\.box.*3 edge lengths"):
    solids.parse_solid({"union": [CUBE, {"box": [1, 2]}]})
  with pytest.raises(solids.SolidError, match=r"answer\.difference\[0\]\.sphere"):
    solids.parse_solid({"difference": [{"sphere": -1}]}, "answer")
  with pytest.raises(solids.SolidError, match="exactly one of"):
    solids.parse_solid({"cube": [1, 1, 1]})
  with pytest.raises(solids.SolidError, match="not valid JSON"):
    solids.parse_solid("a box please")
  # Out-of-range sizes and positions: a box of 1e200 had measured a volume of NaN (shown to the
  # model as `"volume": NaN`, which is not JSON), and 1e-300 a volume of 0 with one component.
  with pytest.raises(solids.SolidError, match=r"solid\.box.*in \[0\.001, 10000\]"):
    solids.measure({"box": [1e200, 1e200, 1e200]})
  with pytest.raises(solids.SolidError, match=r"solid\.union\[0\]\.sphere.*a radius in"):
    solids.measure({"union": [{"sphere": 1e-300}]})
  with pytest.raises(solids.SolidError, match=r"solid\.at.*numbers in \[-10000, 10000\]"):
    solids.measure({"box": [1, 1, 1], "at": [1e308, 0, 0]})
  assert solids.measure({"box": [1e4, 1e4, 1e-3], "at": [-1e4, 0, 0]}).volume == pytest.approx(1e5)
  assert solids.parse_solid('```json\n{"sphere": 1}\n```') == {"sphere": 1}
  assert solids.parse_solid(' {"box": [1, 2, 3]} ') == {"box": [1, 2, 3]}


def test_solids_past_the_primitive_cap_are_refused_before_building(ctx):
  """measure of a union of 100 spheres held the GIL for 2.3 s (a difference of 64 for 15 s)."""
  many = {"union": [{"sphere": 9, "at": [i * 1e-3, 0, 0]} for i in range(100)]}
  with pytest.raises(solids.SolidError, match=f"100 primitives.*limit is {solids.MAX_PRIMITIVES}"):
    solids.parse_solid(many)
  env = make_env(_task(CUBE), ctx)
  refused = _measure(env, {"solid": many})
  assert refused.error and "100 primitives" in refused.content, refused.content
  nested = {"difference": [CUBE, {"union": [{"box": [1, 1, 1], "at": [i, 0, 0]} for i in range(20)]}]}
  assert _measure(env, {"solid": nested}).error  # counted through nesting: 21
  grade = env.grade(f"<answer>{json.dumps(many)}</answer>")
  assert grade.reward == 0.0 and "100 primitives" in grade.details["error"]
  at_cap = {"union": [{"box": [1, 1, 1], "at": [2 * i, 0, 0]} for i in range(solids.MAX_PRIMITIVES)]}
  assert solids.primitive_count(at_cap) == solids.MAX_PRIMITIVES
  assert json.loads(_measure(env, {"solid": at_cap}).content)["components"] == solids.MAX_PRIMITIVES


def test_generated_targets_fit_the_primitive_cap(tasks_by_level):
  """Every template's part (and its corruption, the same tree) stays well under the cap."""
  most = 0
  for templates in gen.LEVELS:
    for template in templates:
      for seed in range(100):
        most = max(most, solids.primitive_count(template(random.Random(seed)).solid))
  assert most <= solids.MAX_PRIMITIVES // 2, most
  for tasks in tasks_by_level.values():
    for task in tasks:
      solids.parse_solid(gen.corrupted_solid(task["target"]))


# ---- environment -------------------------------------------------------------------------------


def _task(target):
  return parse_task({"id": "cad-test", "domain": "cad", "prompt": "make it", "target": target})


def _measure(env, arguments):
  text = arguments if isinstance(arguments, str) else json.dumps(arguments)
  return env.execute(ToolCall(id="c0", name="measure", arguments=text))


def test_measure_tool_results_and_errors(ctx):
  env = make_env(_task(CUBE), ctx)
  prompt, tools = env.reset()
  assert prompt == "make it" and [t.name for t in tools] == ["measure"]
  ok = _measure(env, {"solid": {"box": [2, 3, 4]}})
  assert not ok.error
  report = json.loads(ok.content)
  assert report == {"volume": 24.0, "bounding_box": {"min": [-1.0, -1.5, -2.0], "max": [1.0, 1.5, 2.0],
                                                     "size": [2.0, 3.0, 4.0]}, "components": 1}
  assert json.loads(_measure(env, {"solid": '{"box": [2, 3, 4]}'}).content) == report
  bad = _measure(env, {"solid": {"union": [CUBE, {"box": [1, 2]}]}})
  assert bad.error and "solid.union[1].box" in bad.content
  garbage = _measure(env, {"solid": "garbage"})
  assert garbage.error and "not valid JSON" in garbage.content
  assert _measure(env, {"shape": CUBE}).error
  assert _measure(env, "{not json").error
  assert _measure(env, {"solid": 3}).error


def test_measure_never_depends_on_the_target(ctx):
  a, b = make_env(_task(CUBE), ctx), make_env(_task({"sphere": 7}), ctx)
  probe = {"solid": {"cylinder": [1, 2]}}
  assert _measure(a, probe).content == _measure(b, probe).content


def test_grade_is_iou_with_reasons_for_bad_answers(ctx):
  env = make_env(_task(CUBE), ctx)
  same = env.grade('Done. <answer>{"box": [2, 2, 2]}</answer>')
  assert same.reward == 1.0 and same.success
  partial = env.grade(f"<answer>{json.dumps(SHIFTED)}</answer>")
  assert partial.reward == pytest.approx(1 / 3) and not partial.success
  assert partial.details["answer_volume"] == pytest.approx(8)
  near = env.grade('<answer>{"box": [2, 2, 2.1]}</answer>')  # IoU 8/8.4 = 0.952
  assert near.success and near.reward == pytest.approx(8 / 8.4)
  last = env.grade('<answer>{"sphere": 9}</answer> no: <answer>{"box": [2, 2, 2]}</answer>')
  assert last.reward == 1.0
  for text, reason in [("a cube of side 2", "not valid JSON"), ("<answer>{\"box\": [2, 2]}</answer>",
                                                                "answer.box"),
                       ("<answer>[1, 2, 3]</answer>", "solid object"),
                       ("<answer>" + "[" * 2000 + "]" * 2000 + "</answer>", "nested too deeply")]:
    g = env.grade(text)
    assert g.reward == 0.0 and not g.success and reason in g.details["error"], (text, g.details)


PLATE = {"difference": [{"box": [60, 40, 6]}, {"cylinder": [6, 8], "at": [-11, 1, 0]}]}


def test_success_needs_every_feature(ctx):
  """IoU alone let a part without its features succeed: the plate without its hole scores IoU
  0.96. Success now also needs the volume apart below half the smallest feature."""
  env = make_env(_task(PLATE), ctx)
  assert solids.smallest_feature(PLATE) == pytest.approx(solids.measure({"cylinder": [6, 6]}).volume)
  no_hole = env.grade('<answer>{"box": [60, 40, 6]}</answer>')
  assert no_hole.reward > 0.9 and not no_hole.success
  wider = env.grade(f"<answer>{json.dumps(_hole(PLATE, [6.3, 8], [-11, 1, 0]))}</answer>")
  assert wider.success and wider.details["volume_apart"] < wider.details["smallest_feature"] / 2
  moved = env.grade(f"<answer>{json.dumps(_hole(PLATE, [6, 8], [15, 1, 0]))}</answer>")
  assert moved.reward > 0.9 and not moved.success


def _hole(plate, cylinder, at):
  return {"difference": [plate["difference"][0], {"cylinder": cylinder, "at": at}]}


def test_no_generated_part_succeeds_with_a_feature_left_out(tasks_by_level):
  """Every part of every generated target at levels 2-4 (holes, bosses, drillings, legs) is a
  feature: the target without it does not succeed, though 76% of such answers had IoU >= 0.9."""
  for (_, level), tasks in tasks_by_level.items():
    for task in tasks if level >= 2 else ():
      target = task["target"]
      assert solids.match(target, target).success
      for partial in solids._without_one_part(target):
        assert not solids.match(partial, target).success, (task.id, partial)


# ---- generator ---------------------------------------------------------------------------------


def _check_oracles(tasks, ctx):
  for task in tasks:
    errors = []
    good = replay(task, ctx, on_result=lambda call, result, errors=errors: errors.append(result.error))
    assert good.success and good.reward == 1.0, (task.id, good.details)
    assert not any(errors), task.id
    bad = replay(task, ctx, generators.corrupt_oracle(task))
    assert not bad.success and bad.reward < 0.8, (task.id, bad.details)


def test_oracle_replay_scores_one_and_corruption_fails(tasks_by_level, ctx):
  for tasks in tasks_by_level.values():
    _check_oracles(tasks, ctx)


@pytest.mark.slow
@pytest.mark.parametrize("difficulty", LEVELS)
def test_oracle_replay_200_per_level(difficulty, ctx):
  _check_oracles(gen.generate(split="train", difficulty=difficulty, n=200, seed=0), ctx)


def test_schema_round_trip(tasks_by_level, tmp_path):
  tasks = [t for ts in tasks_by_level.values() for t in ts]
  for task in tasks:
    assert parse_task(json.loads(json.dumps(task.to_json()))) == task
    assert solids.GRAMMAR in task.prompt
  path = tmp_path / "cad.jsonl"
  write_tasks(tasks, path)
  assert load_tasks(path) == tasks


def test_levels_grow_and_use_their_templates(tasks_by_level):
  for d in LEVELS:
    names = {f.__name__ for f in gen.LEVELS[d]}
    assert names, d
  level0 = [t for s in generators.SPLITS for t in tasks_by_level[(s, 0)]]
  assert all(len(t["target"]) == 1 for t in level0)  # one primitive, no `at`
  top = gen.generate(split="train", difficulty=gen.MAX_DIFFICULTY, n=20, seed=0)
  count = lambda node: 1 if len(set(node) - {"at"} & {"union", "difference", "intersection"}) == 0 else \
    sum(count(c) for k, v in node.items() if k != "at" for c in v)
  assert min(count(t["target"]) for t in top) >= 3


def test_deterministic():
  a = [t.to_json() for t in gen.generate(split="heldout", difficulty=3, n=6, seed=2)]
  assert a == [t.to_json() for t in gen.generate(split="heldout", difficulty=3, n=6, seed=2)]
  assert a != [t.to_json() for t in gen.generate(split="heldout", difficulty=3, n=6, seed=3)]


@pytest.mark.parametrize("difficulty", [0, 2])
def test_splits_share_no_instance(difficulty):
  keys = {}
  for split in generators.SPLITS:
    keys[split] = set()
    for i in range(150):
      inst = gen.draw(split, difficulty, 0, i)
      assert common.split_of(gen.instance_key(inst)) == split
      keys[split].add(gen.instance_key(inst))
  assert not keys["train"] & keys["heldout"]


def test_corrupted_solid_is_clearly_wrong(tasks_by_level):
  for tasks in tasks_by_level.values():
    for task in tasks:
      wrong = gen.corrupted_solid(task["target"])
      assert solids.iou(wrong, task["target"]) < 0.8


def test_resolution_is_shared_by_target_and_answer():
  """A cylinder written as the target was is identical as a mesh: the facets line up."""
  a = solids.build({"cylinder": [2, 3]})
  b = manifold3d.Manifold.cylinder(3, 2, 2, N, True)
  assert solids.iou(a, b) == pytest.approx(1.0, abs=1e-9)
