"""JSONL task files: one task object per line, read with every error naming `file:line`.

A key given twice in one object is an error (JSON would keep the last one silently, as it would a
typo'd field's value); a UTF-8 byte order mark at the start of the file is skipped.

The schema of one task, and its checks, are rl/tasks/schema.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rl.tasks.schema import Task, TaskError, parse_task


class _DuplicateKey(Exception):
  pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """A JSON object, refusing a key given twice (json.loads would keep the last one silently)."""
  seen: set[str] = set()
  for key, _ in pairs:
    if key in seen:
      raise _DuplicateKey(key)
    seen.add(key)
  return dict(pairs)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
  try:
    with open(path, encoding="utf-8-sig") as f:  # -sig: a byte order mark (Notepad's) is not a task
      lines = list(enumerate(f, 1))
  except UnicodeDecodeError as e:
    raise TaskError(str(path), None, f"is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                    "UTF-8 (Windows PowerShell's `>` writes UTF-16)") from None
  for lineno, line in lines:
    if line.strip():
      yield lineno, line


def load_tasks(path: str | Path) -> list[Task]:
  """Reads a JSONL task file; every error names `file:line`, the field and the fix."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(
      f"task file {str(path)!r} does not exist (write one with `python -m experiments.make_tasks --out=...`)"
    )
  tasks, seen = [], {}
  for lineno, line in _lines(path):
    where = f"{path}:{lineno}"
    try:
      obj = json.loads(line, object_pairs_hook=_object)
    except _DuplicateKey as e:
      raise TaskError(where, e.args[0], "appears twice in one object (JSON would keep the last one "
                      "silently); give each field once") from None
    except (ValueError, RecursionError) as e:  # also a number of 4301+ digits, arrays nested 1e5 deep
      at = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e).split(";")[0]
      raise TaskError(where, None, f"not valid JSON ({at}); one task object per line") from None
    task = parse_task(obj, where)
    if task.id in seen:
      raise TaskError(where, "id", f"duplicate id {task.id!r} (first at line {seen[task.id]})")
    seen[task.id] = lineno
    tasks.append(task)
  return tasks


def write_tasks(tasks: Iterable[Task], path: str | Path) -> int:
  """Writes tasks as JSONL (one compact object per line); returns the count."""
  n = 0
  with open(path, "w", encoding="utf-8") as f:
    for task in tasks:
      f.write(json.dumps(task.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n")
      n += 1
  return n
