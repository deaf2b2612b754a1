"""What every generator shares: per-task RNGs, split assignment, ids, oracle turns.

Split hygiene: a task's RNG is seeded from (domain, split, difficulty, seed, index), so the
two splits never share a seed; entities and template instances (a company name, a HumanEval
problem, a file-chore template with its parameters) are assigned to one split by a hash of
their key (`split_of`), and a generator draws only entities of its own split.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from model.config import is_int

HELDOUT_FRACTION = 0.25


def _hash(*parts: Any) -> int:
  return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


SPLITS = ("train", "heldout")


def check_args(domain: str, split: str, difficulty: int, max_difficulty: int, seed: int, n: int) -> None:
  """A clear error for a split, level, seed or count a generator does not take (called by every
  `generate`).

  Without it a level of -1 read the top level's templates (`LEVELS[-1]`) under a `d-1` id, and an
  unknown split never matched `split_of`, so the web and docqa generators redrew forever; a NumPy
  seed reached the tasks' meta and failed in json.dumps when they were written, and a seed of 1.5
  or "a" made tasks with ids `-s1.5-`; a count of -1 returned no tasks and 1.5 a TypeError.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
  if not is_int(difficulty, numpy=True) or not 0 <= difficulty <= max_difficulty:
    raise ValueError(f"difficulty for {domain} must be an integer in 0..{max_difficulty}; got {difficulty!r}")
  if not isinstance(difficulty, int):  # numpy's: it would reach task fields and their JSON
    raise ValueError(f"difficulty for {domain}: pass a Python int, int(difficulty); got {difficulty!r}")
  if not is_int(seed):
    raise ValueError(f"seed for {domain} must be a Python int (int(seed) for NumPy's); got {seed!r}")
  if not is_int(n, numpy=True) or n < 0:
    raise ValueError(f"n (the number of {domain} tasks) must be an integer >= 0; got {n!r}")


def task_rng(domain: str, split: str, difficulty: int, seed: int, index: int) -> random.Random:
  """The RNG of one task; distinct for every (domain, split, difficulty, seed, index)."""
  return random.Random(_hash("task", domain, split, difficulty, seed, index))


def split_of(key: Any, heldout_fraction: float = HELDOUT_FRACTION) -> str:
  """The split an entity or template instance belongs to, by a hash of its key."""
  return "heldout" if (_hash("split", key) % 10_000) < heldout_fraction * 10_000 else "train"


def task_id(domain: str, split: str, difficulty: int, seed: int, index: int) -> str:
  return f"{domain}-{split}-d{difficulty}-s{seed}-{index:05d}"


def turn(thinking: str = "", content: str = "", calls: list[tuple[str, dict]] = ()) -> dict[str, Any]:
  """One oracle assistant turn."""
  return {
    "thinking": thinking,
    "content": content,
    "tool_calls": [{"name": name, "arguments": dict(args)} for name, args in calls],
  }


def meta(domain: str, split: str, difficulty: int, seed: int, **extra: Any) -> dict[str, Any]:
  return {"generator": domain, "split": split, "difficulty": difficulty, "seed": seed, **extra}
