"""JSON Lines files people write (task files, SFT chat files): one JSON value per line.

Both readers refuse the same things, naming `file:line` and the fix: a file that is not UTF-8
(a byte order mark is skipped), a line that is not JSON (including a number of 4,301+ digits,
which Python's int refuses, and nesting past the recursion limit), and a key given twice in one
object, which `json.loads` would resolve by keeping the last value silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Builds the error a reader raises: (where: 'file' or 'file:line', field or None, message).
BadLine = Callable[[str, "str | None", str], Exception]


class _DuplicateKey(Exception):
  pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """A JSON object, refusing a key given twice."""
  seen: set[str] = set()
  for key, _ in pairs:
    if key in seen:
      raise _DuplicateKey(key)
    seen.add(key)
  return dict(pairs)


def read_values(path: str | Path, bad: BadLine, one: str) -> Iterator[tuple[int, str, Any]]:
  """(line number, 'file:line', value) of each non-blank line of `path`; `one` names what a line
  holds in the error ('task object'). The file is read whole before the first value is yielded,
  so an encoding error stops a run before anything was built from the file."""
  try:
    with open(path, encoding="utf-8-sig") as f:  # -sig: a byte order mark (Notepad's) is not data
      lines = list(enumerate(f, 1))
  except UnicodeDecodeError as e:
    raise bad(str(path), None, f"is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 "
              "(Windows PowerShell's `>` writes UTF-16)") from None
  for lineno, line in lines:
    if not line.strip():
      continue
    where = f"{path}:{lineno}"
    try:
      value = json.loads(line, object_pairs_hook=_object)
    except _DuplicateKey as e:
      raise bad(where, e.args[0], "appears twice in one object (JSON would keep the last one "
                "silently); give each field once") from None
    except (ValueError, RecursionError) as e:  # also a number of 4301+ digits, arrays nested 1e5 deep
      at = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e).split(";")[0]
      raise bad(where, None, f"not valid JSON ({at}); one {one} per line") from None
    yield lineno, where, value
