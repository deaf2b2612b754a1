"""The web domain: search/open/find on a hand-made site, the python-docs corpus, the generator."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from rl.envs.base import EnvContext, make_env, replay
from rl.tasks.generators import web
from rl.tasks.schema import CORPORA, parse_task
from rl.tools import corpora, search
from serving.types import ToolCall

LONG = "\n".join(f"Line {i}: filler text about rivers and hills number {i}." for i in range(120))
PAGES = [
  {"url": "https://t.local/Alpha", "title": "Alpha",
   "text": "# Alpha\n\nAlpha is a city in [Beta](https://t.local/Beta).\n\n- Population: 1,234\n"},
  {"url": "https://t.local/Beta", "title": "Beta",
   "text": "# Beta\n\nBeta is a country. Its capital is [Alpha](https://t.local/Alpha).\n"},
  {"url": "https://t.local/Gamma", "title": "Gamma",
   "text": "# Gamma\n\nGamma mentions Alpha once.\n" + LONG + "\n- Founded: 1801\n"},
  {"url": "https://t.local/Delta", "title": "Delta", "text": "Nothing to see."},
]


def _task(**extra):
  obj = {"id": "web-t", "domain": "web", "prompt": "What is the population of Alpha?", "answer": 1234,
         "pages": PAGES, **extra}
  return parse_task(obj)


@pytest.fixture()
def env():
  e = make_env(_task(), EnvContext())
  yield e
  e.close()


def _call(env, name, **arguments):
  return env.execute(ToolCall(id="c", name=name, arguments=json.dumps(arguments)))


def test_reset_gives_the_prompt_and_three_tools(env):
  message, tools = env.reset()
  assert message == "What is the population of Alpha?"
  assert [t.name for t in tools] == ["search", "open", "find"]
  assert all(t.parameters["type"] == "object" for t in tools)


def test_search_ranks_the_named_page_first(env):
  result = _call(env, "search", query="alpha")
  assert not result.error
  lines = result.content.splitlines()
  assert lines[1] == "1. Alpha" and lines[2].strip() == "url: https://t.local/Alpha"
  assert "Gamma" in result.content and "Delta" not in result.content  # only pages sharing a word
  assert "No pages match" in _call(env, "search", query="zebra").content


def test_open_shows_page_count_text_and_links(env):
  result = _call(env, "open", url="https://t.local/Alpha")
  assert not result.error
  assert "page 0 of 1" in result.content and "- Population: 1,234" in result.content
  assert "Links on this page:\n- Beta: https://t.local/Beta" in result.content


def test_long_documents_are_paged(env):
  first = _call(env, "open", url="https://t.local/Gamma").content
  n = len(search.split_pages(PAGES[2]["text"]))
  assert n > 1 and f"page 0 of {n}" in first and "page=1" in first
  last = _call(env, "open", url="https://t.local/Gamma", page=n - 1).content
  assert f"page {n - 1} of {n}" in last and "- Founded: 1801" in last
  assert _call(env, "open", url="https://t.local/Gamma", page=float(n - 1)).content == last  # JSON's 1.0


def test_find_searches_the_whole_open_document(env):
  assert _call(env, "find", text="founded").error  # nothing open yet
  _call(env, "open", url="https://t.local/Gamma")
  found = _call(env, "find", text="Founded:").content
  n = len(search.split_pages(PAGES[2]["text"]))
  assert found.startswith("1 line(s)") and f"page {n - 1}: - Founded: 1801" in found
  many = _call(env, "find", text="filler").content
  assert many.startswith("120 line(s)") and "more matching lines not shown" in many
  assert "No line" in _call(env, "find", text="zebra").content


@pytest.mark.parametrize("name,arguments,message", [
  ("search", {"query": "  ?! "}, "query is empty"),
  ("open", {"url": "https://t.local/Alpah"}, "Did you mean https://t.local/Alpha"),
  ("open", {"url": "https://t.local/Alpha", "page": 3}, "out of range"),
  ("open", {"url": "https://t.local/Alpha", "page": -1}, "out of range"),
  ("search", {}, "bad arguments"),
  ("browse", {"url": "x"}, "unknown tool"),
])
def test_bad_calls_are_error_results(env, name, arguments, message):
  result = _call(env, name, **arguments)
  assert result.error and message in result.content


def test_url_forgives_spaces_and_trailing_slash(env):
  assert not _call(env, "open", url=" https://t.local/Beta/ ").error


def test_split_pages_keeps_lines_whole():
  text = PAGES[2]["text"]
  pages = search.split_pages(text, size=300)
  assert "".join(pages) == text and all(len(p) <= 300 for p in pages)
  assert all(p.endswith("\n") for p in pages[:-1])
  assert search.split_pages("x" * 25, size=10) == ["x" * 10, "x" * 10, "x" * 5]


def test_site_index_is_cached_by_content():
  assert search.site_for(PAGES) is search.site_for([dict(p) for p in PAGES])
  changed = [*PAGES[:-1], {**PAGES[-1], "text": "Something else."}]
  assert search.site_for(changed) is not search.site_for(PAGES)


def test_grade_uses_the_last_answer_tag(env):
  assert env.grade("<answer>99</answer> no, <answer>1,234</answer>").reward == 1.0
  assert env.grade("<answer>1235</answer>").reward == 0.0


# ---- the python-docs corpus -------------------------------------------------------------------


def test_python_docs_corpus():
  pages = corpora.load_corpus("python-docs")
  urls = [p["url"] for p in pages]
  assert len(urls) == len(set(urls)) > 500
  by_url = {p["url"]: p for p in pages}
  assert "Signature: `dedent(text)`" in by_url["python-docs/textwrap.dedent"]["text"]
  assert "python-docs/topics/assert" in by_url
  assert not any(" at 0x" in p["text"] for p in pages)
  with pytest.raises(ValueError, match="built-in corpora: python-docs"):
    corpora.load_corpus("wikipedia")
  assert set(CORPORA) == set(corpora._BUILDERS)  # every corpus the schema accepts can be built


def test_python_docs_is_the_same_in_every_process():
  code = ("import hashlib, json; from rl.tools import corpora; "
          "print(hashlib.sha256(json.dumps(corpora.load_corpus('python-docs')).encode()).hexdigest())")
  keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
  assert keys == {hashlib.sha256(json.dumps(corpora.load_corpus("python-docs")).encode()).hexdigest()}


def test_corpus_task_searches_the_corpus():
  task = parse_task({"id": "d", "domain": "web", "prompt": "Which module defines dedent?",
                     "answer": "textwrap", "corpus": "python-docs"})
  env = make_env(task, EnvContext())
  result = _call(env, "search", query="dedent")
  assert "url: python-docs/textwrap.dedent" in result.content.splitlines()[2]


# ---- the generator --------------------------------------------------------------------------


def _entities(tasks):
  return {p["title"] for t in tasks for p in t["pages"]}


def test_generated_tasks_round_trip_and_are_deterministic():
  for level in range(web.MAX_DIFFICULTY + 1):
    tasks = web.generate(split="train", difficulty=level, n=3, seed=7)
    again = web.generate(split="train", difficulty=level, n=3, seed=7)
    assert [t.to_json() for t in tasks] == [t.to_json() for t in again]
    for t in tasks:
      assert parse_task(json.loads(json.dumps(t.to_json()))) == t
      assert len(t.oracle) <= t.max_turns
    assert tasks[0].to_json() != web.generate(split="train", difficulty=level, n=1, seed=8)[0].to_json()


def test_splits_share_no_entity():
  for level in range(web.MAX_DIFFICULTY):
    train = web.generate(split="train", difficulty=level, n=10, seed=0)
    heldout = web.generate(split="heldout", difficulty=level, n=10, seed=0)
    assert not _entities(train) & _entities(heldout)
  asked = {s: {name for t in web.generate(split=s, difficulty=4, n=20, seed=0) for name in t.meta["subjects"]}
           for s in ("train", "heldout")}
  assert not asked["train"] & asked["heldout"]


def test_heldout_top_level_uses_the_real_corpus():
  for t in web.generate(split="heldout", difficulty=web.MAX_DIFFICULTY, n=3, seed=0):
    assert t["corpus"] == "python-docs" and "pages" not in t.fields


def _check_oracles(n, splits=("train", "heldout")):
  ctx = EnvContext()
  for level in range(web.MAX_DIFFICULTY + 1):
    for split in splits:
      tasks = web.generate(split=split, difficulty=level, n=n, seed=0)
      errors = []
      keep_errors = lambda call, result, errors=errors: errors.append(result) if result.error else None
      good = [replay(t, ctx, on_result=keep_errors).reward for t in tasks]
      bad = [replay(t, ctx, web.corrupt_oracle(t)).reward for t in tasks]
      assert good == [1.0] * n and not errors, (level, split)
      assert bad == [0.0] * n, (level, split)


def test_oracle_scores_one_and_corruption_zero():
  _check_oracles(n=6)


@pytest.mark.slow
def test_oracle_scores_one_and_corruption_zero_at_scale():
  _check_oracles(n=200)


@pytest.mark.parametrize("domain", ["math", "web", "docqa", "cad", "terminal", "code"])
def test_generators_refuse_a_split_or_level_they_do_not_have(domain):
  # Every domain's generator (here with web's tests). Called directly (not through
  # rl.tasks.generators.generate), a level of -1 once gave the top level's tasks under a d-1 id
  # (math, cad), and an unknown split redrew forever (web, docqa).
  import importlib
  gen = importlib.import_module(f"rl.tasks.generators.{domain}")
  for split, level, words in [("train", -1, "0.."), ("train", gen.MAX_DIFFICULTY + 1, "0.."),
                              ("train", True, "0.."), ("test", 0, "split must be one of")]:
    with pytest.raises(ValueError, match=words):
      gen.generate(split=split, difficulty=level, n=1, seed=0)
