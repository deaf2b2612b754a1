"""Built-in web corpora: offline sites built from text every Python installation has.

`python-docs` is the language reference topics of `pydoc_data.topics` (the text of `help()`
on keywords and statements) and the API documentation of the fixed list `MODULES` of
platform-independent standard-library modules: one page per module (its docstring and links
to its members), one per public function and class (module link, signature, docstring; a
class page lists its public methods). URLs: `python-docs/<module>`, `python-docs/<module>.<name>`,
`python-docs/topics/<topic>`.

Deterministic for a given Python minor version: members are sorted, memory addresses
(`<object at 0x...>`) are removed and set-valued defaults are printed sorted, so the page text
does not depend on the process. Building takes well under a second and is cached in memory.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from typing import Any

# Pure-Python or stable C modules whose docs do not depend on the platform (no os, posixpath,
# locale, hashlib: their members differ between systems or OpenSSL builds).
MODULES = (
  "abc", "base64", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv", "dataclasses",
  "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "graphlib",
  "gzip", "heapq", "html", "html.parser", "ipaddress", "itertools", "json", "keyword", "math",
  "numbers", "operator", "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil",
  "statistics", "string", "tempfile", "textwrap", "timeit", "urllib.parse", "uuid", "zipfile",
)
CORPUS_PREFIX = "python-docs/"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MAX_DOC_CHARS = 12000  # a page is at most 6 `open` pages of docstring


def corpus_version() -> str:
  """What the corpus text depends on: the Python minor version (docstrings change between them)."""
  return f"python{sys.version_info.major}.{sys.version_info.minor}"


def load_corpus(name: str) -> list[dict[str, str]]:
  """The pages {url, title, text} of a built-in corpus (built once per process; do not mutate)."""
  if name not in _BUILDERS:
    raise ValueError(f"unknown corpus {name!r}; built-in corpora: {', '.join(_BUILDERS)}")
  return _build(name)


@functools.lru_cache(maxsize=None)
def _build(name: str) -> list[dict[str, str]]:
  return _BUILDERS[name]()


# ---- python-docs ---------------------------------------------------------------------------


class _Repr:
  """A default value shown by a fixed text (so `str(signature)` prints our sanitised repr)."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def safe_repr(value: Any) -> str:
  """repr without memory addresses and with sets sorted (the same text in every process)."""
  if isinstance(value, (set, frozenset)):
    items = ", ".join(sorted(safe_repr(v) for v in value))
    return f"{type(value).__name__}({{{items}}})" if items else f"{type(value).__name__}()"
  return _ADDRESS.sub("", repr(value))


def signature_of(obj: Any) -> inspect.Signature | None:
  """The signature of a function or class with sanitised defaults; None when it has none."""
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):
    return None
  params = [p.replace(default=_Repr(safe_repr(p.default))) if p.default is not p.empty else p
            for p in sig.parameters.values()]
  return sig.replace(parameters=params)


def _doc(obj: Any) -> str:
  doc = _ADDRESS.sub("", inspect.getdoc(obj) or "(no documentation)")
  return doc if len(doc) <= _MAX_DOC_CHARS else doc[:_MAX_DOC_CHARS] + "\n[documentation cut]"


def members(module_name: str) -> list[tuple[str, Any]]:
  """The public functions and classes a module defines (not re-exports), sorted by name.

  `__all__` when the module has one, else the public names; an object counts as defined
  here when its `__module__` is the module or its C accelerator (`heapq` / `_heapq`).
  """
  module = importlib.import_module(module_name)
  names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
  homes = {module_name, "_" + module_name.rsplit(".", 1)[-1]}
  out = []
  for name in sorted(set(names)):
    obj = getattr(module, name, None)
    if (inspect.isclass(obj) or inspect.isroutine(obj)) and getattr(obj, "__module__", None) in homes:
      out.append((name, obj))
  return out


def _method_lines(cls: type) -> list[str]:
  lines = []
  for name, attr in sorted(vars(cls).items()):
    if name.startswith("_") or not (inspect.isroutine(attr) or isinstance(attr, (classmethod, staticmethod))):
      continue
    func = getattr(cls, name)
    sig = signature_of(func)
    summary = (inspect.getdoc(func) or "").strip().splitlines()
    lines.append(f"- `{name}{sig if sig is not None else '(...)'}`" + (f": {_ADDRESS.sub('', summary[0])}"
                                                                         if summary else ""))
  return lines


def _member_page(module_name: str, name: str, obj: Any) -> dict[str, str]:
  kind = "class" if inspect.isclass(obj) else "function"
  sig = signature_of(obj)
  text = [f"# {module_name}.{name}", "", f"Module: [{module_name}]({CORPUS_PREFIX}{module_name})",
          f"Kind: {kind}"]
  if sig is not None:
    text.append(f"Signature: `{name}{sig}`")
  text += ["", _doc(obj)]
  if kind == "class":
    methods = _method_lines(obj)
    if methods:
      text += ["", "## Methods", *methods]
  return {"url": f"{CORPUS_PREFIX}{module_name}.{name}", "title": f"{module_name}.{name}",
          "text": "\n".join(text) + "\n"}


def _module_pages(module_name: str) -> list[dict[str, str]]:
  module = importlib.import_module(module_name)
  found = members(module_name)
  text = [f"# {module_name}", "", _doc(module)]
  for kind, test in (("Classes", inspect.isclass), ("Functions", lambda o: not inspect.isclass(o))):
    listed = [f"- [{module_name}.{n}]({CORPUS_PREFIX}{module_name}.{n})" for n, o in found if test(o)]
    if listed:
      text += ["", f"## {kind}", *listed]
  pages = [{"url": f"{CORPUS_PREFIX}{module_name}", "title": f"{module_name} module",
            "text": "\n".join(text) + "\n"}]
  return pages + [_member_page(module_name, n, o) for n, o in found]


def _topic_pages() -> list[dict[str, str]]:
  from pydoc_data.topics import topics
  return [{"url": f"{CORPUS_PREFIX}topics/{name}", "title": f"Python language reference: {name}",
           "text": topics[name].strip() + "\n"} for name in sorted(topics)]


def build_python_docs() -> list[dict[str, str]]:
  """All pages of `python-docs`, modules in `MODULES` order, then the language topics."""
  pages = []
  for module_name in MODULES:
    pages += _module_pages(module_name)
  return pages + _topic_pages()


_BUILDERS = {"python-docs": build_python_docs}
