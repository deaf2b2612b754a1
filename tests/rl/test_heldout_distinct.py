"""Held-out tasks are an evaluation set: no question twice (rl.tasks.generators.generate)."""

import pytest

from model.config import ConfigError
from rl.tasks import generators
from rl.tasks.generators import distinct_tasks, question_key
from rl.tasks.schema import parse_task

DOMAINS = ("math", "web", "docqa", "code", "terminal", "cad")


def _first_distinct_by_prompt(tasks, n):
  """The reference: the first n tasks whose (prompt, answer) was not seen before."""
  seen, out = set(), []
  for t in tasks:
    if (t.prompt, str(t["answer"])) not in seen:
      seen.add((t.prompt, str(t["answer"])))
      out.append(t.id)
  return out[:n]


def test_math_level_0_heldout_has_no_question_twice():
  """200 held-out draws of level 0 held 146 questions: 54 repeats counted as independent evidence."""
  got = generators.generate("math", split="heldout", difficulty=0, n=200)
  assert len({(t.prompt, str(t["answer"])) for t in got}) == 200
  drawn = generators.module("math").generate(split="heldout", difficulty=0, n=400, seed=0)
  assert [t.id for t in got] == _first_distinct_by_prompt(drawn, 200)


def test_train_tasks_are_drawn_with_replacement_as_before():
  got = generators.generate("math", split="train", difficulty=0, n=300)
  assert [t.to_json() for t in got] == [
      t.to_json() for t in generators.module("math").generate(split="train", difficulty=0, n=300, seed=0)]
  assert len({t.prompt for t in got}) < 300  # the small train pool repeats; training may


def test_a_docqa_question_about_another_document_is_another_question():
  drawn = generators.module("docqa").generate(split="heldout", difficulty=0, n=40, seed=0)
  assert len({t.prompt for t in drawn}) < 40  # the same question text, different documents
  assert [t.id for t in generators.generate("docqa", split="heldout", difficulty=0, n=40)] == [
      t.id for t in drawn]


def _pool(size, calls):
  def draw(m):
    calls.append(m)
    return [parse_task({"id": f"t{i}", "domain": "math", "prompt": f"q{i % size}", "answer": i % size},
                       f"t{i}") for i in range(m)]
  return draw


def test_distinct_tasks_draws_more_until_n_and_keeps_the_first_of_each():
  calls = []
  got = distinct_tasks(_pool(5, calls), 5, "pool")
  assert [t.id for t in got] == ["t0", "t1", "t2", "t3", "t4"] and calls == [5]
  calls.clear()
  assert [t.id for t in distinct_tasks(_pool(3, calls), 2, "pool")] == ["t0", "t1"] and calls == [2]


def test_an_exhausted_pool_is_refused_naming_how_many_it_holds():
  calls = []
  with pytest.raises(ConfigError, match=r"pool: 48 draws hold only 5 distinct tasks, fewer than n=6; .* "
                                        r"Ask for n <= 5"):
    distinct_tasks(_pool(5, calls), 6, "pool")
  assert calls == [6, 12, 24, 48]  # doubling, capped at MAX_DRAWS_PER_TASK * n
  assert generators.MAX_DRAWS_PER_TASK == 8


def test_the_question_key_ignores_id_oracle_and_meta():
  a = parse_task({"id": "a", "domain": "math", "prompt": "1+1?", "answer": 2, "meta": {"x": 1}}, "a")
  b = parse_task({"id": "b", "domain": "math", "prompt": "1+1?", "answer": 2}, "b")
  c = parse_task({"id": "c", "domain": "math", "prompt": "1+1?", "answer": 3}, "c")
  assert question_key(a) == question_key(b) != question_key(c)


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_generator_is_prefix_stable(domain):
  """distinct_tasks relies on it: task i depends on (split, difficulty, seed, i) alone."""
  mod = generators.module(domain)
  for level in (0, mod.MAX_DIFFICULTY):
    few = mod.generate(split="heldout", difficulty=level, n=2, seed=3)
    more = mod.generate(split="heldout", difficulty=level, n=4, seed=3)
    assert [t.to_json() for t in few] == [t.to_json() for t in more[:2]], (domain, level)


def test_numpy_integers_draw_the_same_tasks_and_other_types_are_refused():
  """A numpy level or count (from an array of levels) failed with "must be an integer ... got
  np.int64(2)"; a bool level drew level 1 and a float n failed inside range()."""
  import numpy as np

  plain = generators.generate("math", split="heldout", difficulty=2, n=5, seed=3)
  got = generators.generate("math", split="heldout", difficulty=np.int64(2), n=np.int32(5), seed=np.uint8(3))
  assert [t.to_json() for t in got] == [t.to_json() for t in plain]
  assert type(got[0].meta["difficulty"]) is int and type(got[0].meta["seed"]) is int
  for kw, says in [(dict(difficulty=True, n=2), "difficulty for math must be an integer in 0..4; got True"),
                   (dict(difficulty=2.0, n=2), "must be an integer in 0..4; got 2.0"),
                   (dict(difficulty=2, n=2.0), "n must be an integer >= 1; got 2.0"),
                   (dict(difficulty=2, n=False), "n must be an integer >= 1; got False")]:
    with pytest.raises(ValueError, match=says):
      generators.generate("math", split="train", **kw)
  with pytest.raises(ValueError, match=r"difficulty for math: pass a Python int, int\(difficulty\)"):
    generators.module("math").generate(split="train", difficulty=np.int64(2), n=2, seed=0)
