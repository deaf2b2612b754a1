"""The task mixture of joint RL: which domain each prompt comes from, and which task.

`config.rl.mixture` is "source=weight,..." where a source is a domain (its generator's
`train` split at `config.rl.difficulty[domain]`) or `file:PATH` (a JSONL task file in the
public schema; each task is graded by its own domain's environment). Every source is an
endless, deterministic stream: generated domains draw chunk k with generator seed
RL_SEED_BASE + seed * 100_003 + k; files cycle in a shuffled order per pass. SFT draws its
oracle tasks with the small seeds `config.sft.task_seed` (rl/sft/source.py), so RL never
replays the task set its warm start was trained on (with seed 0 for both, the first chunk
was exactly SFT's first 64 tasks per domain, and RL rewarded answers the policy had
memorised). Question texts may still coincide by chance where a level's space is small.

The sampler's whole state (each stream's position, the adaptive weights and their progress
averages) is a small JSON object the checkpoint keeps, so a resumed run draws exactly the
tasks an uninterrupted one would.

Adaptive weights (`config.rl.adaptive`): each source's learning progress is the gap between a
fast and a slow moving average of its success rate, |fast - slow| (absolute learning
progress, as in teacher-student curricula: Matiisen et al. 2017); weights are proportional
to progress + `floor` (so no domain starves), renormalised, and logged every step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from model.config import ConfigError
from rl.tasks import generators
from rl.tasks.schema import DOMAINS, Task
from rl.tasks.task_files import load_tasks

_CHUNK = 64  # generated tasks per stream chunk
RL_SEED_BASE = 1_000_000  # generator seeds of RL streams start here; SFT's task seeds are small


def parse_mixture(text: str) -> dict[str, float]:
  """"math=1,terminal=2,file:/data/t.jsonl=0.5" -> {source: weight}; errors name the fix."""
  out: dict[str, float] = {}
  for part in (p.strip() for p in str(text).split(",")):
    if not part:
      continue
    name, sep, weight = part.rpartition("=")
    name = name.strip()  # "math = 1" as "math=1"
    if not sep or not name:
      raise ConfigError(f"config.rl.mixture: {part!r} is not source=weight (e.g. 'math=1,terminal=1').")
    try:
      w = float(weight)
    except ValueError:
      raise ConfigError(f"config.rl.mixture: weight {weight!r} of {name!r} is not a number.") from None
    if not name.startswith("file:") and name not in DOMAINS:
      raise ConfigError(f"config.rl.mixture: unknown source {name!r}; use a domain ({', '.join(DOMAINS)}) "
                        "or file:PATH.jsonl.")
    if not (math.isfinite(w) and w >= 0):
      raise ConfigError(f"config.rl.mixture: weight of {name!r} is {w}; weights must be finite and >= 0.")
    if name in out:
      raise ConfigError(f"config.rl.mixture: {name} appears twice in {text!r}; give each source once.")
    out[name] = w
  if not out or sum(out.values()) <= 0:
    raise ConfigError(f"config.rl.mixture={text!r}: give at least one source a positive weight.")
  return out


def _level_entries(text: str) -> tuple[int | None, dict[str, int]]:
  """config.rl.difficulty's text -> (the level for every domain or None, {domain: level})."""
  out: dict[str, int] = {}
  default = None
  for part in (p.strip() for p in str(text).split(",")):
    if not part:
      continue
    name, sep, level = part.rpartition("=")
    if not re.fullmatch(r"-?[0-9]+", level.strip()):  # str.isdigit passes '²'; lstrip('-') passes '--1'
      raise ConfigError(f"config.rl.difficulty: {part!r} is not an integer level or domain=level.")
    if not sep:
      if default is not None:
        raise ConfigError(f"config.rl.difficulty={text!r}: more than one level for every domain; give one.")
      default = int(level)
    elif name not in DOMAINS:
      raise ConfigError(f"config.rl.difficulty: unknown domain {name!r}.")
    elif name in out:
      raise ConfigError(f"config.rl.difficulty: {name} appears twice in {text!r}; give each domain once.")
    else:
      out[name] = int(level)
  return default, out


def parse_levels(text: str, sources: Sequence[str]) -> dict[str, int]:
  """"math=1,cad=0" or "0" (every domain) -> {domain: level} for the generated domains of
  `sources` (config.rl.mixture's); a level for a domain the mixture does not draw is an error."""
  default, out = _level_entries(text)
  generated = [s for s in sources if s in DOMAINS]
  for name in out:
    if name not in generated:
      drawn = ", ".join(generated) or "none"
      raise ConfigError(f"config.rl.difficulty: {name}={out[name]} sets a level for {name}, which "
                        f"config.rl.mixture does not draw from (its domains: {drawn}); drop it or add "
                        f"{name} to config.rl.mixture.")
  if default and not generated:  # the default "0" is harmless; a chosen level would go unused
    raise ConfigError(f"config.rl.difficulty={text!r}: config.rl.mixture has no generated domain (file: "
                      "tasks keep their own levels), so the level would be ignored; drop it.")
  levels = {}
  for s in generated:
    top = generators.max_difficulty(s)
    lvl = out.get(s, default or 0)
    if not 0 <= lvl <= top:
      raise ConfigError(f"config.rl.difficulty: {s} level {lvl} is outside 0..{top}.")
    levels[s] = lvl
  return levels


class _Stream:
  """An endless deterministic stream of tasks from one source."""

  def __init__(self, source: str, level: int, seed: int, split: str):
    self.source, self.level, self.seed, self.split = source, level, seed, split
    self.position = 0
    self._cache: dict[int, list[Task]] = {}
    if source.startswith("file:"):
      self._file = load_tasks(source[len("file:"):])
      if not self._file:
        raise ConfigError(f"config.rl.mixture: {source} holds no tasks.")

  def _chunk(self, k: int) -> list[Task]:
    if k not in self._cache:
      if self.source.startswith("file:"):
        order = np.random.default_rng([self.seed, k]).permutation(len(self._file))
        chunk = [self._file[i] for i in order]
        # A task may come back on a later pass: keep ids unique per draw so groups never merge.
        chunk = [t.with_(id=f"{t.id}#p{k}") for t in chunk]
      else:
        chunk = generators.generate(self.source, split=self.split, difficulty=self.level, n=_CHUNK,
                                    seed=RL_SEED_BASE + self.seed * 100_003 + k)
      self._cache = {k: chunk}  # one chunk in memory
    return self._cache[k]

  def next(self) -> Task:
    size = len(self._file) if self.source.startswith("file:") else _CHUNK
    k, i = divmod(self.position, size)
    self.position += 1
    return self._chunk(k)[i]


@dataclasses.dataclass
class AdaptiveWeights:
  """Learning-progress weights (module docstring); `fast`/`slow` are per-source EMAs of success."""

  base: dict[str, float]
  enabled: bool = False
  fast_rate: float = 0.3
  slow_rate: float = 0.05
  floor: float = 0.1
  fast: dict[str, float] = dataclasses.field(default_factory=dict)
  slow: dict[str, float] = dataclasses.field(default_factory=dict)

  def weights(self) -> dict[str, float]:
    total = sum(self.base.values())
    base = {s: w / total for s, w in self.base.items()}
    if not self.enabled or not self.fast:
      return base
    progress = {s: abs(self.fast.get(s, 0.0) - self.slow.get(s, 0.0)) for s in base if base[s] > 0}
    top = max(progress.values(), default=0.0)
    raw = {s: (base[s] > 0) * ((progress.get(s, 0.0) / top if top > 0 else 0.0) + self.floor) for s in base}
    z = sum(raw.values())
    return {s: v / z for s, v in raw.items()}

  def observe(self, success: Mapping[str, float]) -> None:
    """One step's success rate per source (sources not sampled this step keep their averages)."""
    for s, rate in success.items():
      if s not in self.fast:
        self.fast[s] = self.slow[s] = float(rate)
      else:
        self.fast[s] += self.fast_rate * (rate - self.fast[s])
        self.slow[s] += self.slow_rate * (rate - self.slow[s])


class MixtureSampler:
  """Draws (source, task) for each prompt of a step; deterministic in (seed, step, state)."""

  def __init__(self, mixture: Mapping[str, float], levels: Mapping[str, int], *, seed: int,
               adaptive: bool = False, floor: float = 0.1, split: str = "train"):
    self.seed = seed
    self.levels = {s: levels.get(s, 0) for s in mixture if s in DOMAINS}  # generated sources only
    self.streams = {s: _Stream(s, levels.get(s, 0), seed, split) for s in mixture}
    self.adaptive = AdaptiveWeights(dict(mixture), enabled=adaptive, floor=floor)

  def draw(self, step: int, n: int) -> list[tuple[str, Task]]:
    weights = self.adaptive.weights()
    names = sorted(weights)
    p = np.array([weights[s] for s in names])
    picks = np.random.default_rng([self.seed, step, 7]).choice(len(names), size=n, p=p / p.sum())
    return [(names[i], self.streams[names[i]].next()) for i in picks]

  def get_state(self) -> dict[str, Any]:
    a = self.adaptive
    return {"positions": {s: st.position for s, st in self.streams.items()},
            "fast": dict(a.fast), "slow": dict(a.slow)}

  def set_state(self, state: Mapping[str, Any]) -> None:
    missing = set(self.streams) - set(state.get("positions", {}))
    if missing:
      raise ConfigError(f"the checkpoint's task sampler has no position for {sorted(missing)}: the mixture "
                        "changed since it was written; resume with the same config.rl.mixture.")
    for s, st in self.streams.items():
      st.position = int(state["positions"][s])
    self.adaptive.fast = {k: float(v) for k, v in state.get("fast", {}).items()}
    self.adaptive.slow = {k: float(v) for k, v in state.get("slow", {}).items()}
