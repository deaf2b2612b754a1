"""Web tasks at levels 0-3 read through the site they ship (each test names the mistake it
catches): hops, long pages and site size as the levels state, and the answer on the last page."""

import re

import pytest

from rl.tasks.generators import web
from rl.tools import search

HOPS = {0: 0, 1: 0, 2: 1, 3: 2}  # links followed: one hop, one hop on long pages, two hops, three hops
KINDS = {"motors", "labs", "foods", "systems", "textiles", "shipping", "energy", "pharma"}


def _tasks(level):
  return [task for split in ("train", "heldout")
          for task in web.generate(split=split, difficulty=level, n=12, seed=3)]


@pytest.mark.parametrize("level", range(4))
def test_hops_long_pages_and_the_answer_on_the_last_page(level):
  """Catches a level following fewer links than stated, level 3 pages left short (the fact on the
  first page of a page), a path that comes back to a page already read, a final answer that is not
  on the last page opened."""
  for task in _tasks(level):
    calls = [c for turn in task.oracle for c in turn["tool_calls"]]
    opened = [c["arguments"]["url"] for c in calls if c["name"] == "open"]
    assert len(opened) == HOPS[level] + 1 and len(set(opened)) == len(opened), (task.id, opened)
    assert (any(c["name"] == "find" for c in calls)) == (level in (1, 3)), task.id
    browser, text = search.Browser(search.Site(task["pages"])), {p["url"]: p["text"] for p in task["pages"]}
    for before, after in zip(opened[:-1], opened[1:], strict=True):
      assert f"]({after})" in text[before].split("## Facts")[1], (task.id, before, after)  # a fact's link
    answer = task["answer"]
    shown = f"{answer:,}" if isinstance(answer, int) and answer >= 10_000 else str(answer)
    facts = text[opened[-1]].split("## Facts")[1]
    value = re.escape(shown)
    assert re.search(rf"^- [A-Za-z]+: (\[{value}\]\(.*\)|{value})$", facts, re.M), task.id
    for url in opened:
      first = browser.call("open", {"url": url})
      pages = int(re.search(r"page 0 of (\d+)", first)[1])
      if level in (1, 3):  # long pages: the Facts list lies past the first page
        assert pages >= 2 and "## Facts" not in first, (task.id, url)
      else:
        assert pages == 1 and "## Facts" in first, (task.id, url)


def test_the_site_grows_with_the_level_and_names_share_no_word():
  """Catches one site size for every level, and two entities sharing a word of their name (a search
  for one then lists the other)."""
  sizes = []
  for level in range(4):
    tasks = _tasks(level)
    sizes.append(min(len(t["pages"]) for t in tasks))
    for task in tasks:
      words = [w.lower() for p in task["pages"] for w in p["title"].split() if w.lower() not in KINDS]
      assert len(words) == len(set(words)), task.id
  assert sizes == sorted(sizes) and len(set(sizes)) == 4, sizes
