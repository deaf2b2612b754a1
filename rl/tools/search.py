"""An offline website and the `search` / `open` / `find` tools over it.

A site is a list of pages {url, title, text}. The text is markdown; links to other pages are
written inline as `[label](url)` (the only link syntax: `open` lists the links of the page it
shows, so the model can follow them without guessing URLs). URLs are opaque keys: any string
without spaces or parentheses, e.g. `https://wiki.local/Velmora` or `python-docs/json.dumps`.

Ranking is Okapi BM25 (Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and
Beyond", 2009) with Lucene's non-negative IDF, over the title (counted `TITLE_WEIGHT` times, so
an entity's own page beats the pages that merely mention it) and the text with link targets
removed. It is a small inverted index in pure Python rather than `bm25s`, because `bm25s`
imports JAX at import time (2.5 s and an XLA runtime in every environment worker) and a site
here has at most a few thousand pages, which a posting-list scan ranks in milliseconds.

An index is built once per distinct site and cached by a hash of its content (`site_for`), so
hundreds of episodes over the same corpus share one index.
"""

from __future__ import annotations

import collections
import difflib
import hashlib
import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rl.envs.base import ToolError
from serving.types import Tool

PAGE_CHARS = 2000  # the most characters `open` shows as one page of a document
TOP_K = 5  # search results shown
SNIPPET_CHARS = 200
MAX_FIND_LINES = 20
TITLE_WEIGHT = 3
BM25_K1, BM25_B = 1.2, 0.75
_CACHE_SIZE = 64  # distinct sites kept indexed (a per-task site is small; a corpus is one entry)

LINK = re.compile(r"\[([^\]\n]+)\]\(([^()\s]+)\)")
_TOKEN = re.compile(r"[a-z0-9]+")

SEARCH_TOOL = Tool(
  name="search",
  description="Searches the site; returns the best-matching pages (title, url, snippet).",
  parameters={"type": "object", "properties": {
    "query": {"type": "string", "minLength": 1, "description": "keywords, e.g. an entity's name"}},
    "required": ["query"], "additionalProperties": False})
OPEN_TOOL = Tool(
  name="open",
  description=(f"Opens a page by its url and shows one page of its text ({PAGE_CHARS} characters a "
               "page, numbered from 0) with the links on it."),
  parameters={"type": "object", "properties": {
    "url": {"type": "string", "minLength": 1, "description": "a url from search results or links"},
    "page": {"type": "integer", "description": "0-based page of the document (default 0)"}},
    "required": ["url"], "additionalProperties": False})
FIND_TOOL = Tool(
  name="find",
  description="Finds the lines of the currently open document that contain the text (ignoring case).",
  parameters={"type": "object", "properties": {
    "text": {"type": "string", "minLength": 1, "description": "the text to look for"}},
    "required": ["text"], "additionalProperties": False})
TOOLS = (SEARCH_TOOL, OPEN_TOOL, FIND_TOOL)


def tokenize(text: str) -> list[str]:
  """Lower-case alphanumeric runs: `json.dumps` and `get_close_matches` split into words."""
  return _TOKEN.findall(text.lower())


def links(text: str) -> list[tuple[str, str]]:
  """The `[label](url)` links of `text`, in order, as (label, url)."""
  return LINK.findall(text)


def split_pages(text: str, size: int = PAGE_CHARS) -> list[str]:
  """Cuts a document into pages of at most `size` characters, at line ends where possible.

  Cutting at a newline keeps every line (and so every link and every `find` hit) whole on one
  page; a single line longer than `size` is cut hard.
  """
  pages, start = [], 0
  while len(text) - start > size:
    cut = text.rfind("\n", start, start + size)
    end = cut + 1 if cut > start else start + size
    pages.append(text[start:end])
    start = end
  pages.append(text[start:])
  return pages


def _index_text(title: str, text: str) -> list[str]:
  return tokenize(title) * TITLE_WEIGHT + tokenize(LINK.sub(r"\1", text))


class Site:
  """An indexed offline site: BM25 search over its pages, pages by url."""

  def __init__(self, pages: Sequence[Mapping[str, str]]):
    self.pages = [dict(url=p["url"], title=p["title"], text=p["text"]) for p in pages]
    self.by_url = {p["url"]: i for i, p in enumerate(self.pages)}
    if len(self.by_url) != len(self.pages):
      raise ValueError("a site's page urls must be unique")
    self._postings: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    self._lengths = []
    for i, page in enumerate(self.pages):
      counts = collections.Counter(_index_text(page["title"], page["text"]))
      self._lengths.append(sum(counts.values()))
      for term, tf in counts.items():
        self._postings[term].append((i, tf))
    self._avg_length = max(sum(self._lengths) / max(len(self.pages), 1), 1.0)
    self._chunks: dict[str, list[str]] = {}

  def scores(self, query: str) -> dict[int, float]:
    """BM25 score of every page that shares a term with `query` (repeated terms count once)."""
    n, out = len(self.pages), collections.defaultdict(float)
    for term in dict.fromkeys(tokenize(query)):
      posting = self._postings.get(term)
      if not posting:
        continue
      idf = math.log(1 + (n - len(posting) + 0.5) / (len(posting) + 0.5))
      for i, tf in posting:
        norm = BM25_K1 * (1 - BM25_B + BM25_B * self._lengths[i] / self._avg_length)
        out[i] += idf * tf * (BM25_K1 + 1) / (tf + norm)
    return out

  def search(self, query: str, k: int = TOP_K) -> list[dict[str, str]]:
    """The top `k` pages for `query` as {url, title, snippet}, best first (ties: site order)."""
    ranked = sorted(self.scores(query).items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return [{"url": self.pages[i]["url"], "title": self.pages[i]["title"],
             "snippet": snippet(self.pages[i]["text"], query)} for i, _ in ranked]

  def chunks(self, url: str) -> list[str]:
    """The pages (`split_pages`) of the document at `url`, cut once and kept."""
    if url not in self._chunks:
      self._chunks[url] = split_pages(self.pages[self.by_url[url]]["text"])
    return self._chunks[url]

  def resolve(self, url: str) -> str:
    """`url` as a key of the site (surrounding spaces and a trailing '/' forgiven), else ToolError."""
    for candidate in (url, url.strip(), url.strip().rstrip("/")):
      if candidate in self.by_url:
        return candidate
    close = difflib.get_close_matches(url.strip(), list(self.by_url), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else " Use search to find pages and their urls."
    raise ToolError(f"no page with url {url!r} on this site.{hint}")


def snippet(text: str, query: str, limit: int = SNIPPET_CHARS) -> str:
  """The line of `text` with the most query words (first on ties; headings skipped), links as labels."""
  words = set(tokenize(query))
  lines = [LINK.sub(r"\1", line).strip() for line in text.splitlines()]
  lines = [line for line in lines if line and not line.startswith("#")] or [""]
  best = max(lines, key=lambda line: len(words & set(tokenize(line))))
  best = " ".join(best.split())
  return best if len(best) <= limit else best[:limit - 3] + "..."


# ---- cache ---------------------------------------------------------------------------------
_sites: collections.OrderedDict[str, Site] = collections.OrderedDict()
_sites_lock = threading.Lock()


def site_key(pages: Sequence[Mapping[str, str]]) -> str:
  """A hash of the site's content (urls, titles, texts, in order)."""
  blob = json.dumps([[p["url"], p["title"], p["text"]] for p in pages], ensure_ascii=False)
  return hashlib.sha256(blob.encode()).hexdigest()


def site_for(pages: Sequence[Mapping[str, str]], key: str | None = None) -> Site:
  """The indexed Site of `pages`, built once per distinct content (an LRU of `_CACHE_SIZE`)."""
  key = key or site_key(pages)
  with _sites_lock:
    if key in _sites:
      _sites.move_to_end(key)
      return _sites[key]
  site = Site(pages)  # built outside the lock: another thread may build the same one, harmlessly
  with _sites_lock:
    _sites[key] = site
    while len(_sites) > _CACHE_SIZE:
      _sites.popitem(last=False)
  return site


# ---- the tools -----------------------------------------------------------------------------


class Browser:
  """One episode's view of a site: the tools' state is the document last opened."""

  def __init__(self, site: Site):
    self.site = site
    self.current: str | None = None

  def call(self, name: str, arguments: Mapping[str, Any]) -> str:
    """Runs `search`, `open` or `find`; raises ToolError for a bad call."""
    if name == "search":
      return self.search(arguments["query"])
    if name == "open":
      page = arguments.get("page", 0)
      # JSON Schema's "integer" admits 1.0, which then failed as a list index inside the tool.
      return self.open(arguments["url"], int(page) if isinstance(page, float) else page)
    if name == "find":
      return self.find(arguments["text"])
    raise ToolError(f"unknown tool {name!r}; the tools are search, open, find")

  def search(self, query: str) -> str:
    if not tokenize(query):
      raise ToolError("the search query is empty; give keywords, e.g. the name of what you look for")
    results = self.site.search(query)
    if not results:
      return f"No pages match {query!r}. Try other keywords (fewer, or spelled differently)."
    lines = [f"Results for {query!r}:"]
    for i, r in enumerate(results, 1):
      lines += [f"{i}. {r['title']}", f"   url: {r['url']}", f"   {r['snippet']}"]
    return "\n".join(lines)

  def open(self, url: str, page: int = 0) -> str:
    url = self.site.resolve(url)
    chunks = self.site.chunks(url)
    if not 0 <= page < len(chunks):
      raise ToolError(f"page {page} is out of range: {url} has {len(chunks)} page(s), numbered 0 to "
                      f"{len(chunks) - 1}")
    self.current = url
    title = self.site.pages[self.site.by_url[url]]["title"]
    more = f"; open it with page={page + 1} for more" if page + 1 < len(chunks) else ""
    out = [f"{title}", f"url: {url}", f"page {page} of {len(chunks)} (pages 0 to {len(chunks) - 1}{more})",
           "---", chunks[page].rstrip("\n"), "---"]
    found = list(dict.fromkeys(links(chunks[page])))
    if found:
      out.append("Links on this page:")
      out += [f"- {label}: {target}" for label, target in found]
    else:
      out.append("No links on this page.")
    return "\n".join(out)

  def find(self, text: str) -> str:
    if self.current is None:
      raise ToolError("no page is open; open a page (open with a url) before find")
    needle = text.strip().lower()
    if not needle:
      raise ToolError("find needs non-empty text to look for")
    hits = [(i, line.strip()) for i, chunk in enumerate(self.site.chunks(self.current))
            for line in chunk.splitlines() if needle in line.lower()]
    if not hits:
      return f"No line of {self.current} contains {text!r}."
    shown = [f"page {i}: {line if len(line) <= 300 else line[:297] + '...'}"
             for i, line in hits[:MAX_FIND_LINES]]
    more = len(hits) - MAX_FIND_LINES
    extra = f"\n[{more} more matching lines not shown]" if more > 0 else ""
    return f"{len(hits)} line(s) of {self.current} contain {text!r}:\n" + "\n".join(shown) + extra
