"""JSONL task files: one task object per line, read with every error naming `file:line`.

A key given twice in one object is an error (JSON would keep the last one silently, as it would a
typo'd field's value); a UTF-8 byte order mark at the start of the file is skipped.

The schema of one task, and its checks, are rl/tasks/schema.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rl.tasks.jsonl import read_values
from rl.tasks.schema import Task, TaskError, parse_task


def load_tasks(path: str | Path) -> list[Task]:
  """Reads a JSONL task file; every error names `file:line`, the field and the fix."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(
      f"task file {str(path)!r} does not exist (write one with `python -m experiments.make_tasks --out=...`)"
    )
  tasks, seen = [], {}
  for lineno, where, obj in read_values(path, TaskError, "task object"):
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
