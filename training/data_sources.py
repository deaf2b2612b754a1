"""Pretraining text sources: the spec string, file discovery, documents, fingerprints.

A source is a kind (the running interpreter's standard library -- present on
every machine, so the default corpus needs no download -- plain text files,
or JSON lines) plus a glob and a mixture weight. `training.data` tokenizes
sources into shards; this module only says which documents a source holds,
in a fixed order, and fingerprints its inputs cheaply so an unchanged source
is not tokenized again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import re
import sys
import sysconfig
from typing import Iterator, Sequence

import numpy as np
from etils import epath

KINDS = ("stdlib", "text", "jsonl")


class DataError(ValueError):
  """Bad source spec, missing/foreign/corrupt prepared data, or a bad batch."""

# ---- sources -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
  """One corpus: `kind` stdlib | text | jsonl, files matching `pattern`.

  `field` is the JSON key holding a jsonl document's text; `weight` its share
  of the mixture's tokens (relative; normalised over the sources used).
  """
  name: str
  kind: str
  pattern: str
  field: str
  weight: float


def parse_sources(spec: str) -> list[Source]:
  """Parses "stdlib=0.7;text:/data/*.md=0.2;jsonl:/data/x.jsonl@text=0.1".

  Parts are separated by ';'. Each is `stdlib`, `text:<glob>` or
  `jsonl:<glob>[@field]` (field default 'text'; an '@' with a '/' after it
  belongs to the path), optionally followed by `=<weight>` (default 1.0). A
  local glob may start with '~' (the user's home). Names are the kind plus an index per kind
  (stdlib, text_0, text_1, jsonl_0, ...), unique and filesystem-safe.
  """
  if not isinstance(spec, str) or not spec.strip():
    raise DataError(f"sources spec {spec!r} is empty; e.g. 'stdlib=1.0' or "
                    "'stdlib=0.7;text:/data/*.md=0.3'.")
  out: list[Source] = []
  counts: dict[str, int] = {}
  for part in (p.strip() for p in spec.split(";")):
    if not part:
      raise DataError(f"sources spec {spec!r} has an empty part (a stray ';').")
    body, weight = _split_weight(part)
    kind, _, pattern = body.partition(":")
    pattern = pattern.strip()  # "text: /a/*.md" looked for a path starting with a space
    kind = kind.strip()
    if kind not in KINDS:
      raise DataError(f"source {part!r}: unknown kind {kind!r}; use one of {KINDS}, e.g. "
                      "'text:/data/*.md=0.2' or 'jsonl:/data/x.jsonl@text=0.1'.")
    field = "text"
    if kind == "stdlib":
      if pattern:
        raise DataError(f"source {part!r}: 'stdlib' takes no path (it is the running "
                        "interpreter's standard library); write 'stdlib=<weight>'.")
      if counts.get("stdlib"):
        raise DataError(f"sources spec {spec!r} names 'stdlib' twice.")
    elif not pattern:
      raise DataError(f"source {part!r}: missing path/glob; write '{kind}:<glob>=<weight>'.")
    # A '/' after the last '@' makes it part of the path ('jsonl:/data/team@x/*.jsonl').
    if kind == "jsonl" and "@" in pattern and "/" not in pattern.rsplit("@", 1)[1]:
      pattern, field = pattern.rsplit("@", 1)
      if not field:
        raise DataError(f"source {part!r}: empty field after '@'; write '@<json key>'.")
    index = counts.get(kind, 0)
    counts[kind] = index + 1
    name = "stdlib" if kind == "stdlib" else f"{kind}_{index}"
    out.append(Source(name=name, kind=kind, pattern=pattern, field=field, weight=weight))
  if not any(s.weight > 0 for s in out):  # else found only after tokenizing and building the model
    raise DataError(f"sources spec {spec!r}: every weight is 0; give at least one source a weight > 0.")
  return out


def _split_weight(part: str) -> tuple[str, float]:
  if "=" not in part:
    return part, 1.0
  body, text = part.rsplit("=", 1)
  try:
    weight = float(text)
  except ValueError:
    raise DataError(f"source {part!r}: weight {text!r} after the last '=' is not a number.") from None
  if not np.isfinite(weight) or weight < 0:
    raise DataError(f"source {part!r}: weight {weight} must be a finite number >= 0.")
  return body.strip(), weight


def stdlib_root() -> epath.Path:
  """The running interpreter's standard-library directory."""
  return epath.Path(sysconfig.get_paths()["stdlib"])


def source_files(source: Source) -> list[epath.Path]:
  """The files of a source, sorted (stdlib: its .py files outside site-packages)."""
  if source.kind == "stdlib":
    root = pathlib.Path(stdlib_root())  # always a local directory: rglob is fine here
    return sorted(epath.Path(p) for p in root.rglob("*.py") if "site-packages" not in p.parts)
  files = _glob(source.pattern)
  if not files:
    raise DataError(f"source {source.name} ({source.kind}:{source.pattern}): no file matches; "
                    "check the path/glob.")
  return files


def _glob(pattern: str) -> list[epath.Path]:
  """Local globs may use '**' (recursive); remote ones (gs://...) one level of wildcards."""
  if "://" not in pattern:
    pattern = os.path.expanduser(pattern)  # quoted specs reach us with '~' unexpanded
    # a set: '**/**' lists a file once per way of matching it
    return sorted({epath.Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)})
  path = epath.Path(pattern)
  parts = path.parts
  first = next((i for i, p in enumerate(parts) if re.search(r"[*?\[]", p)), None)
  if first is None:
    return [path] if path.is_file() else []
  root = epath.Path(*parts[:first]) if first else epath.Path(".")
  return sorted(p for p in root.glob("/".join(parts[first:])) if p.is_file())


def input_fingerprint(source: Source, files: Sequence[epath.Path] | None = None) -> str:
  """sha256 of the sorted file list with sizes and mtimes (cheap; no content read)."""
  files = source_files(source) if files is None else files
  h = hashlib.sha256(json.dumps([source.kind, source.field, sys.version]).encode())
  for p in files:
    st = p.stat()
    h.update(f"{p}\0{st.length}\0{st.mtime}\n".encode())
  return h.hexdigest()


def iter_documents(source: Source, files: Sequence[epath.Path] | None = None) -> Iterator[str]:
  """The source's documents in a fixed order; whitespace-only documents are skipped.

  stdlib / text: one document per file. jsonl: one per line, its `field`.
  """
  for path in source_files(source) if files is None else files:
    if source.kind == "jsonl":
      yield from _jsonl_documents(path, source.field)
    else:
      text = path.read_bytes().decode("utf-8", errors="replace")
      if text.strip():
        yield text


def check_first_documents(source: Source, files: Sequence[epath.Path]) -> None:
  """Reads each jsonl file's first document, so that a wrong `@field` or a file that is not JSON
  lines fails before any source is tokenized, not after the sources before it (hours, for a
  large corpus). Text and stdlib files need no check."""
  if source.kind == "jsonl":
    for path in files:
      with contextlib.closing(_jsonl_documents(path, source.field)) as docs:
        next(docs, None)


def _jsonl_documents(path: epath.Path, field: str) -> Iterator[str]:
  with path.open("rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:  # bad UTF-8 bytes become U+FFFD, as in text files: one stray byte should not stop a corpus
        obj = json.loads(line.decode("utf-8", errors="replace"))
      except (ValueError, RecursionError) as e:  # also a number of 4301+ digits, nesting 1e5 deep
        why = e.msg if isinstance(e, json.JSONDecodeError) else str(e).split(";")[0]
        raise DataError(f"{path}:{lineno}: not valid JSON ({why}); fix or drop the line.") from None
      if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        raise DataError(f"{path}:{lineno}: no string field {field!r}; pick the field with "
                        "'jsonl:<glob>@<field>'.")
      if obj[field].strip():
        yield obj[field]
