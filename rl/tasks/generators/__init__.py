"""Procedural task generators, one module per domain, each seeded and deterministic.

Every module `rl.tasks.generators.<domain>` provides

  MAX_DIFFICULTY: int        levels 0..MAX_DIFFICULTY; level 0 is learnable by a CPU-sized
                             model in minutes, the top levels are real work
  generate(*, split, difficulty, n, seed) -> list[Task]
                             tasks with an `oracle` trajectory that solves them; the
                             `train` and `heldout` splits share no seed, template instance or
                             entity (see `common.split_of`)
  corrupt_oracle(task) -> list[turn]
                             a near-miss trajectory (wrong final answer, wrong edit) that
                             must score 0: the graders are tested on both

The modules are imported on first use, so `math` never loads manifold3d.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from rl.tasks.schema import DOMAINS, Task

SPLITS = ("train", "heldout")


def module(domain: str) -> ModuleType:
  if domain not in DOMAINS:
    raise ValueError(f"unknown domain {domain!r}; domains: {', '.join(DOMAINS)}")
  return importlib.import_module(f"rl.tasks.generators.{domain}")


def max_difficulty(domain: str) -> int:
  return module(domain).MAX_DIFFICULTY


def generate(domain: str, *, split: str, difficulty: int, n: int, seed: int = 0) -> list[Task]:
  """`n` tasks of `domain` at `difficulty` from `split`, deterministic in (split, difficulty, seed)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
  top = max_difficulty(domain)
  if not isinstance(difficulty, int) or not 0 <= difficulty <= top:
    raise ValueError(f"difficulty for {domain} must be an integer in 0..{top}; got {difficulty!r}")
  if n < 1:
    raise ValueError(f"n must be >= 1; got {n}")
  return module(domain).generate(split=split, difficulty=difficulty, n=n, seed=seed)


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """A trajectory close to the oracle that must score 0 (tests the grader's teeth)."""
  return module(task.domain).corrupt_oracle(task)
