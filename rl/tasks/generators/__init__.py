"""Procedural task generators, one module per domain, each seeded and deterministic.

Every module `rl.tasks.generators.<domain>` provides

  MAX_DIFFICULTY: int        levels 0..MAX_DIFFICULTY; level 0 is learnable by a CPU-sized
                             model in minutes, the top levels are real work
  generate(*, split, difficulty, n, seed) -> list[Task]
                             tasks with an `oracle` trajectory that solves them; the
                             `train` and `heldout` splits share no seed, template instance or
                             entity (see `common.split_of`); task i depends on (split,
                             difficulty, seed, i) alone, so n tasks are a prefix of n + 1
  corrupt_oracle(task) -> list[turn]
                             a near-miss trajectory (wrong final answer, wrong edit) that
                             must score 0: the graders are tested on both

The modules are imported on first use, so `math` never loads manifold3d.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

from model.config import ConfigError, is_int
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
  if not is_int(difficulty, numpy=True) or not 0 <= difficulty <= top:
    raise ValueError(f"difficulty for {domain} must be an integer in 0..{top}; got {difficulty!r}")
  if not is_int(n, numpy=True) or n < 1:
    raise ValueError(f"n must be an integer >= 1; got {n!r}")
  if not is_int(seed, numpy=True):
    raise ValueError(f"seed must be an integer; got {seed!r}")
  difficulty, n, seed = int(difficulty), int(n), int(seed)
  draw = module(domain).generate
  if split == "train":  # drawn with replacement, as training samples
    return draw(split=split, difficulty=difficulty, n=n, seed=seed)
  return distinct_tasks(lambda m: draw(split=split, difficulty=difficulty, n=m, seed=seed), n,
                        f"{domain} heldout level {difficulty}")


# How many draws per wanted task distinct_tasks makes before it calls the pool exhausted.
MAX_DRAWS_PER_TASK = 8


def question_key(task: Task) -> str:
  """What makes two tasks the same question: the prompt and the domain fields (a docqa question
  about another document is another question), not the id, oracle or meta."""
  return json.dumps([task.domain, task.prompt, task.fields], sort_keys=True, default=str)


def distinct_tasks(draw: Callable[[int], list[Task]], n: int, what: str) -> list[Task]:
  """The first n tasks of draw(m) (a prefix-stable generator) with no question twice.

  Held-out tasks are an evaluation set: its confidence intervals count each task as an independent
  question, and a small pool drawn with replacement repeats some (200 draws of math level 0 gave
  146 questions, web level 4 129). A task keeps its id (its index), so the ids have gaps where
  repeats were skipped. Raises ConfigError when MAX_DRAWS_PER_TASK * n draws hold fewer than n.
  """
  m = n
  while True:
    seen: set[str] = set()
    out = []
    for task in draw(m):
      key = question_key(task)
      if key not in seen:
        seen.add(key)
        out.append(task)
        if len(out) == n:
          return out
    if m >= MAX_DRAWS_PER_TASK * n:
      raise ConfigError(f"{what}: {m} draws hold only {len(out)} distinct tasks, fewer than n={n}; the "
                       f"split has about that many questions (every seed draws from them). Ask for n <= "
                       f"{len(out)}.")
    m = min(2 * m, MAX_DRAWS_PER_TASK * n)


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """A trajectory close to the oracle that must score 0 (tests the grader's teeth)."""
  return module(task.domain).corrupt_oracle(task)
