"""Search, corpus and solid tools against references written out here (each test names the
mistake it catches): BM25 scores by the plain formula, snippet and paging bounds, feature
volumes of box solids computed by hand."""

import json
import math

import pytest

from rl.tools import corpora, search, solids

# ---- BM25 -------------------------------------------------------------------------------------

# Titles are indexed three times; link targets are dropped (only the label is a word).
BM25_PAGES = [
  {"url": "u/river", "title": "River Velm", "text": "The river velm runs past the old mill. [Mill](u/mill)"},
  {"url": "u/mill", "title": "Old Mill", "text": "A mill on the river, rebuilt twice; the mill is old."},
  {"url": "u/hill", "title": "Hill", "text": "A hill with no river and no mill in sight at all, only grass."},
  {"url": "u/grass", "title": "Grass", "text": "grass grass grass"},
]
# The index text of each page by hand: 3 x title words, then the text words (link label, no url).
BM25_TOKENS = [
  ["river", "velm"] * 3 + "the river velm runs past the old mill mill".split(),
  ["old", "mill"] * 3 + "a mill on the river rebuilt twice the mill is old".split(),
  ["hill"] * 3 + "a hill with no river and no mill in sight at all only grass".split(),
  ["grass"] * 3 + ["grass"] * 3,
]


def _bm25(docs, query_terms, k1=1.2, b=0.75):
  """Okapi BM25 with Lucene's idf log(1 + (N - df + 0.5) / (df + 0.5)); each query term once."""
  n, avg = len(docs), sum(len(d) for d in docs) / len(docs)
  scores = {}
  for term in set(query_terms):
    df = sum(term in d for d in docs)
    if df == 0:
      continue
    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
    for i, d in enumerate(docs):
      tf = d.count(term)
      if tf:
        scores[i] = scores.get(i, 0.0) + idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(d) / avg))
  return scores


@pytest.mark.parametrize("query", ["mill", "river mill", "velm velm river", "grass", "u", "mill hill no"])
def test_bm25_scores_match_the_plain_formula(query):
  """Catches a wrong idf, length norm or tf factor, a repeated query word counted twice, a title
  weight other than 3, link urls indexed as words."""
  site = search.Site(BM25_PAGES)
  expected = _bm25(BM25_TOKENS, query.split())
  got = site.scores(query)
  assert set(got) == set(expected)
  for i, score in expected.items():
    assert got[i] == pytest.approx(score, rel=1e-12), (query, i)


def test_search_keeps_the_top_five_in_site_order_on_ties():
  pages = [{"url": f"u/{i}", "title": f"Page {i}", "text": "same words here"} for i in range(7)]
  results = search.Site(pages).search("same words")
  assert [r["url"] for r in results] == ["u/0", "u/1", "u/2", "u/3", "u/4"]


def test_snippet_skips_headings_takes_the_first_best_line_and_cuts_at_200():
  text = "# Alpha heading\nAlpha is [here](u/x) today.\nalpha again\nnone"
  assert search.snippet(text, "alpha") == "Alpha is here today."
  long_line = "alpha " + "w" * 194  # exactly 200 characters
  assert search.snippet(long_line, "alpha") == long_line
  longer = long_line + "z"
  assert search.snippet(longer, "alpha") == long_line[:197] + "..."


def test_split_pages_of_exactly_one_page():
  assert search.split_pages("x" * 10, size=10) == ["x" * 10]
  assert search.split_pages("ab\ncd\n", size=6) == ["ab\ncd\n"]


FIND_PAGES = [{"url": "u/a", "title": "A", "text": "\n".join([f"Needle line {i}" for i in range(20)]
                                                            + ["NEEDLE " + "q" * 400, "Founded: 1801"])},
              {"url": "u/one", "title": "One", "text": "one short page"}]


def test_find_ignores_case_and_bounds_its_output():
  browser = search.Browser(search.Site(FIND_PAGES))
  browser.open("u/a")
  assert browser.find("FOUNDED") == "1 line(s) of u/a contain 'FOUNDED':\npage 0: Founded: 1801"
  twenty = browser.find("line")
  assert twenty.startswith("20 line(s)") and "more matching lines" not in twenty
  many = browser.find("needle").splitlines()
  assert many[0].startswith("21 line(s)") and many[-1] == "[1 more matching lines not shown]"
  long_hit = browser.find("qqq").splitlines()[1]
  assert long_hit == "page 0: " + ("NEEDLE " + "q" * 400)[:297] + "..."


def test_open_refuses_the_page_past_the_last_and_offers_no_more_there():
  browser = search.Browser(search.Site(FIND_PAGES))
  with pytest.raises(search.ToolError, match="page 1 is out of range"):
    browser.open("u/one", page=1)
  assert "for more" not in browser.open("u/one")


def test_site_cache_is_least_recently_used():
  first = [{"url": "u/lru", "title": "LRU", "text": "kept because used"}]
  site = search.site_for(first)
  fill = lambda i: search.site_for([{"url": "u/x", "title": "Filler", "text": f"lru filler {i}"}])
  for i in range(search._CACHE_SIZE - 1):
    fill(i)
  assert search.site_for(first) is site  # used again: now the most recent
  fill(search._CACHE_SIZE)
  assert search.site_for(first) is site


# ---- the python-docs corpus ------------------------------------------------------------------


class _Documented:
  """Summary at 0x7f00deadbeef here."""

  def public(self, x=1):
    """Public summary.

    More text."""

  def _private(self):
    """Hidden."""


def test_corpus_text_has_no_addresses_sorted_sets_and_cut_docs():
  assert corpora.safe_repr(frozenset({"b", "c", "a"})) == "frozenset({'a', 'b', 'c'})"
  assert corpora.safe_repr(set()) == "set()"
  assert corpora.safe_repr(object()) == "<object object>"
  assert corpora._doc(_Documented) == "Summary here."
  long_doc = type("Long", (), {"__doc__": "d" * 20000})
  assert corpora._doc(long_doc) == "d" * 12000 + "\n[documentation cut]"
  assert corpora._method_lines(_Documented) == ["- `public(self, x=1)`: Public summary."]


def test_members_include_the_c_accelerator():
  names = [n for n, _ in corpora.members("heapq")]
  assert {"heappush", "heappop", "heapify", "merge", "nlargest"} <= set(names)  # heappush: _heapq


# ---- solids --------------------------------------------------------------------------------------


def test_smallest_feature_of_a_difference_never_drops_the_body():
  # body 2x2x2 = 8; cutter 2x2x1.5 at x+1.5 overlaps x in [0.5, 1]: 0.5*2*1.5 = 1.5; target 6.5.
  # Without the cutter: 8 (change 1.5). The body is not a feature (alone, the cutter is 6: 0.5).
  target = {"difference": [{"box": [2, 2, 2]}, {"box": [2, 2, 1.5], "at": [1.5, 0, 0]}]}
  assert solids.smallest_feature(target) == pytest.approx(1.5, rel=1e-9)


def test_smallest_feature_of_a_union_counts_every_member():
  # A 1x1x1 box (first) apart from a 2x2x2 box: leaving out the small one changes 1, the big 8.
  target = {"union": [{"box": [1, 1, 1], "at": [5, 0, 0]}, {"box": [2, 2, 2]}]}
  assert solids.smallest_feature(target) == pytest.approx(1.0, rel=1e-9)


def test_smallest_feature_of_a_lifted_child_keeps_the_parent_translation():
  # The 2-box minus a unit box at its corner (7), moved to x=10, beside a 4-box at the origin (64):
  # without the unit cut the 2-box stays at x=10 (72: change 1); at the origin it would hide in
  # the 4-box (64: change 7). Leaving out the 4-box changes 64, the moved part 7.
  moved = {"difference": [{"box": [2, 2, 2]}, {"box": [1, 1, 1], "at": [0.5, 0.5, 0.5]}], "at": [10, 0, 0]}
  target = {"union": [{"box": [4, 4, 4]}, moved]}
  assert solids.smallest_feature(target) == pytest.approx(1.0, rel=1e-9)


def test_a_part_that_changes_nothing_is_no_feature():
  # The unit box lies inside the 4-box: leaving it out changes 0, which is not a feature (63 is).
  target = {"union": [{"box": [4, 4, 4]}, {"box": [1, 1, 1]}]}
  assert solids.smallest_feature(target) == pytest.approx(63.0, rel=1e-9)


def _plate(hole_x):
  return {"difference": [{"box": [10, 10, 2]}, {"box": [2, 2, 4], "at": [hole_x, 0, 0]}]}


@pytest.mark.parametrize("shift,success", [(0.4, True), (0.6, False)])
def test_match_reports_volume_apart_and_needs_it_below_half_a_feature(shift, success):
  # Plate 10x10x2 (200) with a 2x2 hole (8 removed: the feature). Moving the hole by s in x
  # leaves 2*2*s of the plate on each side that the other lacks: apart 4s*2 = 8s; IoU is
  # (192 - 4s) / (192 + 4s). Success needs apart < 8 / 2.
  result = solids.match(_plate(shift), _plate(0))
  assert result.smallest_feature == pytest.approx(8.0, rel=1e-9)
  assert result.apart == pytest.approx(8 * shift, rel=1e-9)
  assert result.iou == pytest.approx((192 - 4 * shift) / (192 + 4 * shift), rel=1e-9)
  assert (result.answer_volume, result.target_volume) == (pytest.approx(192), pytest.approx(192))
  assert result.success is success


def test_canonical_ignores_a_zero_translation_and_int_float():
  assert solids.canonical({"box": [2, 2, 2], "at": [0, 0, 0]}) == solids.canonical({"box": [2.0, 2, 2]})
  assert solids.canonical({"box": [2, 2, 2], "at": [0, 0, 1]}) != solids.canonical({"box": [2, 2, 2]})


def test_measure_json_never_shows_negative_zero():
  m = solids.Measure(1.0, (-1e-9, 0.0, -2.0), (1.0, 1.0, 1.0), 1)
  report = m.to_json()
  assert report["bounding_box"] == {"min": [0.0, 0.0, -2.0], "max": [1.0, 1.0, 1.0], "size": [1.0, 1.0, 3.0]}
  assert "-0.0" not in json.dumps(report)


def test_the_primitive_cap_is_sixteen():
  row = lambda n: {"union": [{"box": [1, 1, 1], "at": [2 * i, 0, 0]} for i in range(n)]}
  assert solids.parse_solid(row(16)) == row(16)
  with pytest.raises(solids.SolidError, match="17 primitives"):
    solids.parse_solid(row(17))


def test_an_iou_of_exactly_the_match_threshold_matches():
  # A single box has no features: 9x1x1 inside 10x1x1 is IoU 9/10, exactly MATCH_IOU = 0.9.
  result = solids.match({"box": [9, 1, 1]}, {"box": [10, 1, 1]})
  assert result.iou == 0.9 and result.smallest_feature is None and result.success


def test_only_a_closed_fence_is_stripped():
  assert solids.parse_solid('```\n{"sphere": 1}\n```') == {"sphere": 1}
  with pytest.raises(solids.SolidError, match="not valid JSON"):
    solids.parse_solid('```{"sphere": 1}abc')
