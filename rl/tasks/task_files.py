"""JSONL task files: one task object per line, read with every error naming `file:line`.

The schema of one task, and its checks, are rl/tasks/schema.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from rl.tasks.schema import Task, TaskError, parse_task


def _lines(path: Path) -> Iterator[tuple[int, str]]:
  try:
    with open(path, encoding="utf-8") as f:
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
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise TaskError(
        where, None, f"not valid JSON ({e.msg} at column {e.colno}); one task object per line"
      ) from None
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
